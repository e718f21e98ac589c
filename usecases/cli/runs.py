"""`usecases run` and `usecases demo`: one use case end to end, or every one on its default data."""

from __future__ import annotations

import argparse

from usecases.cli import options
from usecases.cli.options import EXIT_OK


def register(commands) -> None:
    run = options.add_command(commands, "run", run_command, help="run one use case",
                              description="Run one use case end to end.")
    run.add_argument("name", help="use case (see `usecases list`)")
    options.add_device_options(run)
    options.add_config_options(run)
    resume = run.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true", help="continue the last interrupted run of this preset")
    resume.add_argument("--resume-if-interrupted", action="store_true",
                        help="continue the last interrupted run of this preset if there is one, else start one (what "
                             "a spot instance's recovery or a restarted Kubernetes Job runs)")

    demo = options.add_command(commands, "demo", demo_command, help="run every use case on its default data",
                               description="Run every use case with its default preset; a data set that cannot be "
                                           "had is replaced by the use case's synthetic data.")
    options.add_device_options(demo)


def run_command(args: argparse.Namespace, bench: bool = False) -> int:
    """One tracked run; `bench` runs the use case's benchmark instead of its pipeline."""
    from common.runner import run_usecase
    from common.runtime.process import use_gpu_frames
    from common.usecase import RunRequest

    use_gpu_frames(args.frames, args.device)  # before the use case's package is imported: cudf.pandas takes over
    run_usecase(RunRequest(options.usecase(args.name), args.preset, (*args.overrides, *options.engine_overrides(args)),
                           args.device, args.frames, args.data, args.summary, getattr(args, "resume", False),
                           getattr(args, "resume_if_interrupted", False), bench=bench))
    return EXIT_OK


def demo_command(args: argparse.Namespace) -> int:
    from common.errors import UserError
    from common.runner import run_demo
    from common.runtime.process import use_gpu_frames
    from usecases.cli.tracking import print_runs_links

    use_gpu_frames(args.frames, args.device)  # before any use case is imported, as `run` does
    loaded = options.loaded()
    for name, usecase in loaded.items():
        if isinstance(usecase, UserError):
            print(f"{name}: skipped: {usecase}", flush=True)
    run_demo([usecase for usecase in loaded.values() if not isinstance(usecase, UserError)], args.device, args.frames)
    print("Done. Browse the runs with `usecases ui` (from the clone: make ui), then open each use case's runs:")
    print_runs_links(list(loaded))
    return EXIT_OK
