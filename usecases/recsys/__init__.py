"""Top-K recommendation: MovieLens or any interaction log, full-ranking evaluation, the best model served."""

from common.usecase import UseCase

from .config import Config


def summary_columns(config: Config) -> list[str]:
    """The metrics printed at the end of a run; summary.json holds them all."""
    return ["recall@10", "ndcg@10", "hit@10", "mrr@10", "precision@10", "coverage@10", "fit_seconds"]


USECASE = UseCase.declare(
    __name__,
    description="top-K recommendation (MovieLens or your log): pop, ItemKNN, EASE, ALS, BPR, LightGCN, full ranking",
    config=Config,
    primary_metric=("ndcg@10", "max"),  # of the served model; the registry picks its champion by it
    summary_columns=summary_columns,
    # its server (`usecases serve recsys`): uvicorn with the C HTTP parser and event loop, 10x MLflow's at
    # concurrency 8; FAISS, the first stage of two-stage retrieval (common/serving/ann.py); Prometheus' client for
    # its /metrics (common/serving/metrics.py)
    requirements=("orjson>=3.9", "starlette>=0.40", "uvicorn>=0.30", "httptools>=0.6",
                  "uvloop>=0.19; sys_platform != 'win32'", "faiss-cpu>=1.8", "prometheus-client>=0.20"),
    # implicit's ALS baseline (skipped without it); Redis Streams as the server's event store across machines
    optional_requirements={"als": ("implicit>=0.7",), "events": ("redis>=5",)},
    evidence=("users_evaluated", "users"),  # what the served model's test figure rests on
    has_benchmark=True,
    scale={"data.synthetic.users": 25_000},  # x 100 interactions each: 2.5 M, 10 M and 40 M for bench scale
)
