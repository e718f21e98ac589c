"""Top-K recommendation: MovieLens or any interaction log, full-ranking evaluation, the best model served."""

from pathlib import Path

from usecases.recsys.config import Config

DESCRIPTION = "top-K recommendation (MovieLens or your log): pop, ItemKNN, EASE, ALS, BPR, LightGCN, full ranking"
PRESETS_DIR = Path(__file__).parent / "presets"
PRIMARY_METRIC = ("ndcg@10", "max")  # of the served model; the registry picks its champion by it


def summary_columns(config: Config) -> list[str]:
    """The metrics printed at the end of a run; summary.json holds them all."""
    return ["recall@10", "ndcg@10", "hit@10", "mrr@10", "precision@10", "coverage@10", "fit_seconds"]


__all__ = ["Config", "DESCRIPTION", "PRESETS_DIR", "PRIMARY_METRIC", "summary_columns"]
