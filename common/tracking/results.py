"""`usecases report`: a use case's results page, docs/results/NAME.md, generated from the tracking store. A store holds
only the runs of the machines that tracked into it, so the rows are kept in docs/results/NAME.json: a report merges the
store's newest FINISHED run per key into it and renders the page from the JSON alone, which `--check` renders again and
compares, so that a hand edit is caught without any store."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

from common.errors import UserError
from common.paths import project_root, write_json_atomic, write_text_atomic
from common.tabular import render_table
from common.tracking.runs import experiment_name, metric_name
from common.tracking.stores import check_reachable

KINDS = {"run": "", "benchmark": "-benchmark"}  # each kind of row and the suffix of its experiment
MACHINE = ("cpu_model", "cpu_bf16", "cpu_cores", "gpu")
KEY = ("kind", "preset", "data", "data_sha256", *MACHINE)  # a row per key; a newer run of it replaces the row


def results_folder() -> Path:
    return project_root() / "docs" / "results"


def read_store(uri: str):
    """A client on the store, or one line saying why not (a SQLite file that is not there is not created empty)."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError
    check_reachable(uri)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise UserError(f"store {uri}: no such file")
    try:
        client = mlflow.MlflowClient(uri)
        client.search_experiments(max_results=1)
    except (MlflowException, SQLAlchemyError, OSError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"store {uri} cannot be read: {reason}") from None
    return client


def collect(client, name: str, metric: str) -> list[dict]:
    """The newest FINISHED run of each key in the store, as rows."""
    rows: dict[tuple, dict] = {}
    for kind, suffix in KINDS.items():
        experiment = client.get_experiment_by_name(experiment_name(name + suffix))
        if experiment is None:
            continue
        token = None
        while True:
            page = client.search_runs([experiment.experiment_id], "attributes.status = 'FINISHED'",
                                      order_by=["attributes.start_time DESC"], max_results=1000, page_token=token)
            for run in page:
                row = _row(run, kind, metric)
                rows.setdefault(_key(row), row)
            token = page.token
            if not token:
                break
    return list(rows.values())


def _row(run, kind: str, metric: str) -> dict:
    tags, metrics = run.data.tags, run.data.metrics
    gpu = "none"
    if tags.get("device") == "cuda":
        count = int(tags.get("gpu_count", "1") or 1)
        gpu = f"{count}x {tags.get('gpu_name', '?')}" if count > 1 else tags.get("gpu_name", "?")
    bf16 = {"true": "yes", "false": "no"}.get(tags.get("cpu_bf16", ""), "?")
    return {
        "kind": kind, "preset": tags.get("preset", "?"), "data": tags.get("data_source", "?"),
        "data_sha256": tags.get("data_sha256", "?")[:12], "cpu_model": tags.get("cpu_model", "?"), "cpu_bf16": bf16,
        "cpu_cores": tags.get("cpu_cores", "?"), "gpu": gpu, "torch": tags.get("torch_version", "?"),
        "commit": tags.get("git_commit", "?")[:7] + ("+" if tags.get("git_dirty") == "true" else ""),
        "date": datetime.fromtimestamp(run.info.start_time / 1000, timezone.utc).strftime("%Y-%m-%d"),
        "started_ms": run.info.start_time, "run_id": run.info.run_id, "served": tags.get("primary_model"),
        "time_s": _rounded(metrics.get("time/total_s")), "results": _results(metrics, kind, metric)}


def _results(metrics: dict[str, float], kind: str, metric: str) -> dict[str, float]:
    """A run: the served model's test and validation primary metric, then every model's test primary metric. A
    benchmark: every model's every test metric."""
    name = metric_name(metric)
    if kind == "run":
        results = {metric: metrics.get(f"primary/{name}"), f"val {metric}": metrics.get(f"primary/val_{name}")}
        results |= {key.split("/")[1]: value for key, value in sorted(metrics.items())
                    if key.startswith("test/") and key.endswith(f"/{name}") and key.count("/") == 2}
    else:
        results = {" ".join(key.split("/")[1:]): value for key, value in sorted(metrics.items())
                   if key.startswith("test/") and key.count("/") == 2}
    return {key: _rounded(value) for key, value in results.items() if value is not None}


def _rounded(value: float | None) -> float | None:
    """Six significant digits: what the page shows and a little more, without float noise in the JSON's diffs."""
    return None if value is None or not math.isfinite(value) else float(f"{value:.6g}")


def _key(row: dict) -> tuple:
    return tuple(row[field] for field in KEY)


def merge(kept: list[dict], new: list[dict]) -> list[dict]:
    """The kept rows with the new ones in: a row per key, the newer run's; newest first."""
    rows = {_key(row): row for row in kept}
    for row in new:
        if _key(row) not in rows or row["started_ms"] >= rows[_key(row)]["started_ms"]:
            rows[_key(row)] = row
    return sorted(rows.values(), key=lambda row: (-row["started_ms"], row["run_id"]))


