"""`usecases advise NAME --serve --target-rps RATE [--p99-ms MS]`: how many instances of each catalogue row carry a
serving load at a p99 latency, and a month of them, from the capacity MEASURED by the newest `usecases bench serve
NAME` run (docs/advisor.md, "Serving fleet").

A server's capacity per core at the target is the most requests/s among the bench's concurrencies whose p99 met it
without errors, over its workers, recomputed here for the target asked. The fastest of the use case's own servers is
sized (MLflow's, the bench's baseline, is shown, never sized): each instance runs a worker per vCPU less `OS_CORES`,
a vCPU serves `CORE_SPEED` times the bench core's rate, and instances run at most `HEADROOM` of their capacity. Every
figure is an estimate, a range."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from common.advisor.advise import HOURS_PER_MONTH
from common.advisor.catalog import Instance, load_catalogue
from common.advisor.estimate import Range
from common.advisor.facts import json_safe, number_of
from common.advisor.words import money, span
from common.errors import UserError
from common.tabular import render_table
from common.tracking.advice import BENCH_METRIC, bench_run

# Requests/s a cloud vCPU serves over one of the bench's cores: a hyperthread with its sibling busy gets about 0.6 of
# a core, where the bench's cores are often hyperthreads too (1.0), and a newer CPU does up to about 1.3x a thread's
# work. Assumed, not calibrated: a bench run on the instance itself replaces it.
CORE_SPEED = Range(0.6, 1.0, 1.3)
HEADROOM = 0.70  # of an instance's capacity it runs at: the autoscaler's CPU target
OS_CORES = 1  # per instance, left to the OS and the event store's client
BASELINE = "mlflow"  # MLflow's scoring server: the bench's comparison, not what the fleet runs
HEADER = ["instance", "cloud", "vCPUs", "workers", "requests/s each (full)", "instances", "$/h",
          "$ a month (on demand)"]


@dataclass(frozen=True)
class Level:
    """One concurrency of one server, as the bench measured it."""

    concurrency: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    errors: float


@dataclass(frozen=True)
class Capacity:
    server: str
    levels: tuple[Level, ...]  # by concurrency
    met: Level | None  # the fastest concurrency that met the p99 target without errors; None: none did
    per_core: float  # its requests/s over the bench's workers; NaN where none met

    def as_dict(self) -> dict:
        return {"capacity_rps_per_core": None if self.met is None else self.per_core,
                "at_concurrency": None if self.met is None else self.met.concurrency, "levels": self.levels}


@dataclass(frozen=True)
class Bench:
    run_id: str
    workers: int
    cpu_model: str
    model_uri: str
    p99_ms: float  # the bench's own target; NaN where it logged none
    options: dict[str, list[str]]  # each server's options of `usecases serve`
    capacities: dict[str, Capacity]
    logged: dict[str, float]  # serve/S/capacity_rps_per_core as the bench logged it, at its own target
    notes: list[str]


@dataclass(frozen=True)
class FleetRow:
    instance: Instance
    workers: int  # server workers on each instance
    per_instance: Range  # requests/s one instance serves at full use
    instances: Range
    month: Range  # USD, on demand
    spot_month: Range | None  # USD, on spot; None where the catalogue has no spot price

    def as_dict(self) -> dict:
        instance = self.instance
        return {"provider": instance.provider, "instance": instance.name, "region": instance.region,
                "gpu": f"{instance.gpu_count} x {instance.gpu.name}", "vcpus": instance.vcpus,
                "ram_gb": instance.ram_gb, "workers": self.workers, "price_per_hour_usd": instance.price_per_hour,
                "spot_price_per_hour_usd": instance.spot_price_per_hour, "requests_per_s_each": self.per_instance,
                "instances": self.instances, "month_usd": self.month, "spot_month_usd": self.spot_month}


def capacity(server: str, levels: list[Level], p99_ms: float, workers: int) -> Capacity:
    """The server's capacity per core at `p99_ms`."""
    levels = sorted(levels, key=lambda level: level.concurrency)
    meeting = [level for level in levels if level.p99_ms <= p99_ms and level.errors == 0]
    met = max(meeting, key=lambda level: level.requests_per_s, default=None)
    return Capacity(server, tuple(levels), met, math.nan if met is None else met.requests_per_s / workers)


