"""A fitted model's served form (what `serving` scores with: factors and how a user's events fold in, an item-item
matrix, a sequence network, popularity), its fold-in chosen on the validation period's replay, and the served model
at a cut of the log: knowing what was known there."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

from .baselines import ALS, EASE, ItemKNN
from .config import Config
from .data import Interactions
from .foldin import FoldIn
from .models import LightGCN, PairwiseRanker
from .replay import replay
from .sasrec import sequences_by_user
from .sequence import SequenceScorer, served_sequence_form
from .serving import Recommender

log = logging.getLogger(__name__)


def replayed(name: str, recommender: Recommender, events, config: Config, period: str = "test",
             users: int | None = None) -> dict[str, float]:
    """The replay of a period's events through a served form that knows what was known before it: of a seeded
    sample of `users` of its users, else of `evaluation.replay_users` (null: every one)."""
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
    """What the served model scores with, on the CPU: factors (and how to fold a user's events in), an item-item
    matrix, or popularity alone."""
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
    """BPR and LightGCN fold events in as `serving.foldin` says; with `auto`, every method is offered
    (`foldin_choices`, the first the default) and `chosen_foldin` keeps the best on the validation replay of a
    sample of its users.
    LightGCN's graph fold-in needs its layer-0 user rows, the items' summed layers and their training degrees."""
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
    """The form with the fold-in method whose replay of the validation period (what was known at its start) ranks
    the next events best on a seeded sample of its users (`serving.foldin.choice_users`), and each method's figure
    there; with them the chosen method's replay where the sample is the whole replay (else None: the caller replays
    the period for the chosen method alone). A form without choices as it is."""
    choices = form.get("foldin_choices")
    if not choices:
        return form, {}, None
    form = {key: value for key, value in form.items() if key != "foldin_choices"}
    if not config.evaluation.replay or data.val_events is None:
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
    """What was known at a point of the log: the history (unordered) and the frames it came from, in time order
    (a sequence form is served from each user's events in order)."""

    history: sp.csr_matrix
    frames: tuple


def served_at(form: dict, data: Interactions, config: Config, cut: Cut, device: torch.device) -> Recommender:
    """The served model of `form` at `cut`, scoring batches on `device` (what a replay ranks with)."""
    return Recommender(bundle_at(form, data, config, cut)).to(device)


def bundle_at(form: dict, data: Interactions, config: Config, cut: Cut) -> dict:
    """The served model of `form` knowing what was known at `cut`."""
    if form["kind"] == "sequence":
        known = sequences_by_user(pd.concat(cut.frames), data.n_users)
        form = served_sequence_form(SequenceScorer.from_form(form).with_history(known))
    return serving_bundle(form, data, config, cut.history)


def serving_bundle(form: dict, data: Interactions, config: Config, history: sp.csr_matrix) -> dict:
    """A served model: `form` applied to `history` (whose items are also the ones not recommended again, and whose
    counts are the popularity); users without training rows (`trained`) are served from their history in it."""
    return {**form, "history": history, "seen": history, "popularity": np.asarray(history.sum(axis=0)).ravel(),
            "trained": torch.from_numpy(np.diff(data.matrix("train").indptr) > 0),
            "user_ids": data.user_ids, "item_ids": data.item_ids, "titles": data.titles,
            "k": config.serving.k, "latency_users": config.serving.latency_users,
            "max_events": config.serving.foldin.max_events, "ann_candidates": config.serving.ann.candidates}
