"""Serving what a run trained: the bundle codec, the MLflow pyfunc base every use case serves through, and MLflow's
scoring protocol for a use case's own server."""
