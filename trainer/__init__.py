"""trainer component."""