def size(instance: Instance, per_core: float, target_rps: float) -> FleetRow:
    """The instances of this row that serve `target_rps` at `HEADROOM` of their capacity, and their month."""
    workers = max(1, instance.vcpus - OS_CORES)
    per_instance = CORE_SPEED.scaled(per_core * workers)
    # ceil with a hair of tolerance: 10,000 / 1,000 computed as 10.000000000000002 is 10 instances, not 11
    count = Range(*(max(1, math.ceil(target_rps / (HEADROOM * rate) - 1e-9))
                    for rate in (per_instance.high, per_instance.expected, per_instance.low)))
    spot = instance.spot_price_per_hour
    return FleetRow(instance, workers, per_instance, count, count.scaled(instance.price_per_hour * HOURS_PER_MONTH),
                    count.scaled(spot * HOURS_PER_MONTH) if spot >= 0 else None)


def read_bench(run, p99_ms: float) -> Bench:
    """The bench run's measurements, each server's capacity recomputed at `p99_ms`."""
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    notes = []
    workers = _count(tags.get("workers"))
    if workers is None:
        workers = _count(tags.get("cpu_cores"))
        if workers is None:
            raise UserError(f"run {run.info.run_id}: its tag 'workers' ({tags.get('workers', 'absent')!r}) is not the "
                            "server's number of worker processes, so its capacity per core is unknown: rerun the "
                            "bench with --serve-workers N")
        notes.append(f"the bench's tag 'workers' is {tags.get('workers')!r}: taken as its machine's {workers} cores")
    found: dict[str, dict[int, dict[str, float]]] = {}
    for key, value in metrics.items():
        match = BENCH_METRIC.fullmatch(key)
        if match:
            found.setdefault(match["server"], {}).setdefault(int(match["level"]), {})[match["name"]] = value
    capacities = {}
    for server, levels in sorted(found.items()):
        rows = [Level(level, values.get("requests_per_s", math.nan), values.get("p50_ms", math.nan),
                      values.get("p99_ms", math.nan), values.get("errors", 0.0))
                for level, values in levels.items() if "requests_per_s" in values and "p99_ms" in values]
        if rows:
            capacities[server] = capacity(server, rows, p99_ms, workers)
    logged = {server: metrics[f"serve/{server}/capacity_rps_per_core"] for server in capacities
              if f"serve/{server}/capacity_rps_per_core" in metrics}
    return Bench(run.info.run_id, workers, tags.get("cpu_model", "an unnamed CPU"), tags.get("model_uri", "?"),
                 number_of(params.get("p99_ms")), _options(tags, params, capacities), capacities, logged, notes)


def _options(tags: dict[str, str], params: dict[str, str], servers) -> dict[str, list[str]]:
    """Each server's options of `usecases serve`: as the bench logged them (its tag `serve_options`), or, for a run
    logged before that tag, as the bench then named its servers: `ours`, `ours_batch` (`ours+batch`) with its
    --batch-ms, `mlflow`, and any other by the retrieval mode it served with."""
    if "serve_options" in tags:
        return json.loads(tags["serve_options"])
    batch = ["--batch-ms", params["batch_ms"]] if params.get("batch_ms", "None") != "None" else []
    named = {"ours": [], "ours_batch": batch, "ours+batch": batch, BASELINE: ["--mlflow"]}
    return {server: named.get(server, ["--retrieval", server, *batch]) for server in servers}


def _count(text: str | None) -> int | None:
    value = number_of(text)
    return int(value) if value >= 1 and value == int(value) else None


