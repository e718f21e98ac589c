"""`usecases compare`: a use case's finished runs side by side, grouped by the hardware they ran on."""

from __future__ import annotations

import mlflow

from common.errors import UserError
from common.tracking.runs import experiment_name, metric_name
from common.tracking.stores import tracking_uri


def compare_runs(usecase: str, metric: str, mode: str):
    """The FINISHED runs of a use case grouped by hardware (GPU name, else CPU model), instance type and precision:
    runs, best primary metric, mean throughput, wall time and cost, best group first."""
    import pandas as pd
    mlflow.set_tracking_uri(tracking_uri())
    runs = mlflow.search_runs(experiment_names=[experiment_name(usecase)], filter_string="status = 'FINISHED'")
    if runs.empty:
        raise UserError(f"no finished runs of '{usecase}' in {tracking_uri()} (run `usecases run {usecase}` first)")

    def column(name: str) -> pd.Series:
        return runs[name] if name in runs else pd.Series([None] * len(runs), index=runs.index)

    gpu = column("tags.gpu_name")
    frame = pd.DataFrame({
        "hardware": gpu.where(gpu.notna() & (gpu != "none"), column("tags.cpu_model")).fillna("unknown"),
        "instance_type": column("tags.instance_type").fillna("-"), "precision": column("tags.precision").fillna("-"),
        "primary": pd.to_numeric(column(f"metrics.{metric_name('primary/' + metric)}"), errors="coerce"),
        "throughput": pd.to_numeric(column("metrics.throughput/samples_per_s"), errors="coerce"),
        "wall_s": pd.to_numeric(column("metrics.time/total_s"), errors="coerce"),
        "cost": pd.to_numeric(column("metrics.cost"), errors="coerce")})
    best = "min" if mode == "min" else "max"
    table = frame.groupby(["hardware", "instance_type", "precision"], dropna=False).agg(
        runs=("primary", "size"), **{metric: ("primary", best)}, samples_per_s=("throughput", "mean"),
        wall_s=("wall_s", "mean"), cost=("cost", "mean")).reset_index()
    return table.sort_values(metric, ascending=mode == "min", na_position="last").reset_index(drop=True)
