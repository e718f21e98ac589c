"""`usecases advise NAME --serve --target-rps RATE [--p99-ms MS]`: how many instances of each catalogue row carry a
serving load at a p99 latency, and what a month of them costs, from the serving capacity MEASURED by the newest
`usecases bench serve NAME` run (experiment NAME-serve, tag `preset=serve`).

The bench logs, per server S (`exact`, `ann`; `ours`, `mlflow`, `ours_batch` in older runs) and concurrency C,
`serve/S/cC/requests_per_s`, `p50_ms`, `p99_ms` and `errors`, and the tag `workers`: the server's worker processes,
the cores it used. A server's capacity per core at a p99 target is the highest requests/s among the concurrencies
whose p99 met the target without errors, over the workers. It is recomputed here for the target asked, which may
differ from the bench's own (its `serve/S/capacity_rps_per_core`). The fastest server is sized; MLflow's scoring
server, the bench's baseline, is shown but never sized: the fleet runs the use case's own server.

The sizing is an ESTIMATE, every figure a range (low, expected, high):
- each instance runs one server worker per vCPU, less `OS_CORES` for the OS and the event store's client (at least 1);
- a vCPU serves `CORE_SPEED` times the bench core's measured rate (see there why);
- instances = ceil(target / (HEADROOM x capacity of one instance)): each runs at most 70 % of its capacity, the
  HorizontalPodAutoscaler's CPU target, so a spike or a lost instance has room; the expected count from the expected
  capacity, the low count from the high capacity and the high count from the low;
- a month = instances x the price an hour x 730 h, on demand, and on spot where the catalogue has a spot price.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from common.advisor.budget import HOURS_PER_MONTH
from common.advisor.catalog import Instance, load_catalogue
from common.advisor.estimate import Range
from common.advisor.formats import json_safe, money, span
from common.advisor.serve_launch import BATCHED, RETRIEVALS, write_serve_files
from common.errors import UserError
from common.tabular import render_table

# Requests/s a cloud vCPU serves, over one of the bench machine's cores (low, expected, high). A cloud vCPU is one
# hyperthread of a physical core: with its sibling busy too, it gets about 0.6 of a core to itself (two threads on one
# core do about 1.2-1.3x one thread's work: the low end), where the bench's "cores" are what the OS counted, often
# hyperthreads themselves (then alike: the expected 1.0). A newer server CPU at a higher clock can do more per thread
# than the bench machine's (up to about 1.3x: a generation's gain in clock and instructions per cycle). Assumed, not
# calibrated: a bench run on the instance itself replaces it with a measurement.
CORE_SPEED = Range(0.6, 1.0, 1.3)
HEADROOM = 0.70  # of an instance's capacity it runs at: the HPA's CPU utilisation target
OS_CORES = 1  # per instance, left to the OS and the event store's client
BASELINE = "mlflow"  # MLflow's scoring server: the bench's comparison, not what the fleet runs
METRIC = re.compile(r"serve/(?P<server>.+)/c(?P<level>\d+)/(?P<name>requests_per_s|p50_ms|p99_ms|errors)")
ESTIMATED = "estimated: expected (low-high)"


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
                "at_concurrency": None if self.met is None else self.met.concurrency,
                "levels": [level.__dict__ for level in self.levels]}


@dataclass(frozen=True)
class Bench:
    run_id: str
    workers: int
    cpu_model: str
    model_uri: str
    p99_ms: float  # the bench's own target; NaN where it logged none
    batch_ms: str  # its micro-batching window, for the server ours_batch ("" where none)
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
                "ram_gb": None if math.isnan(instance.ram_gb) else instance.ram_gb, "workers": self.workers,
                "price_per_hour_usd": _clean(instance.price_per_hour),
                "spot_price_per_hour_usd": _clean(instance.spot_price_per_hour),
                "requests_per_s_each": self.per_instance.as_dict(), "instances": self.instances.as_dict(),
                "month_usd": {key: _clean(value) for key, value in self.month.as_dict().items()},
                "spot_month_usd": None if self.spot_month is None else self.spot_month.as_dict()}


def capacity(server: str, levels: list[Level], p99_ms: float, workers: int) -> Capacity:
    """The server's capacity per core at `p99_ms`: its fastest concurrency whose p99 met the target without errors,
    over the workers."""
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


def find_bench(usecase: str, run_id: str | None):
    """The bench run: `run_id`, else the newest finished `preset=serve` run of experiment NAME-serve."""
    import mlflow

    from common.tracking.runs import experiment_name
    from common.tracking.stores import tracking_uri

    mlflow.set_tracking_uri(tracking_uri())
    client = mlflow.MlflowClient()
    if run_id is not None:
        try:
            run = client.get_run(run_id)
        except mlflow.exceptions.MlflowException:
            raise UserError(f"--run {run_id}: no such run in {tracking_uri()}") from None
        if not _measured(run):
            raise UserError(f"--run {run_id}: not a serving bench run (no serve/SERVER/cN/requests_per_s metrics): "
                            f"run `usecases bench serve {usecase}`")
        return run
    names = dict.fromkeys((experiment_name(f"{usecase}-serve"), f"{usecase}-serve"))  # as tracked, or as named
    ids = [experiment.experiment_id for name in names if (experiment := client.get_experiment_by_name(name))]
    found = [] if not ids else client.search_runs(
        ids, "attributes.status = 'FINISHED' and tags.preset = 'serve'", order_by=["attributes.start_time DESC"],
        max_results=20)
    found = [run for run in found if _measured(run)]
    if not found:
        raise UserError(f"no serving bench run of '{usecase}' in {tracking_uri()}: run `usecases bench serve "
                        f"{usecase}` first")
    return found[0]


def _measured(run) -> bool:
    return any(METRIC.fullmatch(key) for key in run.data.metrics)


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
        match = METRIC.fullmatch(key)
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
                 _number(params.get("p99_ms")), params.get("batch_ms", "") if params.get("batch_ms") != "None" else "",
                 capacities, logged, notes)


def _count(text: str | None) -> int | None:
    value = _number(text)
    return int(value) if value >= 1 and value == int(value) else None


def _number(text: str | None) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def sized_server(bench: Bench, p99_ms: float) -> Capacity:
    """The fastest of the use case's own servers at `p99_ms`; a one-line error where none met it."""
    own = [found for server, found in bench.capacities.items() if server != BASELINE]
    if not own:
        raise UserError(f"run {bench.run_id}: no server of the use case's own was measured (only MLflow's), so there "
                        "is nothing to size")
    meeting = [found for found in own if found.met is not None]
    if not meeting:
        best = min(((found.server, level) for found in own for level in found.levels),
                   key=lambda pair: pair[1].p99_ms)
        raise UserError(f"no server of bench run {bench.run_id} met p99 <= {p99_ms:g} ms without errors at any "
                        f"concurrency (the lowest p99: {best[1].p99_ms:.3g} ms, {best[0]} at concurrency "
                        f"{best[1].concurrency}): ask a larger --p99-ms, or rerun the bench at lower --concurrency")
    return max(meeting, key=lambda found: found.per_core)


