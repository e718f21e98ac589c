"""What a run measured, as `usecases advise` reads it: from an MLflow run (the workload facts of
`common.training.workload`, the phases of `common.runtime.phases`, the data's size, the checkpoint interval) or from
a `--workload` file; and as JSON (`json_safe`, read back by `RunFacts.from_json`)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import KW_ONLY, dataclass, field, fields, is_dataclass, replace
from pathlib import Path

from common.advisor.catalog import GPU, match_gpu
from common.errors import UserError
from common.runtime.phases import SCALES, TAG, Phase


@dataclass
class RunFacts:
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
        """The same run on a data set of `data_gb` GB stored alike: the epochs' samples, so the models' steps, grow
        with it; the phases stay as measured (a small run's fixed costs scaled up would swamp the answer)."""
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


def json_safe(value):
    """A value as JSON has it: a dataclass as its `as_dict()` where it has one, else as its fields; infinity (a spot
    run that never finishes, data read from memory) and NaN (unknown) as null: JSON has neither."""
    if hasattr(value, "as_dict"):
        return json_safe(value.as_dict())
    if is_dataclass(value):
        return {item.name: json_safe(getattr(value, item.name)) for item in fields(value)}
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def facts_from_run(run, usecase: str, gpus: dict[str, GPU]) -> RunFacts:
    """The facts of an MLflow run; a run without them is one line saying what to run first."""
    from common.tracking.advice import trained_samples

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
    gpu = None
    if tags.get("gpu_name", "none") != "none" and tags.get("device", "cpu").startswith("cuda"):
        try:
            gpu = match_gpu(tags["gpu_name"], gpus)
        except UserError:  # a GPU the catalogue does not know: advised as a CPU run would be
            pass
    world = int(tags.get("world_size", "1") or 1)
    for name, model in models.items():
        model["trained_samples"] = trained_samples(run.info.run_id, name)
        if gpu is not None and "train_samples_per_s" in model:
            model["measured_train_samples_per_s"] = model["train_samples_per_s"] / world
    utilisation = [value for key, value in metrics.items() if re.fullmatch(r"system/gpu_\d+_utilization_percentage",
                                                                            key)]
    return RunFacts(run.info.run_id, models, _phases(metrics, tags), cores=int(tags.get("cpu_cores", "1") or 1),
                    gpu=gpu, gpu_count=world if gpu else 0, precision=params.get("runtime.precision", "auto"),
                    tf32=params.get("runtime.tf32", "False") == "True", usecase=usecase, preset=tags.get("preset"),
                    total_seconds=metrics.get("time/total_s", math.nan), data_bytes=number_of(tags.get("data_bytes")),
                    gpu_utilisation=sum(utilisation) / len(utilisation) if utilisation else math.nan,
                    data_samples=number_of(tags.get("data_samples")),
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
    number = number_of(params.get(f"{name}.checkpoint_every_s") or params.get("train.checkpoint_every_s"))
    return None if math.isnan(number) else number


def number_of(text: str | None) -> float:
    """A tag's or a param's number; NaN where it is absent or none."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


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
    """A CPU run's facts, its phases kept, with the training and input rates another run measured on a GPU."""
    models = {}
    for name, model in facts.models.items():
        there = gpu_run.models.get(name, {})
        models[name] = {**model, **{key: value for key, value in there.items() if key.startswith("measured_")}}
        if "loader_samples_per_s" in there:
            models[name].update(loader_samples_per_s=there["loader_samples_per_s"], loader_cores=gpu_run.cores)
    return replace(facts, models=models, rates_gpu=gpu_run.gpu)