def sized_server(bench: Bench, p99_ms: float) -> Capacity:
    """The fastest of the use case's own servers at `p99_ms`; a one-line error where none met it."""
    own = [found for server, found in bench.capacities.items() if server != BASELINE]
    if not own:
        raise UserError(f"run {bench.run_id}: no server of the use case's own was measured (only MLflow's), so there "
                        "is nothing to size")
    meeting = [found for found in own if found.met is not None]
    if not meeting:
        best = min(((found.server, level) for found in own for level in found.levels), key=lambda pair: pair[1].p99_ms)
        raise UserError(f"no server of bench run {bench.run_id} met p99 <= {p99_ms:g} ms without errors at any "
                        f"concurrency (the lowest p99: {best[1].p99_ms:.3g} ms, {best[0]} at concurrency "
                        f"{best[1].concurrency}): ask a larger --p99-ms, or rerun the bench at lower --concurrency")
    return max(meeting, key=lambda found: found.per_core)


def fleet_command(usecase, run_id: str | None, catalog: Path | None, output: str, target_rps: float, p99_ms: float,
                  launch: Path | None = None, tracking: str | None = None) -> str:
    """The fleet report of `usecase` (a `UseCase`) as printed; with `launch`, the cheapest row's manifests."""
    name = usecase.name
    _, instances = load_catalogue(catalog)
    bench = read_bench(bench_run(name, run_id), p99_ms)
    sized = sized_server(bench, p99_ms)
    rows = sorted((size(instance, sized.per_core, target_rps) for instance in instances), key=_order)
    cheapest = next((row for row in rows if not math.isnan(row.month.expected)), None)
    report = {"source": f"serving bench run {bench.run_id} of {name}: {bench.workers} worker(s) on "
                        f"{bench.cpu_model}, model {bench.model_uri}",
              "estimated": True, "target_rps": target_rps, "p99_ms": p99_ms,
              "bench": {"run_id": bench.run_id, "workers": bench.workers, "cpu_model": bench.cpu_model,
                        "model_uri": bench.model_uri, "p99_ms": bench.p99_ms,
                        "logged_capacity_rps_per_core": bench.logged},
              "servers": bench.capacities, "sized_server": sized.server,
              "assumptions": {"workers_per_instance": f"vCPUs - {OS_CORES}, at least 1", "core_speed": CORE_SPEED,
                              "headroom": HEADROOM, "hours_per_month": HOURS_PER_MONTH},
              "lines": bench.notes + _server_lines(bench, sized, p99_ms), "rows": rows,
              "cheapest": None if cheapest is None else cheapest.instance.name}
    if launch is not None:
        if cheapest is None:
            raise UserError("--launch: no row of the catalogue has a price, so none is the cheapest to launch")
        report["launch"] = _launch(usecase, launch, tracking, cheapest, sized.server, bench.options[sized.server],
                                   f"for {target_rps:,.0f} requests/s at p99 <= {p99_ms:g} ms")
    if output == "json":
        return json.dumps(json_safe(report), indent=2, allow_nan=False)
    text = _render(report, rows, cheapest, markdown=output == "markdown")
    if launch is not None:
        text += "\n\nLaunch files:\n" + "\n".join(f"- {line}" for line in report["launch"]["lines"])
    return text


def _launch(usecase, folder: Path, tracking: str | None, cheapest: FleetRow, server: str, options: list[str],
            sized_for: str) -> dict:
    """The cheapest row's manifests, its pods sharing the event store the use case's server plug-in names."""
    from common.deploy.launch import write_serve_files

    events = getattr(usecase.server(), "FLEET_EVENTS", None)
    if events is None:
        raise UserError(f"--launch: the server of '{usecase.name}' names no event store its pods share "
                        "(FLEET_EVENTS in its server.py)")
    return write_serve_files(folder, usecase.name, cheapest, server, options, events, tracking, sized_for)


