"""`usecases advise NAME --serve --target-rps RATE --p99-ms MS`: a serving fleet sized on each catalogue row from the
capacity the newest serving bench run measured (its runs made here by hand, as `usecases bench serve NAME` logs
them), with the counts and costs worked out by hand; the stricter target, the faster server, the newest run; the
Kubernetes Deployment, Service and autoscaler as the Kubernetes client reads them; one line for each mistake."""

from __future__ import annotations

import json
import os

import mlflow
import pytest
import yaml

from common.advisor.fleet import CORE_SPEED, HEADROOM
from common.tracking.runs import experiment_name
from tests.cli_helpers import in_process, plain_tables, user_error

# Two priced rows and one without a price: 4 vCPUs (3 workers) at $0.50 an hour ($0.20 on spot), 8 vCPUs (7 workers)
# at $1.20 with no spot price.
CATALOGUE = """provider,instance,gpu,gpu_count,vcpus,ram_gb,price_per_hour_usd,region,source,as_of,\
spot_price_per_hour_usd
test,four,T4,1,4,16,0.5,here,a test,2026-12-01,0.2
test,eight,T4,1,8,32,1.2,here,a test,2026-12-01,
test,unpriced,T4,1,16,64,,here,a test,2026-12-01,
"""
# exact on 4 workers: 2,000 requests/s at concurrency 8 with p99 25 ms, so 500 a core at p99 <= 30 ms; only
# concurrency 1 (800 requests/s, 200 a core) keeps p99 <= 15 ms; concurrency 32 misses 30 ms.
EXACT = {1: (800, 10, 0), 8: (2000, 25, 0), 32: (2600, 60, 0)}


def bench(servers: dict[str, dict[int, tuple]], workers: str = "4", start_time: int | None = None,
          params: dict | None = None, preset: str = "serve", options: dict | None = None) -> str:
    """A finished serving bench run as the bench logs it: per server and concurrency, (requests/s, p99 ms, errors);
    with `options`, each server's `usecases serve` options (a run logged before that tag has none)."""
    client = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])  # this test's store, not the last one set
    name = experiment_name("recsys-serve")
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
    run = client.create_run(experiment_id, start_time=start_time, tags={
        "preset": preset, "model_uri": "models:/gpu-usecases-recsys/3", "workers": workers,
        "cpu_model": "Test CPU 9000", "usecase": "recsys-serve",
        **({"serve_options": json.dumps(options)} if options else {})})
    run_id = run.info.run_id
    for key, value in {"p99_ms": "30", **(params or {})}.items():
        client.log_param(run_id, key, value)
    for server, levels in servers.items():
        for level, (rate, p99, errors) in levels.items():
            for metric, value in (("requests_per_s", rate), ("p50_ms", p99 / 3), ("p99_ms", p99), ("errors", errors)):
                client.log_metric(run_id, f"serve/{server}/c{level}/{metric}", value)
    client.set_terminated(run_id)
    return run_id


