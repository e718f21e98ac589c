"""`usecases list`, `new`, `export`, `doctor` and `gpu-check`: the use cases there are, one of your own started
from one of them or written out as a project of its own, and whether this machine can run them."""

from __future__ import annotations

import argparse
from pathlib import Path

from common.errors import UserError
from usecases.cli import options
from usecases.cli.options import EXIT_OK, EXIT_USER_ERROR


def register(commands) -> None:
    options.add_command(commands, "list", list_command, help="list the use cases and their presets",
                        description="List the use cases, their presets and where each comes from.")

    new = options.add_command(commands, "new", new_command, help="start a use case of your own from an existing one",
                              description="Copy a use case into usecases/NAME (package, imports, presets, README, "
                                          "experiment and model names renamed) and its tests into tests/NAME.")
    new.add_argument("name", help="the new use case's name: a Python identifier, e.g. derm")
    new.add_argument("--from", dest="source", required=True, help="the use case to start from (see `usecases list`)")

    export = options.add_command(commands, "export", export_command, help="write one use case as a standalone project",
                                 description="Write DIR as a project of its own: common/, the one use case and its "
                                             "tests, a pyproject.toml with only what they need, Makefile, CI, README "
                                             "and the source commit it came from.")
    export.add_argument("name", help="use case (see `usecases list`)")
    export.add_argument("folder", type=Path, metavar="DIR", help="where to write it (must be empty or absent)")
    export.add_argument("--force", action="store_true",
                        help="write into a non-empty DIR (an earlier export): each file and folder the export writes "
                             "replaces its old one; the rest (.git, your data) stays")

    doctor = options.add_command(commands, "doctor", doctor_command,
                                 help="check that this machine can run every use case, and say why not",
                                 description="One line per check (Python, torch and its CUDA build, the driver, "
                                             "GPUs, NCCL, CuPy, cuDF, NVML, disk, tracking store, CPU), with a fix "
                                             "for each problem. Exit 0 when every use case can run on the device "
                                             "asked for, 2 otherwise.")
    doctor.add_argument("--device", default="auto", choices=options.DEVICES,
                        help="the device to check for: auto and cuda expect a GPU; cpu checks the CPU path only")

    gpu_check = options.add_command(commands, "gpu-check", gpu_check_command,
                                    help="on a GPU machine: doctor, gpu tests, every default run and benchmark, "
                                         "written to gpu-report.json and gpu-report.md",
                                    description="Measure everything GPU-side in one command, within a time budget. "
                                                "Without a GPU: one line, exit 2.")
    gpu_check.add_argument("--out", type=Path, default=Path("."), help="where the reports go (default: here)")
    gpu_check.add_argument("--budget-s", type=float, default=420, help="seconds for all steps (default: 420)")


def list_command(args: argparse.Namespace) -> int:
    from common.config import available_presets

    found = options.found()
    for name, usecase in options.loaded().items():
        if isinstance(usecase, UserError):
            print(f"{name:10} {usecase}")
            continue
        presets = ", ".join(available_presets(usecase.presets_dir))
        print(f"{name:10} {usecase.description}  [presets: {presets}]  ({found[name].origin})")
    return EXIT_OK


def new_command(args: argparse.Namespace) -> int:
    from common.tools.scaffold import new_usecase

    created = new_usecase(options.usecase(args.source), args.name, set(options.found()))
    print(f"created {', '.join(str(path) for path in created)}\n"
          f"try it: usecases run {args.name} --preset smoke && python -m pytest tests/{args.name}")
    return EXIT_OK


def export_command(args: argparse.Namespace) -> int:
    from common.tools.scaffold import export_usecase

    others = [usecase for usecase in options.usable() if usecase.name != args.name]
    export_usecase(options.usecase(args.name), others, args.folder, args.force)
    print(f"exported {args.name} to {args.folder}\nthere: make demo (runs it), make test (its tests)")
    return EXIT_OK


def doctor_command(args: argparse.Namespace) -> int:
    from common.tools.doctor import run_checks, verdict

    checks = run_checks(args.device)
    for check in checks:
        print(check.line(), flush=True)
    ready, line = verdict(checks)
    print(line)
    return EXIT_OK if ready else EXIT_USER_ERROR


def gpu_check_command(args: argparse.Namespace) -> int:
    from common.tools.gpu_check import gpu_check

    return gpu_check(options.usable(), args.out, args.budget_s)
