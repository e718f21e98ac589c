"""The `gapped` preset: a synthetic panel whose true variance is known and whose range misses 30 % of it overnight.
Issue 13's scale-bias acceptance, with the two baselines it compares (under a minute on 2 cores; in the slow suite,
which `make test-slow` runs)."""

import pytest

from tests.cli_helpers import preset_summary

pytestmark = pytest.mark.slow
COMPARED = ("gjr_garch_t", "har_rv")  # the correctly specified model and the range one: the other baselines' fits aside


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return preset_summary(tmp_path_factory, "finance", "gapped", f"baselines.models=[{','.join(COMPARED)}]")["models"]


def test_the_neural_model_is_within_ten_percent_of_the_correctly_specified_gjr_t(models):
    assert models["neural"]["qlike_true"] < 1.1 * models["gjr_garch_t"]["qlike_true"]


def test_the_range_variance_model_is_caught(models):
    range_model, oracle = models["har_rv"], models["gjr_garch_t"]["qlike_sq_oracle"]
    assert range_model["scale_sq"] > 1.4 and range_model["qlike_true"] > 20 * models["gjr_garch_t"]["qlike_true"]
    assert range_model["qlike_sq"] - oracle > 10 * (models["neural"]["qlike_sq"] - oracle)
