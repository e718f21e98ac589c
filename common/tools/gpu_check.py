"""`make gpu-check`: on a machine with a GPU, one command measures everything GPU-side into `gpu-report.json` and
`gpu-report.md` (a row per run and benchmark, and what ran), and the results pages (`usecases report`). A lent machine
is short, so the steps run in priority order, each with a cap (`CAPS`) or its share of what is left: the doctor, every
benchmark, every `default` preset, `bench serve` where a use case has its own server; then the `gpu` tests and the
whole-slide benchmarks. At its cap a run is sent SIGUSR1: it stops at its next safe point and finishes with the models
it measured and a `capped` tag, so that it reaches the results pages; one that does not stop within `GRACE_S` is
killed (its summary, written as it goes, still holds the models it finished)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.config import available_presets
from common.tabular import render_table
from common.usecase import RunRequest, UseCase

DEFAULT_BUDGET_S = 420  # what a 15-minute lease leaves for measuring, after the machine's start and the install
SLIDES_PRESET = "slides-smoke"  # a use case with this preset has a whole-slide benchmark (`bench slides NAME`)
# Seconds a priority step may take at most; their sum for the three use cases fits DEFAULT_BUDGET_S with time to spare
# (a test checks it). The goals on one H200 (issue 31): the three default runs in 15, 45 and 30 s.
CAPS = {"doctor": 30, "bench": 45, "run": 75, "serve": 45}
GRACE_S = 30  # after the cap's signal, for the run to log what it measured and finish


@dataclass
class Step:
    name: str
    command: list[str]
    kind: str = "run"  # a key of CAPS, or "gpu tests" and "slides", run on what the priority steps leave
    returncode: int | None = None
    seconds: float = 0.0
    timeout_s: float = 0.0
    output_tail: str = ""
    summary: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.returncode == 0

    @property
    def priority(self) -> bool:
        return self.kind in CAPS

    @property
    def state(self) -> str:
        if self.returncode is None:
            return "not run"
        if self.returncode == 124:
            return "stopped at its cap" + (" (partial summary)" if self.summary.get("models") else "")
        if self.passed and self.summary.get("capped"):
            return f"capped, finished with {len(self.summary.get('models', {}))} model(s)"
        return "ok" if self.passed else f"exit {self.returncode}"


def plan(usecases: list[UseCase], python: str = sys.executable) -> list[Step]:
    cli = [python, "-m", "usecases"]
    steps = [Step("doctor", [*cli, "doctor", "--device", "cuda"], "doctor")]
    steps += [Step(f"bench {case.name}", [*cli, *RunRequest(case, device="cuda", bench=True).command_line()], "bench")
              for case in usecases if case.has_benchmark]
    steps += [Step(f"run {case.name}", [*cli, *RunRequest(case, device="cuda").command_line()], "run")
              for case in usecases]
    steps += [Step(f"serve {case.name}", [*cli, "bench", "serve", case.name, "--batch-ms", "2"], "serve")
              # the champion the run registered, scored on the GPU one request at a time and micro-batched
              for case in usecases if case.server() is not None]
    steps.append(Step("gpu tests", [python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"], "gpu tests"))
    steps += [Step(f"bench slides {case.name}", [*cli, "bench", "slides", case.name, "--preset", SLIDES_PRESET,
                                                  "--device", "cuda", "--set", "benchmark.gigapixel=false"], "slides")
              # tiles/s on the GPU; writing the gigapixel slide (minutes on one core) would spend the step's share
              for case in usecases if case.has_benchmark and SLIDES_PRESET in available_presets(case.presets_dir)]
    return steps


def run_capped(command: list[str], capture_output: bool = True, text: bool = True,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run` whose timeout is a cap: SIGUSR1 at `timeout`, for the run to finish with what it measured,
    then `subprocess.TimeoutExpired` (the process killed) where it is still going `GRACE_S` later."""
    with subprocess.Popen(command, stdout=subprocess.PIPE if capture_output else None,
                          stderr=subprocess.PIPE if capture_output else None, text=text) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGUSR1)
            try:
                out, err = process.communicate(timeout=GRACE_S)
            except subprocess.TimeoutExpired as expired:
                process.kill()
                expired.stdout, _ = process.communicate()
                raise
        return subprocess.CompletedProcess(command, process.returncode, out, err)


def execute(steps: list[Step], budget_s: float, run: Callable = run_capped,
            clock: Callable[[], float] = time.monotonic) -> list[Step]:
    """Each step with its timeout; a step past it is recorded as stopped, one with no time left as not run."""
    deadline = clock() + budget_s
    with tempfile.TemporaryDirectory() as folder:
        for index, step in enumerate(steps):
            step.timeout_s = timeout_for(step, steps[index:], deadline - clock())
            if step.timeout_s < 1:
                step.output_tail = f"not run: {max(deadline - clock(), 0):.0f} s of the {budget_s:.0f} s budget left"
                continue
            _execute_one(step, Path(folder) / f"summary{index}.json", run, clock)
    return steps


