"""The training loop, the callbacks it calls around its epochs, and what it measures of a model."""
