"""Approximate maximum-inner-product retrieval with FAISS (on the CPU), the first stage of two-stage serving: any
`index_factory` string on the inner product, or `auto` (`VectorIndex.tuned`), its search effort tuned, not guessed.
Stored as FAISS's serialisation in a uint8 tensor (no pickle) with a digest of the vectors it indexes, so that an
index of other vectors is refused in one line."""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from common.errors import UserError

EFFORTS = {"HNSW": ("efSearch", (16, 32, 64, 128, 256, 512, 1024)),
           "IVF": ("nprobe", (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))}
FILTER_ABOVE = 1024  # exclusions of a query beyond which they are filtered inside the search, not over-fetched
LIFTED = "lifted:"  # a spec's prefix: the index built by L2 over the vectors lifted to one norm (`build`)
TRAINING_VECTORS = 2**18  # what IVF's k-means and PQ's codebooks train on: 64 vectors a list for 4,096 lists


def faiss_module():
    """FAISS, or one line saying how to get it."""
    try:
        import faiss
    except ImportError:
        raise UserError("approximate retrieval needs FAISS: pip install faiss-cpu (or set serving.retrieval: "
                        "exact)") from None
    return faiss


def inverted_lists(rows: int) -> int:
    """About 4 sqrt(rows), a power of two, with at least 39 training vectors a list (FAISS's minimum)."""
    return int(max(1, min(2 ** round(np.log2(max(4 * np.sqrt(rows), 1))), rows // 39)))


def vectors_digest(vectors: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(vectors, np.float32).tobytes()).hexdigest()[:16]


@dataclass
class Tuned:
    """What tuning measured: the effort chosen, its recall and seconds a query, and every effort tried."""

    effort: int | None
    recall: float
    tried: dict[int, float]
    seconds: float = 0.0


class Queries(NamedTuple):
    """What an index is tuned on: query vectors, each one's excluded rows, the kind of query each is (`groups`) and
    how often a server meets it (`weights`): the recall that must reach the target is the least of the kinds' weighted
    means. A kind that is rare among the queries but hard, such as requests that fold many new events in, is not
    averaged away by easy ones; nor is a user who comes often (a long history, and as long an exclusion list that
    crowds the nearest cells and graph nodes with items already seen) by the many who come once."""

    vectors: np.ndarray
    exclude: list[np.ndarray] | None = None
    groups: np.ndarray | None = None
    weights: np.ndarray | None = None

    def recall(self, found: np.ndarray, exact: np.ndarray) -> float:
        shares = overlaps(found, exact)
        groups = np.zeros(len(shares), np.int64) if self.groups is None else self.groups
        weights = np.ones(len(shares)) if self.weights is None else self.weights
        return float(min(np.average(shares[groups == group], weights=weights[groups == group])
                         for group in np.unique(groups)))


def as_queries(queries: Queries | np.ndarray) -> Queries:
    return queries if isinstance(queries, Queries) else Queries(np.asarray(queries, np.float32))


class VectorIndex:
    """A FAISS inner-product index over `rows` vectors of `dim`, searched with per-query exclusions."""

    def __init__(self, index, spec: str, digest: str, build_seconds: float = 0.0, l2_norm: float | None = None):
        self.index, self.spec, self.digest, self.build_seconds = index, spec, digest, build_seconds
        self.l2_norm = l2_norm  # a graph's: it holds the vectors lifted to this one norm, searched by L2
        self.effort_name = effort_name(index)  # from the index itself: a file's spec says nothing of its type
        self.effort: int | None = None
        self.recall: float | None = None  # what tuning measured at `effort`, against its `target`
        self.target: float | None = None

    @classmethod
    def tuned(cls, vectors: np.ndarray, spec: str, queries: Queries | np.ndarray, k: int, candidates: int,
              target: float, seed: int = 0) -> tuple[VectorIndex, dict[str, Tuned]]:
        """The index of `spec` tuned to `target`, and what tuning measured for each index built. `auto` builds an
        inverted file and HNSW32 and keeps the faster at the target (the higher recall where neither reaches it): a
        graph reaches a high recall at the least effort on factors whose norms vary with popularity (searched by L2
        over lifted vectors: `build`); an inverted file always gets there, its full scan being exact."""
        specs = [f"IVF{inverted_lists(len(vectors))},Flat", "HNSW32", f"{LIFTED}HNSW32"] if spec == "auto" else [spec]
        queries = as_queries(queries)
        exact = exact_top_k(queries.vectors, vectors, k, queries.exclude)  # once for every index built
        built, measured = [], {}
        for candidate in specs:
            index = cls.build(vectors, candidate, seed)
            measured[index.spec] = index.tune(queries, vectors, k, candidates, target, exact)
            built.append(index)
        reaching = [index for index in built if index.recall >= target]
        if reaching:
            return min(reaching, key=lambda index: measured[index.spec].seconds), measured
        return max(built, key=lambda index: index.recall), measured

    @classmethod
    def build(cls, vectors: np.ndarray, spec: str = "HNSW32", seed: int = 0) -> VectorIndex:
        """The index of `spec` over `vectors`, on the inner product; `lifted:SPEC` builds SPEC by L2 over the vectors
        lifted to one norm (`lifted`), which keeps the inner product's ranking exactly and lets a graph's greedy
        search work as designed where it stalls on the inner product (100,000 clustered vectors of varied norms:
        recall@10 0.997 at efSearch 64, against 0.986), though not everywhere (ALS's factors on ml-latest-small: 0.84
        lifted, 0.99 on the inner product): `auto` builds both."""
        faiss = faiss_module()
        vectors = np.ascontiguousarray(vectors, np.float32)
        started = time.perf_counter()
        l2_norm = float(np.linalg.norm(vectors, axis=1).max(initial=0.0)) if spec.startswith(LIFTED) else None
        stored = vectors if l2_norm is None else lifted(vectors, l2_norm)
        try:
            index = faiss.index_factory(stored.shape[1], spec.removeprefix(LIFTED),
                                        faiss.METRIC_INNER_PRODUCT if l2_norm is None else faiss.METRIC_L2)
        except RuntimeError as error:
            raise UserError(f"serving.ann.index: {spec!r} is not a FAISS index_factory string (or lifted: and one) "
                            f"({str(error).strip().splitlines()[-1][:120]})") from None
        if not index.is_trained:  # IVF's coarse quantizer, PQ's codebooks: on a seeded sample
            sample = np.random.default_rng(seed).permutation(len(stored))[:TRAINING_VECTORS]
            index.train(stored[np.sort(sample)])
        index.add(stored)
        return cls(index, spec, vectors_digest(vectors), time.perf_counter() - started, l2_norm)

    @property
    def rows(self) -> int:
        return int(self.index.ntotal)

    @property
    def dim(self) -> int:
        return int(self.index.d) - (self.l2_norm is not None)

    def set_effort(self, effort: int | None) -> None:
        if effort is not None and self.effort_name is not None:
            faiss_module().ParameterSpace().set_index_parameter(self.index, self.effort_name, int(effort))
        self.effort = effort

    def search(self, queries: np.ndarray, count: int, exclude: list[np.ndarray] | None = None) -> np.ndarray:
        """(B, count) row ids, best first by the index's own scores; -1 where fewer rows are left. `exclude[b]`: rows
        query b must not get. Queries with few are searched together, in one call, for that many more, which are
        dropped (an exclusion tested on every vector scanned cost twice the search); one with more than
        `FILTER_ABOVE` is filtered inside a search of its own."""
        queries = np.ascontiguousarray(queries, np.float32)
        if self.l2_norm is not None:
            queries = lifted_queries(queries)
        count = min(count, self.rows)
        if exclude is None:
            return self.index.search(queries, count)[1]
        found = np.full((len(queries), count), -1, np.int64)
        few = [row for row, excluded in enumerate(exclude) if len(excluded) <= FILTER_ABOVE]
        if few:
            asked = min(count + max(len(exclude[row]) for row in few), self.rows)
            for row, ids in zip(few, self.index.search(queries[few], asked, params=self._params(None))[1]):
                ids = ids[(ids >= 0) & ~np.isin(ids, exclude[row])][:count]
                found[row, :len(ids)] = ids
        faiss = faiss_module()
        for row in sorted(set(range(len(queries))) - set(few)):
            selector = faiss.IDSelectorNot(faiss.IDSelectorBatch(np.ascontiguousarray(exclude[row], np.int64)))
            ids = self.index.search(queries[row][None], count, params=self._params(selector))[1][0]
            found[row, :len(ids)] = ids
        return found

    def _params(self, selector):
        """The search's effort (and exclusions): FAISS's per-call parameters, safe to share across threads."""
        return search_parameters(self.index, self.effort, selector)

    def tune(self, queries: Queries | np.ndarray, vectors: np.ndarray, k: int, candidates: int,
             target: float, exact: np.ndarray | None = None) -> Tuned:
        """The least search effort whose top-k (of `candidates` retrieved, rescored exactly) holds at least `target` of
        the exact top-k of `queries` (by `Queries.recall`; `exact`, where given, is that top-k); the largest tried if
        none does."""
        queries = as_queries(queries)
        exact = exact_top_k(queries.vectors, vectors, k, queries.exclude) if exact is None else exact
        if self.effort_name is None:
            started = time.perf_counter()
            self.recall = queries.recall(self.top_k(queries.vectors, vectors, k, candidates, queries.exclude), exact)
            self.target = target
            return Tuned(None, self.recall, {}, (time.perf_counter() - started) / len(queries.vectors))
        tried = {}
        for effort in self.ladder():
            self.set_effort(effort)
            started = time.perf_counter()
            tried[effort] = queries.recall(self.top_k(queries.vectors, vectors, k, candidates, queries.exclude), exact)
            seconds = (time.perf_counter() - started) / len(queries.vectors)
            if tried[effort] >= target:
                break
        self.recall, self.target = tried[self.effort], target
        return Tuned(self.effort, self.recall, tried, seconds)

    def ladder(self) -> list[int]:
        """The search efforts tuning tries, least first (an inverted file's up to every list: a full scan, exact)."""
        if self.effort_name is None:
            return []
        ladder = list(EFFORTS["HNSW" if self.effort_name == "efSearch" else "IVF"][1])
        if self.effort_name == "nprobe":
            lists = faiss_module().extract_index_ivf(self.index).nlist
            ladder = [effort for effort in ladder if effort < lists] + [lists]
        return ladder

    def confirmed(self, queries: Queries, vectors: np.ndarray, k: int, candidates: int) -> float:
        """The recall on `queries` of users tuning did not draw, the effort stepped up the ladder while it is below the
        target (requests that fold many events in are harder than any one sample: a second one catches some of it)."""
        queries = as_queries(queries)
        exact = exact_top_k(queries.vectors, vectors, k, queries.exclude)
        higher = [effort for effort in self.ladder() if self.effort is None or effort > self.effort]
        while True:
            recall = queries.recall(self.top_k(queries.vectors, vectors, k, candidates, queries.exclude), exact)
            if recall >= (self.target or 0) or not higher:
                self.recall = recall
                return recall
            self.set_effort(higher.pop(0))

    def top_k(self, queries: np.ndarray, vectors: np.ndarray, k: int, candidates: int,
              exclude: list[np.ndarray] | None = None) -> np.ndarray:
        """(B, k) ids: `candidates` retrieved per query, scored exactly against `vectors`, the best k kept."""
        found = self.search(queries, max(k, candidates), exclude)
        scores = np.einsum("bd,bcd->bc", queries, vectors[np.maximum(found, 0)])
        scores[found < 0] = -np.inf
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(found, order, axis=1)

    def stored(self) -> dict:
        """The bundle's form: FAISS's serialisation (a uint8 tensor) and what it indexes."""
        data = faiss_module().serialize_index(self.index)
        return {"index": torch.from_numpy(np.asarray(data, np.uint8).copy()), "spec": self.spec, "rows": self.rows,
                "dim": self.dim, "digest": self.digest, "effort": self.effort, "recall": self.recall,
                "target": self.target, "l2_norm": self.l2_norm}

    @classmethod
    def from_stored(cls, stored: dict, vectors: np.ndarray, where: str) -> VectorIndex:
        """The index `stored` describes, checked against the `vectors` it must index (`where` names it)."""
        faiss = faiss_module()
        try:
            index = faiss.deserialize_index(np.ascontiguousarray(stored["index"].numpy(), np.uint8))
        except RuntimeError:
            raise UserError(f"{where}: not a FAISS index (faiss.deserialize_index refused it)") from None
        loaded = cls(index, stored["spec"], stored["digest"], l2_norm=stored.get("l2_norm"))
        loaded.check(vectors, where, stored["digest"])
        loaded.set_effort(stored.get("effort"))
        loaded.recall, loaded.target = stored.get("recall"), stored.get("target")
        return loaded

    @classmethod
    def read(cls, path: str, vectors: np.ndarray, spec: str = "file") -> VectorIndex:
        """An index a user built (`faiss.write_index`), checked against the model's vectors."""
        faiss = faiss_module()
        try:
            index = faiss.read_index(str(path))
        except RuntimeError as error:
            reason = str(error).strip().splitlines()[-1].split(" failed: ")[-1]  # FAISS's words, not its C++ frame
            raise UserError(f"{path}: not a FAISS index ({reason[:100]})") from None
        loaded = cls(index, spec, vectors_digest(vectors))
        loaded.check(vectors, str(path), None)
        loaded.probe(vectors, str(path))
        return loaded

    def probe(self, vectors: np.ndarray, where: str) -> None:
        """One search with a few exclusions and one with more than `FILTER_ABOVE` (filtered inside the index), as
        requests will search: an index type that refuses either is one line now, not a failure per request."""
        few, many = np.arange(min(3, self.rows)), np.arange(min(FILTER_ABOVE + 1, self.rows))
        try:
            self.search(vectors[:1], 10, [few])
            self.search(vectors[:1], 10, [many])
        except RuntimeError as error:
            reason = str(error).strip().splitlines()[-1][:120]
            raise UserError(f"{where}: FAISS cannot search this {type(_unwrapped(self.index)).__name__} with "
                            f"excluded items ({reason})") from None

    def check(self, vectors: np.ndarray, where: str, digest: str | None) -> None:
        faiss = faiss_module()
        if (self.rows, self.dim) != vectors.shape:
            raise UserError(f"{where}: the index holds {self.rows:,} vectors of dimension {self.dim}, the model "
                            f"{vectors.shape[0]:,} of dimension {vectors.shape[1]}: it was built for another model")
        if self.index.metric_type != (faiss.METRIC_INNER_PRODUCT if self.l2_norm is None else faiss.METRIC_L2):
            raise UserError(f"{where}: the index ranks by another metric than the inner product the model scores by")
        if digest is not None and digest != vectors_digest(vectors):
            raise UserError(f"{where}: the index was built from other vectors than the model's (digest {digest}, "
                            f"the model's {vectors_digest(vectors)}): it was built for another model")
        if digest is None and not self._holds(vectors):  # a user's file: it must hold the model's vectors
            raise UserError(f"{where}: the index does not hold the model's item vectors (its vectors of 32 sampled "
                            f"items differ from the model's): it was built for another model")

    def _holds(self, vectors: np.ndarray) -> bool:
        """Whether the index's vectors of a sample of rows point as the model's do (cosine above 0.9: an index that
        quantises its vectors reconstructs them only approximately)."""
        faiss = faiss_module()
        rows = np.sort(np.random.default_rng(0).permutation(len(vectors))[:32])
        with contextlib.suppress(RuntimeError):  # not an inverted file: its storage reconstructs by row
            faiss.extract_index_ivf(self.index).make_direct_map()
        try:
            rebuilt = np.stack([self.index.reconstruct(int(row)) for row in rows])
        except RuntimeError:  # an index that cannot say what it holds: its answers must then be the model's
            exact = exact_top_k(vectors[rows], vectors, 1)
            return overlap(self.top_k(vectors[rows], vectors, 1, 10), exact) >= 0.5
        mine = vectors[rows]
        norms = np.linalg.norm(rebuilt, axis=1) * np.linalg.norm(mine, axis=1)
        cosine = (rebuilt * mine).sum(1) / np.maximum(norms, 1e-12)
        return bool(np.mean(cosine[norms > 0]) > 0.9)


def lifted(vectors: np.ndarray, norm: float) -> np.ndarray:
    """Each vector with one more coordinate, sqrt(norm^2 - |v|^2), so that all have the norm `norm`: the nearest by
    L2 to a query with a 0 there (`lifted_queries`) are then its largest inner products (Bachrach et al., 2014)."""
    extra = np.sqrt(np.maximum(norm**2 - np.einsum("nd,nd->n", vectors, vectors), 0.0))
    return np.ascontiguousarray(np.hstack([vectors, extra[:, None]]), np.float32)


def lifted_queries(queries: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.hstack([queries, np.zeros((len(queries), 1), np.float32)]), np.float32)


def _unwrapped(index):
    """The index as its own FAISS class (`index_factory` and `read_index` hand back the base class)."""
    return faiss_module().downcast_index(index)


def effort_name(index) -> str | None:
    """The search-effort parameter of an index of any type: `efSearch` of a graph, `nprobe` of an inverted file
    (inside a transform or a refinement too), None for a flat scan."""
    faiss = faiss_module()
    index = _unwrapped(index)
    if isinstance(index, (faiss.IndexPreTransform, faiss.IndexRefine)):
        return effort_name(index.index if isinstance(index, faiss.IndexPreTransform) else index.base_index)
    if isinstance(index, faiss.IndexHNSW):
        return "efSearch"
    if isinstance(index, faiss.IndexIVF):
        return "nprobe"
    return None


def search_parameters(index, effort: int | None, selector=None):
    """FAISS's per-call parameters of the type `index` takes (an inverted file refuses any other), nested through
    transforms and refinements, with the search `effort` (None: the index's own) and the exclusions `selector`."""
    faiss = faiss_module()
    index = _unwrapped(index)
    chosen = {} if selector is None else {"sel": selector}
    if isinstance(index, faiss.IndexPreTransform):
        return faiss.SearchParametersPreTransform(index_params=search_parameters(index.index, effort, selector))
    if isinstance(index, faiss.IndexRefine):
        return faiss.IndexRefineSearchParameters(k_factor=index.k_factor,
                                                 base_index_params=search_parameters(index.base_index, effort,
                                                                                     selector), **chosen)
    if isinstance(index, faiss.IndexHNSW):
        return faiss.SearchParametersHNSW(efSearch=int(effort or index.hnsw.efSearch), **chosen)
    if isinstance(index, faiss.IndexIVF):
        return faiss.SearchParametersIVF(nprobe=int(effort or index.nprobe), **chosen)
    return faiss.SearchParameters(**chosen)


def exact_top_k(queries: np.ndarray, vectors: np.ndarray, k: int, exclude: list[np.ndarray] | None = None,
                chunk: int = 64) -> np.ndarray:
    """(B, k) ids of the largest inner products, none of `exclude[b]`: what the index is measured against."""
    best = np.zeros((len(queries), k), np.int64)
    for first in range(0, len(queries), chunk):
        scores = queries[first:first + chunk] @ vectors.T
        for row in range(len(scores)):
            if exclude is not None:
                scores[row, exclude[first + row]] = -np.inf
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1, kind="stable")
        best[first:first + chunk] = np.take_along_axis(top, order, axis=1)
    return best


def overlaps(found: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """Each row's share of `exact` that `found` holds: recall@k of the approximate top-k, per query."""
    k = exact.shape[1]
    return np.array([len(np.intersect1d(mine, truth)) / k for mine, truth in zip(found, exact)])


def overlap(found: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean(overlaps(found, exact)))
