"""``cyclone ui``: a small web dashboard over the same Client API as the CLI."""
