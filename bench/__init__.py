"""Benchmarks: Cyclone against its peers on the same PostgreSQL, printed as ratios."""
