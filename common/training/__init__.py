"""The training loop and what it measures of a model."""
