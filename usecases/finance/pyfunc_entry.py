"""MLflow models-from-code entry point: the logged model is this file, not a pickled object."""

import mlflow

from usecases.finance.serving import VolatilityForecaster

mlflow.models.set_model(VolatilityForecaster())
