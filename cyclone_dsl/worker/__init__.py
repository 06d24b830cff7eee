"""The worker: claims steps, runs handlers, commits outcomes; and the scanner."""
