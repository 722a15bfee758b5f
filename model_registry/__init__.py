"""model_registry component."""