def report(name: str, primary_metric: tuple[str, str], store: str, folder: Path, required: bool = True) -> Path | None:
    """Merge the store's rows into folder/NAME.json and render folder/NAME.md from it. Without finished runs in the
    store: one line when `required`, else the page is rendered from the JSON (None when it keeps nothing either)."""
    source = folder / f"{name}.json"
    kept = json.loads(source.read_text(encoding="utf-8")) if source.is_file() else {"rows": []}
    new = collect(read_store(store), name, primary_metric[0])
    if not new and required:
        raise UserError(f"no finished run of '{name}' in {store} (run `usecases run {name}` first)")
    if not new and not kept["rows"]:
        return None
    data = {"usecase": name, "primary_metric": list(primary_metric), "rows": merge(kept["rows"], new)}
    write_json_atomic(data, source)
    page = folder / f"{name}.md"
    write_text_atomic(render(data), page)
    return page


def check(name: str, folder: Path) -> None:
    """One line when folder/NAME.md is not what folder/NAME.json renders."""
    source, page = folder / f"{name}.json", folder / f"{name}.md"
    if not source.is_file():
        raise UserError(f"{source} is missing: write it with `usecases report {name}`")
    expected = render(json.loads(source.read_text(encoding="utf-8")))
    if not page.is_file() or page.read_text(encoding="utf-8") != expected:
        raise UserError(f"{page} is not what `usecases report {name}` renders from {source.name} (edited by hand?): "
                        f"run `usecases report {name}` to render it again")


def pages(folder: Path) -> list[str]:
    return sorted({path.stem for pattern in ("*.md", "*.json") for path in folder.glob(pattern)})


def render(data: dict) -> str:
    name, (metric, mode) = data["usecase"], data["primary_metric"]
    lines = [f"# {name}: results", "",
             f"*Generated by `usecases report {name}` from [{name}.json]({name}.json); do not edit by hand "
             f"(`usecases report {name} --check` fails on an edit).*", "",
             f"A row per machine: its newest finished run, newest machines first. Runs: `{metric}` on test of the "
             f"served model ({'higher' if mode == 'max' else 'lower'} is better) and on validation, then each "
             f"model's test `{metric}` (the baselines beside it); time is the whole run's; a commit ending in `+` "
             f"ran with uncommitted changes. A machine whose store was reported once keeps its row until a newer run "
             f"of it replaces it."]
    tables: dict[tuple, list[dict]] = {}
    for row in data["rows"]:
        tables.setdefault((list(KINDS).index(row["kind"]), row["preset"], row["data"], row["data_sha256"]),
                          []).append(row)
    for (kind, preset, source, digest), rows in sorted(tables.items(),
                                                       key=lambda item: (item[0][0], -item[1][0]["started_ms"])):
        title = "Benchmark" if kind else "Run"
        lines += ["", f"## {title}: preset `{preset}`, data `{source}` ({digest})", "", *_table(rows, metric)]
    gpu_rows = [row for row in data["rows"] if row["gpu"] != "none"]
    if gpu_rows:
        cells = [[row["gpu"], f"`usecases {'bench run' if row['kind'] == 'benchmark' else 'run'} {name} --preset "
                              f"{row['preset']} --device cuda`", _gpu_result(row, metric), _seconds(row["time_s"]),
                  row["torch"], row["commit"], row["date"]] for row in gpu_rows]
        lines += ["", "## On a GPU", "",
                  render_table(cells, ["GPU", "command", "result", "time", "torch", "commit", "date"])]
    return "\n".join(lines) + "\n"


def _table(rows: list[dict], metric: str) -> list[str]:
    """A run's columns past the served model's two are model names, shown as code like model names elsewhere."""
    columns = list(dict.fromkeys(column for row in rows for column in row["results"]))
    served = any(row["served"] for row in rows)
    models = rows[0]["kind"] == "run"
    header = ["CPU", "BF16", "cores", "GPU", "torch", "commit", "date", *(["served"] if served else []),
              *[f"`{column}`" if models and column not in (metric, f"val {metric}") else column
                for column in columns], "time"]
    cells = [[row["cpu_model"], row["cpu_bf16"], row["cpu_cores"], row["gpu"], row["torch"], row["commit"],
              row["date"], *([f"`{row['served']}`" if row["served"] else "-"] if served else []),
              *[_number(row["results"].get(column)) for column in columns], _seconds(row["time_s"])] for row in rows]
    return render_table(cells, header).split("\n")


def _gpu_result(row: dict, metric: str) -> str:
    if row["kind"] == "run":
        value = row["results"].get(metric)
        return f"`{row['served']}` {metric} {_number(value)}" if value is not None else "-"
    speedups = [f"{column} {_number(value)}x" for column, value in row["results"].items()
                if column.endswith("speedup") and value != 1.0]
    return ", ".join(speedups) or "-"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if abs(value) < 10 else f"{value:,.1f}" if abs(value) < 1000 else f"{value:,.0f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} s"
