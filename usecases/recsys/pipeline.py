"""The recsys job: every model fitted on the same training split, ranked against every item on the same test
users, the best one (by validation NDCG@10, or by the validation period's replay) served and timed.

Each model's served form (what `serving` scores with: factors, an item-item matrix, a sequence network, popularity)
is ranked on the test users too, as `served_ndcg@10` with the history the evaluation used (so a loss to the form,
EASE pruned above `serving.max_similarity_mb`, shows), and as `served_fresh_ndcg@10` with the history known at the
test cut (train + validation): what the served model's use of every event it knows is worth. The users first seen in
the validation period, whom no model trained on and the test metrics leave out, are ranked by the served form at the
test cut against their test items, as `served_untrained_ndcg@10`: what a user known only from their events gets.
With `evaluation.replay`, the form also replays the test period's events in time order (`replay.py`): frozen at the
cut against each user's events folded in as they come, what real-time serving is worth."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp
import torch

from common.errors import UserError
from common.job import Job
from common.paths import stored_bytes
from common.runtime.devices import all_cores
from common.usecase import RunResult
from .baselines import ALS, EASE, ItemKNN, ModelUnavailable, Popularity
from .config import Config
from .data import Interactions, expected_interactions, load_interactions
from .evaluate import full_ranking, sample_users
from .foldin import FoldIn
from .models import LightGCN, PairwiseRanker
from .movielens import movielens_files, movielens_folder, movielens_format
from .replay import replay
from .retrieval import KINDS, ann_figures, build_index
from .sasrec import SequenceScorer, fit_sasrec, sequences_by_user, served_sequence_form
from .publish import log_recommender
from .serving import Recommender
from .train import fit_ranker, seconds_per_epoch

log = logging.getLogger(__name__)

LEARNED = ("bpr", "lightgcn")


def load_data(config: Config, path: Path | None, client=None) -> tuple[Interactions, dict[str, str]]:
    """Everything that can be wrong with the data is found here, before an MLflow run is started; with a Dask
    `client`, on its cluster."""
    if path is None and config.data.source == "synthetic":  # before drawing a log too large to hold
        check_memory(config, config.data.synthetic.users + 1, config.data.synthetic.items + 1, "data.synthetic")
    data = load_interactions(config, path, client)
    check_memory(config, data.n_users, data.n_items, str(path or data.source))
    if data.n_items - 1 < max(config.evaluation.ks):
        raise UserError(f"{path or data.source}: evaluation.ks asks for the top {max(config.evaluation.ks)} of a "
                        f"catalogue of {data.n_items - 1} items (set evaluation.ks to K values up to that)")
    sizes = {split: data.size(split) for split in ("train", "val", "test")}
    samples = sum(sizes.values())
    return data, {"data_source": data.source, "data_sha256": data.sha256, "data_users": data.n_users - 1,
                  "data_items": data.n_items - 1, **{f"data_{split}_interactions": n for split, n in sizes.items()},
                  "data_bytes": log_bytes(config, path, samples), "data_samples": samples,
                  **({"data_path": str(path)} if path else {}),
                  "data_schema": "user_id:string,item_id:string,rating:double,timestamp:long"}


TABLE_COPIES = 4  # an embedding table, its gradient and Adam's two moments
SCORE_COPIES = 3  # a batch's scores, their masked copy and top-k's work


def memory_needed(config: Config, users: int, items: int) -> dict[str, float]:
    """Bytes the largest parts of a run hold at once, from the catalogue's size: each learned model's tables while
    it trains, a batch of full-ranking scores, the ANN index over the item vectors."""
    parts = {}
    for name in ("bpr", "lightgcn", "sasrec"):
        if name in config.models:
            rows = items if name == "sasrec" else users + items
            parts[f"{name}'s embedding tables"] = rows * getattr(config, name).dim * 4 * TABLE_COPIES
    if "als" in config.models:
        parts["als's factors"] = (users + items) * config.als.factors * 4 * 2
    parts["a batch of full-ranking scores (evaluation.batch_users)"] = \
        config.evaluation.batch_users * items * 4 * SCORE_COPIES
    if config.serving.retrieval != "exact":
        dims = [getattr(config, name).dim for name in ("bpr", "lightgcn", "sasrec") if name in config.models]
        parts["the ANN index"] = items * (max(dims, default=0) + 64) * 4  # vectors and HNSW's links
    return parts


def check_memory(config: Config, users: int, items: int, where: str) -> None:
    """One line, before anything is trained, where the catalogue's largest part would not fit the memory free."""
    import psutil

    parts = memory_needed(config, users, items)
    largest = max(parts, key=parts.get)
    free = psutil.virtual_memory().available
    if parts[largest] > free:
        raise UserError(f"{where}: a catalogue of {items - 1:,} items is too large for this machine's memory: "
                        f"{largest} alone take {parts[largest] / 2**30:,.1f} GB, {free / 2**30:,.1f} GB are free "
                        f"(fewer items, a smaller dim or evaluation.batch_users, or a larger machine)")


INTERACTION_BYTES = 32  # a row of the split frames: user, item and timestamp as int64, rating as float64


