"""MLflow: the store, tracked runs and their lifecycle, model packaging, the registry, comparison."""
