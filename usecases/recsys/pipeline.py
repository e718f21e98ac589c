"""The recsys job: every model fitted on the same training split and ranked against every item on the same test
users, its served form ranked and replayed too, and the best one served."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp

from common.errors import UserError
from common.job import Job
from common.paths import stored_bytes
from common.runtime.process import all_cores
from common.serving.ann import Queries, VectorIndex, exact_top_k
from common.usecase import RunResult
from .baselines import ALS, EASE, ItemKNN, ModelUnavailable, Popularity
from .config import Config
from .data import Interactions, expected_interactions, load_interactions
from .evaluate import full_ranking, sample_users
from .movielens import movielens_files, movielens_folder, movielens_format
from .ranking import UNKNOWN, row_codes
from .retrieval import KINDS
from .sequence import SequenceScorer
from .served import Cut, bundle_at, chosen_foldin, log_recommender, replayed, served_at, served_form
from .serving import Recommender
from .train import fit_figures, fit_ranker, fit_sasrec, sequences_by_user

log = logging.getLogger(__name__)

LEARNED = ("bpr", "lightgcn")
BASELINES = {"itemknn": ItemKNN, "ease": EASE, "als": ALS}  # each fitted from (train, its config, device)


def load_data(config: Config, path: Path | None, client=None) -> tuple[Interactions, dict[str, str]]:
    """The data and its tags; what can be wrong with it is found here, before an MLflow run is started."""
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
    """Bytes the largest parts of a run hold at once, from the catalogue's size."""
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
        dims += [config.als.factors] if "als" in config.models else []
        parts["the ANN index"] = items * (max(dims, default=0) + 1 + 64) * 4  # vectors (lifted) and HNSW's links
    return parts


def check_memory(config: Config, users: int, items: int, where: str) -> None:
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
    """What a run reads from storage; a synthetic log counts its `samples` as the frames hold them."""
    if path is None and config.data.source == "synthetic":
        return samples * INTERACTION_BYTES
    where = movielens_folder(config.data.movielens) if path is None else path
    return stored_bytes(*movielens_files(where, movielens_format(where))) if where.is_dir() else stored_bytes(where)


AUTO_DASK_INTERACTIONS = 20_000_000  # runtime.engine=auto prepares logs of more than this on Dask


def large_data(config: Config, path: Path | None) -> str | None:
    """For `runtime.engine: auto`: why the log is large, when its size is known before reading it."""
    rows = expected_interactions(config, path)
    if rows is not None and rows > AUTO_DASK_INTERACTIONS:
        return f"about {rows / 1e6:,.0f} M interactions (more than {AUTO_DASK_INTERACTIONS / 1e6:,.0f} M)"
    return None


FIT_SCALES = {"als": "cores"}  # how each fit scales (`common.runtime.phases`); the others are tensor work: device
# Fits of large matrix work, given every core (a SASRec epoch on 2 cores took 60 % of one core's time); the others
# keep runtime.cpu_threads (BPR's and LightGCN's small steps were slower on two threads).
ALL_CORES = ("ease", "sasrec")


def fit_model(name: str, data: Interactions, config: Config, job: Job, val: sp.csr_matrix):
    """The fitted scorer and what its fit measured; the learned models validate on `val`."""
    train, device = data.matrix("train"), job.runtime.device
    started = time.perf_counter()
    with all_cores() if name in ALL_CORES else nullcontext():
        if name == "sasrec":
            return fit_sasrec(data, val, config, job)
        if name in LEARNED:
            model, result = fit_ranker(name, train, val, config, job)
            settings = getattr(config, name)
            # every rank draws its own batches of the epoch
            pairs = min(train.nnz, (settings.steps_per_epoch or train.nnz) * settings.batch_size
                        * job.runtime.world_size)
            return model, fit_figures(started, result, pairs)
        model = Popularity(train, device) if name == "pop" else BASELINES[name](train, getattr(config, name), device)
        return model, {"fit_seconds": time.perf_counter() - started}


