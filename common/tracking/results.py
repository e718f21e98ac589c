"""`usecases report`: a use case's results page, docs/results/NAME.md, generated from the tracking store. A store holds
only the runs of the machines that tracked into it, so the rows are kept in docs/results/NAME.json: a report merges the
store's newest FINISHED run per key into it and renders the page from the JSON alone, which `--check` renders again and
compares, so that a hand edit is caught without any store."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from common.errors import UserError
from common.paths import project_root, write_json_atomic, write_text_atomic
from common.tabular import render_table
from common.tracking.runs import experiment_name, metric_name
from common.tracking.stores import check_reachable

KINDS = {"run": "", "benchmark": "-benchmark"}  # each kind of row and the suffix of its experiment
# the CPU's model name as the OS reports it, its native BF16, cores, the GPU, and the precision the run trained in
MACHINE = ("cpu_model", "cpu_bf16", "cpu_cores", "gpu", "precision")
KEY = ("kind", "preset", "data", "data_sha256", *MACHINE)  # a row per key; a newer run of it replaces the row


@dataclass(frozen=True)
class PageColumns:
    """What a use case's page shows beyond the primary metric: each model's `reported` metrics in a table below a
    run's, and `evidence`, (metric, unit): how many test units (users, days, images) the served model's test figure
    rests on, beside its bootstrap interval where the run computed one (`<metric>_ci_low`, `_ci_high`)."""

    reported: tuple[str, ...] = ()
    evidence: tuple[str, str] | None = None

    @classmethod
    def of(cls, usecase) -> PageColumns:
        return cls(tuple(usecase.reported_metrics), usecase.evidence)


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


def collect(client, name: str, metric: str, columns: PageColumns = PageColumns()) -> list[dict]:
    """The newest FINISHED run of each key in the store, as rows, with what `columns` asks of a run."""
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
                row = _row(run, kind, metric, columns)
                rows.setdefault(_key(row), row)
            token = page.token
            if not token:
                break
    return list(rows.values())


def _row(run, kind: str, metric: str, columns: PageColumns = PageColumns()) -> dict:
    tags, metrics = run.data.tags, run.data.metrics
    gpu = "none"
    if tags.get("device") == "cuda":
        count = int(tags.get("gpu_count", "1") or 1)
        gpu = f"{count}x {tags.get('gpu_name', '?')}" if count > 1 else tags.get("gpu_name", "?")
    bf16 = {"true": "yes", "false": "no"}.get(tags.get("cpu_bf16", ""), "?")
    return {
        "kind": kind, "preset": tags.get("preset", "?"), "data": tags.get("data_source", "?"),
        "data_sha256": tags.get("data_sha256", "?")[:12], "cpu_model": tags.get("cpu_model", "?"), "cpu_bf16": bf16,
        "cpu_cores": tags.get("cpu_cores", "?"), "gpu": gpu, "precision": tags.get("precision", "?"),
        "torch": tags.get("torch_version", "?"), "commit": _commit(tags),
        "date": datetime.fromtimestamp(run.info.start_time / 1000, timezone.utc).strftime("%Y-%m-%d"),
        "started_ms": run.info.start_time, "run_id": run.info.run_id, "served": tags.get("primary_model"),
        "time_s": _rounded(metrics.get("time/total_s")), "capped": tags.get("capped") == "true",
        "results": _results(metrics, kind, metric),
        "reported": _reported(metrics, columns.reported) if kind == "run" else {},
        "evidence": _evidence(metrics, tags.get("primary_model"), metric, columns.evidence) if kind == "run" else {}}


def _evidence(metrics: dict[str, float], served: str | None, metric: str, evidence: tuple[str, str] | None) -> dict:
    """The served model's count of test units and the bounds of its primary metric's interval, where logged."""
    name = metric_name(metric)
    keys = {"n": evidence[0] if evidence else None, "ci_low": f"{name}_ci_low", "ci_high": f"{name}_ci_high"}
    found = {key: metrics.get(f"test/{served}/{logged}") for key, logged in keys.items() if served and logged}
    return {key: _rounded(value) for key, value in found.items() if value is not None}


def _commit(tags: dict[str, str]) -> str:
    """The commit; `+` where the run had uncommitted changes, `?` where it ran before runs said (no `git_dirty`)."""
    commit = tags.get("git_commit", "?")[:7]
    return commit + {"true": "+", "false": ""}.get(tags.get("git_dirty", ""), "?" if commit != "?" else "")


def _reported(metrics: dict[str, float], names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Each model's test values of `names` (a risk model's backtests, say), for the table below a run's."""
    models = sorted({key.split("/")[1] for key in metrics if key.startswith("test/") and key.count("/") == 2})
    table = {model: {name: _rounded(metrics.get(f"test/{model}/{name}")) for name in names} for model in models}
    return {model: values for model, values in table.items() if any(value is not None for value in values.values())}


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
    """The kept rows with the new ones in: a row per key, the newer run's; newest first. A row kept from before the
    precision was recorded says `?`."""
    rows = {_key(row): row for row in ({"precision": "?", "reported": {}, **row} for row in kept)}
    for row in new:
        if _key(row) not in rows or row["started_ms"] >= rows[_key(row)]["started_ms"]:
            rows[_key(row)] = row
    return sorted(rows.values(), key=lambda row: (-row["started_ms"], row["run_id"]))


