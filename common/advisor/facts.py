"""What a run measured, as `usecases advise` reads it: from MLflow (the workload facts of
`common.training.workload`, the run's phases of `common.runtime.phases`, the data's size, the checkpoint interval)
or from a user's `--workload` file; and as JSON, so that a run's facts can be kept and advised on without its store:

    .venv/bin/python -m common.advisor.facts RUN_ID facts.json     # with MLFLOW_TRACKING_URI pointing at its store
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import KW_ONLY, dataclass, field, fields, replace
from datetime import datetime, timezone
from pathlib import Path

from common.advisor.catalog import GPU, load_gpus, match_gpu
from common.errors import UserError
from common.runtime.phases import SCALES, TAG, Phase

@dataclass
class RunFacts:
    """What a run measured, as `advise` reads it from MLflow (or a user's `--workload` file)."""

    run_id: str | None
    models: dict[str, dict[str, float]]  # per torch model, its `model/<name>/` facts
    phases: dict[str, Phase] = field(default_factory=dict)  # `time/<phase>_s` and how each scales
    _: KW_ONLY  # many fields of like types: by name only
    cores: int = 1
    gpu: str | None = None  # the catalogue's name of the GPU it ran on, None on a CPU
    rates_gpu: str | None = None  # the GPU another run of its preset measured its training rates on (`calibrated`)
    gpu_count: int = 0
    precision: str = "auto"
    tf32: bool = False
    total_seconds: float = math.nan
    gpu_utilisation: float = math.nan  # percent, mean over the run
    task: str = "both"
    usecase: str | None = None
    preset: str | None = None
    data_bytes: float = math.nan  # the data set as stored (the `data_bytes` tag)
    data_samples: float = math.nan  # the samples it holds (`data_samples`)
    checkpoint_every_s: dict[str, float] = field(default_factory=dict)  # seconds of a fit between checkpoints
    data_scale: float = 1.0  # the data set advised on over the run's (--data-gb)
    probed: bool = True  # trained through the common loop, its operators counted: the host's cost applies

    @property
    def scaled(self) -> bool:
        return self.data_scale != 1.0

    @property
    def bytes_per_sample(self) -> float:
        return self.data_bytes / self.data_samples if self.data_samples > 0 else math.nan

    def scaled_to(self, data_gb: float) -> RunFacts:
        """The same run on a data set of `data_gb` GB stored alike: each epoch's samples and the run's samples grow
        with it (so do the torch models' steps), the per-sample facts stay, and so do the phases as measured (how a
        fit's validation, a baseline, an evaluation or the data's loading grows with the data is the use case's: a
        small run's fixed costs scaled up would swamp the answer). A one-line error where the run did not log its
        data's size."""
        if not self.data_bytes > 0:
            if self.run_id is None:
                raise UserError("--data-gb: the workload file gives no data_gb (the data set's size it describes)")
            raise UserError(f"--data-gb: run {self.run_id} logged no data size (tag data_bytes): run it again with "
                            "this version of the project")
        factor = data_gb * 1e9 / self.data_bytes
        models = {name: {**model, **{key: model[key] * factor for key in ("samples_per_epoch", "trained_samples")
                                     if key in model}} for name, model in self.models.items()}
        return replace(self, models=models, data_bytes=data_gb * 1e9, data_samples=self.data_samples * factor,
                       data_scale=self.data_scale * factor)

    def as_json(self) -> dict:
        """The facts as JSON values (NaN as null), read back by `from_json`."""
        values = {item.name: getattr(self, item.name) for item in fields(self)}
        values["phases"] = {name: {"seconds": phase.seconds, "scales": phase.scales}
                            for name, phase in self.phases.items()}
        return _nulls(values)

    @classmethod
    def from_json(cls, values: dict) -> RunFacts:
        known = {item.name for item in fields(cls)}
        values = {key: (math.nan if value is None and key in _NUMBERS else value) for key, value in values.items()
                  if key in known}
        values["models"] = {name: {key: (math.nan if number is None else float(number))
                                   for key, number in model.items()} for name, model in values["models"].items()}
        values["phases"] = {name: Phase(float(phase["seconds"]), phase["scales"])
                            for name, phase in values.get("phases", {}).items()}
        return cls(**values)


_NUMBERS = ("total_seconds", "gpu_utilisation", "data_bytes", "data_samples")


def _nulls(value):
    if isinstance(value, dict):
        return {key: _nulls(item) for key, item in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


def facts_from_run(run, usecase: str, gpus: dict[str, GPU]) -> RunFacts:
    """The facts of an MLflow run; a run without them is one line saying what to run first."""
    metrics, params, tags = run.data.metrics, run.data.params, run.data.tags
    models: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        if found := re.fullmatch(r"model/([^/]+)/(.+)", key):
            models.setdefault(found.group(1), {})[found.group(2)] = value
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
    return RunFacts(run.info.run_id, models, _phases(metrics, tags), cores=int(tags.get("cpu_cores", "1") or 1),
                    gpu=gpu, gpu_count=world if gpu else 0, precision=params.get("runtime.precision", "auto"),
                    tf32=params.get("runtime.tf32", "False") == "True",
                    total_seconds=metrics.get("time/total_s", math.nan),
                    gpu_utilisation=sum(utilisation) / len(utilisation) if utilisation else math.nan, usecase=usecase,
                    preset=tags.get("preset"), data_bytes=_number(tags.get("data_bytes")),
                    data_samples=_number(tags.get("data_samples")),
                    checkpoint_every_s={name: _checkpoint_every_s(params, name) for name in models})


def _phases(metrics: dict[str, float], tags: dict[str, str]) -> dict[str, Phase]:
    """The run's phases (`time_phases` tag and `time/<phase>_s` metrics); none for a run logged before them."""
    try:
        scales = json.loads(tags.get(TAG) or "{}")
    except ValueError:
        return {}
    return {name: Phase(metrics[f"time/{name}_s"], how) for name, how in scales.items()
            if how in SCALES and f"time/{name}_s" in metrics}


def _checkpoint_every_s(params: dict[str, str], name: str) -> float | None:
    """Seconds of a fit between its checkpoints, from the model's own key or the common one; None where unknown."""
    value = params.get(f"{name}.checkpoint_every_s") or params.get("train.checkpoint_every_s")
    number = _number(value)
    return None if math.isnan(number) else number


def _number(text: str | None) -> float:
    try:
        return float(text) if text else math.nan
    except ValueError:
        return math.nan


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
    for key in ("data_gb", "samples", "weight_bytes"):
        if key in spec and not (isinstance(spec[key], (int, float)) and spec[key] > 0):
            raise UserError(f"{path}: {key} must be a positive number (got {spec[key]!r})")
    every = spec.get("checkpoint_every_s")
    if "checkpoint_every_s" in spec and not (isinstance(every, (int, float)) and not isinstance(every, bool) and
                                             every >= 0):
        raise UserError(f"{path}: checkpoint_every_s must be a number of seconds, 0 or more (got {every!r})")
    if ("data_gb" in spec) != ("samples" in spec):
        raise UserError(f"{path}: data_gb and samples go together (the data set's size and the samples it holds)")
    model["weight_bytes"] = float(spec.get("weight_bytes", 0.0))  # the gradients DDP all-reduces
    precision = "auto" if spec["precision"] == "amp" else spec["precision"]
    return RunFacts(None, {"workload": model}, gpu=gpu, gpu_count=1 if gpu else 0, precision=precision,
                    tf32=spec["precision"] == "tf32", task=spec["task"],
                    data_bytes=float(spec.get("data_gb", math.nan)) * 1e9,
                    data_samples=float(spec.get("samples", math.nan)),
                    checkpoint_every_s={"workload": None if every is None else float(every)}, probed=False)


def calibrated(facts: RunFacts, gpu_run: RunFacts) -> RunFacts:
    """A CPU run's facts with what another run of the same models measured on a GPU: the training rates its steps
    are scaled from, and the input pipeline's rate with the cores it had there; its phases stay the CPU run's,
    timed on its machine."""
    models = {}
    for name, model in facts.models.items():
        there = gpu_run.models.get(name, {})
        models[name] = {**model, **{key: value for key, value in there.items() if key.startswith("measured_")}}
        if "loader_samples_per_s" in there:
            models[name].update(loader_samples_per_s=there["loader_samples_per_s"], loader_cores=gpu_run.cores)
    return replace(facts, models=models, rates_gpu=gpu_run.gpu)


def source_of(run) -> dict:
    """Where a run's facts come from: the run, its use case and preset, the commit, the machine and the date."""
    tags = run.data.tags
    return {"run_id": run.info.run_id, "usecase": tags.get("usecase"), "preset": tags.get("preset"),
            "commit": tags.get("git_commit"), "device": tags.get("device"), "gpu": tags.get("gpu_name"),
            "cpu": tags.get("cpu_model"), "cpu_cores": tags.get("cpu_cores"), "torch": tags.get("torch_version"),
            "date": datetime.fromtimestamp(run.info.start_time / 1000, timezone.utc).isoformat(timespec="seconds")}


def write_facts(path: Path, facts: RunFacts, source: dict, metrics: dict[str, float] | None = None) -> None:
    """The facts as JSON with their source, and any other metrics of the run worth keeping beside them."""
    kept = {"source": source, "metrics": metrics or {}, "facts": facts.as_json()}
    path.write_text(json.dumps(kept, indent=2, allow_nan=False) + "\n")


def read_facts(path: Path) -> tuple[RunFacts, dict]:
    """A run's facts kept by `write_facts`, and the rest of the file (`source`, `metrics`)."""
    kept = json.loads(path.read_text())
    return RunFacts.from_json(kept.pop("facts")), kept


def main(argv: list[str] | None = None) -> int:
    """Keep a run's facts as JSON (from the store MLFLOW_TRACKING_URI names, or --tracking-uri)."""
    import mlflow

    from common.tracking.stores import tracking_uri

    parser = argparse.ArgumentParser(prog="python -m common.advisor.facts", description=main.__doc__)
    parser.add_argument("run_id")
    parser.add_argument("out", type=Path)
    parser.add_argument("--tracking-uri")
    parser.add_argument("--metric", action="append", default=[], metavar="KEY",
                        help="another metric of the run to keep beside the facts (repeat for more)")
    parser.add_argument("--note", help="what the run's tags do not say (uncommitted changes, the machine's load)")
    args = parser.parse_args(argv)
    mlflow.set_tracking_uri(args.tracking_uri or tracking_uri())
    run = mlflow.MlflowClient().get_run(args.run_id)
    usecase = run.data.tags.get("usecase") or "unknown"
    missing = [key for key in args.metric if key not in run.data.metrics]
    if missing:
        parser.error(f"run {args.run_id} has no metric {missing[0]}")
    source = {**source_of(run), **({"note": args.note} if args.note else {})}
    write_facts(args.out, facts_from_run(run, usecase, load_gpus()), source,
                {key: run.data.metrics[key] for key in args.metric})
    print(f"{args.out}: the facts of run {args.run_id} ({usecase})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