@dataclass(frozen=True)
class Setting:
    """What every model of a run is fitted, ranked and served on, the history known at each cut of the log."""

    config: Config
    data: Interactions
    job: Job
    train: sp.csr_matrix
    val: sp.csr_matrix
    test: sp.csr_matrix
    seen_before_test: sp.csr_matrix
    untrained: sp.csr_matrix | None
    cuts: dict[str, Cut]

    @classmethod
    def of(cls, config: Config, data: Interactions, job: Job) -> Setting:
        train, evaluation, seed = data.matrix("train"), config.evaluation, config.runtime.seed
        validation_period = data.val if data.val_events is None else data.val_events  # with its new users
        seen_before_test = (train + data.matrix("val" if data.val_events is None else "val_events")).sign().tocsr()
        cuts = {"train": Cut(train, (data.train,)), "test": Cut(seen_before_test, (data.train, validation_period)),
                "known": Cut(data.matrix("known"), (data.train, data.val_events, data.test_events))}
        return cls(config, data, job, train, sample_users(data.matrix("val"), evaluation.sample_users, seed),
                   sample_users(data.matrix("test"), evaluation.sample_users, seed), seen_before_test,
                   untrained_truth(data, seen_before_test, config), cuts)

    def ranking(self, scorer, truth: sp.csr_matrix, exclude: sp.csr_matrix, ks: list[int],
                collective: bool = True) -> dict[str, float]:
        """Full ranking on the run's device; `collective=False` where rank 0 alone ranks (no all-reduce)."""
        runtime = self.job.runtime
        return full_ranking(scorer, truth, exclude, ks, runtime.device, self.config.evaluation.batch_users,
                            runtime if collective else None)


@dataclass
class Evaluated:
    """A model after its fit and evaluation; `cut` is the history its test ranking read."""

    metrics: dict[str, float]
    form: dict
    validation: float
    cut: str
    index: VectorIndex | None = None


def run(config: Config, data: Interactions, job: Job) -> RunResult:
    """Under DDP every rank fits every model and ranks its share of the users; rank 0 logs."""
    setting = Setting.of(config, data, job)
    if data.prepare_seconds is not None:
        job.tracker.log_metrics({"time/preprocess_s": data.prepare_seconds})
    evaluated = {}
    for name in config.models:
        model = evaluate_model(name, setting)
        if model is not None:
            evaluated[name] = model
            job.model_done(name, model.metrics)
    if not evaluated or not job.runtime.is_main:
        return RunResult({})
    models = {name: model.metrics for name, model in evaluated.items()}
    if config.serving.select_by == "val_replay":  # the validation period's replay, with its events folded in
        scores = {name: metrics.get("val_replay_fresh_ndcg@10", -1.0) for name, metrics in models.items()}
    else:
        scores = {name: model.validation for name, model in evaluated.items()}
    best = max(scores, key=scores.get)
    job.tracker.set_tags({"served_model": best})
    return RunResult(models, serve(best, evaluated[best], setting))


def evaluate_model(name: str, setting: Setting) -> Evaluated | None:
    """Fit, rank, choose the fold-in, rank as served, index and replay one model; None where it cannot run."""
    job, config, is_main = setting.job, setting.config, setting.job.runtime.is_main
    try:
        with job.phase(f"fit/{name}", FIT_SCALES.get(name, "device")):
            scorer, fitted = fit_model(name, setting.data, config, job, setting.val)
    except ModelUnavailable as exc:
        log.warning("%s; skipped", exc)
        return None
    model = ranked(name, scorer, fitted, setting)
    val_replay = None
    if is_main and "foldin_choices" in model.form:  # rank 0 serves: it alone replays the methods
        with job.phase(f"foldin/{name}"):
            model.form, chosen, val_replay = chosen_foldin(name, model.form, setting.data, config,
                                                           setting.cuts["train"], job.runtime.device)
        model.metrics.update(chosen)
    model.form.pop("foldin_choices", None)
    served = {}  # the served form ranked on test with its test ranking's history, and with the test cut's
    with job.phase(f"evaluate/{name}"):
        for key, cut in (("served_ndcg@10", model.cut), ("served_fresh_ndcg@10", "test")):
            served[cut] = served.get(cut) or Recommender(bundle_at(model.form, setting.data, config, setting.cuts[cut]))
            model.metrics[key] = setting.ranking(served[cut], setting.test, setting.seen_before_test,
                                                 config.evaluation.ks)["ndcg@10"]
    if model.form["kind"] in KINDS and config.serving.retrieval != "exact" and is_main:
        with job.phase(f"index/{name}", "cores"):
            model.index = build_index(served[model.cut], config, setting.val)
        job.tracker.set_tags({f"ann_index/{name}": model.index.spec})
        with job.phase(f"evaluate/{name}"):
            model.metrics.update(ann_figures(served[model.cut], model.index, setting))
    if setting.untrained is not None and is_main:  # by the fold-in served, which rank 0 alone chooses
        model.metrics["served_untrained_ndcg@10"] = setting.ranking(
            served["test"], setting.untrained, setting.seen_before_test, config.evaluation.ks, False)["ndcg@10"]
    if config.evaluation.replay and is_main:
        with job.phase(f"replay/{name}"):
            model.metrics.update(replays(name, model.form, val_replay, setting))
    log.info("%s: test NDCG@10 %.4f (served form %.4f), recall@10 %.4f", name, model.metrics["ndcg@10"],
             model.metrics["served_ndcg@10"], model.metrics["recall@10"])
    return model


