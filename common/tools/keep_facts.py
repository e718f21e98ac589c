"""A run's facts kept as JSON, as `usecases advise` reads them, with their source, so that they outlive the run's
store (tests/data holds such files): `python -m common.tools.keep_facts RUN_ID FILE.json`."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

from common.advisor.catalog import load_gpus
from common.advisor.facts import RunFacts, facts_from_run, json_safe


def write_facts(path: Path, facts: RunFacts, source: dict, metrics: dict[str, float] | None = None) -> None:
    """The facts as JSON with their source, and any other metrics of the run worth keeping beside them."""
    path.write_text(json.dumps({"source": source, "metrics": metrics or {}, "facts": json_safe(facts)}, indent=2,
                               allow_nan=False) + "\n")


def read_facts(path: Path) -> tuple[RunFacts, dict]:
    """A run's facts kept by `write_facts`, and the rest of the file (`source`, `metrics`)."""
    kept = json.loads(path.read_text())
    return RunFacts.from_json(kept.pop("facts")), kept


def main(argv: list[str] | None = None) -> int:
    """Keep a run's facts as JSON (from the store MLFLOW_TRACKING_URI names, or --tracking-uri)."""
    import mlflow

    from common.tracking.stores import tracking_uri

    parser = argparse.ArgumentParser(prog="python -m common.tools.keep_facts", description=main.__doc__)
    parser.add_argument("run_id")
    parser.add_argument("out", type=Path)
    parser.add_argument("--tracking-uri")
    parser.add_argument("--metric", action="append", default=[], metavar="KEY",
                        help="another metric of the run to keep beside the facts (repeat for more)")
    parser.add_argument("--note", help="what the run's tags do not say (uncommitted changes, the machine's load)")
    args = parser.parse_args(argv)
    mlflow.set_tracking_uri(args.tracking_uri or tracking_uri())
    run = mlflow.MlflowClient().get_run(args.run_id)
    tags = run.data.tags
    usecase = tags.get("usecase") or "unknown"
    missing = [key for key in args.metric if key not in run.data.metrics]
    if missing:
        parser.error(f"run {args.run_id} has no metric {missing[0]}")
    source = {"run_id": run.info.run_id, "usecase": tags.get("usecase"), "preset": tags.get("preset"),
              "commit": tags.get("git_commit"), "device": tags.get("device"), "gpu": tags.get("gpu_name"),
              "cpu": tags.get("cpu_model"), "cpu_cores": tags.get("cpu_cores"), "torch": tags.get("torch_version"),
              "date": datetime.fromtimestamp(run.info.start_time / 1000, timezone.utc).isoformat(timespec="seconds"),
              **({"note": args.note} if args.note else {})}
    write_facts(args.out, facts_from_run(run, usecase, load_gpus()), source,
                {key: run.data.metrics[key] for key in args.metric})
    print(f"{args.out}: the facts of run {args.run_id} ({usecase})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