def _server_lines(bench: Bench, sized: Capacity, p99_ms: float) -> list[str]:
    """Each server's measured capacity per core at the target, the sized one first, or why it has none."""
    lines = []
    for found in sorted(bench.capacities.values(),
                        key=lambda found: (found is not sized, 0.0 if found.met is None else -found.per_core)):
        if found.met is None:
            best = min(found.levels, key=lambda level: level.p99_ms)
            lines.append(f"{found.server}: no concurrency of the bench met p99 <= {p99_ms:g} ms without errors (its "
                         f"lowest p99: {best.p99_ms:.3g} ms at concurrency {best.concurrency})")
            continue
        role = ("sized" if found is sized else
                "MLflow's scoring server, the baseline: shown, not sized" if found.server == BASELINE else
                f"{sized.per_core / found.per_core:.2g}x less than {sized.server}'s")
        lines.append(f"{found.server}: {found.per_core:,.0f} requests/s per core at p99 <= {p99_ms:g} ms (measured: "
                     f"{found.met.requests_per_s:,.0f} requests/s on {bench.workers} worker(s) at concurrency "
                     f"{found.met.concurrency}, p99 {found.met.p99_ms:.3g} ms) - {role}")
    return lines


def _order(row: FleetRow) -> tuple:
    return (math.isnan(row.month.expected), row.month.expected, row.month.high, row.instances.expected)


def _money_span(value: Range) -> str:
    return money(value.expected) if math.isnan(value.expected) else span(value, money)


def _cells(row: FleetRow, spot: bool) -> list[str]:
    instance = row.instance
    cells = [instance.name, instance.provider, str(instance.vcpus), str(row.workers),
             span(row.per_instance, lambda value: f"{value:,.0f}"),
             f"{row.instances.expected:g} ({row.instances.low:g}-{row.instances.high:g})",
             money(instance.price_per_hour), _money_span(row.month)]
    return cells + ([_money_span(row.spot_month) if row.spot_month is not None else "-"] if spot else [])


def _render(report: dict, rows: list[FleetRow], cheapest: FleetRow | None, markdown: bool) -> str:
    spot = any(row.spot_month is not None for row in rows)
    header = HEADER + (["$ a month (spot)"] if spot else [])
    lines = [f"Serving fleet for {report['target_rps']:,.0f} requests/s at p99 <= {report['p99_ms']:g} ms, from the "
             f"{report['source']}.", "", "Measured capacity per core:", *(f"- {line}" for line in report["lines"]), "",
             "Every figure below is estimated: expected (low-high): each instance runs one server worker per vCPU "
             f"less {OS_CORES} for the OS and the event store; a vCPU serves {CORE_SPEED.low:g}-{CORE_SPEED.high:g}x "
             f"(expected {CORE_SPEED.expected:g}x) the bench core's rate; instances are sized to run at most "
             f"{100 * HEADROOM:.0f} % of their capacity (the autoscaler's CPU target); a month is {HOURS_PER_MONTH:g} "
             "h at each row's price (its source dates it). The GPUs are not used: the server was sized per CPU core.",
             "", render_table([_cells(row, spot) for row in rows], header, markdown=markdown), ""]
    if cheapest is None:
        lines.append("Cheapest: none (no row of the catalogue has a price)")
    else:
        instance = cheapest.instance
        on_spot = "" if cheapest.spot_month is None else f"; on spot {span(cheapest.spot_month, money)}"
        lines.append(f"Cheapest (expected): {cheapest.instances.expected:g} x {instance.name} ({instance.provider} "
                     f"{instance.region}, {instance.vcpus} vCPUs, {cheapest.workers} workers each), "
                     f"{span(cheapest.month, money)} a month on demand{on_spot}; "
                     f"{cheapest.instances.low:g}-{cheapest.instances.high:g} instances over the range (estimated)")
    return "\n".join(lines)