def ranked(name: str, scorer, fitted: dict, setting: Setting) -> Evaluated:
    """The model ranked on validation and on test (a sequence model from the history at the test cut)."""
    with setting.job.phase(f"evaluate/{name}"):
        started = time.perf_counter()
        validation = setting.ranking(scorer, setting.val, setting.train, [10])["ndcg@10"]
        cut = "train"  # the history the test ranking used, which served_ndcg@10 serves with
        if isinstance(scorer, SequenceScorer):
            scorer = scorer.with_history(sequences_by_user(pd.concat(setting.cuts["test"].frames),
                                                           setting.data.n_users))
            cut = "test"
        metrics = setting.ranking(scorer, setting.test, setting.seen_before_test, setting.config.evaluation.ks)
        metrics = {**metrics, **fitted, "val_ndcg@10": validation, "evaluate_seconds": time.perf_counter() - started}
        return Evaluated(metrics, served_form(scorer, setting.config, setting.train), validation, cut)


def build_index(recommender: Recommender, config: Config, requests: sp.csr_matrix | None) -> VectorIndex:
    """The index over the item vectors, its search effort tuned on one sample of users' queries, then confirmed on
    another (stepped up while that one is below the target: the effort chosen on a sample flatters that sample), whose
    recall `serving.retrieval: auto` is gated on. The queries are what a server searches with (`tuning_queries`),
    with the validation period's events (`requests`) as the new events of the users who have some, split between the
    two samples; no test data read."""
    settings, rng = config.serving.ann, np.random.default_rng(config.runtime.seed)
    users = np.flatnonzero(recommender.form.has_rows)
    users = users[users != UNKNOWN]
    active = np.intersect1d(users, np.flatnonzero(np.diff(requests.indptr))) if requests is not None else users[:0]
    order = np.concatenate([rng.permutation(active), rng.permutation(np.setdiff1d(users, active))])
    tuning, checking = (np.sort(order[first::2][:settings.tune_users]) for first in (0, 1))
    queries = tuning_queries(recommender, tuning, config.runtime.seed, requests)
    index, measured = VectorIndex.tuned(recommender.item_vectors(), settings.index, queries, 10, settings.candidates,
                                        settings.target_recall, config.runtime.seed)
    for spec, tuned in measured.items():
        log.info("ANN index %s over %d items: %s %s for recall@10 %.4f on %d queries, the least of their kinds' "
                 "(tried %s)", spec, index.rows, index.effort_name if spec == index.spec else "effort", tuned.effort,
                 tuned.recall, len(queries.vectors),
                 ", ".join(f"{effort}: {recall:.3f}" for effort, recall in tuned.tried.items()) or "-")
    checks = tuning_queries(recommender, checking, config.runtime.seed + 1, requests)
    tuned_effort, tuned_recall = index.effort, index.recall
    index.confirmed(checks, recommender.item_vectors(), 10, settings.candidates)
    log.info("ANN index %s served: built in %.1f s, %s %s, recall@10 %.4f on %d queries of other users (%s %s: %.4f "
             "on the tuning users') against a target of %g", index.spec, index.build_seconds, index.effort_name,
             index.effort, index.recall, len(checks.vectors), index.effort_name, tuned_effort, tuned_recall,
             settings.target_recall)
    return index


TUNING_EVENTS = 3  # the made-up new events of every other query of a user without validation events


