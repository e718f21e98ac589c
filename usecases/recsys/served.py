"""A fitted model's served form, its fold-in chosen on the validation period's replay (each event ranked for its
user frozen at the cut, and fresh with their earlier events folded in), the served model at a cut of the log, and
the best one logged: timed through the pyfunc's own `predict`, exact or by two stages as `serving.retrieval` says."""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

from common.serving.pyfunc import Publication, log_served
from common.usecase import Served
from .baselines import ALS, EASE, ItemKNN
from .config import Config, Serving
from .data import Interactions
from .foldin import FoldIn
from .models import LightGCN, PairwiseRanker
from .train import sequences_by_user
from .sequence import SequenceScorer, served_sequence_form
from .ranking import UNKNOWN
from .serving import Recommender, RecommenderModel, python_value

log = logging.getLogger(__name__)

METRIC_K = 10
CHUNK = 1024  # requests ranked in one call: a (CHUNK, n_items) score matrix on the device
LATENCY_BATCH = 1000
LATENCY_BATCH_SCORES = 2**27  # users x items scored at once by the batch timing: bounded memory at any catalogue
EXAMPLE_TIME = 1_700_000_000  # the logged example's recent events: 2023-11-14, seconds since the epoch


def replay(recommender: Recommender, events: pd.DataFrame, k: int = METRIC_K, max_users: int | None = None,
           seed: int = 0, chunk: int = CHUNK) -> dict[str, float]:
    """HR@k and NDCG@k of the frozen and the fresh rankings over `events`, of `max_users` users where given."""
    frozen, fresh = replay_gains(recommender, events, k, max_users, seed, chunk)
    if not len(frozen):
        return {"replay_events": 0.0}
    figures = {"replay_events": float(len(frozen))}
    for name, gains in (("frozen", frozen), ("fresh", fresh)):
        figures[f"replay_{name}_hr@{k}"] = float((gains > 0).mean())
        figures[f"replay_{name}_ndcg@{k}"] = float(gains.mean())
    base = figures[f"replay_frozen_ndcg@{k}"]
    figures[f"replay_lift_ndcg@{k}"] = figures[f"replay_fresh_ndcg@{k}"] / base - 1 if base > 0 else math.nan
    return figures


