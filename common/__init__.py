"""Shared core of the use cases: runtime, config, training loop and tracking."""
