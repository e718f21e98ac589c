"""Pathology on whole-slide images: reading pyramids region by region, tissue and tiles, stain normalisation, and
slide-level learning (attention MIL) on tile features. Its readers are the `slides` extra: without them, importing
this package stops in one line naming it (the image classifier needs none of them)."""

from usecases.medical import USECASE

USECASE.require("slides")
