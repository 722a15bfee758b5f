"""signals component."""
