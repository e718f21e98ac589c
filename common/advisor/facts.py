"""What a run measured, as `usecases advise` reads it: from MLflow (the workload facts of
`common.training.workload`, the data's size, the presets' checkpoint interval) or from a user's `--workload` file.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from common.advisor.catalog import GPU, match_gpu
from common.errors import UserError


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
    usecase: str | None = None
    preset: str | None = None
    data_bytes: float = math.nan  # the data set as stored (the `data_bytes` tag)
    data_samples: float = math.nan  # the samples it holds (`data_samples`)
    checkpoint_every: dict[str, int] = field(default_factory=dict)  # epochs between checkpoints, per model
    scaled: bool = False  # to another data set's size than the run's (--data-gb)

    @property
    def bytes_per_sample(self) -> float:
        return self.data_bytes / self.data_samples if self.data_samples > 0 else math.nan

    def scaled_to(self, data_gb: float) -> RunFacts:
        """The same run on a data set of `data_gb` GB stored alike: each epoch's samples and the run's samples
        grow with it, the per-sample facts stay (a one-line error where the run did not log its data's size)."""
        if not self.data_bytes > 0:
            if self.run_id is None:
                raise UserError("--data-gb: the workload file gives no data_gb (the data set's size it describes)")
            raise UserError(f"--data-gb: run {self.run_id} logged no data size (tag data_bytes): run it again with "
                            "this version of the project")
        factor = data_gb * 1e9 / self.data_bytes
        models = {name: {**model, **{key: model[key] * factor for key in ("samples_per_epoch", "trained_samples")
                                     if key in model}} for name, model in self.models.items()}
        return replace(self, models=models, data_bytes=data_gb * 1e9, data_samples=self.data_samples * factor,
                       scaled=True)


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
                    sum(utilisation) / len(utilisation) if utilisation else math.nan, usecase=usecase,
                    preset=tags.get("preset"), data_bytes=_number(tags.get("data_bytes")),
                    data_samples=_number(tags.get("data_samples")),
                    checkpoint_every={name: int(params.get(f"{name}.checkpoint_every") or
                                                params.get("train.checkpoint_every") or 0) for name in models})


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
    if "checkpoint_every" in spec and not (isinstance(spec["checkpoint_every"], int) and spec["checkpoint_every"] >= 1):
        raise UserError(f"{path}: checkpoint_every must be a whole number of epochs, at least 1 (got "
                        f"{spec['checkpoint_every']!r})")
    if ("data_gb" in spec) != ("samples" in spec):
        raise UserError(f"{path}: data_gb and samples go together (the data set's size and the samples it holds)")
    model["weight_bytes"] = float(spec.get("weight_bytes", 0.0))  # the gradients DDP all-reduces
    precision = "auto" if spec["precision"] == "amp" else spec["precision"]
    return RunFacts(None, {"workload": model}, gpu=gpu, gpu_count=1 if gpu else 0, precision=precision,
                    tf32=spec["precision"] == "tf32", task=spec["task"],
                    data_bytes=float(spec.get("data_gb", math.nan)) * 1e9,
                    data_samples=float(spec.get("samples", math.nan)),
                    checkpoint_every={"workload": int(spec.get("checkpoint_every", 0))})


def calibrated(facts: RunFacts, gpu_run: RunFacts) -> RunFacts:
    """A CPU run's facts with the training rates another run of the same models measured on a GPU."""
    models = {name: {**model, **{key: value for key, value in gpu_run.models.get(name, {}).items()
                                 if key.startswith("measured_")}} for name, model in facts.models.items()}
    return replace(facts, models=models, gpu=gpu_run.gpu, gpu_count=gpu_run.gpu_count)
