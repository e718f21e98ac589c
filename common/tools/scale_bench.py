"""`usecases bench scale NAME`: how a use case's cost grows with its data, on each engine. Its `scale` preset runs at
multiples of a base size, once per engine, each in a fresh `usecases run` process so that its wall time and peak
memory are its own; the `NAME-scale` run gets `scale.csv`, metrics per engine and size, and a log-log plot. A run that
is refused or fails is a row saying so, not the end of the benchmark."""

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
    from common.config import available_presets, load_config
    from common.tracking.runs import tracked_run
    if usecase.scale is None:
        raise UserError(f"use case '{usecase.name}' declares no size to scale (UseCase.declare(scale=...))")
    key, declared_base = next(iter(usecase.scale.items()))
    base = base or declared_base
    if "scale" not in available_presets(usecase.presets_dir):
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
        log_plotted(table, "engine", (key, key), {"time_s": "wall time (s)",
                                                  "peak_rss_gb": "peak resident memory, process tree (GB)"},
                    ("scale.csv", "cost_vs_size.png"), log_y=True)
    print(table.to_string(index=False), flush=True)
    return table


def _one(usecase: UseCase, overrides: list[str], values: dict[str, int], multiple: int, engine: str, folder: Path,
         timeout_s: float | None) -> dict:
    """One run of the scale preset with the size keys at `values`; its throughput counts them all per second."""
    summary = folder / f"{engine}-{multiple}.json"
    sizes = [f"{name}={value}" for name, value in values.items()]
    request = RunRequest(usecase, "scale", (*overrides, *sizes, f"runtime.engine={engine}"), summary=summary)
    command = [sys.executable, "-m", "usecases", *request.command_line()]
    row = {"engine": engine, "multiple": multiple, **values}
    unmeasured = {"time_s": math.nan, "peak_rss_gb": math.nan, "per_s": math.nan}
    size = ", ".join(f"{name}={value}" for name, value in values.items())
    log.info("scale: %s engine, %s", engine, size)
    started = time.perf_counter()
    try:
        finished = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {**row, "status": f"over {timeout_s:g} s", **unmeasured}
    elapsed = time.perf_counter() - started
    if finished.returncode != 0 or not summary.exists():
        last = (finished.stderr.strip().splitlines() or ["(no output)"])[-1]
        status = last.removeprefix("error: ") if finished.returncode == 2 else f"failed (exit {finished.returncode})"
        log.warning("scale: %s engine, %s: %s", engine, size, status)
        return {**row, "status": status, **unmeasured}
    run_id = json.loads(summary.read_text())["run_id"]
    metrics = mlflow.get_run(run_id).data.metrics
    seconds = metrics.get("time/total_s", elapsed)
    return {**row, "status": "finished", "time_s": seconds, "peak_rss_gb": metrics.get("memory/peak_rss_gb", math.nan),
            "per_s": sum(values.values()) / seconds, "run_id": run_id}


def log_plotted(table: pd.DataFrame, group: str, x: tuple[str, str], panels: dict[str, str], files: tuple[str, str],
                log_y: bool) -> None:
    """`table` as the active run's CSV `files[0]`, and its plot `files[1]`: a panel per column of `panels` (its axis
    label), a line per value of `group` against the column `x[0]` (labelled `x[1]`) on a log scale."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import NullFormatter
    figure, axes = plt.subplots(1, len(panels), figsize=(10, 4))
    for name, rows in table.groupby(group):
        for axis, column in zip(axes, panels):
            shown = rows[rows[column].notna()]  # a run refused or failed measured nothing
            axis.plot(shown[x[0]], shown[column], marker="o", label=name)
    ticks = sorted(table[x[0]].unique())
    for axis, label in zip(axes, panels.values()):
        axis.set_xscale("log")
        axis.set_yscale("log" if log_y else "linear")
        axis.set_xticks(ticks, [f"{tick:,}" for tick in ticks])
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.set_xlabel(x[1])
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.tight_layout()
    with tempfile.TemporaryDirectory() as out:
        table.to_csv(Path(out) / files[0], index=False)
        figure.savefig(Path(out) / files[1], dpi=120)
        mlflow.log_artifacts(out)
    plt.close(figure)
