"""Files the type checker reads, never runs: see README.md."""
