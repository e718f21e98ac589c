"""`usecases advise`: which GPU instance to rent to train and serve a use case, what it costs, and the launch files
of the pick; the estimates are in common/advisor."""

from __future__ import annotations

import argparse
from pathlib import Path

from common.errors import UserError
from usecases.cli import options
from usecases.cli.options import EXIT_OK


def register(commands) -> None:
    advise = options.add_command(commands, "advise", advise_command_line,
                                 help="which GPU instance to rent to train and serve a use case, and its cost",
                                 description="Estimate, from a run's measured workload and phases, the time and cost "
                                             "of the whole run (training one part of it) and of serving on each GPU "
                                             "instance of the catalogue, with ranges and the bottleneck, then "
                                             "recommend and say what the measurements call for. The table and a "
                                             "cost-against-time plot are logged to the run.")
    advise.add_argument("name", nargs="?", help="use case (see `usecases list`); not needed with --workload")
    advise.add_argument("--run", dest="run_id", metavar="RUN_ID", help="the run to advise on (default: the latest)")
    advise.add_argument("--task", default="both", choices=["train", "serve", "both"])
    advise.add_argument("--catalog", type=Path, metavar="FILE",
                        help="your own instances and prices, in the columns of common/catalog/instances.csv")
    advise.add_argument("--format", default="table", choices=["table", "markdown", "json"], dest="output_format")
    advise.add_argument("--workload", type=Path, metavar="FILE.json",
                        help="a model of your own: task, flops_per_sample, bytes_per_sample, precision, batch_size, "
                             "optionally measured: {gpu, samples_per_s}, weight_bytes, data_gb, checkpoint_every_s")
    advise.add_argument("--budget", type=options.positive("--budget"), metavar="USD",
                        help="only runs expected to cost at most this, the whole run (on demand or spot)")
    advise.add_argument("--deadline", type=options.positive("--deadline"), metavar="HOURS",
                        help="only runs expected to finish within this, the whole run, interruptions included")
    advise.add_argument("--data-gb", type=options.positive("--data-gb"), metavar="GB",
                        help="the data set you will train on, stored as the run's (default: the run's own): epochs "
                             "grow with it, and where it should sit on each instance is said")
    advise.add_argument("--requests-per-s", type=options.positive("--requests-per-s"), metavar="RATE",
                        help="the serving load a month's cost is stated at (default: 100, as the report says)")
    advise.add_argument("--spot-interruptions-per-hour", type=options.positive("--spot-interruptions-per-hour"),
                        metavar="RATE", help="the spot interruption rate to plan with (default: `0.05`, as the "
                                             "report says)")
    advise.add_argument("--launch", type=Path, metavar="DIR",
                        help="write a SkyPilot task and a Kubernetes Job for the recommended training instance")
    advise.add_argument("--tracking-uri", metavar="URI",
                        help="with --launch: the MLflow server the launched run logs to (default: "
                             "$MLFLOW_TRACKING_URI when it is a server)")
    advise.add_argument("--serve", action="store_true",
                        help="size a serving fleet instead, from the newest `usecases bench serve NAME` run: "
                             "instances and a month's cost on each catalogue row (--launch: Kubernetes manifests)")
    advise.add_argument("--target-rps", type=options.positive("--target-rps"), metavar="RATE",
                        help="with --serve: the requests per second the fleet must carry")
    advise.add_argument("--p99-ms", type=options.positive("--p99-ms"), metavar="MS",
                        help="with --serve: the p99 latency each server must keep (default: 30)")


def advise_command_line(args: argparse.Namespace) -> int:
    if args.workload is None and args.name is None:
        raise UserError("advise needs a use case name (see `usecases list`) or --workload FILE.json")
    if args.tracking_uri and args.launch is None:
        raise UserError("--tracking-uri is for the launch files: give --launch DIR with it")
    if args.serve or args.target_rps is not None or args.p99_ms is not None:
        if not args.serve or args.target_rps is None:
            raise UserError("a serving fleet is sized with --serve --target-rps RATE (and --p99-ms MS): give both")
        given = [option for option, value in (("--workload", args.workload), ("--budget", args.budget),
                                              ("--deadline", args.deadline), ("--data-gb", args.data_gb),
                                              ("--requests-per-s", args.requests_per_s),
                                              ("--spot-interruptions-per-hour", args.spot_interruptions_per_hour))
                 if value is not None] + (["--task"] if args.task != "both" else [])
        if given or args.name is None:
            raise UserError(f"--serve sizes a use case's serving fleet from its bench run: give its name, without "
                            f"{given[0] if given else '--workload'} (--target-rps is the load)")
        from common.advisor.fleet import fleet_command

        print(fleet_command(options.usecase(args.name), args.run_id, args.catalog, args.output_format, args.target_rps,
                            args.p99_ms or 30.0, args.launch, args.tracking_uri))
        return EXIT_OK
    if args.launch is not None and args.task == "serve":
        raise UserError("--launch writes the training instance's files: leave out --task serve")
    if args.name is not None:
        options.usecase(args.name)
    from common.advisor.advise import Options
    from common.advisor.report import AdviseRequest, advise_command

    stated = {"requests_per_s": args.requests_per_s, "interruptions_per_hour": args.spot_interruptions_per_hour}
    limits = Options(args.budget, args.deadline, **{key: value for key, value in stated.items() if value})
    print(advise_command(AdviseRequest(args.name, args.run_id, args.task, args.catalog, args.output_format,
                                       args.workload, limits, args.data_gb, args.launch, args.tracking_uri)))
    return EXIT_OK