def report(name: str, primary_metric: tuple[str, str], store: str, folder: Path, required: bool = True,
           columns: PageColumns = PageColumns(), upstream: bool = False) -> Path | None:
    """Merge the store's rows into folder/NAME.local.json (the team's own rows beside the project's; with `upstream`,
    into the project's folder/NAME.json) and render folder/NAME.md from both. Without finished runs in the store: one
    line when `required`, else the page is rendered from the JSON (None when there are no rows at all)."""
    target = folder / f"{name}{'' if upstream else LOCAL}.json"
    kept = _load(target)
    new = collect(read_store(store), name, primary_metric[0], columns)
    if not new and required:
        raise UserError(f"no finished run of '{name}' in {store} (run `usecases run {name}` first)")
    if new or kept["rows"]:
        write_json_atomic({"usecase": name, "primary_metric": list(primary_metric), "reported": list(columns.reported),
                           "unit": columns.evidence[1] if columns.evidence else None, "rows": merge(kept["rows"], new)},
                          target)
    data = _combined(name, folder)
    if data is None:
        return None
    page = folder / f"{name}.md"
    write_text_atomic(render(data), page)
    return page


LOCAL = ".local"  # NAME.local.json: a fork's own rows, kept apart from the project's NAME.json that it pulls


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"rows": []}


def _combined(name: str, folder: Path) -> dict | None:
    """The project's rows, and the team's (NAME.local.json) as `local_rows`; None where neither file has a row."""
    upstream, local = _load(folder / f"{name}.json"), _load(folder / f"{name}{LOCAL}.json")
    if not upstream["rows"] and not local["rows"]:
        return None
    meta = {key: value for kept in (upstream, local) for key, value in kept.items() if key != "rows"}  # the team's last
    return {**meta, "rows": upstream["rows"], "local_rows": local["rows"]}


def check(name: str, folder: Path) -> None:
    """One line when folder/NAME.md is not what folder/NAME.json (and NAME.local.json) render."""
    source, page = folder / f"{name}.json", folder / f"{name}.md"
    data = _combined(name, folder)
    if data is None:
        raise UserError(f"{source} is missing: write it with `usecases report {name}`")
    if not page.is_file() or page.read_text(encoding="utf-8") != render(data):
        raise UserError(f"{page} is not what `usecases report {name}` renders from {source.name} (edited by hand?): "
                        f"run `usecases report {name}` to render it again")


def pages(folder: Path) -> list[str]:
    return sorted({path.stem.removesuffix(LOCAL) for pattern in ("*.md", "*.json") for path in folder.glob(pattern)})


def render(data: dict) -> str:
    name, (metric, mode) = data["usecase"], data["primary_metric"]
    unit = data.get("unit") or "units"
    lines = [f"# {name}: results", "",
             f"*Generated by `usecases report {name}` from [{name}.json]({name}.json); do not edit by hand "
             f"(`usecases report {name} --check` fails on an edit).*", "",
             f"A row per machine: its newest finished run, newest machines first. A run's row leads with what chose "
             f"the served model, its `{metric}` on validation (the registry serves the best there), then its test "
             f"`{metric}` ({'higher' if mode == 'max' else 'lower'} is better) with its 95 % bootstrap interval where "
             f"the run computed one and the number of test {unit} it rests on (few make it noise), then each model's "
             f"test `{metric}` (the baselines beside it; a model's variant that scores as it does, such as its tail "
             f"rules, only in the table below); time is the whole run's, `(capped)` where `gpu-check` stopped it at "
             f"its cap with the models it had measured; precision is what the run trained in; a commit ending in `+` "
             f"ran with uncommitted changes, in `?` before runs said (its code state is unknown). A machine whose "
             f"store was reported once keeps its row until a newer run of it replaces it."]
    if data.get("local_rows"):
        lines += ["", f"Your runs (`{name}{LOCAL}.json`, written by `usecases report`) come first, each table titled "
                      f"so; the project's own rows (`{name}.json`, as pulled) follow, unchanged."]
    for owner, rows in (("Your runs", data.get("local_rows", [])), ("", data["rows"])):
        lines += _run_tables(rows, metric, data, owner)
    gpu_rows = [row for row in data["rows"] + data.get("local_rows", []) if row["gpu"] != "none"]
    if gpu_rows:
        cells = [[row["gpu"], f"`usecases {'bench run' if row['kind'] == 'benchmark' else 'run'} {name} --preset "
                              f"{row['preset']} --device cuda`", _gpu_result(row, metric), _seconds(row["time_s"]),
                  row["torch"], row["commit"], row["date"]] for row in gpu_rows]
        lines += ["", "## On a GPU", "",
                  render_table(cells, ["GPU", "command", "result", "time", "torch", "commit", "date"])]
    return "\n".join(lines) + "\n"


