"""MLflow models-from-code entry point: the logged model is this file, not a pickled object."""

import mlflow

from usecases.recsys.serving import RecommenderModel

mlflow.models.set_model(RecommenderModel())
