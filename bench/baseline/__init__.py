"""Baselines measured on the same server in the same run: the raw PostgreSQL queue."""