def _run_tables(rows: list[dict], metric: str, data: dict, owner: str) -> list[str]:
    """A table per kind, preset and data set, newest first; `owner` prefixes the titles of a fork's own rows."""
    tables: dict[tuple, list[dict]] = {}
    for row in ({"precision": "?", "reported": {}, "evidence": {}, **row} for row in rows):
        tables.setdefault((list(KINDS).index(row["kind"]), row["preset"], row["data"], row["data_sha256"]),
                          []).append(row)
    lines = []
    for (kind, preset, source, digest), grouped in sorted(tables.items(),
                                                          key=lambda item: (item[0][0], -item[1][0]["started_ms"])):
        title = f"{owner + ', ' if owner else ''}{'benchmark' if kind else 'run'}"
        lines += ["", f"## {title[0].upper()}{title[1:]}: preset `{preset}`, data `{source}` ({digest})", "",
                  *_table(grouped, metric, data.get("unit") or "units"),
                  *_reported_table(grouped[0], data.get("reported", []))]
    return lines


def _reported_table(row: dict, names: list[str]) -> list[str]:
    """The newest run's `reported` metrics of every model (a risk model's backtests, say), where it recorded them."""
    if not names or not row.get("reported"):
        return []
    cells = [[f"`{model}`", *[_number(values.get(name)) for name in names]]
             for model, values in row["reported"].items()]
    return ["", f"Each model's {', '.join(f'`{name}`' for name in names)} on test, in the newest run above "
                f"({row['cpu_model']}, commit {row['commit']}, {row['date']}):", "",
            *render_table(cells, ["model", *names]).split("\n")]


def _variants(rows: list[dict], columns: list[str]) -> set[str]:
    """Columns that are another column's variant (`neural_fz` of `neural`) with its values in every row."""
    return {column for column in columns for other in columns
            if column.startswith(f"{other}_") and all(row["results"].get(column) == row["results"].get(other)
                                                       for row in rows)}


def _table(rows: list[dict], metric: str, unit: str) -> list[str]:
    """A run's: the served model's validation and test figures (with their evidence), then each model's test figure,
    its name shown as code like model names elsewhere. A benchmark's: each model's every metric."""
    columns = list(dict.fromkeys(column for row in rows for column in row["results"]))
    served = any(row["served"] for row in rows)
    headline, evidence = [], []
    if rows[0]["kind"] == "run":
        headline = [column for column in (f"val {metric}", metric) if column in columns]
        columns = [column for column in columns if column not in headline and column not in _variants(rows, columns)]
        evidence = [key for key in ("ci", "n") if any(_evidence_cell(row, key) != "-" for row in rows)]
    header = ["CPU", "BF16", "cores", "GPU", "precision", "torch", "commit", "date", *(["served"] if served else []),
              *headline, *[{"ci": "95 % CI", "n": f"test {unit}"}[key] for key in evidence],
              *[f"`{column}`" if headline else column for column in columns], "time"]
    cells = [[row["cpu_model"], row["cpu_bf16"], row["cpu_cores"], row["gpu"], row["precision"], row["torch"],
              row["commit"], row["date"], *([f"`{row['served']}`" if row["served"] else "-"] if served else []),
              *[_number(row["results"].get(column)) for column in headline],
              *[_evidence_cell(row, key) for key in evidence],
              *[_number(row["results"].get(column)) for column in columns],
              _seconds(row["time_s"]) + (" (capped)" if row.get("capped") else "")] for row in rows]
    return render_table(cells, header).split("\n")


def _evidence_cell(row: dict, key: str) -> str:
    found = row.get("evidence") or {}
    if key == "n":
        return f"{found['n']:,.0f}" if "n" in found else "-"
    return f"{_number(found['ci_low'])}–{_number(found['ci_high'])}" if "ci_low" in found and "ci_high" in found \
        else "-"


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