def replay_gains(recommender: Recommender, events: pd.DataFrame, k: int = METRIC_K, max_users: int | None = None,
                 seed: int = 0, chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """Each event's frozen and fresh gain (by user then time): each event a request with its user's earlier ones."""
    users = events["user"].unique()
    if max_users is not None and len(users) > max_users:
        users = np.random.default_rng(seed).choice(users, size=max_users, replace=False)
        events = events[events["user"].isin(users)]
    ordered = events.sort_values(["user", "timestamp"], kind="stable")
    users, items = ordered["user"].to_numpy(np.int64), ordered["item"].to_numpy(np.int64)
    first = np.flatnonzero(np.concatenate([[True], users[1:] != users[:-1]]))[:len(users)]
    own_first = np.repeat(first, np.diff(np.append(first, len(users))))  # per event, its user's first event
    ranked = np.full((len(items), k), -1, np.int64)
    for start in range(0, len(items), chunk):
        stop = min(start + chunk, len(items))
        best, scores = recommender.top_k_batch(users[start:stop], [items[own_first[event]:event]
                                                                    for event in range(start, stop)], k)
        ranked[start:stop, :best.shape[1]] = np.where(np.isfinite(scores), best, -1)
    return _gains(ranked[own_first], items), _gains(ranked, items)


def _gains(ranked: np.ndarray, items: np.ndarray) -> np.ndarray:
    discounts = 1 / np.log2(np.arange(2, ranked.shape[1] + 2))
    return ((ranked == items[:, None]) * discounts).sum(axis=1)


def replayed(name: str, recommender: Recommender, events, config: Config, period: str = "test",
             users: int | None = None) -> dict[str, float]:
    """The replay of a period's events, of `users` of its users (default `evaluation.replay_users`)."""
    if events is None:
        log.warning("%s: no replay (the Dask engine keeps no frame of the %s period)", name, period)
        return {}
    started = time.perf_counter()
    figures = replay(recommender, events, max_users=users or config.evaluation.replay_users, seed=config.runtime.seed)
    figures["replay_seconds"] = time.perf_counter() - started
    if figures["replay_events"]:
        log.info("%s: replay of %d %s events: next-event NDCG@10 %.4f frozen, %.4f fresh", name,
                 figures["replay_events"], period, figures["replay_frozen_ndcg@10"], figures["replay_fresh_ndcg@10"])
    return figures


def served_form(scorer, config: Config, train: sp.csr_matrix) -> dict:
    """What the served model scores with, on the CPU."""
    if isinstance(scorer, SequenceScorer):
        return served_sequence_form(scorer)
    if isinstance(scorer, PairwiseRanker):
        users, items = scorer.embeddings()
        form = {"kind": "factors", "users": users.detach().float().cpu(), "items": items.detach().float().cpu()}
        return {**form, **_learned_foldin(scorer, config, train)}
    if isinstance(scorer, ALS):
        users, items = scorer.factors()
        foldin = FoldIn("als", regularization=config.als.regularization, alpha=config.als.alpha)
        return {"kind": "factors", "users": users.cpu(), "items": items.cpu(), "foldin": foldin.as_plain()}
    if isinstance(scorer, ItemKNN):
        return {"kind": "item_item", "similarity": scorer.similarity_matrix()}
    if isinstance(scorer, EASE):
        return {"kind": "item_item", "similarity": scorer.similarity_matrix(config.serving.item_neighbours,
                                                                            config.serving.max_similarity_mb * 2**20)}
    return {"kind": "popularity"}


FOLDIN_METHODS = {"bpr": ("gradient", "least_squares"), "lightgcn": ("least_squares", "gradient", "graph")}


def _learned_foldin(scorer: PairwiseRanker, config: Config, train: sp.csr_matrix) -> dict:
    """The fold-in `serving.foldin` says; with `auto`, every method (`foldin_choices`) for `chosen_foldin`."""
    settings, name = config.serving.foldin, "lightgcn" if isinstance(scorer, LightGCN) else "bpr"
    method = getattr(settings, name)
    methods = FOLDIN_METHODS[name] if method == "auto" else (method,)
    choices = {}
    for candidate in methods:
        if candidate == "graph":
            choices[candidate] = FoldIn("graph", layers=scorer.layers).as_plain()
        elif candidate == "gradient":
            choices[candidate] = FoldIn("gradient", steps=settings.steps, lr=settings.lr,
                                        weight_decay=getattr(config, name).weight_decay,
                                        seed=config.runtime.seed).as_plain()
        else:
            choices[candidate] = FoldIn("least_squares", regularization=settings.regularization).as_plain()
    form = {"foldin": choices[methods[0]], **({"foldin_choices": choices} if len(choices) > 1 else {})}
    if "graph" in choices:
        egos, layer_sum = scorer.foldin_tables()
        degree = torch.from_numpy(np.diff(train.tocsc().indptr).astype(np.float32))
        form.update({"egos": egos.cpu(), "layer_sum": layer_sum.cpu(), "degree": degree})
    return form


def chosen_foldin(name: str, form: dict, data: Interactions, config: Config, cut: Cut,
                  device: torch.device) -> tuple[dict, dict, dict | None]:
    """The form with the fold-in whose replay of the validation period (on `serving.foldin.choice_users` of its
    users) is best, each method's figure, and the chosen one's replay where the sample is the whole (else None)."""
    choices = form.get("foldin_choices")
    form = {key: value for key, value in form.items() if key != "foldin_choices"}
    if not choices or not config.evaluation.replay or data.val_events is None:
        return form, {}, None
    period = data.val_events["user"].nunique()
    whole = min(config.evaluation.replay_users or period, period)  # the users a replay of the period counts
    sample = min(config.serving.foldin.choice_users or whole, whole)
    replays = {method: replayed(f"{name} ({method} fold-in)",
                                served_at({**form, "foldin": foldin}, data, config, cut, device),
                                data.val_events, config, "validation", users=sample)
               for method, foldin in choices.items()}
    scores = {method: figures["replay_fresh_ndcg@10"] for method, figures in replays.items()}
    best = max(scores, key=scores.get)
    log.info("%s: fold-in by %s (validation replay NDCG@10 of %d of its %d users: %s)", name, best, sample, period,
             ", ".join(f"{method} {value:.4f}" for method, value in scores.items()))
    return ({**form, "foldin": choices[best]},
            {f"foldin_{method}_val_replay_ndcg@10": value for method, value in scores.items()},
            replays[best] if sample == whole else None)


@dataclass(frozen=True)
class Cut:
    """What was known at a point of the log: the history, and the frames it came from in time order."""

    history: sp.csr_matrix
    frames: tuple


def served_at(form: dict, data: Interactions, config: Config, cut: Cut, device: torch.device) -> Recommender:
    return Recommender(bundle_at(form, data, config, cut)).to(device)


def bundle_at(form: dict, data: Interactions, config: Config, cut: Cut) -> dict:
    if form["kind"] == "sequence":
        known = sequences_by_user(pd.concat(cut.frames), data.n_users)
        form = served_sequence_form(SequenceScorer.from_form(form).with_history(known))
    return {**serving_bundle(form, data, config, cut.history), "events_after": latest_timestamp(cut.frames)}


def latest_timestamp(frames: tuple) -> int | None:
    """The model's watermark: the last timestamp of what it knows, after which a server folds stored events in (those
    before it are in the model already); None where the frames are not at hand (a log read on Dask)."""
    known = [int(frame["timestamp"].max()) for frame in frames
             if frame is not None and "timestamp" in frame and len(frame)]
    return max(known) if known else None


def serving_bundle(form: dict, data: Interactions, config: Config, history: sp.csr_matrix) -> dict:
    """`form` applied to `history`, whose items are not recommended again and whose counts are the popularity."""
    return {**form, "history": history, "seen": history, "popularity": np.asarray(history.sum(axis=0)).ravel(),
            "trained": torch.from_numpy(np.diff(data.matrix("train").indptr) > 0),
            "user_ids": data.user_ids, "item_ids": data.item_ids, "titles": data.titles,
            "k": config.serving.k, "latency_users": config.serving.latency_users,
            "max_events": config.serving.foldin.max_events, "ann_candidates": config.serving.ann.candidates,
            "retrieval_rule": config.serving.retrieval, "auto_above_ms": config.serving.ann.auto_above_ms}


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
            "latency_p95_ms": float(np.percentile(timings, 95) * 1000), "batch_users_per_s": len(batch) / batch_seconds}


