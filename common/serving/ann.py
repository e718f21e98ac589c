"""Approximate maximum-inner-product retrieval with FAISS (on the CPU), the first stage of two-stage serving: any
`index_factory` string on the inner product, or `auto` (`VectorIndex.tuned`), its search effort tuned, not guessed.
Stored as FAISS's serialisation in a uint8 tensor (no pickle) with a digest of the vectors it indexes, so that an
index of other vectors is refused in one line."""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass

import numpy as np
import torch

from common.errors import UserError

EFFORTS = {"HNSW": ("efSearch", (16, 32, 64, 128, 256, 512, 1024)),
           "IVF": ("nprobe", (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))}
FILTER_ABOVE = 1024  # exclusions of a query beyond which they are filtered inside the search, not over-fetched
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


class VectorIndex:
    """A FAISS inner-product index over `rows` vectors of `dim`, searched with per-query exclusions."""

    def __init__(self, index, spec: str, digest: str, build_seconds: float = 0.0):
        self.index, self.spec, self.digest, self.build_seconds = index, spec, digest, build_seconds
        self.effort_name = next((name for prefix, (name, _) in EFFORTS.items() if spec.startswith(prefix)), None)
        self.effort: int | None = None
        self.recall: float | None = None  # what tuning measured at `effort`, against its `target`
        self.target: float | None = None

    @classmethod
    def tuned(cls, vectors: np.ndarray, spec: str, queries: np.ndarray, k: int, candidates: int, target: float,
              exclude: list[np.ndarray] | None = None, seed: int = 0) -> tuple[VectorIndex, dict[str, Tuned]]:
        """The index of `spec` tuned to `target`, and what tuning measured for each index built. `auto` builds an
        inverted file and HNSW32 and keeps the faster at the target (the higher recall where neither reaches it): a
        graph reaches a high recall at the least effort on factors whose norms vary with popularity, but stalls at
        0.965 on a million trained item vectors, where an inverted file's full scan is exact."""
        specs = [f"IVF{inverted_lists(len(vectors))},Flat", "HNSW32"] if spec == "auto" else [spec]
        built, measured = [], {}
        for candidate in specs:
            index = cls.build(vectors, candidate, seed)
            measured[index.spec] = index.tune(queries, vectors, k, candidates, target, exclude)
            built.append(index)
        reaching = [index for index in built if index.recall >= target]
        if reaching:
            return min(reaching, key=lambda index: measured[index.spec].seconds), measured
        return max(built, key=lambda index: index.recall), measured

    @classmethod
    def build(cls, vectors: np.ndarray, spec: str = "HNSW32", seed: int = 0) -> VectorIndex:
        faiss = faiss_module()
        vectors = np.ascontiguousarray(vectors, np.float32)
        started = time.perf_counter()
        try:
            index = faiss.index_factory(vectors.shape[1], spec, faiss.METRIC_INNER_PRODUCT)
        except RuntimeError as error:
            raise UserError(f"serving.ann.index: {spec!r} is not a FAISS index_factory string "
                            f"({str(error).strip().splitlines()[-1][:120]})") from None
        if not index.is_trained:  # IVF's coarse quantizer, PQ's codebooks: on a seeded sample
            sample = np.random.default_rng(seed).permutation(len(vectors))[:TRAINING_VECTORS]
            index.train(vectors[np.sort(sample)])
        index.add(vectors)
        return cls(index, spec, vectors_digest(vectors), time.perf_counter() - started)

    @property
    def rows(self) -> int:
        return int(self.index.ntotal)

    @property
    def dim(self) -> int:
        return int(self.index.d)

    def set_effort(self, effort: int | None) -> None:
        if effort is not None and self.effort_name is not None:
            faiss_module().ParameterSpace().set_index_parameter(self.index, self.effort_name, int(effort))
        self.effort = effort

    def search(self, queries: np.ndarray, count: int, exclude: list[np.ndarray] | None = None) -> np.ndarray:
        """(B, count) row ids, best first by the index's own scores; -1 where fewer rows are left. `exclude[b]`: rows
        query b must not get. A query with few asks for that many more and drops them (an exclusion tested on every
        vector scanned cost twice the search); one with more than `FILTER_ABOVE` is filtered inside the search."""
        queries = np.ascontiguousarray(queries, np.float32)
        count = min(count, self.rows)
        if exclude is None:
            return self.index.search(queries, count)[1]
        faiss = faiss_module()
        found = np.full((len(queries), count), -1, np.int64)
        for row, (query, excluded) in enumerate(zip(queries, exclude)):
            if len(excluded) <= FILTER_ABOVE:
                ids = self.index.search(query[None], min(count + len(excluded), self.rows),
                                        params=self._params(None))[1][0]
                ids = ids[(ids >= 0) & ~np.isin(ids, excluded)][:count]
            else:
                selector = faiss.IDSelectorNot(faiss.IDSelectorBatch(np.ascontiguousarray(excluded, np.int64)))
                ids = self.index.search(query[None], count, params=self._params(selector))[1][0]
            found[row, :len(ids)] = ids
        return found

    def _params(self, selector):
        """The search's effort (and exclusions): FAISS's per-call parameters, safe to share across threads."""
        faiss = faiss_module()
        chosen = {} if selector is None else {"sel": selector}
        if self.effort_name == "efSearch":
            return faiss.SearchParametersHNSW(efSearch=int(self.effort or self.index.hnsw.efSearch), **chosen)
        if self.effort_name == "nprobe":
            return faiss.SearchParametersIVF(nprobe=int(self.effort or self.index.nprobe), **chosen)
        return faiss.SearchParameters(**chosen)

    def tune(self, queries: np.ndarray, vectors: np.ndarray, k: int, candidates: int, target: float,
             exclude: list[np.ndarray] | None = None) -> Tuned:
        """The least search effort whose top-k (of `candidates` retrieved, rescored exactly) holds at least `target` of
        the exact top-k of `queries`, on average; the largest tried if none does."""
        exact = exact_top_k(queries, vectors, k, exclude)
        if self.effort_name is None:
            started = time.perf_counter()
            self.recall, self.target = overlap(self.top_k(queries, vectors, k, candidates, exclude), exact), target
            return Tuned(None, self.recall, {}, (time.perf_counter() - started) / len(queries))
        tried = {}
        ladder = EFFORTS["HNSW" if self.spec.startswith("HNSW") else "IVF"][1]
        if self.effort_name == "nprobe":  # up to every list: a full scan, whose recall is 1
            lists = faiss_module().extract_index_ivf(self.index).nlist
            ladder = [effort for effort in ladder if effort < lists] + [lists]
        for effort in ladder:
            self.set_effort(effort)
            started = time.perf_counter()
            tried[effort] = overlap(self.top_k(queries, vectors, k, candidates, exclude), exact)
            seconds = (time.perf_counter() - started) / len(queries)
            if tried[effort] >= target:
                break
        self.recall, self.target = tried[self.effort], target
        return Tuned(self.effort, self.recall, tried, seconds)

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
                "target": self.target}

    @classmethod
    def from_stored(cls, stored: dict, vectors: np.ndarray, where: str) -> VectorIndex:
        """The index `stored` describes, checked against the `vectors` it must index (`where` names it)."""
        faiss = faiss_module()
        try:
            index = faiss.deserialize_index(np.ascontiguousarray(stored["index"].numpy(), np.uint8))
        except RuntimeError:
            raise UserError(f"{where}: not a FAISS index (faiss.deserialize_index refused it)") from None
        loaded = cls(index, stored["spec"], stored["digest"])
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
        return loaded

    def check(self, vectors: np.ndarray, where: str, digest: str | None) -> None:
        faiss = faiss_module()
        if (self.rows, self.dim) != vectors.shape:
            raise UserError(f"{where}: the index holds {self.rows:,} vectors of dimension {self.dim}, the model "
                            f"{vectors.shape[0]:,} of dimension {vectors.shape[1]}: it was built for another model")
        if self.index.metric_type != faiss.METRIC_INNER_PRODUCT:
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


def overlap(found: np.ndarray, exact: np.ndarray) -> float:
    """Mean share of each row of `exact` that `found` holds: recall@k of the approximate top-k."""
    k = exact.shape[1]
    return float(np.mean([len(np.intersect1d(mine, truth)) / k for mine, truth in zip(found, exact)]))