def timeout_for(step: Step, remaining: list[Step], left_s: float) -> float:
    """A priority step: its cap, or its share of what is left by the caps to come; a last step: an equal share."""
    if step.priority:
        caps = sum(CAPS[later.kind] for later in remaining if later.priority)
        return min(CAPS[step.kind], left_s * CAPS[step.kind] / caps)
    return left_s / sum(1 for later in remaining if not later.priority)


def _execute_one(step: Step, summary_file: Path, run: Callable, clock: Callable[[], float]) -> None:
    command = [*step.command, "--summary", str(summary_file)] if "--preset" in step.command else step.command
    started = clock()
    try:
        result = run(command, capture_output=True, text=True, timeout=step.timeout_s)
        step.returncode, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as expired:
        step.returncode, output = 124, f"stopped at its cap of {step.timeout_s:.0f} s\n{expired.stdout or ''}"
    step.seconds = clock() - started
    step.output_tail = (output if isinstance(output, str) else output.decode(errors="replace"))[-4000:]
    if summary_file.is_file():
        step.summary = json.loads(summary_file.read_text())


def markdown_rows(steps: list[Step], gpu: str, primary: dict[str, tuple[str, str]]) -> list[str]:
    """gpu-report.md's table of the runs and benchmarks: each one's best primary metric or speedup."""
    rows = []
    for step in steps:
        if not step.name.startswith(("run ", "bench ")):
            continue
        kind, name = step.name.split()[0], step.name.split()[-1]
        models = step.summary.get("models", {})
        if step.returncode is None:
            result = "not run"
        elif not step.passed and not models:
            result = f"failed (exit {step.returncode})" if step.returncode != 124 else "stopped at its cap"
        elif kind == "run":
            metric, mode = primary[name]
            scores = [values[metric] for values in models.values() if metric in values]
            result = f"best {metric} {(max if mode == 'max' else min)(scores):.4f}" if scores else "ok"
        else:
            speedups = [value for values in models.values() for key, value in values.items()
                        if key.endswith("speedup") and value != 1.0]
            result = f"speedup {speedups[0]:.2f}x over the plain loop" if speedups else "ok"
        if models and not step.passed:
            result = f"{result} (of {', '.join(models)}: {step.state})"
        rows.append([gpu, name, f"`usecases {' '.join(step.command[3:])}`", result, f"{step.seconds:.0f} s"])
    return render_table(rows, ["GPU", "use case", "command", "result", "wall time"]).split("\n")


def step_table(steps: list[Step]) -> list[str]:
    rows = [[step.name, step.state, f"{step.seconds:.0f}", f"{step.timeout_s:.0f}"] for step in steps]
    return render_table(rows, ["step", "outcome", "seconds", "timeout"]).split("\n")


def gpu_check(usecases: list[UseCase], out: Path, budget_s: float = DEFAULT_BUDGET_S,
              run: Callable = run_capped) -> int:
    """0 when every step that ran passed (the last steps may be left for time), 1 otherwise, 2 without a GPU."""
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
    (out / "gpu-report.md").write_text("\n".join([*rows, "", *step_table(steps)]) + "\n")
    for step in steps:
        print(f"{step.name:26} {step.state:34} {step.seconds:6.0f} s of {step.timeout_s:4.0f}", flush=True)
    write_results_pages(usecases)
    return verdict(steps)


def write_results_pages(usecases: list[UseCase], store: str | None = None) -> None:
    """The finished runs of the store (capped ones too) into each use case's results page, as `usecases report`."""
    from common.tracking import results
    from common.tracking.stores import tracking_uri

    for case in usecases:
        page = results.report(case.name, case.primary_metric, store or tracking_uri(), results.results_folder(),
                              required=False, columns=results.PageColumns.of(case))
        print(f"gpu-check: {case.name}'s results page: {page or 'no finished run'}", flush=True)


def verdict(steps: list[Step]) -> int:
    """1 when a priority step did not pass or a step failed, else 0; a line for each last step left out for time."""
    for step in steps:
        if not step.priority and step.returncode in (None, 124):
            why = step.output_tail.removeprefix("not run: ") if step.returncode is None else \
                f"stopped after {step.seconds:.0f} s, its share of what the priority steps left"
            print(f"gpu-check: {step.name} left out for time: {why}"
                  + (" (make test-gpu runs them on their own)" if step.kind == "gpu tests" else ""), flush=True)
    failed = [step for step in steps if step.returncode not in (None, 0) and (step.priority or step.returncode != 124)]
    failed += [step for step in steps if step.priority and step.returncode is None]
    print(f"gpu-check: {sum(step.passed for step in steps)} of {len(steps)} steps passed"
          + (f"; failed, stopped or not run: {', '.join(step.name for step in failed)}" if failed else ""), flush=True)
    return 1 if failed else 0
