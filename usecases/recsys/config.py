"""The recommendation config schema; presets in presets/*.yaml set a subset of these keys."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from common.config import ConfigModel, RuntimeConfig, TrackingConfig, TrainConfig

ModelName = Literal["pop", "itemknn", "ease", "als", "bpr", "lightgcn", "sasrec"]


class Columns(ConfigModel):
    user: str = "user_id"
    item: str = "item_id"
    rating: str | None = Field("rating", description="optional; null when the log has none")
    timestamp: str | None = Field("timestamp", description="optional (needed by the temporal split); Unix seconds "
                                                           "or anything pandas parses as a date")
    title: str | None = Field("title", description="optional: an item title column, shown by the served model")


class MovieLens(ConfigModel):
    version: Literal["ml-100k", "ml-1m", "ml-latest-small", "ml-25m"] = "ml-latest-small"
    cache_dir: Path | None = Field(
        None, description="<version>/ is looked for here first, and downloads go here; default: $MOVIELENS_CACHE, "
                          "else $XDG_CACHE_HOME/gpu-usecases/movielens or ~/.cache/gpu-usecases/movielens. Then "
                          "movielens/<version>/ in each folder of $USECASES_DATA_PATH, then a download (MD5 checked)")
    download: bool = True


class Synthetic(ConfigModel):
    """Users and items with latent factors; power-law item popularity; timestamps. Learnable by construction."""

    users: int = Field(600, ge=10)
    items: int = Field(1000, ge=10)
    interactions_per_user: int = Field(40, ge=5)
    factors: int = Field(8, ge=1)
    popularity_exponent: float = Field(1.0, ge=0, description="Zipf exponent of item popularity")
    candidates: int | None = Field(None, ge=1, description="items each user scores, drawn by popularity; null: the "
                                                          "whole catalogue (large catalogues: a few hundred)")
    seed: int = 0


class Data(ConfigModel):
    source: Literal["movielens", "file", "synthetic"] = "movielens"
    movielens: MovieLens = MovieLens()
    columns: Columns = Columns()
    synthetic: Synthetic = Synthetic()
    rating_threshold: float | None = Field(None, description="keep interactions rated at least this as positives; "
                                                             "null keeps every rating")
    min_user_interactions: int = Field(0, ge=0, description="k-core filtering of users (0: off)")
    min_item_interactions: int = Field(0, ge=0, description="k-core filtering of items (0: off)")


class Evaluation(ConfigModel):
    ks: list[Annotated[int, Field(ge=1)]] = Field(
        [10, 20], min_length=1, description="must hold 10: validation and the registry's primary metric are NDCG@10")
    batch_users: int = Field(2048, ge=1, description="users ranked at once on the device")
    sample_users: int | None = Field(None, ge=1, description="rank a seeded sample of this many validation and "
                                                             "test users (logs of millions); null: every user")
    replay: bool = Field(False, description="replay the test period's events in time order: next-event HR@10 and "
                                            "NDCG@10 of each served form, frozen and with the events folded in")
    replay_users: int | None = Field(None, ge=1, description="replay a seeded sample of this many test users; null: "
                                                             "every one")

    @field_validator("ks")
    @classmethod
    def _holds_10(cls, ks: list[int]) -> list[int]:
        if 10 not in ks:
            raise ValueError("must include 10 (validation and the registry's primary metric are NDCG@10)")
        return ks


class ItemKNN(ConfigModel):
    neighbours: int = Field(100, ge=1)
    shrink: float = Field(10.0, ge=0)


class EASE(ConfigModel):
    l2: float = Field(500.0, gt=0)


class ALS(ConfigModel):
    factors: int = Field(64, ge=1)
    iterations: int = Field(15, ge=1)
    regularization: float = Field(0.05, ge=0)
    alpha: float = Field(2.0, gt=0)


class Learned(TrainConfig):
    """A learned model's embedding size, and the common loop's keys with these models' defaults."""

    epochs: int = Field(200, ge=1)
    batch_size: int = Field(2048, ge=1)
    patience: int | None = Field(20, ge=1)
    dim: int = Field(64, ge=1)
    weight_decay: float = Field(0.0, ge=0, description="L2 on the embeddings of each batch")
    steps_per_epoch: int | None = Field(None, ge=1, description="at most this many batches an epoch, drawn afresh "
                                                                "each epoch (logs too large for whole epochs); null: "
                                                                "every training pair")


class LightGCNConfig(Learned):
    layers: int = Field(3, ge=1)
    weight_decay: float = Field(1e-4, ge=0, description="L2 on the embeddings of each batch")


class FoldInConfig(ConfigModel):
    """How the served model takes a user's latest events in (ALS by its own least squares)."""

    bpr: Literal["auto", "gradient", "least_squares"] = Field(
        "auto", description="BPR steps on the fixed item factors from the user's trained vector (zero for a new user), "
                            "ridge least squares on them, or auto: the better on the validation replay of "
                            "choice_users users (with evaluation.replay; else gradient)")
    lightgcn: Literal["auto", "least_squares", "gradient", "graph"] = Field(
        "auto", description="least squares on the item factors, BPR steps, graph (the user as a new node of the "
                            "training graph), or auto: the best on the validation replay of choice_users users (with "
                            "evaluation.replay; else least_squares)")
    choice_users: int | None = Field(
        24, ge=1, description="auto compares the methods on the validation replay of a seeded sample of this many of "
                              "the period's users (null: every one); the chosen method's replay then covers them all")
    regularization: float = Field(1.0, gt=0, description="lambda of least squares for bpr and lightgcn")
    steps: int = Field(20, ge=1, description="gradient fold-in: BPR steps")
    lr: float = Field(0.05, gt=0, description="gradient fold-in: step size")
    max_events: int = Field(200, ge=1, description="the newest events of a user folded in")


