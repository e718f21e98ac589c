"""The CLI's contract: help everywhere, exit 2 and one line for user mistakes, no run left RUNNING."""

import pytest
import torch

from tests.cli_helpers import runs, usecases


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["list", "--help"], ["ui", "--help"],
                                  ["demo", "--help"]])
def test_help(args):
    result = usecases(*args)
    assert result.returncode == 0 and "usage: usecases" in result.stdout


def test_list_names_every_use_case_with_its_presets():
    result = usecases("list")
    assert result.returncode == 0
    assert "finance" in result.stdout and "[presets: default, full, smoke]" in result.stdout


def user_error(*args):
    result = usecases(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_unknown_use_case():
    assert "unknown use case 'weather'" in user_error("run", "weather")


def test_unknown_config_key():
    assert "unknown config key 'train.epoch'" in user_error("run", "finance", "--preset", "smoke",
                                                           "--set", "train.epoch=3")


def test_wrong_type():
    assert "config key 'train.epochs'" in user_error("run", "finance", "--preset", "smoke",
                                                    "--set", "train.epochs=many")


def test_unknown_preset():
    assert "no such preset" in user_error("run", "finance", "--preset", "huge")


def test_missing_data_path(tmp_path):
    assert "no such file or folder" in user_error("run", "finance", "--data", str(tmp_path / "nope.csv"))


def test_bad_device_choice_is_an_argparse_error():
    result = usecases("run", "finance", "--device", "tpu")
    assert result.returncode == 2 and "invalid choice" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu():
    assert "no CUDA GPU" in user_error("run", "finance", "--preset", "smoke", "--device", "cuda")


def test_resume_without_a_checkpoint():
    assert "no interrupted run" in user_error("run", "finance", "--preset", "smoke", "--resume")


def test_user_errors_leave_no_run_behind():
    user_error("run", "finance", "--preset", "smoke", "--set", "train.epoch=3")
    assert [run.info.status for run in runs()] == []