def fleet_command(usecase: str, run_id: str | None, catalog: Path | None, output: str, target_rps: float,
                  p99_ms: float, launch: Path | None = None, tracking: str | None = None) -> str:
    """The fleet report as printed (table, Markdown or JSON); with `launch`, the Kubernetes manifests of the
    cheapest row are written there."""
    _, instances = load_catalogue(catalog)
    run = find_bench(usecase, run_id)
    bench = read_bench(run, p99_ms)
    sized = sized_server(bench, p99_ms)
    rows = sorted((size(instance, sized.per_core, target_rps) for instance in instances), key=_order)
    cheapest = next((row for row in rows if not math.isnan(row.month.expected)), None)
    report = {"source": f"serving bench run {bench.run_id} of {usecase}: {bench.workers} worker(s) on "
                        f"{bench.cpu_model}, model {bench.model_uri}",
              "estimated": True, "target_rps": target_rps, "p99_ms": p99_ms,
              "bench": {"run_id": bench.run_id, "workers": bench.workers, "cpu_model": bench.cpu_model,
                        "model_uri": bench.model_uri, "p99_ms": _clean(bench.p99_ms),
                        "logged_capacity_rps_per_core": bench.logged},
              "servers": {server: found.as_dict() for server, found in bench.capacities.items()},
              "sized_server": sized.server,
              "assumptions": {"workers_per_instance": f"vCPUs - {OS_CORES}, at least 1",
                              "core_speed": CORE_SPEED.as_dict(), "headroom": HEADROOM,
                              "hours_per_month": HOURS_PER_MONTH},
              "lines": bench.notes + _server_lines(bench, sized, p99_ms),
              "rows": [row.as_dict() for row in rows],
              "cheapest": None if cheapest is None else cheapest.instance.name}
    if launch is not None:
        if cheapest is None:
            raise UserError("--launch: no row of the catalogue has a price, so none is the cheapest to launch")
        extra = ["--retrieval", sized.server] if sized.server in RETRIEVALS else []
        if (sized.server in BATCHED or sized.server in RETRIEVALS) and bench.batch_ms:
            extra += ["--batch-ms", bench.batch_ms]
        report["launch"] = write_serve_files(launch, usecase, cheapest, sized.server, extra, tracking,
                                             f"for {target_rps:,.0f} requests/s at p99 <= {p99_ms:g} ms")
    if output == "json":
        return json.dumps(json_safe(report), indent=2, allow_nan=False)
    text = _render(report, rows, cheapest, markdown=output == "markdown")
    if launch is not None:
        text += "\n\nLaunch files:\n" + "\n".join(f"- {line}" for line in report["launch"]["lines"])
    return text


