"""What every area of the CLI shares: the parser that words a usage mistake in one line, the option groups that
several commands take, and finding a use case by name. Nothing imported here imports pandas, so that cudf.pandas
can still take over pandas when a run starts (a test)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from common.errors import UserError
from common.usecase import DEVICES

EXIT_OK, EXIT_FAILURE, EXIT_USER_ERROR = 0, 1, 2


class Parser(argparse.ArgumentParser):
    """Usage mistakes in one line, like every other user error."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"error: {message} (see: {self.prog} --help)\n")


def positive(option: str):
    """A number above zero, or a one-line usage error naming the option."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not value > 0 or math.isinf(value):
            raise argparse.ArgumentTypeError(f"expected a positive number, got '{text}'")
        return value
    parse.__name__ = option
    return parse


def add_command(commands, name: str, handler, help: str, description: str) -> argparse.ArgumentParser:
    """A subcommand whose parsed arguments are handed to `handler(args) -> exit code`."""
    parser = commands.add_parser(name, help=help, description=description)
    parser.set_defaults(handler=handler)
    return parser


def add_device_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="where torch runs: auto picks CUDA when there is a GPU")
    parser.add_argument("--frames", default="auto", choices=["auto", "pandas"],
                        help="DataFrame backend: auto uses cuDF through cudf.pandas on a GPU; pandas forces the CPU")


def add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.epochs=5 (repeatable)")


def add_config_options(parser: argparse.ArgumentParser, preset: str = "default") -> None:
    """The options of one run: its preset, overrides, data, summary file and where its data work runs."""
    parser.add_argument("--preset", default=preset, help=f"config preset (see `usecases list`; default: {preset})")
    add_overrides(parser)
    parser.add_argument("--data", type=Path, help="a data file or folder of your own instead of the preset's data")
    parser.add_argument("--summary", type=Path, metavar="FILE", help="also write summary.json here")
    parser.add_argument("--engine", choices=["pandas", "dask", "auto"],
                        help="where per-series and data work runs (runtime.engine; auto: Dask for large data; "
                             "default: the preset's, pandas)")
    parser.add_argument("--cluster", metavar="ADDRESS", help="a Dask scheduler, e.g. tcp://10.0.0.5:8786 "
                                                              "(runtime.cluster; default: $DASK_SCHEDULER_ADDRESS, "
                                                              "else a local cluster)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="processes of the local Dask cluster (runtime.workers; default: one per core)")


def engine_overrides(args: argparse.Namespace) -> list[str]:
    """--engine, --cluster and --workers are the config's runtime keys, so the run records them as params."""
    given = {"engine": args.engine, "cluster": args.cluster, "workers": args.workers}
    overrides = [f"runtime.{key}={value}" for key, value in given.items() if value is not None]
    if (args.cluster or args.workers) and not args.engine:
        overrides.append("runtime.engine=dask")
    return overrides


def found() -> dict:
    """Every use case: the packages in this folder and those that installed distributions register."""
    import usecases
    from common.usecase import discover

    return discover(usecases.__name__, Path(usecases.__file__).parent)


def usecase(name: str):
    from common.usecase import resolve

    return resolve(name, found())


def loaded() -> dict:
    from common.usecase import load_all

    return load_all(found())


def usable() -> list:
    """The use cases that load here (one that cannot is a UserError in `loaded()`)."""
    return [case for case in loaded().values() if not isinstance(case, UserError)]
