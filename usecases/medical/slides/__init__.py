"""Pathology on whole-slide images: reading pyramids region by region, tissue and tiles, stain normalisation, and
slide-level learning (attention MIL) on tile features."""