def log_bytes(config: Config, path: Path | None, samples: int) -> int:
    """What a run reads from storage: the log file, or a MovieLens release's files; a synthetic log (generated in
    memory, or on Dask into the cache) counts its `samples` interactions as the frames hold them, uncompressed, so
    that both engines report one size."""
    if path is None and config.data.source == "synthetic":
        return samples * INTERACTION_BYTES
    where = movielens_folder(config.data.movielens) if path is None else path
    if where.is_dir():
        return stored_bytes(*movielens_files(where, movielens_format(where)))
    return stored_bytes(where)


AUTO_DASK_INTERACTIONS = 20_000_000  # runtime.engine=auto prepares logs of more than this on Dask


def large_data(config: Config, path: Path | None) -> str | None:
    """For `runtime.engine: auto`: a log of more than AUTO_DASK_INTERACTIONS interactions, when its size is known
    before reading it."""
    rows = expected_interactions(config, path)
    if rows is not None and rows > AUTO_DASK_INTERACTIONS:
        return f"about {rows / 1e6:,.0f} M interactions (more than {AUTO_DASK_INTERACTIONS / 1e6:,.0f} M)"
    return None


FIT_SCALES = {"als": "cores"}  # how each fit scales (`common.runtime.phases`); the others are tensor work: device
# Fits of large matrix work, given every core: on the 2-core machine with its cores free, a SASRec epoch on
# ml-latest-small took 2.5 s against 4.1 s on one core, EASE's inverse (float64) 24 s against 33 s. The others keep
# runtime.cpu_threads (one, in the presets: BPR's and LightGCN's small steps were slower on two threads).
ALL_CORES = ("ease", "sasrec")


def fit_model(name: str, data: Interactions, config: Config, job: Job, val: sp.csr_matrix | None = None):
    """The fitted scorer and what its fit measured (seconds; per epoch for the learned models). `val` is what the
    learned models validate on (the validation split, or its sample of users)."""
    with all_cores() if name in ALL_CORES else nullcontext():
        return _fitted(name, data, config, job, val)


def _fitted(name: str, data: Interactions, config: Config, job: Job, val: sp.csr_matrix | None):
    train, device = data.matrix("train"), job.runtime.device
    started = time.perf_counter()
    if name == "sasrec":
        return fit_sasrec(data, data.matrix("val") if val is None else val, config, job)
    if name in LEARNED:
        model, result = fit_ranker(name, train, data.matrix("val") if val is None else val, config, job)
        settings = getattr(config, name)
        world = job.runtime.world_size  # every rank draws its own batches of the epoch
        pairs = min(train.nnz, (settings.steps_per_epoch or train.nnz) * settings.batch_size * world)
        return model, {"fit_seconds": time.perf_counter() - started, "best_epoch": result.best_epoch + 1,
                       "seconds_per_epoch": seconds_per_epoch(result.history, pairs)}
    make = {"pop": lambda: Popularity(train, device),
            "itemknn": lambda: ItemKNN(train, config.itemknn, device),
            "ease": lambda: EASE(train, config.ease, device),
            "als": lambda: ALS(train, config.als, device)}[name]
    scorer = make()
    return scorer, {"fit_seconds": time.perf_counter() - started}


