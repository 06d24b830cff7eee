"""The graph model, its validation, fingerprint and compilation to rows. No I/O."""
