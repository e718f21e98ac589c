"""The Dask engine's entry: a scheduler that does not answer, or Dask not installed, is one line and no run."""

import sys

import pytest

from tests.cli_helpers import assert_rejected, free_port
from usecases import cli


def test_an_unreachable_cluster_is_one_line_and_no_run(capsys):
    address = f"tcp://127.0.0.1:{free_port()}"
    assert_rejected(capsys, "finance", "run", "finance", "--preset", "smoke", "--cluster", address,
                    names=(f"runtime.cluster {address}", "no Dask scheduler answers there"))


def test_the_dask_engine_without_dask_says_which_extra_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # `import distributed` now fails as if not installed
    assert_rejected(capsys, "finance", "run", "finance", "--preset", "smoke", "--engine", "dask",
                    names=("runtime.engine=dask needs Dask", "gpu-usecases[dask]"))


@pytest.mark.parametrize("options, overrides", [
    ([], []),
    (["--engine", "dask"], ["runtime.engine=dask"]),
    (["--workers", "2"], ["runtime.workers=2", "runtime.engine=dask"]),
    (["--engine", "pandas", "--cluster", "tcp://h:8786"], ["runtime.engine=pandas", "runtime.cluster=tcp://h:8786"]),
])
def test_engine_options_are_the_config_s_runtime_keys(options, overrides):
    args = cli._parser().parse_args(["run", "finance", *options])
    assert cli._engine_overrides(args) == overrides
