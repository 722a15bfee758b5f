"""Simulated users and synthetic telemetry: they drive the loop from outside, as a product would."""