def fleet(capsys, tmp_path, *args: str) -> str:
    catalogue = tmp_path / "catalogue.csv"
    catalogue.write_text(CATALOGUE)
    result = in_process(capsys, "advise", "recsys", "--serve", "--catalog", str(catalogue), *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def report(capsys, tmp_path, *args: str) -> dict:
    return json.loads(fleet(capsys, tmp_path, *args, "--format", "json"))


def rows(found: dict) -> dict[str, dict]:
    return {row["instance"]: row for row in found["rows"]}


def test_500_requests_a_core_for_10000_requests_gives_the_counts_and_costs_worked_by_hand(capsys, tmp_path):
    run_id = bench({"exact": EXACT})
    # four: 3 workers x 500 = 1,500 requests/s (0.6x: 900, 1.3x: 1,950), at 70 %: 1,050 (630, 1,365) carried each,
    # so ceil(10,000 / 1,050) = 10 instances (ceil(10,000 / 1,365) = 8, ceil(10,000 / 630) = 16): x $0.50 x 730 h.
    # eight: 7 x 500 = 3,500 (2,100, 4,550): ceil(10,000 / 2,450) = 5 (ceil(10,000 / 3,185) = 4, ceil(10,000 /
    # 1,470) = 7), x $1.20 x 730 = $4,380: dearer than four's $3,650.
    assert (CORE_SPEED.low, CORE_SPEED.expected, CORE_SPEED.high, HEADROOM) == (0.6, 1.0, 1.3, 0.7)
    found = report(capsys, tmp_path, "--target-rps", "10000", "--p99-ms", "30")
    assert found["estimated"] is True and found["bench"]["run_id"] == run_id and found["sized_server"] == "exact"
    exact = found["servers"]["exact"]
    assert exact["capacity_rps_per_core"] == 500 and exact["at_concurrency"] == 8
    four, eight, unpriced = (rows(found)[name] for name in ("four", "eight", "unpriced"))
    assert four["workers"] == 3 and eight["workers"] == 7 and unpriced["workers"] == 15
    assert four["requests_per_s_each"] == pytest.approx({"low": 900, "expected": 1500, "high": 1950})
    assert four["instances"] == {"low": 8, "expected": 10, "high": 16}
    assert four["month_usd"] == pytest.approx({"low": 2920, "expected": 3650, "high": 5840})
    assert four["spot_month_usd"] == pytest.approx({"low": 1168, "expected": 1460, "high": 2336})
    assert eight["instances"] == {"low": 4, "expected": 5, "high": 7} and eight["spot_month_usd"] is None
    assert eight["month_usd"]["expected"] == pytest.approx(4380)
    assert unpriced["month_usd"]["expected"] is None and found["cheapest"] == "four"
    assert [row["instance"] for row in found["rows"]] == ["four", "eight", "unpriced"]  # cheapest first
    table = fleet(capsys, tmp_path, "--target-rps", "10000")  # --p99-ms defaults to 30
    assert "Every figure below is estimated" in table and "at most 70 % of their capacity" in table
    line = next(line for line in table.splitlines() if line.startswith("four "))
    assert "10 (8-16)" in line and "$3,650 ($2,920-$5,840)" in line and "$1,460 ($1,168-$2,336)" in line
    assert "Cheapest (expected): 10 x four (test here, 4 vCPUs, 3 workers each), $3,650 ($2,920-$5,840) a month on " \
           "demand; on spot $1,460 ($1,168-$2,336)" in table
    assert "exact: 500 requests/s per core at p99 <= 30 ms (measured: 2,000 requests/s on 4 worker(s) at " \
           "concurrency 8, p99 25 ms) - sized" in table
    markdown = fleet(capsys, tmp_path, "--target-rps", "10000", "--format", "markdown")
    assert "| four | test | 4 | 3 | 1,500 (900-1,950) | 10 (8-16) | $0.5 | $3,650 ($2,920-$5,840) |" in \
        plain_tables(markdown)


def test_a_stricter_p99_that_only_the_lowest_concurrency_meets_needs_more_instances(capsys, tmp_path):
    bench({"exact": EXACT})
    loose = rows(report(capsys, tmp_path, "--target-rps", "10000", "--p99-ms", "30"))["four"]["instances"]
    strict = report(capsys, tmp_path, "--target-rps", "10000", "--p99-ms", "15")
    # 800 / 4 = 200 a core: 3 workers serve 600 (360-780), 420 at 70 %: ceil(10,000 / 420) = 24 (ceil(10,000 /
    # 546) = 19, ceil(10,000 / 252) = 40)
    assert strict["servers"]["exact"]["capacity_rps_per_core"] == 200
    assert rows(strict)["four"]["instances"] == {"low": 19, "expected": 24, "high": 40}
    assert rows(strict)["four"]["instances"]["expected"] > loose["expected"] == 10
    line = user_error(capsys, "advise", "recsys", "--serve", "--target-rps", "10000", "--p99-ms", "5")
    assert "met p99 <= 5 ms" in line and "the lowest p99: 10 ms, exact at concurrency 1" in line


def test_the_faster_server_is_sized_and_the_others_shown(capsys, tmp_path):
    """ANN retrieval at 850 requests/s a core against exact's 500: ANN is sized, exact's capacity printed beside
    it; MLflow's scoring server is never sized, however fast; a server that meets no p99 says so in one line."""
    bench({"exact": EXACT, "ann": {1: (1200, 5, 0), 8: (3400, 20, 0), 32: (5000, 31, 0)},
           "mlflow": {1: (9000, 2, 0)}, "slow": {1: (100, 80, 0), 8: (300, 200, 0)}})
    found = report(capsys, tmp_path, "--target-rps", "10000")
    assert found["sized_server"] == "ann" and found["servers"]["ann"]["capacity_rps_per_core"] == 850
    assert found["servers"]["exact"]["capacity_rps_per_core"] == 500
    assert found["servers"]["slow"]["capacity_rps_per_core"] is None
    # four: 3 x 850 = 2,550 each, 1,785 at 70 %: ceil(10,000 / 1,785) = 6
    assert rows(found)["four"]["instances"]["expected"] == 6
    table = fleet(capsys, tmp_path, "--target-rps", "10000")
    lines = [line[2:] for line in table.splitlines() if line.startswith("- ")]
    assert lines[0].startswith("ann: 850 requests/s per core") and lines[0].endswith("- sized")
    assert any(line.startswith("exact: 500 requests/s per core") and "1.7x less than ann's" in line for line in lines)
    assert any(line.startswith("mlflow: ") and "the baseline: shown, not sized" in line for line in lines)
    assert "slow: no concurrency of the bench met p99 <= 30 ms without errors (its lowest p99: 80 ms at " \
           "concurrency 1)" in lines


def test_the_newest_bench_run_is_read_and_errors_disqualify_a_concurrency(capsys, tmp_path):
    bench({"exact": EXACT}, start_time=1_000)
    newest = bench({"exact": {1: (800, 10, 0), 8: (2000, 25, 3)}}, workers="2", start_time=2_000)
    bench({"exact": {1: (1e6, 1, 0)}}, start_time=3_000, preset="smoke")  # not a serving bench run
    found = report(capsys, tmp_path, "--target-rps", "10000")
    assert found["bench"]["run_id"] == newest and found["bench"]["workers"] == 2
    assert found["servers"]["exact"]["capacity_rps_per_core"] == 400  # 800 / 2: concurrency 8 had errors
    older = report(capsys, tmp_path, "--target-rps", "10000", "--run", found["bench"]["run_id"])
    assert older["bench"]["run_id"] == newest


def test_mistakes_are_one_line(capsys, tmp_path):
    line = user_error(capsys, "advise", "recsys", "--serve", "--target-rps", "10000")
    assert "no serving bench run of 'recsys'" in line and "run `usecases bench serve recsys` first" in line
    for value in ("0", "-5", "lots"):
        line = user_error(capsys, "advise", "recsys", "--serve", "--target-rps", value)
        assert "--target-rps" in line and "expected a positive number" in line
    assert "--p99-ms" in user_error(capsys, "advise", "recsys", "--serve", "--target-rps", "10", "--p99-ms", "0")
    assert "--target-rps" in user_error(capsys, "advise", "recsys", "--serve")
    assert "--serve" in user_error(capsys, "advise", "recsys", "--target-rps", "10")
    assert "without --budget" in user_error(capsys, "advise", "recsys", "--serve", "--target-rps", "10", "--budget",
                                            "5")
    bench({"exact": EXACT}, workers="per core")
    assert "its tag 'workers' ('per core')" in user_error(capsys, "advise", "recsys", "--serve", "--target-rps", "10")
    bench({"exact": EXACT}, start_time=4_000_000_000_000)  # newer than the one above
    (tmp_path / "mine.csv").write_text("provider,instance\naws,x\n")
    line = user_error(capsys, "advise", "recsys", "--serve", "--target-rps", "10", "--catalog",
                      str(tmp_path / "mine.csv"))
    assert "mine.csv" in line and "missing column" in line
    (tmp_path / "a-file").write_text("")
    line = user_error(capsys, "advise", "recsys", "--serve", "--target-rps", "10", "--launch", str(tmp_path / "a-file"))
    assert "cannot be made a folder" in line


KINDS = {"Deployment": "V1Deployment", "Service": "V1Service", "HorizontalPodAutoscaler": "V2HorizontalPodAutoscaler"}


def kubernetes_objects(documents: list[dict]) -> list:
    """tests/common/test_renting.py's check for these kinds: each document read by the Kubernetes client's models,
    and given back unchanged (a misspelt or unknown field would be dropped)."""
    client = pytest.importorskip("kubernetes.client", reason="the kubernetes client (the dev extra) is not installed")
    api = client.ApiClient()
    objects = []
    for document in documents:
        found = api.deserialize(json.dumps(document), KINDS[document["kind"]], "application/json")
        assert api.sanitize_for_serialization(found) == document, document["kind"]
        objects.append(found)
    return objects


def test_launch_writes_a_deployment_service_and_autoscaler_the_kubernetes_client_reads(capsys, tmp_path):
    bench({"exact": EXACT})
    out = tmp_path / "out"
    printed = fleet(capsys, tmp_path, "--target-rps", "10000", "--launch", str(out), "--tracking-uri",
                    "http://mlflow.internal:5000")
    assert "Cheapest (expected): 10 x four" in printed and "8-16 instances over the range" in printed
    assert f"- {out / 'k8s-serve.yaml'}: Kubernetes Deployment (10 x `usecases serve recsys` on four" in printed
    assert "provide a Redis Service named 'redis'" in printed and "is not a server" not in printed
    text = (out / "k8s-serve.yaml").read_text()
    assert "provide it yourself, a Service named `redis`" in text.split("apiVersion")[0]
    deployment, service, autoscaler = kubernetes_objects(list(yaml.safe_load_all(text)))
    assert deployment.spec.replicas == 10  # the printed expected count
    assert (autoscaler.spec.min_replicas, autoscaler.spec.max_replicas) == (10, 16)  # expected and high
    (metric,) = autoscaler.spec.metrics
    assert (metric.resource.name, metric.resource.target.average_utilization) == ("cpu", 70)
    assert autoscaler.spec.scale_target_ref.name == deployment.metadata.name
    (port,) = service.spec.ports
    assert (service.spec.type, port.port, port.target_port) == ("ClusterIP", 80, 5001)
    assert service.spec.selector == deployment.spec.selector.match_labels == deployment.spec.template.metadata.labels
    (container,) = deployment.spec.template.spec.containers
    assert container.command[0].endswith("/usecases") and container.command[1:] == [
        "serve", "recsys", "--model-uri", "models:/gpu-usecases-recsys@champion", "--host", "0.0.0.0", "--port",
        "5001", "--workers", "3", "--events", "redis://redis:6379/0", "--retrieval", "exact"]
    assert container.resources.requests == {"cpu": "3", "memory": "13Gi"}
    assert container.resources.limits == {"cpu": "4", "memory": "13Gi"}
    for probe in (container.readiness_probe, container.liveness_probe, container.startup_probe):
        assert (probe.http_get.path, probe.http_get.port) == ("/ping", 5001)
    assert {item.name: item.value for item in container.env} == {"MLFLOW_TRACKING_URI": "http://mlflow.internal:5000"}
    (install,) = deployment.spec.template.spec.init_containers
    assert "pip install -e '.[recsys,events]'" in install.command[-1]


def test_launch_sizes_the_micro_batched_server_of_an_older_run_with_its_window(capsys, tmp_path):
    """An older bench's servers (ours, ours+batch logged as ours_batch, mlflow): micro-batching is the faster, so the
    Deployment serves with the bench's --batch-ms; a local store is no server for the pods, and the file says where
    one goes."""
    bench({"ours": {8: (1200, 20, 0)}, "ours_batch": {8: (1800, 22, 0)}, "mlflow": {8: (300, 28, 0)}},
          params={"batch_ms": "2"})
    out = tmp_path / "out"
    printed = fleet(capsys, tmp_path, "--target-rps", "2000", "--launch", str(out))
    assert "ours_batch: 450 requests/s per core" in printed and "is not a server" in printed
    deployment, _, _ = kubernetes_objects(list(yaml.safe_load_all((out / "k8s-serve.yaml").read_text())))
    (container,) = deployment.spec.template.spec.containers
    assert container.command[-2:] == ["--batch-ms", "2"]
    assert {item.name: item.value for item in container.env} == {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}


def test_launch_runs_the_sized_server_with_the_options_its_bench_logged(capsys, tmp_path):
    """A bench run that logged each server's `usecases serve` options: the Deployment runs the sized server's."""
    bench({"exact": EXACT, "ann": {8: (3400, 20, 0)}},
          options={"exact": ["--retrieval", "exact"], "ann": ["--retrieval", "ann", "--batch-ms", "3"]})
    out = tmp_path / "out"
    fleet(capsys, tmp_path, "--target-rps", "10000", "--launch", str(out))
    deployment, _, _ = kubernetes_objects(list(yaml.safe_load_all((out / "k8s-serve.yaml").read_text())))
    (container,) = deployment.spec.template.spec.containers
    assert container.command[-6:] == ["--events", "redis://redis:6379/0", "--retrieval", "ann", "--batch-ms", "3"]