def run(config: Config, data: Interactions, job: Job) -> RunResult:
    """Under DDP every rank fits every model (the learned ones together, the baselines each alone: deterministic,
    and no rank waits in a collective while another fits) and ranks its share of the users; rank 0 logs."""
    runtime = job.runtime
    train = data.matrix("train")
    val = sample_users(data.matrix("val"), config.evaluation.sample_users, config.runtime.seed)
    test = sample_users(data.matrix("test"), config.evaluation.sample_users, config.runtime.seed)
    validation_period = data.val if data.val_events is None else data.val_events  # with the users first seen there
    seen_before_test = (train + data.matrix("val" if data.val_events is None else "val_events")).sign().tocsr()
    untrained = untrained_truth(data, seen_before_test, config)
    models, forms, validation, indices = {}, {}, {}, {}
    if data.prepare_seconds is not None:
        job.tracker.log_metrics({"time/preprocess_s": data.prepare_seconds})

    def ranking(scorer, truth, exclude, ks):
        return full_ranking(scorer, truth, exclude, ks, runtime.device, config.evaluation.batch_users, runtime)

    cuts = {"train": Cut(train, (data.train,)), "test": Cut(seen_before_test, (data.train, validation_period)),
            "known": Cut(data.matrix("known"), (data.train, data.val_events, data.test_events))}
    for name in config.models:
        try:
            with job.phase(f"fit/{name}", FIT_SCALES.get(name, "device")):
                scorer, fitted = fit_model(name, data, config, job, val)
        except ModelUnavailable as exc:
            log.warning("%s; skipped", exc)
            continue
        with job.phase(f"evaluate/{name}"):
            started = time.perf_counter()
            validation[name] = ranking(scorer, val, train, [10])["ndcg@10"]
            evaluated = "train"  # the history the test ranking used, which served_ndcg@10 serves with
            if isinstance(scorer, SequenceScorer):  # ranks from each user's sequence as known at the test cut
                scorer = scorer.with_history(sequences_by_user(pd.concat(cuts["test"].frames), data.n_users))
                evaluated = "test"
            metrics = ranking(scorer, test, seen_before_test, config.evaluation.ks)
            models[name] = {**metrics, **fitted, "val_ndcg@10": validation[name],
                            "evaluate_seconds": time.perf_counter() - started}
            forms[name] = served_form(scorer, config, train)
        val_replay = None
        if runtime.is_main and "foldin_choices" in forms[name]:  # rank 0 serves: it alone replays the methods
            with job.phase(f"foldin/{name}"):
                forms[name], chosen, val_replay = chosen_foldin(name, forms[name], data, config, cuts["train"],
                                                                runtime.device)
            models[name].update(chosen)
        forms[name].pop("foldin_choices", None)
        served = {}  # the served form at each cut, with the fold-in it serves
        with job.phase(f"evaluate/{name}"):
            for key, cut in (("served_ndcg@10", evaluated), ("served_fresh_ndcg@10", "test")):
                served[cut] = served.get(cut) or Recommender(bundle_at(forms[name], data, config, cuts[cut]))
                models[name][key] = ranking(served[cut], test, seen_before_test, config.evaluation.ks)["ndcg@10"]
        if forms[name]["kind"] in KINDS and config.serving.retrieval != "exact" and runtime.is_main:
            with job.phase(f"index/{name}", "cores"):
                indices[name] = build_index(served[evaluated], config)
            job.tracker.set_tags({f"ann_index/{name}": indices[name].spec})
            with job.phase(f"evaluate/{name}"):
                models[name].update(ann_figures(
                    served[evaluated], indices[name], test, config,
                    lambda scorer: full_ranking(scorer, test, seen_before_test, config.evaluation.ks, runtime.device,
                                                config.evaluation.batch_users)))  # rank 0 alone: no collective
        if untrained is not None and runtime.is_main:  # by the fold-in served, which rank 0 alone chooses
            as_served = served["test"]
            models[name]["served_untrained_ndcg@10"] = full_ranking(
                as_served, untrained, seen_before_test, config.evaluation.ks, runtime.device,
                config.evaluation.batch_users)["ndcg@10"]
        if config.evaluation.replay and runtime.is_main:
            with job.phase(f"replay/{name}"):
                at_test_cut = served_at(forms[name], data, config, cuts["test"], runtime.device)
                models[name].update(replayed(name, at_test_cut, data.test_events, config))
                if config.serving.select_by == "val_replay":  # what was known at the validation cut, its period
                    if val_replay is None:  # else the fold-in choice replayed it whole
                        at_val_cut = served_at(forms[name], data, config, cuts["train"], runtime.device)
                        val_replay = replayed(name, at_val_cut, data.val_events, config, "validation")
                    models[name].update({f"val_{key}": value for key, value in val_replay.items()})
        log.info("%s: test NDCG@10 %.4f (served form %.4f), recall@10 %.4f", name, metrics["ndcg@10"],
                 models[name]["served_ndcg@10"], metrics["recall@10"])
        job.model_done(name, models[name])
    if not models:
        return RunResult(models)
    if not runtime.is_main:
        return RunResult({})
    best = served_choice(models, validation, config)
    job.tracker.set_tags({"served_model": best})
    bundle = bundle_at(forms[best], data, config, cuts["known"])
    if best in indices:
        bundle["ann"] = indices[best].stored()
    with job.phase("serving_bundle", "serial"):
        figures, served = log_recommender(bundle, best, job, config.serving.retrieval, config.serving.ann.auto_above_ms)
    models[best].update(figures)
    return RunResult(models, served)


def untrained_truth(data: Interactions, seen_before_test: sp.csr_matrix, config: Config) -> sp.csr_matrix | None:
    """The test items of the users with a history at the test cut but no training rows (first seen in the
    validation period), less what they had consumed by then: what `served_untrained_ndcg@10` ranks (a seeded sample
    of `evaluation.sample_users`). None without such users, or on the Dask engine (which keeps no frame of the
    periods)."""
    if data.test_events is None:
        return None
    without_rows = (np.diff(data.matrix("train").indptr) == 0) & (np.diff(seen_before_test.indptr) > 0)
    truth = sp.diags(without_rows.astype(np.float32)) @ data.matrix("test_events")
    truth = (truth - truth.multiply(seen_before_test)).tocsr()
    truth.eliminate_zeros()
    return sample_users(truth, config.evaluation.sample_users, config.runtime.seed) if truth.nnz else None


def served_choice(models: dict[str, dict[str, float]], validation: dict[str, float], config: Config) -> str:
    """The model served: by validation NDCG@10, or by the validation period's replay with events folded in."""
    if config.serving.select_by == "val_replay":
        replayed_models = {name: metrics.get("val_replay_fresh_ndcg@10", -1.0) for name, metrics in models.items()}
        return max(replayed_models, key=replayed_models.get)
    return max(validation, key=validation.get)


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
