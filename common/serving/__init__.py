"""Serving what a run trained: the bundle codec and the MLflow pyfunc base every use case serves through."""
