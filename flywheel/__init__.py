"""Flywheel: real-time online RL from how users react to a model's generations.

This shared package holds what every component agrees on: settings, the event
contract, connections, the Kafka interface, the lake, the model helpers and the CLI.
"""

__version__ = "0.1.0"
