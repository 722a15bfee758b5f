"""serving component."""