def _server_lines(bench: Bench, sized: Capacity, p99_ms: float) -> list[str]:
    """Each server's measured capacity per core at the target, the sized one first, or why it has none."""
    lines = []
    for found in sorted(bench.capacities.values(), key=lambda found: (found is not sized, -_or_zero(found.per_core))):
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


def _or_zero(value: float) -> float:
    return 0.0 if math.isnan(value) else value


def _order(row: FleetRow) -> tuple:
    return (math.isnan(row.month.expected), row.month.expected, row.month.high, row.instances.expected)


HEADER = ["instance", "cloud", "vCPUs", "workers", "requests/s each (full)", "instances", "$/h",
          "$ a month (on demand)"]


def _count_span(value: Range) -> str:
    return f"{value.expected:g} ({value.low:g}-{value.high:g})"


def _cells(row: FleetRow, spot: bool) -> list[str]:
    instance = row.instance
    cells = [instance.name, instance.provider, str(instance.vcpus), str(row.workers),
             span(row.per_instance, lambda value: f"{value:,.0f}"), _count_span(row.instances),
             money(instance.price_per_hour), _money_span(row.month)]
    return cells + ([_money_span(row.spot_month) if row.spot_month is not None else "-"] if spot else [])


def _money_span(value: Range) -> str:
    return money(value.expected) if math.isnan(value.expected) else span(value, money)


def _render(report: dict, rows: list[FleetRow], cheapest: FleetRow | None, markdown: bool) -> str:
    spot = any(row.spot_month is not None for row in rows)
    header = HEADER + (["$ a month (spot)"] if spot else [])
    cells = [_cells(row, spot) for row in rows]
    lines = [f"Serving fleet for {report['target_rps']:,.0f} requests/s at p99 <= {report['p99_ms']:g} ms, from the "
             f"{report['source']}.", "", "Measured capacity per core:"]
    lines += [f"- {line}" for line in report["lines"]]
    lines += ["", f"Every figure below is {ESTIMATED}: each instance runs one server worker per vCPU less "
              f"{OS_CORES} for the OS and the event store; a vCPU serves {CORE_SPEED.low:g}-{CORE_SPEED.high:g}x "
              f"(expected {CORE_SPEED.expected:g}x) the bench core's rate; instances are sized to run at most "
              f"{100 * HEADROOM:.0f} % of their capacity (the autoscaler's CPU target); a month is "
              f"{HOURS_PER_MONTH:g} h "
              "at each row's price (its source dates it). The GPUs are not used: the server was sized per CPU core."]
    lines += ["", render_table(cells, header, markdown=markdown)]
    lines.append("")
    if cheapest is None:
        lines.append("Cheapest: none (no row of the catalogue has a price)")
    else:
        instance = cheapest.instance
        on_spot = ("" if cheapest.spot_month is None else
                   f"; on spot {span(cheapest.spot_month, money)}")
        lines.append(f"Cheapest (expected): {cheapest.instances.expected:g} x {instance.name} ({instance.provider} "
                     f"{instance.region}, {instance.vcpus} vCPUs, {cheapest.workers} workers each), "
                     f"{span(cheapest.month, money)} a month on demand{on_spot}; "
                     f"{cheapest.instances.low:g}-{cheapest.instances.high:g} instances over the range (estimated)")
    return "\n".join(lines)


def _clean(value: float):
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


