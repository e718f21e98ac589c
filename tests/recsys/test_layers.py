"""The recsys server stands on the serving layer alone: importing it loads no data loading, training or evaluation
code (what a serving image would otherwise carry and start with)."""

import subprocess
import sys

TRAINING_SIDE = ("usecases.recsys.data", "usecases.recsys.evaluate", "usecases.recsys.train",
                 "usecases.recsys.pipeline", "usecases.recsys.movielens",
                 "common.training")


def loaded_by(module: str) -> list[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def test_importing_the_server_loads_no_training_side_module():
    loaded = loaded_by("usecases.recsys.server")
    assert "usecases.recsys.serving" in loaded and "usecases.recsys.forms" in loaded
    assert [module for module in loaded if module.startswith(TRAINING_SIDE)] == []


def test_the_training_side_does_load_what_the_check_looks_for():
    """The check above would see the modules it forbids: the pipeline loads them."""
    loaded = loaded_by("usecases.recsys.pipeline")
    assert {"usecases.recsys.data", "usecases.recsys.evaluate", "common.training.loop"} <= set(loaded)
