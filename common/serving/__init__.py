"""Serving what a run trained: the bundle codec, the MLflow pyfunc base, the scoring protocol, the ANN index."""
