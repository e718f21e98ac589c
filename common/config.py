"""Typed configs: a pydantic schema per use case, YAML presets, and `--set a.b=c` overrides; every mistake is one
`UserError` line naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.errors import UserError, one_line

Schema = TypeVar("Schema", bound="ConfigModel")


class ConfigModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RuntimeConfig(ConfigModel):
    """Reproducibility and precision, shared by every use case's schema as its `runtime` section."""

    seed: int = 0
    deterministic: bool | Literal["auto"] = Field(
        "auto", description="deterministic algorithms (bit-identical reruns and resumes); auto: on a CPU, where they "
                            "cost nothing, and not on a GPU, where cuDNN then picks its fastest algorithms per shape "
                            "(the run's tags say which it got)")
    precision: Literal["auto", "auto-gpu", "fp32", "bf16", "fp16"] = Field(
        "auto-gpu", description="auto: mixed precision wherever the device computes it natively (a GPU; a CPU with "
                                "AVX512-BF16 or AMX), else fp32; auto-gpu: mixed precision on a GPU, fp32 on any CPU")
    cpu_threads: int | None = Field(None, ge=1, description="torch intra-op threads on CPU; null keeps torch's")
    tf32: bool = Field(False, description="fp32 matrix products on TF32 tensor cores (GPUs of compute capability 8+)")
    compile: bool = Field(False, description="torch.compile the trained model; its warm-up epoch is left out of "
                                             "the logged throughput")
    engine: Literal["pandas", "dask", "auto"] = Field(
        "pandas", description="where per-series and data work runs: this process, or a Dask cluster "
                              "(common/runtime/engine.py); auto: Dask when the use case finds its data large (its README "
                              "says above what) and Dask is installed")
    cluster: str | None = Field(None, description="Dask scheduler address, e.g. tcp://10.0.0.5:8786; null: "
                                                  "$DASK_SCHEDULER_ADDRESS, else a local cluster")
    workers: int | None = Field(None, ge=1, description="processes of the local Dask cluster; null: one per core")


class TrainConfig(ConfigModel):
    """What the common training loop reads; a use case's `train` section extends it with its own keys."""

    epochs: int = Field(100, ge=1)
    batch_size: int = Field(128, ge=1)
    lr: float = Field(1e-3, gt=0)
    patience: int | None = Field(None, ge=1, description="stop after this many epochs without a better validation "
                                                          "metric; null trains every epoch")
    grad_clip: float | None = Field(None, gt=0, description="clip the gradient norm to this; null: no clipping")
    checkpoint_every_s: float = Field(300, ge=0, description="seconds of a fit between checkpoints, for --resume (0: "
                                      "after every epoch); a fit shorter than this writes none and is trained again "
                                      "on a resume")
    validate_every: int = Field(1, ge=1, description="epochs between validations (the last epoch is always "
                                                     "validated); early stopping and the best epoch see only these")


class TrackingConfig(ConfigModel):
    """What the run cannot detect about its machine, as tags: so runs compare by instance type and by cost."""

    instance_type: str | None = Field(None, description="e.g. g5.xlarge; a tag for `usecases compare`")
    price_per_hour: float | None = Field(None, ge=0, description="the machine's price per hour, for the run's cost")


def available_presets(presets_dir: Path) -> list[str]:
    return sorted(path.stem for path in presets_dir.glob("*.yaml"))


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set {item}: expected key=value, for example train.epochs=5")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise UserError(f"--set {item}: the value is not valid YAML (quote it, or write a list as [a, b])") from None
    if not isinstance(value, (list, dict)) and value is not None:
        value = raw  # scalars stay text so the schema, not YAML, decides their type
    return key.strip().split("."), value


def _set_nested(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        if node.get(part) is None:
            node[part] = {}
        if not isinstance(node[part], dict):
            raise UserError(f"config key '{'.'.join(path)}': '{part}' is a value, not a section")
        node = node[part]
    node[path[-1]] = value


def _field_names(schema: type[BaseModel], parent: tuple) -> list[str]:
    model: Any = schema
    for part in parent:
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return sorted(model.model_fields)


def _explain(error: ValidationError, schema: type[BaseModel]) -> str:
    first = error.errors()[0]
    location = tuple(str(part) for part in first["loc"])
    key = ".".join(location)
    if first["type"] == "extra_forbidden":
        known = ", ".join(_field_names(schema, location[:-1]))
        return f"unknown config key '{key}' (expected one of: {known})"
    if not location:  # a check across keys (a model validator): its message names them
        return f"config: {first['msg'].removeprefix('Value error, ')}"
    return f"config key '{key}': {first['msg'].lower()} (got {first['input']!r})"


def load_config(schema: type[Schema], presets_dir: Path, preset: str, overrides: list[str] = ()) -> Schema:
    path = presets_dir / f"{preset}.yaml"
    if not path.is_file():
        raise UserError(f"--preset {preset}: no such preset (available: {', '.join(available_presets(presets_dir))})")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({one_line(exc)})") from None
    if not isinstance(tree, dict):
        raise UserError(f"{path}: expected a mapping of config sections at the top level")
    for item in overrides:
        _set_nested(tree, *_parse_override(item))
    try:
        return schema.model_validate(tree)
    except ValidationError as exc:
        raise UserError(_explain(exc, schema)) from None


def flatten(config: BaseModel | dict, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` as `{"a.b": 1}`, the form MLflow params take."""
    tree = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
