"""`usecases bench scale NAME`: how a use case's cost grows with its data, on each engine.

The use case's `scale` preset runs at 1x, 4x and 16x of a base size (its declared size keys, such as
`data.synthetic.users`, multiplied together; the first names the size), once per engine, each run a fresh `usecases run` process, so that its wall time and the
peak resident memory of its process tree (workers included) are its own and nothing leaks from one size to the
next. Each run is tracked in the use case's experiment as usual; the comparison goes to a `NAME-scale` run: a
table (`scale.csv`, and metrics per engine and size) and a log-log plot of time and memory against size
(`cost_vs_size.png`). A run that the pandas engine refuses (too large for the free memory) or that fails is a row
saying so, not the end of the benchmark.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import pandas as pd

from common.errors import UserError
from common.usecase import RunRequest, UseCase

log = logging.getLogger(__name__)

SIZES = (1, 4, 16)
ENGINES = ("pandas", "dask")


def parse_list(text: str, name: str, kind=str) -> list:
    try:
        values = [kind(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"{name} {text}: expected a comma-separated list, e.g. 1,4,16") from None
    if not values:
        raise UserError(f"{name}: expected at least one value")
    return values


def scale_bench(usecase: UseCase, overrides: list[str], sizes: list[int], engines: list[str], base: int | None,
                timeout_s: float | None) -> pd.DataFrame:
    """Every engine at every size; returns the table that was logged and printed."""
    from common.config import load_config
    from common.tracking.runs import tracked_run

    if usecase.scale is None:
        raise UserError(f"use case '{usecase.name}' declares no size to scale (UseCase.declare(scale=...))")
    key, declared_base = next(iter(usecase.scale.items()))
    base = base or declared_base
    if "scale" not in [path.stem for path in usecase.presets_dir.glob("*.yaml")]:
        raise UserError(f"use case '{usecase.name}' has no `scale` preset")
    unknown = [engine for engine in engines if engine not in ENGINES]
    if unknown or any(size < 1 for size in sizes):
        raise UserError(f"--scale-engines takes {', '.join(ENGINES)} and --sizes positive multiples of the base "
                        f"(got {','.join(engines)} and {','.join(map(str, sizes))})")
    config = load_config(usecase.config, usecase.presets_dir, "scale", overrides)
    rows = []
    with tempfile.TemporaryDirectory(prefix="scale-") as folder:
        for engine in engines:
            for size in sizes:
                values = {name: round(value * size * base / declared_base) for name, value in usecase.scale.items()}
                rows.append(_one(usecase, overrides, values, size, engine, Path(folder), timeout_s))
    table = pd.DataFrame(rows)
    tags = {"preset": "scale", "scale_key": key, "scale_base": base, "engines": ",".join(engines)}
    with tracked_run(f"{usecase.name}-scale", config, tags, run_name=f"{usecase.name}-scale",
                     description=f"How the cost of {usecase.name} grows with {key}, per engine.") as tracker:
        for row in rows:
            if row["status"] == "finished":
                tracker.log_metrics({f"scale/{row['engine']}/x{row['multiple']}/{name}": row[name]
                                     for name in ("time_s", "peak_rss_gb", "per_s")})
        with tempfile.TemporaryDirectory() as out:
            table.to_csv(Path(out) / "scale.csv", index=False)
            _plot(table, key, Path(out) / "cost_vs_size.png")
            mlflow.log_artifacts(out)
    print(table.to_string(index=False), flush=True)
    return table


def _one(usecase: UseCase, overrides: list[str], values: dict[str, int], multiple: int, engine: str, folder: Path,
         timeout_s: float | None) -> dict:
    """One run of the scale preset with the size keys at `values`; its throughput counts them all (users, tickers,
    or images of every split) per second."""
    summary = folder / f"{engine}-{multiple}.json"
    sizes = [f"{name}={value}" for name, value in values.items()]
    request = RunRequest(usecase, "scale", (*overrides, *sizes, f"runtime.engine={engine}"), summary=summary)
    command = [sys.executable, "-m", "usecases", *request.command_line()]
    row = {"engine": engine, "multiple": multiple, **values}
    size = ", ".join(f"{name}={value}" for name, value in values.items())
    log.info("scale: %s engine, %s", engine, size)
    started = time.perf_counter()
    try:
        finished = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {**row, "status": f"over {timeout_s:g} s", "time_s": math.nan, "peak_rss_gb": math.nan,
                "per_s": math.nan}
    elapsed = time.perf_counter() - started
    if finished.returncode != 0 or not summary.exists():
        last = (finished.stderr.strip().splitlines() or ["(no output)"])[-1]
        status = last.removeprefix("error: ") if finished.returncode == 2 else f"failed (exit {finished.returncode})"
        log.warning("scale: %s engine, %s: %s", engine, size, status)
        return {**row, "status": status, "time_s": math.nan, "peak_rss_gb": math.nan, "per_s": math.nan}
    run_id = json.loads(summary.read_text())["run_id"]
    metrics = mlflow.get_run(run_id).data.metrics
    seconds = metrics.get("time/total_s", elapsed)
    return {**row, "status": "finished", "time_s": seconds, "peak_rss_gb": metrics.get("memory/peak_rss_gb", math.nan),
            "per_s": sum(values.values()) / seconds, "run_id": run_id}


def _plot(table: pd.DataFrame, key: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import NullFormatter

    figure, (times, memory) = plt.subplots(1, 2, figsize=(10, 4))
    for engine, rows in table[table["status"] == "finished"].groupby("engine"):
        times.plot(rows[key], rows["time_s"], marker="o", label=engine)
        memory.plot(rows[key], rows["peak_rss_gb"], marker="o", label=engine)
    sizes = sorted(table[key].unique())
    for axis, label in ((times, "wall time (s)"), (memory, "peak resident memory, process tree (GB)")):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xticks(sizes, [f"{size:,}" for size in sizes])
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.set_xlabel(key)
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
