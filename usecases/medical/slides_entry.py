"""MLflow models-from-code entry point of the slide-level model: the logged model is this file, not a pickled object."""

import mlflow

from usecases.medical.slides.serving import SlideClassifierModel

mlflow.models.set_model(SlideClassifierModel())
