"""`usecases bench run|scale|serve|slides`: a use case's pipeline against a plain loop, its cost against data size,
its server against MLflow's, and its whole-slide reading. Each reports ratios against a baseline measured in the
same run."""

from __future__ import annotations

import argparse
from functools import partial

from common.errors import UserError
from usecases.cli import options
from usecases.cli.options import EXIT_OK
from usecases.cli.runs import run_command

SLIDES_PRESET = "slides-smoke"  # what `bench slides` runs unless a preset is given
MODES = ("run", "scale", "serve", "slides")


def register(commands) -> None:
    bench = commands.add_parser("bench", help="measure a use case against a baseline in the same run",
                                description="A use case's benchmarks, each against a baseline measured in the same "
                                            "run.")
    modes = bench.add_subparsers(dest="mode", required=True, metavar="MODE")

    run = options.add_command(modes, "run", partial(run_command, bench=True),
                              help="our pipeline against a plain loop on the same data",
                              description="Run a use case's benchmark: our pipeline and a plain loop on the same "
                                          "data in one run, throughputs and their ratio.")
    _add_name(run)
    options.add_device_options(run)
    options.add_config_options(run)

    scale = options.add_command(modes, "scale", scale_bench, help="wall time and peak memory against data size",
                                description="The use case's `scale` preset at several sizes on each engine, a "
                                            "fresh process each: wall time, peak memory and throughput against size, "
                                            "in a NAME-scale run with scale.csv and a log-log plot.")
    _add_name(scale)
    options.add_overrides(scale)
    scale.add_argument("--sizes", default="1,4,16", help="multiples of the base size (default 1,4,16)")
    scale.add_argument("--scale-engines", default="pandas,dask", metavar="ENGINES",
                       help="the engines to compare (default pandas,dask)")
    scale.add_argument("--base", type=int, help="the 1x value of the use case's size key (default: its declared one)")
    scale.add_argument("--timeout-s", type=float, help="stop a run after this long, a row saying so")

    serve = options.add_command(modes, "serve", serve_bench, help="the use case's own server against MLflow's",
                                description="The use case's own server against MLflow's scoring server on the same "
                                            "model (or retrieving each way), and each one's capacity per core at a "
                                            "p99 target.")
    _add_name(serve)
    serve.add_argument("--model-uri", help="the model (default: the champion on the data trained on last)")
    serve.add_argument("--concurrency", default="1,8,32", help="concurrent clients (default 1,8,32)")
    serve.add_argument("--seconds", type=float, default=20.0, help="load per concurrency (default 20)")
    serve.add_argument("--serve-workers", type=int, help="our server's workers (default: one per core)")
    serve.add_argument("--batch-ms", type=float, metavar="MS",
                       help="also measure our server micro-batching concurrent requests for up to MS milliseconds "
                            "(server ours+batch; ours then runs unbatched)")
    serve.add_argument("--retrieval", metavar="MODES",
                       help="our server retrieving each way, e.g. exact,ann, instead of MLflow's server")
    serve.add_argument("--p99-ms", type=options.positive("--p99-ms"), default=30.0, metavar="MS",
                       help="the p99 target each server's capacity per core is stated at (default 30)")

    slides = options.add_command(modes, "slides", slides_bench, help="tiles/s of whole-slide reading and encoding",
                                 description="The whole-slide benchmark: tiles/s of read + normalise + encode "
                                             "against a plain per-tile loop, and a gigapixel slide's peak memory.")
    _add_name(slides)
    options.add_device_options(slides)
    options.add_config_options(slides, preset=SLIDES_PRESET)


def _add_name(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="use case with a benchmark (see `usecases list`)")


def slides_bench(args: argparse.Namespace) -> int:
    """The slides preset unless one is given, and a given one must read slides."""
    from common.config import load_config

    usecase = options.usecase(args.name)
    config = load_config(usecase.config, usecase.presets_dir, args.preset, args.overrides)
    source = getattr(getattr(config, "data", None), "source", None)
    if source != "slides":
        raise UserError(f"bench slides: preset '{args.preset}' reads {source or 'no slides'} (data.source), not "
                        f"slides; give a preset with data.source: slides, such as {SLIDES_PRESET}")
    return run_command(args, bench=True)


def scale_bench(args: argparse.Namespace) -> int:
    from common.tools.scale_bench import parse_list, scale_bench as measure

    measure(options.usecase(args.name), args.overrides, parse_list(args.sizes, "--sizes", int),
            parse_list(args.scale_engines, "--scale-engines"), args.base, args.timeout_s)
    return EXIT_OK


def serve_bench(args: argparse.Namespace) -> int:
    from common.tools.scale_bench import parse_list
    from common.tools.serve_bench import ServeBench, serve_bench as measure
    from common.tracking.registry import served_model

    usecase = options.usecase(args.name)
    model_uri, _ = served_model(usecase, args.model_uri)
    retrieval = parse_list(args.retrieval, "--retrieval") if args.retrieval else None
    measure(usecase, ServeBench(model_uri=model_uri, concurrency=parse_list(args.concurrency, "--concurrency", int),
                                seconds=args.seconds, workers=args.serve_workers, batch_ms=args.batch_ms,
                                retrieval=retrieval, p99_ms=args.p99_ms))
    return EXIT_OK


def old_spelling(argv: list[str]) -> str | None:
    """`bench NAME [--scale|--serve|--slides] ...`, the spelling before the modes, answered with the new one."""
    if len(argv) < 2 or argv[0] != "bench" or argv[1] in MODES or argv[1].startswith("-"):
        return None
    flags = [mode for mode in ("scale", "serve", "slides") if f"--{mode}" in argv]
    if len(flags) > 1:
        return f"bench: give one of bench {'|'.join(MODES)}, not --{' --'.join(flags)}"
    rest = [word for word in argv[2:] if word not in {f"--{mode}" for mode in flags}]
    new = " ".join(["usecases bench", flags[0] if flags else "run", argv[1], *rest])
    return f"`usecases bench NAME{' --' + flags[0] if flags else ''}` is now `{new}`"
