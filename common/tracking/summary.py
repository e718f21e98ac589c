"""What a run prints and leaves at its end: every model's test metrics as MLflow metrics, `summary.json` (and
`--summary FILE`), and the table printed."""

from __future__ import annotations

from pathlib import Path

from common.paths import write_json_atomic
from common.tabular import render_table
from common.tracking.runs import Tracker


def format_table(models: dict[str, dict[str, float]], columns: list[str] | None = None) -> str:
    """Models as rows, in plain text; by default every metric without a per-series suffix as a column."""
    if columns is None:
        columns = sorted({metric for metrics in models.values() for metric in metrics if "/" not in metric})
    rows = [[name, *(float(metrics.get(column, float("nan"))) for column in columns)] for name, metrics in models.items()]
    return render_table(rows, ["model", *columns], markdown=False, number_format=".4f")


def write_summary(
    tracker: Tracker,
    usecase: str,
    preset: str,
    device: str,
    models: dict[str, dict[str, float]],
    path: Path | None = None,
    columns: list[str] | None = None,
) -> dict:
    """Test metrics of every model in the run: as MLflow metrics, summary.json, --summary FILE and a table."""
    summary = {"usecase": usecase, "run_id": tracker.run_id, "preset": preset, "device": device, "models": models}
    for model, metrics in models.items():
        tracker.log_metrics({f"test/{model}/{metric}": value for metric, value in metrics.items()})
    tracker.log_dict(summary, "summary.json")
    if path is not None:
        write_json_atomic(summary, path)
    print(format_table(models, columns), flush=True)
    return summary
