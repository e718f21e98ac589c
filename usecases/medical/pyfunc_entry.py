"""MLflow models-from-code entry point: the logged model is this file, not a pickled object."""

import mlflow

from usecases.medical.serving import ImageClassifierModel

mlflow.models.set_model(ImageClassifierModel())
