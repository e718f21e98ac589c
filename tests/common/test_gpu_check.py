"""`make gpu-check`: its plan, its time budget, its reports, and its one line on a machine without a GPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from common.tools import gpu_check
from common.config import ConfigModel
from common.usecase import UseCase
from tests.cli_helpers import in_process


def usecase(name: str, benchmark: bool, primary=("score", "max")) -> UseCase:
    return UseCase(name, f"plugins.{name}", "a test use case", ConfigModel, Path("/nowhere") / name, primary,
                   has_benchmark=benchmark)


CASES = [usecase("alpha", True), usecase("beta", False, ("loss", "min"))]


def test_the_plan_runs_doctor_the_gpu_tests_every_default_run_and_every_benchmark():
    names = [step.name for step in gpu_check.plan(CASES, python="py")]
    assert names == ["doctor", "gpu tests", "run alpha", "run beta", "bench alpha"]
    run_step = gpu_check.plan(CASES, python="py")[2]
    assert run_step.command == ["py", "-m", "usecases", "run", "alpha", "--preset", "default", "--device", "cuda"]


def test_a_use_case_with_its_own_server_gets_the_serving_bench_after_its_run(monkeypatch):
    monkeypatch.setattr(UseCase, "server", lambda case: object() if case.name == "beta" else None)
    steps = gpu_check.plan(CASES, python="py")
    assert [step.name for step in steps][-1] == "serve beta"
    assert steps[-1].command == ["py", "-m", "usecases", "bench", "beta", "--serve", "--batch-ms", "2"]


def test_a_use_case_with_a_slides_preset_gets_the_whole_slide_bench_and_its_row(tmp_path):
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "slides-smoke.yaml").write_text("{}\n")
    slides = UseCase("gamma", "plugins.gamma", "a test use case", ConfigModel, tmp_path, ("auc", "max"),
                     has_benchmark=True)
    steps = gpu_check.plan([*CASES, slides], python="py")
    assert [step.name for step in steps][-3:] == ["bench alpha", "bench gamma", "bench gamma --slides"]
    assert steps[-1].command == ["py", "-m", "usecases", "bench", "gamma", "--slides", "--preset", "slides-smoke",
                                 "--device", "cuda", "--set", "benchmark.gigapixel=false"]
    summary = {"models": {"pipeline": {"speedup": 4.0}, "plain_loop": {"speedup": 1.0}}}
    gpu_check.execute(steps[-1:], budget_s=100, run=fake_runner({"bench gamma": (0, summary)}, []))
    assert steps[-1].summary == summary, "its summary is kept, as a run's is"
    (row,) = gpu_check.markdown_rows(steps[-1:], "GPU", {"gamma": ("auc", "max")})[2:]
    assert row == ("| GPU | gamma | `usecases bench gamma --slides --preset slides-smoke --device cuda --set "
                   "benchmark.gigapixel=false` | speedup 4.00x over the plain loop | 0 s |")


def fake_runner(outcomes: dict[str, tuple[int, dict]], timeouts: list[float]):
    """Answers each command as `outcomes` says, writing its summary where `--summary` points."""

    def run(command, capture_output, text, timeout):
        timeouts.append(timeout)
        key = " ".join(command[3:5]) if command[1:3] == ["-m", "usecases"] else "pytest"
        code, summary = outcomes.get(key, (0, {}))
        if "--summary" in command and summary:
            Path(command[command.index("--summary") + 1]).write_text(json.dumps(summary))
        if code == 124:
            raise subprocess.TimeoutExpired(command, timeout)
        return subprocess.CompletedProcess(command, code, "out", "err")

    return run


def test_each_run_gets_at_most_its_share_of_the_budget_and_its_summary_is_kept():
    timeouts = []
    outcomes = {"run alpha": (0, {"models": {"m": {"score": 0.9}, "baseline": {"score": 0.7}}}),
                "run beta": (124, {}), "bench alpha": (0, {"models": {"ours": {"speedup": 2.5}}})}
    steps = gpu_check.execute(gpu_check.plan(CASES), budget_s=100, run=fake_runner(outcomes, timeouts))
    assert [step.returncode for step in steps] == [0, 0, 0, 124, 0]
    assert timeouts[2] == pytest.approx(100 / 3, abs=1) and all(timeout <= 100 for timeout in timeouts)
    assert steps[2].summary["models"]["m"]["score"] == 0.9 and "timed out" in steps[3].output_tail
    rows = gpu_check.markdown_rows(steps, "NVIDIA H200", {case.name: case.primary_metric for case in CASES})
    assert rows[2] == ("| NVIDIA H200 | alpha | `usecases run alpha --preset default --device cuda` | best score "
                       "0.9000 | 0 s |")
    assert "failed (exit 124)" in rows[3] and "speedup 2.50x" in rows[4]


def test_steps_past_the_budget_are_recorded_as_not_run():
    steps = gpu_check.execute(gpu_check.plan(CASES), budget_s=0, run=fake_runner({}, []))
    assert all(step.returncode is None and "budget" in step.output_tail for step in steps)
    rows = gpu_check.markdown_rows(steps, "GPU", {case.name: case.primary_metric for case in CASES})
    assert all("not run" in row for row in rows[2:])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without a GPU")
def test_without_a_gpu_it_is_one_line_and_exit_2(capsys, tmp_path):
    result = in_process(capsys, "gpu-check", "--out", str(tmp_path))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "no CUDA GPU" in result.stderr and list(tmp_path.iterdir()) == []
