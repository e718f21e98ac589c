"""How a run logs its served recommender: timed through the pyfunc's own `predict` as it will be loaded, served
exact or by two stages as `serving.retrieval` says (auto: by two stages where exact ranking's measured p95 per
request is above `serving.ann.auto_above_ms` and the index reached its target recall), with an example of the
requests it takes."""

from __future__ import annotations

import logging
import time
import warnings

import numpy as np
import pandas as pd

from common.serving.pyfunc import Publication, log_served
from common.usecase import Served
from .ranking import UNKNOWN
from .serving import RecommenderModel, python_value

log = logging.getLogger(__name__)

LATENCY_BATCH = 1000
LATENCY_BATCH_SCORES = 2**27  # users x items scored at once by the batch timing: bounded memory at any catalogue
EXAMPLE_TIME = 1_700_000_000  # the logged example's recent events: 2023-11-14, seconds since the epoch


def latency(model: RecommenderModel, users: np.ndarray, single: int) -> dict[str, float]:
    """p50 and p95 of one-user requests, and users per second in batches, through the pyfunc's own predict."""
    rng = np.random.default_rng(0)
    timings = []
    for user in rng.choice(users, size=single):
        started = time.perf_counter()
        model.predict(None, pd.DataFrame({"user_id": [user]}))
        timings.append(time.perf_counter() - started)
    batch = rng.choice(users, size=max(1, min(LATENCY_BATCH, LATENCY_BATCH_SCORES // len(model.item_ids))))
    started = time.perf_counter()
    model.predict(None, pd.DataFrame({"user_id": batch}))
    batch_seconds = time.perf_counter() - started
    return {"latency_p50_ms": float(np.percentile(timings, 50) * 1000),
            "latency_p95_ms": float(np.percentile(timings, 95) * 1000),
            "batch_users_per_s": len(batch) / batch_seconds}


def served_retrieval(served: RecommenderModel, known: np.ndarray, single: int, retrieval: str,
                     auto_above_ms: float) -> tuple[dict[str, float], str]:
    """Latency of the model served exact and by two stages, and the retrieval served; the model is left serving it."""
    figures = {}
    for mode in ("exact", "ann"):
        served.recommender.use_retrieval(mode)
        figures.update({f"{mode}_{key}": value for key, value in latency(served, known, single).items()})
    exact_p95, index = figures["exact_latency_p95_ms"], served.recommender.index
    reached = index.recall is None or index.recall >= index.target
    chosen = retrieval if retrieval != "auto" else "ann" if exact_p95 > auto_above_ms and reached else "exact"
    log.log(logging.INFO if reached or chosen == "exact" else logging.WARNING,
            "retrieval %s served (serving.retrieval %s; p95 per request: exact %.2f ms, ann %.2f ms; auto serves ann "
            "above %g ms where the index reached its target recall@10: %s of %s)", chosen, retrieval, exact_p95,
            figures["ann_latency_p95_ms"], auto_above_ms, _shown(index.recall), _shown(index.target))
    served.recommender.use_retrieval(chosen)
    return {**figures, **{key: figures[f"{chosen}_{key}"] for key in ("latency_p50_ms", "latency_p95_ms",
                                                                      "batch_users_per_s")}}, chosen


def _shown(value: float | None) -> str:
    return "unmeasured" if value is None else f"{value:.3f}"


def request_example(bundle: dict, users: np.ndarray) -> pd.DataFrame:
    """Two known users, the second with two recent items (the most popular, oldest first): the logged input
    example, whose columns and types the signature is inferred from."""
    popular = np.argsort(-np.asarray(bundle["popularity"]), kind="stable")[:2]
    recent = [python_value(bundle["item_ids"][code]) for code in popular if code != UNKNOWN][:2]
    return pd.DataFrame({"user_id": users, "k": [bundle["k"]] * len(users),
                         "recent_items": [recent[:1], recent],
                         "recent_timestamps": [[EXAMPLE_TIME], [EXAMPLE_TIME, EXAMPLE_TIME + 60]][:len(users)]})


def log_recommender(bundle: dict, model_name: str, job, retrieval: str = "exact",
                    auto_above_ms: float = 5.0) -> tuple[dict[str, float], Served | None]:
    """Log the served form of the best model as `model`; its latency figures, and what was logged. With an ANN index
    in the bundle, both retrievals are timed and the one `retrieval` says is served (auto: ann where exact's p95 is
    above `auto_above_ms`)."""
    served = RecommenderModel.from_bundle(bundle)  # timed and scored as it will be loaded
    known = np.asarray(bundle["user_ids"][1:])
    if bundle.get("ann") is None:
        figures = latency(served, known, bundle["latency_users"])
    else:
        figures, bundle["retrieval"] = served_retrieval(served, known, bundle["latency_users"], retrieval,
                                                        auto_above_ms)
        job.tracker.set_tags({"retrieval": bundle["retrieval"]})
    example = request_example(bundle, known[:2])
    with warnings.catch_warnings():  # ids are never missing: MLflow's advice on integer columns does not apply
        warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer")
        logged = log_served(served, bundle, example, job.tracker, Publication(
            model_name, __package__, ("torch", "numpy", "pandas", "scipy", "mlflow"),
            optional_inputs=("k", "recent_items", "recent_timestamps"), params={"k": bundle["k"]},
            metadata={"model": model_name, "kind": bundle["kind"]}))
    return figures, logged