class ANN(ConfigModel):
    """Two-stage serving's first stage: a FAISS index over the item vectors."""

    index: str = Field("auto", description="a FAISS index_factory string on the inner product (HNSW32, "
                                           "'IVF4096,Flat', 'IVF4096,PQ32', 'HNSW32,SQ8'), lifted:SPEC (built by "
                                           "L2 over the vectors lifted to one norm), or auto: an inverted file, "
                                           "HNSW32 and lifted:HNSW32 built and tuned, the fastest at "
                                           "target_recall served")
    candidates: int = Field(50, ge=1, description="items retrieved per request and scored exactly (at least k)")
    target_recall: float = Field(0.99, gt=0, le=1, description="the search effort (efSearch, nprobe) is the least "
                                                               "whose top-10 holds this share of the exact top-10 "
                                                               "on tune_users sampled users' queries, each user "
                                                               "weighted by their history's events")
    tune_users: int = Field(256, ge=8, description="users whose vectors tune the search effort (no labels read)")
    recall_users: int = Field(1000, ge=1, description="test users on whom the ANN top-10 is compared with the "
                                                      "exact top-10 (ann_recall@10)")
    auto_above_ms: float = Field(5.0, gt=0, description="retrieval auto serves ann where exact ranking's p95 per "
                                                        "request, measured in the run, is above this")


class Serving(ConfigModel):
    k: int = Field(10, ge=1)
    retrieval: Literal["exact", "ann", "auto"] = Field(
        "auto", description="factor and sequence models: rank every item (exact), retrieve candidates from an ANN "
                            "index and score them (ann), or auto: ann where exact's measured p95 per request is "
                            "above ann.auto_above_ms; item-item models and popularity are always exact")
    ann: ANN = ANN()
    select_by: Literal["val_ndcg", "val_replay"] = Field(
        "val_ndcg", description="the model served: the best validation NDCG@10 (frozen), or the best next-event "
                                "NDCG@10 of the validation period's replay with its events folded in (what a "
                                "real-time endpoint is worth; needs evaluation.replay)")
    foldin: FoldInConfig = FoldInConfig()
    max_similarity_mb: float = Field(1024, gt=0, description="EASE is served with its whole items x items matrix "
                                                             "(float32) when it takes at most this many MB")
    item_neighbours: int = Field(500, ge=1, description="above serving.max_similarity_mb, EASE is served with this "
                                                        "many neighbours per item (served_ndcg@10 says what it costs)")
    latency_users: int = Field(200, ge=1, description="single-user requests timed for p50 and p95")


class Benchmark(ConfigModel):
    epochs: int = Field(5, ge=2, description="BPR epochs per loop; the first is a warm-up and not counted")


class SASRec(TrainConfig):
    """SASRec's settings, whose defaults train on ml-latest-small in about a minute on 2 CPU cores (the paper's
    ML-1M settings: max_len 200, batch_size 128, lr 1e-3, 200 epochs; on a GPU)."""

    epochs: int = Field(40, ge=1)
    batch_size: int = Field(32, ge=1, description="user sequences per batch (few users: more steps per epoch)")
    lr: float = Field(3e-3, gt=0)
    patience: int | None = Field(10, ge=1)
    dim: int = Field(64, ge=1)
    layers: int = Field(2, ge=1, description="self-attention blocks")
    heads: int = Field(1, ge=1, description="attention heads; must divide dim")
    dropout: float = Field(0.2, ge=0, lt=1)
    max_len: int = Field(50, ge=1, description="the newest events a sequence holds, in training and serving")
    sampled_negatives: int | None = Field(
        None, ge=1, description="null: cross-entropy over the whole catalogue; n: sampled softmax against n uniform "
                                "negatives per batch (catalogues too large for full logits)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")

    @model_validator(mode="after")
    def _heads_divide_dim(self) -> SASRec:
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not a multiple of heads {self.heads}")
        return self


class Config(ConfigModel):
    data: Data = Data()
    split: Literal["temporal", "random", "leave_last_out"] = "temporal"
    split_ratios: list[float] = Field([0.8, 0.1, 0.1], min_length=3, max_length=3)
    models: list[ModelName] = Field(["pop", "itemknn", "ease", "als", "bpr", "lightgcn", "sasrec"], min_length=1)
    evaluation: Evaluation = Evaluation()
    itemknn: ItemKNN = ItemKNN()
    ease: EASE = EASE()
    als: ALS = ALS()
    bpr: Learned = Learned()
    lightgcn: LightGCNConfig = LightGCNConfig()
    sasrec: SASRec = SASRec()
    serving: Serving = Serving()
    benchmark: Benchmark = Benchmark()
    runtime: RuntimeConfig = RuntimeConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _replay_to_select_by(self) -> Config:
        if self.serving.select_by == "val_replay" and not self.evaluation.replay:
            raise ValueError("serving.select_by=val_replay needs evaluation.replay=true")
        return self
