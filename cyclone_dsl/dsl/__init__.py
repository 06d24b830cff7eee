"""The decorator DSL: pure Python, no I/O; it records graphs while a builder runs."""
