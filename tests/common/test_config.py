"""`load_config`: presets, typed `--set` overrides, and one-line `UserError`s that name the key."""

from __future__ import annotations

import pytest

from common.config import ConfigModel, RuntimeConfig, available_presets, flatten, load_config
from common.errors import UserError


class Train(ConfigModel):
    epochs: int = 1
    lr: float = 0.1
    amp: bool = False
    sizes: list[int] = [8]
    limit: int | None = 5


class Data(ConfigModel):
    path: str = "data.csv"


class Schema(ConfigModel):
    name: str = "demo"
    train: Train = Train()
    data: Data = Data()
    runtime: RuntimeConfig = RuntimeConfig()


@pytest.fixture
def presets(tmp_path):
    (tmp_path / "default.yaml").write_text("train:\n  epochs: 2\n  lr: 0.01\n")
    (tmp_path / "smoke.yaml").write_text("name: smoke\ntrain:\n  epochs: 1\n  sizes: [2, 3]\n")
    return tmp_path


def load(presets, *overrides, preset="default"):
    return load_config(Schema, presets, preset, list(overrides))


def error_of(presets, *overrides, preset="default") -> str:
    with pytest.raises(UserError) as caught:
        load(presets, *overrides, preset=preset)
    message = str(caught.value)
    assert "\n" not in message, "the CLI prints the error as one line"
    return message


def test_preset_values_over_schema_defaults(presets):
    config = load(presets)
    assert isinstance(config, Schema)
    assert (config.train.epochs, config.train.lr) == (2, 0.01)
    assert config.train.sizes == [8] and config.data.path == "data.csv" and config.name == "demo"
    smoke = load(presets, preset="smoke")
    assert (smoke.name, smoke.train.epochs, smoke.train.sizes) == ("smoke", 1, [2, 3])


def test_available_presets_sorted_by_name(presets):
    assert available_presets(presets) == ["default", "smoke"]


@pytest.mark.parametrize(
    ("override", "read", "expected"),
    [
        ("train.epochs=7", lambda c: c.train.epochs, 7),
        ("train.lr=0.5", lambda c: c.train.lr, 0.5),
        ("train.lr=1e-3", lambda c: c.train.lr, 1e-3),
        ("train.amp=true", lambda c: c.train.amp, True),
        ("train.amp=false", lambda c: c.train.amp, False),
        ("train.sizes=[1,2]", lambda c: c.train.sizes, [1, 2]),
        ("train.limit=null", lambda c: c.train.limit, None),
        ("name=123", lambda c: c.name, "123"),
        ("data.path=other.csv", lambda c: c.data.path, "other.csv"),
        ("runtime.precision=bf16", lambda c: c.runtime.precision, "bf16"),
    ],
)
def test_override_typed_by_the_schema(presets, override, read, expected):
    """Scalars reach the schema as text, so a str field keeps '123' while an int field gets 7."""
    value = read(load(presets, override))
    assert value == expected
    assert type(value) is type(expected)


def test_overrides_apply_in_order(presets):
    assert load(presets, "train.epochs=3", "train.epochs=4").train.epochs == 4


def test_unknown_nested_key_names_dotted_key_and_expected_keys(presets):
    message = error_of(presets, "train.epoch=5")
    assert "'train.epoch'" in message
    assert "amp, epochs, limit, lr, sizes" in message


def test_unknown_section_lists_top_level_keys(presets):
    message = error_of(presets, "trian.epochs=5")
    assert "'trian'" in message
    assert "data, name, runtime, train" in message


def test_unknown_key_in_preset_file_is_a_user_error(presets):
    (presets / "typo.yaml").write_text("train:\n  epohcs: 2\n")
    message = error_of(presets, preset="typo")
    assert "'train.epohcs'" in message and "epochs" in message


@pytest.mark.parametrize(
    ("override", "key", "shown"),
    [
        ("train.epochs=abc", "train.epochs", "abc"),
        ("train.epochs=2.5", "train.epochs", "2.5"),
        ("train.amp=maybe", "train.amp", "maybe"),
        ("train.sizes=[a]", "train.sizes.0", "a"),
        ("runtime.precision=fp8", "runtime.precision", "fp8"),
        ("train=5", "train", "5"),
    ],
)
def test_wrong_type_names_the_key_and_value(presets, override, key, shown):
    message = error_of(presets, override)
    assert f"config key '{key}'" in message
    assert shown in message


def test_value_used_as_section_is_a_user_error(presets):
    message = error_of(presets, "train.epochs.max=3")
    assert "'train.epochs.max'" in message and "'epochs' is a value" in message


def test_unknown_preset_lists_available_ones(presets):
    message = error_of(presets, preset="fast")
    assert "fast" in message and "default, smoke" in message


@pytest.mark.parametrize("override", ["train.epochs", "=5", " =5"])
def test_override_needs_key_and_equals(presets, override):
    assert "expected key=value" in error_of(presets, override)


def test_invalid_preset_yaml_is_a_user_error(presets):
    (presets / "broken.yaml").write_text("train: [1,\n")
    assert "not valid YAML" in error_of(presets, preset="broken")


def test_malformed_yaml_override_is_a_user_error(presets):
    """`--set train.sizes=[1,` should be one UserError line, not a yaml traceback with exit code 1."""
    with pytest.raises(UserError, match="train.sizes"):
        load(presets, "train.sizes=[1,")


def test_flatten_model_as_dotted_json_values(presets):
    flat = flatten(load(presets, "train.limit=null"))
    assert flat["train.epochs"] == 2 and flat["train.sizes"] == [8] and flat["train.limit"] is None
    assert flat["runtime.precision"] == "auto-gpu" and flat["name"] == "demo"
    runtime_keys = {f"runtime.{key}" for key in RuntimeConfig.model_fields}
    assert set(flat) == {
        "name", "train.epochs", "train.lr", "train.amp", "train.sizes", "train.limit", "data.path", *runtime_keys,
    }


def test_flatten_dict_with_prefix():
    assert flatten({"a": {"b": {"c": 1}, "d": [1, 2]}, "e": None}, "cfg.") == {
        "cfg.a.b.c": 1, "cfg.a.d": [1, 2], "cfg.e": None,
    }
