"""ingest component."""
