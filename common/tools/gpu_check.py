"""`make gpu-check`: on a machine with a GPU, one command measures everything GPU-side and writes it down.

It runs `usecases doctor --device cuda`, the `gpu` tests, every use case's `default` preset and every benchmark on
the GPU (the whole-slide one too, `usecases bench NAME --slides`, where a use case has its preset; and, for a use
case with its own server, `usecases bench NAME --serve` on the champion the run registered), one after another
within a time budget (each step gets what is left, at most its share), and writes `gpu-report.json` (every step's
outcome, the doctor's lines, each run's summary) and `gpu-report.md` (the rows the READMEs' GPU tables take).
Without a GPU it says so in one line and exits 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.config import available_presets
from common.usecase import RunRequest, UseCase

DEFAULT_BUDGET_S = 480  # the 8 minutes a lent GPU machine leaves for measuring, after its start
SLIDES_PRESET = "slides-smoke"  # a use case with this preset has a whole-slide benchmark (`bench NAME --slides`)


@dataclass
class Step:
    name: str
    command: list[str]
    returncode: int | None = None
    seconds: float = 0.0
    output_tail: str = ""
    summary: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.returncode == 0


def plan(usecases: list[UseCase], python: str = sys.executable) -> list[Step]:
    """The steps, cheapest and most telling first: doctor, the gpu tests, each default run, each benchmark, each
    use case's own server against MLflow's."""
    cli = [python, "-m", "usecases"]
    steps = [Step("doctor", [*cli, "doctor", "--device", "cuda"]),
             Step("gpu tests", [python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"])]
    steps += [Step(f"run {case.name}", [*cli, *RunRequest(case, device="cuda").command_line()])
              for case in usecases]
    steps += [Step(f"bench {case.name}", [*cli, *RunRequest(case, device="cuda", bench=True).command_line()])
              for case in usecases if case.has_benchmark]
    steps += [Step(f"bench {case.name} --slides", [*cli, "bench", case.name, "--slides", "--preset", SLIDES_PRESET,
                                                   "--device", "cuda", "--set", "benchmark.gigapixel=false"])
              # tiles/s on the GPU; writing the gigapixel slide (minutes on one core) would spend the step's share
              for case in usecases if case.has_benchmark and SLIDES_PRESET in available_presets(case.presets_dir)]
    steps += [Step(f"serve {case.name}", [*cli, "bench", case.name, "--serve", "--batch-ms", "2"])  # the champion
              # the run registered, scored on the GPU one request at a time and micro-batched
              for case in usecases if case.server() is not None]
    return steps


def execute(steps: list[Step], budget_s: float, run: Callable = subprocess.run) -> list[Step]:
    """Each step with a timeout of its share of what is left of the budget; a step past it is recorded as such."""
    deadline = time.monotonic() + budget_s
    with tempfile.TemporaryDirectory() as folder:
        for index, step in enumerate(steps):
            _execute_one(step, deadline, len(steps) - index, Path(folder) / f"summary{index}.json", run)
    return steps


def _execute_one(step: Step, deadline: float, steps_left: int, summary_file: Path, run: Callable) -> None:
    """One step, with a timeout of at most its share of what is left; its summary kept when it wrote one."""
    left = deadline - time.monotonic()
    if left <= 1:
        step.output_tail = "not run: the time budget was spent"
        return
    share = left / steps_left if step.name.startswith(("run ", "bench ", "serve ")) else left
    command = [*step.command, "--summary", str(summary_file)] if "--preset" in step.command else step.command
    started = time.monotonic()
    try:
        result = run(command, capture_output=True, text=True, timeout=max(share, 1))
        step.returncode, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as expired:
        step.returncode, output = 124, f"timed out after {share:.0f} s\n{expired.stdout or ''}"
    step.seconds = time.monotonic() - started
    step.output_tail = (output if isinstance(output, str) else output.decode(errors="replace"))[-4000:]
    if summary_file.is_file():
        step.summary = json.loads(summary_file.read_text())


def markdown_rows(steps: list[Step], gpu: str, primary: dict[str, tuple[str, str]]) -> list[str]:
    """`| GPU | use case | command | primary metric | wall time |` rows for the use case READMEs' GPU tables."""
    rows = ["| GPU | use case | command | result | wall time |", "| --- | --- | --- | --- | --- |"]
    for step in steps:
        if not step.name.startswith(("run ", "bench ")):
            continue
        kind, name = step.name.split()[:2]
        if not step.passed:
            result = "not run" if step.returncode is None else f"failed (exit {step.returncode})"
        elif kind == "run":
            metric, mode = primary[name]
            scores = [values[metric] for values in step.summary.get("models", {}).values() if metric in values]
            result = f"best {metric} {(max if mode == 'max' else min)(scores):.4f}" if scores else "ok"
        else:
            speedups = [value for values in step.summary.get("models", {}).values() for key, value in values.items()
                        if key.endswith("speedup") and value != 1.0]
            result = f"speedup {speedups[0]:.2f}x over the plain loop" if speedups else "ok"
        rows.append(f"| {gpu} | {name} | `usecases {' '.join(step.command[3:])}` | {result} | {step.seconds:.0f} s |")
    return rows


def gpu_check(usecases: list[UseCase], out: Path, budget_s: float = DEFAULT_BUDGET_S,
              run: Callable = subprocess.run) -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU visible to torch on this machine; run it where there is one "
              "(usecases doctor says why)", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0)
    steps = execute(plan(usecases), budget_s, run)
    out.mkdir(parents=True, exist_ok=True)
    report = {"gpu": gpu, "gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "budget_s": budget_s, "steps": [asdict(step) for step in steps]}
    (out / "gpu-report.json").write_text(json.dumps(report, indent=2, allow_nan=True) + "\n")
    rows = markdown_rows(steps, gpu, {case.name: case.primary_metric for case in usecases})
    (out / "gpu-report.md").write_text("\n".join(rows) + "\n")
    for step in steps:
        state = "ok" if step.passed else ("not run" if step.returncode is None else f"exit {step.returncode}")
        print(f"{step.name:20} {state:10} {step.seconds:6.0f} s", flush=True)
    print(f"gpu-check: wrote {out / 'gpu-report.json'} and {out / 'gpu-report.md'}")
    return 0 if all(step.passed for step in steps) else 1
