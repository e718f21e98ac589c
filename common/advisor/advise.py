"""`usecases advise`: which GPU instance to rent to train and to serve a use case, and what it will cost, from the
workload facts its run logged (`common.training.workload`), the catalogue (`common.advisor.catalog`) and the estimator
(`common.advisor.estimate`). Every figure of another machine is an estimate with its range; this run's own figures are
measured and labelled so.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from common.advisor.estimate import Range, Workload, cpu_seconds, data_parallel, estimate
from common.advisor.catalog import GPU, Instance, load_gpus, load_instances, match_gpu
from common.errors import UserError

DATA_WAIT_ACTION = 0.10  # of a training epoch spent waiting for data
LOW_UTILISATION = 40.0  # percent of the GPU busy
HIGH_MEMORY = 0.90  # of the GPU's memory
CPU_SHARE_ACTION = 0.30  # of a run spent in CPU-side work
NVLINK_GBS, PCIE_GBS = 150.0, 12.0  # effective all-reduce bandwidth between two GPUs of one machine


@dataclass
class RunFacts:
    """What a run measured, as `advise` reads it from MLflow (or a user's `--workload` file)."""

    run_id: str | None
    models: dict[str, dict[str, float]]  # per torch model, its `model/<name>/` facts
    cpu_parts: dict[str, dict[str, float]] = field(default_factory=dict)  # `workload/cpu/<part>/`
    cores: int = 1
    gpu: str | None = None  # the catalogue's name of the GPU it ran on, None on a CPU
    gpu_count: int = 0
    precision: str = "auto"
    tf32: bool = False
    total_seconds: float = math.nan
    gpu_utilisation: float = math.nan  # percent, mean over the run
    task: str = "both"


def facts_from_run(run, usecase: str, gpus: dict[str, GPU]) -> RunFacts:
    """The facts of an MLflow run; a run without them is one line saying what to run first."""
    metrics, params, tags = run.data.metrics, run.data.params, run.data.tags
    models: dict[str, dict[str, float]] = {}
    parts: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        if found := re.fullmatch(r"model/([^/]+)/(.+)", key):
            models.setdefault(found.group(1), {})[found.group(2)] = value
        elif found := re.fullmatch(r"workload/cpu/([^/]+)/(.+)", key):
            parts.setdefault(found.group(1), {})[found.group(2)] = value
    models = {name: facts for name, facts in models.items() if "train_flops_per_sample" in facts}
    if not models:
        raise UserError(f"run {run.info.run_id} has no workload facts (metrics model/<name>/train_flops_per_sample):"
                        f" it was logged before `advise` existed, or trained no torch model; run `usecases run "
                        f"{usecase} --preset smoke` first")
    gpu_name = tags.get("gpu_name", "none")
    gpu = None
    if gpu_name != "none" and tags.get("device", "cpu").startswith("cuda"):
        try:
            gpu = match_gpu(gpu_name, gpus)
        except UserError:
            gpu = None  # a GPU the catalogue does not know: advised as a CPU run would be
    for name, model in models.items():
        model["trained_samples"] = _trained_samples(run.info.run_id, name)
    world = int(tags.get("world_size", "1") or 1)
    if gpu is not None:
        for model in models.values():
            if "train_samples_per_s" in model:
                model["measured_train_samples_per_s"] = model["train_samples_per_s"] / world
    utilisation = [value for key, value in metrics.items() if re.fullmatch(r"system/gpu_\d+_utilization_percentage",
                                                                            key)]
    return RunFacts(run.info.run_id, models, parts, int(tags.get("cpu_cores", "1") or 1), gpu,
                    world if gpu else 0, params.get("runtime.precision", "auto"),
                    params.get("runtime.tf32", "False") == "True", metrics.get("time/total_s", math.nan),
                    sum(utilisation) / len(utilisation) if utilisation else math.nan)


def _trained_samples(run_id: str, name: str) -> float:
    """Every sample a model trained on in the run: each fit (a refit, an ensemble member) logs its samples
    per epoch and epochs once."""
    import mlflow

    client = mlflow.MlflowClient()
    per_epoch = client.get_metric_history(run_id, f"model/{name}/samples_per_epoch")
    epochs = client.get_metric_history(run_id, f"model/{name}/epochs_run")
    return float(sum(samples.value * run.value for samples, run in zip(per_epoch, epochs)))


def facts_from_file(path: Path, gpus: dict[str, GPU]) -> RunFacts:
    """A model that is not one of ours, as `--workload FILE.json` describes it."""
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot be read as JSON ({exc})") from None
    required = ("task", "flops_per_sample", "bytes_per_sample", "precision", "batch_size")
    missing = [key for key in required if key not in spec]
    if missing:
        raise UserError(f"{path}: missing key '{missing[0]}' (a workload file has {', '.join(required)}, and "
                        "optionally measured: {\"gpu\": NAME, \"samples_per_s\": X})")
    if spec["task"] not in ("train", "serve") or spec["precision"] not in ("fp32", "tf32", "fp16", "bf16", "amp"):
        raise UserError(f"{path}: expected task train or serve and precision fp32, tf32, fp16, bf16 or amp (got "
                        f"{spec['task']!r}, {spec['precision']!r})")
    try:
        facts = {"flops": float(spec["flops_per_sample"]), "bytes": float(spec["bytes_per_sample"]),
                 "batch_size": float(spec["batch_size"])}
    except (TypeError, ValueError):
        raise UserError(f"{path}: flops_per_sample, bytes_per_sample and batch_size must be numbers") from None
    prefix = "train" if spec["task"] == "train" else "infer"
    model = {f"{prefix}_flops_per_sample": facts["flops"], f"{prefix}_bytes_per_sample": facts["bytes"],
             "batch_size": facts["batch_size"], "samples_per_epoch": 1e6, "epochs_run": 1.0}  # times per 1M samples
    measured = spec.get("measured") or {}
    gpu = match_gpu(str(measured["gpu"]), gpus) if "gpu" in measured else None
    if gpu is not None:
        try:
            model[f"measured_{spec['task']}_samples_per_s"] = float(measured["samples_per_s"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path}: measured needs samples_per_s, a number, beside gpu") from None
    precision = "auto" if spec["precision"] == "amp" else spec["precision"]
    return RunFacts(None, {"workload": model}, gpu=gpu, gpu_count=1 if gpu else 0, precision=precision,
                    tf32=spec["precision"] == "tf32", task=spec["task"])


def _workload(facts: RunFacts, model: dict[str, float], task: str) -> Workload:
    """One model's training or serving workload; the rate measured on the run's GPU, if any, calibrates it."""
    prefix = "train" if task == "train" else "infer"
    measured = model.get(f"measured_{task}_samples_per_s") if facts.gpu is not None else None
    return Workload(task, model.get(f"{prefix}_flops_per_sample", math.nan),
                    model.get(f"{prefix}_bytes_per_sample", math.nan), facts.precision, int(model.get("batch_size", 1)),
                    ops_per_batch=model.get("train_ops_per_step" if task == "train" else "infer_ops_per_batch", 0.0),
                    weight_bytes=model.get("weight_bytes", 0.0), peak_memory_gb=model.get("peak_memory_gb", math.nan),
                    loader_samples_per_s=model.get("loader_samples_per_s", math.nan),
                    loader_cores=facts.cores,
                    measured_gpu=facts.gpu if measured else None, measured_samples_per_s=measured or None)


@dataclass
class Row:
    """One instance's estimates (every figure a Range, or NaN where the price is unknown)."""

    instance: Instance
    train_seconds: Range | None = None
    epoch_seconds: Range | None = None
    train_cost: Range | None = None
    train_bound: str = ""
    train_per_s: Range | None = None  # of the model that takes the most time
    serve_per_s: Range | None = None
    latency_ms: Range | None = None
    serve_cost_per_million: Range | None = None
    memory_share: float = math.nan
    fits: bool = True


def advise(facts: RunFacts, instances: list[Instance], gpus: dict[str, GPU], task: str) -> list[Row]:
    rows = []
    for instance in instances:
        row = Row(instance)
        if task in ("train", "both"):
            _train(row, facts, gpus)
        if task in ("serve", "both"):
            _serve(row, facts, gpus)
        rows.append(row)
    return rows


def _train(row: Row, facts: RunFacts, gpus: dict[str, GPU]) -> None:
    instance = row.instance
    epoch, run, bounds, shares = Range(0, 0, 0), Range(0, 0, 0), [], []
    for model in facts.models.values():
        if "train_flops_per_sample" not in model:
            continue
        found = estimate(_workload(facts, model, "train"), instance.gpu, gpus, instance.vcpus, facts.tf32)
        rate = data_parallel(found.samples_per_s, instance.gpu_count)
        samples = model.get("samples_per_epoch", model.get("batch_size", 1))
        epoch = epoch.plus(rate.inverse().scaled(samples))
        run = run.plus(rate.inverse().scaled(model.get("trained_samples") or samples * model.get("epochs_run", 1)))
        bounds.append((samples / rate.expected, found.bound, rate))
        shares.append((found.memory_share, found.fits))
    cpu = Range(0, 0, 0)
    for part in facts.cpu_parts.values():
        cpu = cpu.plus(cpu_seconds(part.get("seconds", 0.0), bool(part.get("parallel")), facts.cores,
                                   instance.vcpus))
    row.epoch_seconds, row.train_seconds = epoch, run.plus(cpu)
    if bounds:
        _, bound, row.train_per_s = max(bounds, key=lambda entry: entry[0])
        row.train_bound = "CPU-side work" if cpu.expected > run.expected else bound
    row.train_cost = row.train_seconds.scaled(instance.price_per_hour / 3600)
    if shares:
        row.memory_share = max(share for share, _ in shares)
        row.fits = all(fits for _, fits in shares)


def served_model(facts: RunFacts) -> dict[str, float] | None:
    """The model serving runs: the torch model with the most inference FLOPs per sample."""
    served = [model for model in facts.models.values() if not math.isnan(model.get("infer_flops_per_sample",
                                                                                   math.nan))]
    return max(served, key=lambda model: model["infer_flops_per_sample"]) if served else None


def _serve(row: Row, facts: RunFacts, gpus: dict[str, GPU]) -> None:
    model = served_model(facts)
    if model is None:
        return
    instance = row.instance
    workload = _workload(facts, model, "serve")
    found = estimate(workload, instance.gpu, gpus, instance.vcpus, facts.tf32)
    single = estimate(workload.at_batch(1), instance.gpu, gpus, instance.vcpus, facts.tf32)
    row.serve_per_s = found.samples_per_s.scaled(instance.gpu_count)  # one replica per GPU
    row.latency_ms = single.samples_per_s.inverse().scaled(1000)
    row.serve_cost_per_million = row.serve_per_s.inverse().scaled(1e6 * instance.price_per_hour / 3600)
    if math.isnan(row.memory_share):
        row.memory_share, row.fits = found.memory_share, found.fits
    if not row.train_bound:
        row.train_bound = found.bound


def recommend(rows: list[Row]) -> dict[str, Row | None]:
    """Training: the cheapest run that fits, and the fastest within 1.5x of its cost; serving: the cheapest per
    million predictions that fits. Instances without a known price are not recommended."""
    priced = [row for row in rows if row.fits and not math.isnan(row.instance.price_per_hour)]
    picks: dict[str, Row | None] = {"train_cheapest": None, "train_fastest": None, "serve_cheapest": None}
    trained = [row for row in priced if row.train_cost is not None]
    if trained:
        cheapest = min(trained, key=lambda row: row.train_cost.expected)
        within = [row for row in trained if row.train_cost.expected <= 1.5 * cheapest.train_cost.expected]
        picks["train_cheapest"] = cheapest
        picks["train_fastest"] = min(within, key=lambda row: row.train_seconds.expected)
    served = [row for row in priced if row.serve_cost_per_million is not None]
    if served:
        picks["serve_cheapest"] = min(served, key=lambda row: row.serve_cost_per_million.expected)
    return picks


def actions(facts: RunFacts, rows: list[Row], picks: dict[str, Row | None], gpus: dict[str, GPU]) -> list[str]:
    """What the measurements call for, each with its number."""
    lines = []
    for name, model in facts.models.items():
        wait = model.get("data_wait_share", 0.0)
        if wait > DATA_WAIT_ACTION:
            lines.append(f"{name}: data-wait share {100 * wait:.0f} % (measured): add loader workers "
                         "(train.workers) or keep the data on the device (data.in_memory)")
    if facts.gpu is not None and not math.isnan(facts.gpu_utilisation) and facts.gpu_utilisation < LOW_UTILISATION:
        here = [row for row in rows if row.instance.gpu.name == facts.gpu and row.train_seconds is not None]
        cheaper = _cheaper_alike(rows, here[0]) if here else None
        lines.append(f"GPU utilisation {facts.gpu_utilisation:.0f} % on {facts.gpu} (measured)" +
                     (f": {cheaper.instance.gpu.name} ({cheaper.instance.name}) gives about the same time at "
                      f"{cheaper.instance.price_per_hour / here[0].instance.price_per_hour:.0%} of the price "
                      "(estimated)" if cheaper else ": a smaller GPU would do"))
    pick = picks.get("train_cheapest")
    if pick is not None:
        if pick.memory_share > HIGH_MEMORY:
            lines.append(f"peak memory {100 * pick.memory_share:.0f} % of the {pick.instance.gpu.name}'s (estimated):"
                         " the next larger GPU or a smaller batch")
        if pick.train_seconds is not None and facts.cpu_parts:
            share, vcpus = _cpu_share(facts, pick), _vcpus_to_match(facts, pick)
            advice = (f"an instance with at least {vcpus} vCPUs keeps it below the GPU's time"
                      if share > CPU_SHARE_ACTION and vcpus > pick.instance.vcpus else
                      f"its {pick.instance.vcpus} vCPUs suffice (it needs {vcpus} to stay below the GPU's time)")
            lines.append(f"CPU-side work ({', '.join(facts.cpu_parts)}: {_seconds(facts)} s on {facts.cores} cores, "
                         f"measured) is {100 * share:.0f} % of the run on {pick.instance.name} (estimated): "
                         f"{advice}")
        lines.append(_data_parallel_line(facts, pick.instance.gpu, gpus))
    return [line for line in lines if line]


def _cheaper_alike(rows: list[Row], here: Row) -> Row | None:
    """The cheapest instance whose expected training time is within 10 % of `here`'s."""
    alike = [row for row in rows if row.fits and row.train_seconds is not None and row.instance.gpu_count == 1 and
             row.train_seconds.expected <= 1.1 * here.train_seconds.expected and
             row.instance.price_per_hour < here.instance.price_per_hour]
    return min(alike, key=lambda row: row.instance.price_per_hour) if alike else None


def _cpu_share(facts: RunFacts, row: Row) -> float:
    cpu = sum(cpu_seconds(part.get("seconds", 0.0), bool(part.get("parallel")), facts.cores,
                          row.instance.vcpus).expected for part in facts.cpu_parts.values())
    return cpu / row.train_seconds.expected if row.train_seconds.expected else 0.0


def _seconds(facts: RunFacts) -> str:
    return f"{sum(part.get('seconds', 0.0) for part in facts.cpu_parts.values()):.2g}"


def _vcpus_to_match(facts: RunFacts, row: Row) -> int:
    """The vCPUs at which the parallel CPU-side parts take no longer than the GPU's share of the run."""
    gpu_seconds = row.train_seconds.expected * (1 - _cpu_share(facts, row))
    parallel = sum(part.get("seconds", 0.0) for part in facts.cpu_parts.values() if part.get("parallel"))
    return max(1, math.ceil(parallel * facts.cores / max(gpu_seconds, 1e-9)))


def _data_parallel_line(facts: RunFacts, gpu: GPU, gpus: dict[str, GPU]) -> str:
    """The speed-up of 2 GPUs of this kind with DDP: the step's time against the gradients' all-reduce."""
    model = max(facts.models.values(), key=lambda model: model.get("samples_per_epoch", 0) *
                model.get("train_flops_per_sample", 0))
    workload = _workload(facts, model, "train")
    step = workload.batch_size / estimate(workload, gpu, gpus, tf32=facts.tf32).samples_per_s.expected
    link = NVLINK_GBS if "SXM" in gpu.name else PCIE_GBS
    all_reduce = workload.weight_bytes / (link * 1e9)  # a ring all-reduce of 2 GPUs sends the gradients once
    speedup = 2 * step / (step + all_reduce)
    return (f"2 GPUs ({gpu.name}): expected speed-up {speedup:.1f}x with DDP at this step time "
            f"({1000 * step:.1f} ms a step, {1000 * all_reduce:.1f} ms to all-reduce the gradients; estimated)")


def calibrated(facts: RunFacts, gpu_run: RunFacts) -> RunFacts:
    """A CPU run's facts with the training rates another run of the same models measured on a GPU."""
    models = {name: {**model, **{key: value for key, value in gpu_run.models.get(name, {}).items()
                                 if key.startswith("measured_")}} for name, model in facts.models.items()}
    return replace(facts, models=models, gpu=gpu_run.gpu, gpu_count=gpu_run.gpu_count)


def load_catalogue(catalog: Path | None) -> tuple[dict[str, GPU], list[Instance]]:
    gpus = load_gpus()
    return gpus, load_instances(gpus, catalog)