def tuning_queries(recommender: Recommender, users: np.ndarray, seed: int,
                   requests: sp.csr_matrix | None = None) -> Queries:
    """What a server searches with, for `users`, each with its exclusions, in three kinds: their vectors, those their
    histories fold into (with a fold-in), and those a request with new events makes: a user's validation events
    (`requests`, up to `max_events`, as a server folds them in), else events drawn without a label from the user's
    own exact top items, a few or as many as are folded in. Each user weighs as many requests as their history holds
    events: a server meets its active users most, and they exclude the most (two users of ml-latest-small with 2,516
    and 1,646 films seen kept 3 and 4 of their top 10 where the mean user kept 9.96 of 10)."""
    form, rng = recommender.form, np.random.default_rng(seed)
    plain = form.query_vectors(users)
    excluded = [recommender.excluded(user) for user in users.tolist()]
    activity = np.diff(form.history.indptr)[users] + 1.0
    kinds = len(plain) // max(len(users), 1)  # the vectors, and with a fold-in those of the histories
    queries, exclusions, groups = [plain], excluded * kinds, [np.repeat(np.arange(kinds), len(users))]
    weights = [np.tile(activity, kinds)]
    vectors = recommender.item_vectors()
    sizes = (TUNING_EVENTS, max(form.max_events, TUNING_EVENTS))
    liked = exact_top_k(plain[:len(users)], vectors, min(2 * sizes[1], len(vectors) - 1), excluded)
    for number, (user, seen, top) in enumerate(zip(users.tolist(), excluded, liked)):
        events = np.zeros(0, np.int64) if requests is None else row_codes(requests, user)[-form.max_events:]
        if not len(events):
            events = np.sort(rng.choice(top, size=min(sizes[number % 2], len(top)), replace=False)).astype(np.int64)
        query = form.query(user, events)
        if query is not None:
            queries.append(np.asarray(query, np.float32)[None])
            exclusions.append(np.union1d(seen, events))
            groups.append(np.full(1, kinds))
            weights.append(activity[number:number + 1])
    return Queries(np.concatenate(queries).astype(np.float32), exclusions, np.concatenate(groups),
                   np.concatenate(weights))


def test_users(setting: Setting) -> np.ndarray:
    return np.flatnonzero(np.diff(setting.test.indptr))


def ann_figures(recommender: Recommender, index: VectorIndex, setting: Setting) -> dict[str, float]:
    """Two stages against exact as a server meets its users: test users with their test events (which the tuning
    never reads) as the request's events (folded in, excluded), recall@10 of the two-stage top-10 against the exact
    one; and the two stages' test NDCG@10 (rank 0 alone)."""
    config = setting.config
    users = test_users(setting)
    users = np.sort(np.random.default_rng(config.runtime.seed).permutation(users)[:config.serving.ann.recall_users])
    events = [row_codes(setting.test, user)[-recommender.form.max_events:] for user in users.tolist()]
    exact = [items for items, _ in recommender.recommend_many(users, events, 10)]
    recommender.use_retrieval("ann", index)
    try:
        found = [items for items, _ in recommender.recommend_many(users, events, 10)]
        ndcg = setting.ranking(recommender, setting.test, setting.seen_before_test, config.evaluation.ks, False)
    finally:
        recommender.use_retrieval("exact")
    recall = float(np.mean([len(np.intersect1d(mine, truth)) / max(len(truth), 1)
                            for mine, truth in zip(found, exact)])) if users.size else float("nan")
    return {"ann_recall@10": recall, "ann_served_ndcg@10": ndcg["ndcg@10"], "ann_build_seconds": index.build_seconds,
            "ann_index_mb": len(index.stored()["index"]) / 2**20, "ann_search_effort": float(index.effort or 0),
            "ann_recall_users": float(len(users))}


def replays(name: str, form: dict, val_replay: dict | None, setting: Setting) -> dict[str, float]:
    """The test period replayed through the form served at its start, and where needed the validation period's."""
    data, config, device = setting.data, setting.config, setting.job.runtime.device
    figures = replayed(name, served_at(form, data, config, setting.cuts["test"], device), data.test_events, config)
    if config.serving.select_by == "val_replay":  # what was known at the validation cut, its period
        if val_replay is None:
            val_replay = replayed(name, served_at(form, data, config, setting.cuts["train"], device),
                                  data.val_events, config, "validation")
        figures.update({f"val_{key}": value for key, value in val_replay.items()})
    return figures


def serve(best: str, model: Evaluated, setting: Setting):
    """Log the chosen model for serving, knowing everything, and add its serving figures."""
    config = setting.config
    bundle = bundle_at(model.form, setting.data, config, setting.cuts["known"])
    if model.index is not None:
        bundle["ann"] = model.index.stored()
    with setting.job.phase("serving_bundle", "serial"):
        figures, served = log_recommender(bundle, best, setting.job, config.serving)
    model.metrics.update(figures)
    return served


def untrained_truth(data: Interactions, seen_before_test: sp.csr_matrix, config: Config) -> sp.csr_matrix | None:
    """The new test items of the users first seen in the validation period; None without them, or on Dask."""
    if data.test_events is None:
        return None
    without_rows = (np.diff(data.matrix("train").indptr) == 0) & (np.diff(seen_before_test.indptr) > 0)
    truth = sp.diags(without_rows.astype(np.float32)) @ data.matrix("test_events")
    truth = (truth - truth.multiply(seen_before_test)).tocsr()
    truth.eliminate_zeros()
    return sample_users(truth, config.evaluation.sample_users, config.runtime.seed) if truth.nnz else None