def served_retrieval(served: RecommenderModel, known: np.ndarray, single: int,
                     serving: Serving) -> tuple[dict[str, float], str]:
    """Latency of the model served exact and by two stages, and the retrieval served; the model is left serving it."""
    figures = {}
    for mode in ("exact", "ann"):
        served.recommender.use_retrieval(mode)
        figures.update({f"{mode}_{key}": value for key, value in latency(served, known, single).items()})
    exact_p95, index = figures["exact_latency_p95_ms"], served.recommender.index
    retrieval, auto_above_ms = serving.retrieval, serving.ann.auto_above_ms
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
    """The logged input example, which the signature is inferred from."""
    popular = np.argsort(-np.asarray(bundle["popularity"]), kind="stable")[:2]
    recent = [python_value(bundle["item_ids"][code]) for code in popular if code != UNKNOWN][:2]
    return pd.DataFrame({"user_id": users, "k": [bundle["k"]] * len(users), "recent_items": [recent[:1], recent],
                         "recent_timestamps": [[EXAMPLE_TIME], [EXAMPLE_TIME, EXAMPLE_TIME + 60]][:len(users)]})


def log_recommender(bundle: dict, model_name: str, job, serving: Serving) -> tuple[dict[str, float], Served | None]:
    """Log the served form of the best model as `model`; its latency figures, and what was logged."""
    served = RecommenderModel.from_bundle(bundle)  # timed and scored as it will be loaded
    known = np.asarray(bundle["user_ids"][1:])
    if bundle.get("ann") is None:
        figures = latency(served, known, bundle["latency_users"])
    else:
        figures, bundle["retrieval"] = served_retrieval(served, known, bundle["latency_users"], serving)
        job.tracker.set_tags({"retrieval": bundle["retrieval"]})
    example = request_example(bundle, known[:2])
    with warnings.catch_warnings():  # ids are never missing: MLflow's advice on integer columns does not apply
        warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer")
        logged = log_served(served, bundle, example, job.tracker, Publication(
            model_name, __package__, ("torch", "numpy", "pandas", "scipy", "mlflow"),
            optional_inputs=("k", "recent_items", "recent_timestamps"), params={"k": bundle["k"]},
            metadata={"model": model_name, "kind": bundle["kind"]}))
    return figures, logged
