"""The renting half of `usecases advise`: the catalogue's network, disk, spot and interconnect columns, where the data
should sit, several GPUs against the published 8-GPU scaling, spot runs with their interruptions, serving for a month,
the budget and the deadline, and the launch files as SkyPilot and the Kubernetes client read them."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import yaml

from common.advisor.advise import Choice, Options, advise, place, recommend, serving_month, spot_run
from common.advisor.catalog import FOLDER, load_gpus, load_instances, load_links
from common.advisor.estimate import Range
from common.advisor.facts import RunFacts, facts_from_file
from common.deploy.launch import write_launch_files
from common.advisor.wholerun import SCALING_EFFICIENCY, data_parallel
from common.advisor.words import placement_line
from common.errors import UserError
from tests.common.advisor_calibration import scaling_efficiency

GPUS = load_gpus()
INSTANCES = {instance.name: instance for instance in load_instances(GPUS)}
LINKS = load_links()
RESNET50_GRADIENT_BYTES = 25_557_032 * 4  # torchvision's resnet50: 25,557,032 parameters, fp32 gradients


def test_the_catalogue_has_spot_prices_network_disks_and_links_with_sources():
    priced = [instance for instance in INSTANCES.values() if instance.provider in ("aws", "gcp", "azure")]
    assert sum(instance.spot_price_per_hour < instance.price_per_hour for instance in priced) >= 25
    assert all(instance.hardware_source.startswith("https://") for instance in priced)
    assert all(instance.interconnect in LINKS for instance in INSTANCES.values())
    p4d, g4dn = INSTANCES["p4d.24xlarge"], INSTANCES["g4dn.xlarge"]
    assert (p4d.network_gbps, p4d.nvme_total_gb, p4d.interconnect) == (400, 8000, "nvlink3")
    assert g4dn.nvme_total_gb == 125 and 0 < g4dn.disk_gbs < 0.2 and g4dn.interconnect == "pcie3"
    assert INSTANCES["p3.2xlarge"].nvme_total_gb == 0  # EBS only: none, not unknown
    assert math.isnan(INSTANCES["ecs.gn6i-c4g1.xlarge"].network_gbps)  # unknown stays empty
    assert GPUS["V100-16GB-SXM2"].cuda_major == 12 and GPUS["T4"].cuda_major == 13


def test_a_users_catalogue_may_leave_the_new_columns_out_and_a_bad_link_is_one_line(tmp_path):
    table = pd.read_csv(FOLDER / "instances.csv", dtype=str, keep_default_na=False)
    table.iloc[:, :10].to_csv(tmp_path / "mine.csv", index=False)
    mine = load_instances(GPUS, tmp_path / "mine.csv")
    assert math.isnan(mine[0].spot_price_per_hour) and mine[0].interconnect == ""
    table.assign(interconnect=["nvlink9"] + list(table["interconnect"][1:])).to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(UserError, match=r"bad.csv: column 'interconnect', row 1: expected one of pcie3, .*nvlink4 or "
                                        r"empty, got 'nvlink9'"):
        load_instances(GPUS, tmp_path / "bad.csv")


def published_scaling() -> list[tuple]:
    """DeepLearningExamples' ResNet-50 training figures on 8 GPUs, each with its one-GPU figure of the same table,
    GPU and precision: (one GPU's images/s, batch, GPUs, their images/s, gradient bytes, the link)."""
    table = pd.read_csv(FOLDER / "published.csv")
    table = table[table["model"].str.startswith("ResNet") & (table["task"] == "train")]
    single = table[table["gpus"] == 1].set_index(["model", "gpu", "precision"])["samples_per_s"]
    link = {"A100-80GB-SXM": LINKS["nvlink3"], "V100-16GB-SXM2": LINKS["nvlink2"], "V100-32GB-SXM2": LINKS["nvlink2"]}
    return [(single[row.model, row.gpu, row.precision], 256, int(row.gpus), row.samples_per_s, RESNET50_GRADIENT_BYTES,
             link[row.gpu]) for row in table[table["gpus"] > 1].itertuples()]


def test_the_ddp_efficiency_is_the_fit_on_the_published_8_gpu_figures_and_holds_each_of_them():
    figures = published_scaling()
    assert len(figures) == 6
    assert scaling_efficiency(figures) == SCALING_EFFICIENCY
    for single, batch, gpus, together, gradients, link in figures:
        predicted = data_parallel(batch / single, gradients, gpus, link).speedup
        assert predicted.low <= together / single <= predicted.high, (single, together, predicted)
        assert abs(predicted.expected / (together / single) - 1) < 0.10


def test_fast_small_steps_scale_worse_than_long_ones_and_a_slow_network_makes_two_machines_slower():
    quick = data_parallel(0.6e-3, 4e5, 2, LINKS["pcie3"])  # a small model: 0.6 ms a step
    assert quick.speedup.low < 1 < quick.speedup.expected < 1.6, quick  # the old advice printed 2.0x here
    long = data_parallel(0.1, RESNET50_GRADIENT_BYTES, 2, LINKS["pcie3"])
    assert long.speedup.expected > 1.75 and long.speedup.high <= 2
    slow = data_parallel(0.1, RESNET50_GRADIENT_BYTES, 8, LINKS["nvlink3"], nodes=2, network_gbps=25)
    fast = data_parallel(0.1, RESNET50_GRADIENT_BYTES, 8, LINKS["nvlink3"], nodes=2, network_gbps=400)
    assert slow.speedup.expected < fast.speedup.expected < 16
    assert slow.all_reduce_s.expected > 5 * fast.all_reduce_s.expected
    assert data_parallel(0.1, 1e8, 8, LINKS["nvlink3"], nodes=2) is None  # an unknown network: no figure


def test_the_data_goes_to_memory_then_local_nvme_then_the_disk_and_says_how_long_the_copy_takes():
    p4d, g5 = INSTANCES["p4d.24xlarge"], INSTANCES["g5.2xlarge"]
    small = place(41, 20_000, 110_000, p4d)  # 41 GB of 110 kB images at 20,000 images/s: 2.2 GB/s
    assert small.where == "memory" and not small.bounds
    assert "load the 41 GB data set into memory first" in placement_line(small, p4d)
    big = place(1000, 20_000, 110_000, p4d)
    assert big.where == "local NVMe" and big.needed_gbs == pytest.approx(2.2)
    assert big.copy_s.expected == pytest.approx(1000 / (400 / 8 * 0.5))  # at half the 400 Gbit/s network
    line = placement_line(big, p4d)
    assert "reads 2.2 GB/s of input; this instance's network disk gives 0.12 GB/s: copy the 1,000 GB data set to " \
           "local NVMe first" in line and big.matters
    too_big = place(1000, 2000, 110_000, g5)  # larger than its 450 GB drive: read from object storage
    assert too_big.where == "object storage" and too_big.bounds is False and too_big.copy_s.expected == 0
    starved = place(1000, 20_000, 110_000, g5)
    assert starved.bounds and "reading caps training at" in placement_line(starved, g5)
    assert not place(0.01, 1000, 1000, g5).matters


def test_a_spot_run_pays_for_its_interruptions_and_checkpoints_bound_the_loss():
    work, copy = Range(36000, 36000, 36000), Range(0, 0, 0)
    often = spot_run(work, Range(600, 600, 600), 1.0, copy, per_hour=0.1)  # a checkpoint every 10 min
    rarely = spot_run(work, Range(12000, 12000, 12000), 1.0, copy, per_hour=0.1)
    assert often.lost_s == 300 and rarely.lost_s == 6000
    assert 36000 < often.seconds.expected < rarely.seconds.expected
    assert often.interruptions == pytest.approx(0.1 * often.seconds.expected / 3600)
    # T = work / (1 - rate x (lost + restart)): 10 h of work, 0.1 an hour, 300 s lost and a 480 s restart
    assert often.seconds.expected == pytest.approx(36000 / (1 - 0.1 / 3600 * (300 + 480)))
    assert often.saving(Range(36000, 36000, 36000).scaled(3 / 3600)) > 0.6  # $1/h spot against $3/h
    never = spot_run(work, None, 1.0, copy, per_hour=1.0)  # no checkpoint: an hour's rate loses 5 h a time
    assert math.isinf(never.seconds.expected) and never.lost_s == 18000
    assert spot_run(work, Range(600, 600, 600), math.nan, copy) is None


def test_the_time_between_checkpoints_is_checkpoint_every_s_at_most_a_fit(tmp_path):
    """A fit saves every `checkpoint_every_s` seconds, none when it is shorter (so an interruption loses half the
    fit); 0 saves after every epoch."""
    from common.advisor.advise import _between_checkpoints

    rows = {}
    for every in (None, 0, 60, 1e9):
        facts = workload_facts(tmp_path, checkpoint_every_s=every)
        (row,) = advise(facts, [INSTANCES["g5.xlarge"]], GPUS, "train")
        rows[every] = (row, _between_checkpoints(facts, next(iter(row.whole.models.values()))))
    (row, between) = rows[1e9]
    fit = next(iter(row.whole.models.values())).fit_s
    assert between == fit and rows[None][1] is None
    assert rows[0][1] == next(iter(rows[0][0].whole.models.values())).epoch_s
    assert rows[60][1].expected == 60 and rows[60][0].spot.lost_s == 30


def test_serving_a_month_takes_as_many_instances_as_the_load_needs():
    month = serving_month(Range(400, 1000, 2000), 2500, 1.0)
    assert (month.replicas.low, month.replicas.expected, month.replicas.high) == (2, 3, 7)
    assert month.month_usd.expected == pytest.approx(3 * 730)
    assert serving_month(Range(400, 1000, 2000), 1, 1.0).replicas.high == 1


def workload_facts(tmp_path, checkpoint_every_s: float | None = 600, **extra) -> RunFacts:
    spec = {"task": "train", "flops_per_sample": 8e9, "bytes_per_sample": 2e8, "precision": "amp",
            "batch_size": 256, "weight_bytes": RESNET50_GRADIENT_BYTES, **extra}
    if checkpoint_every_s is not None:
        spec["checkpoint_every_s"] = checkpoint_every_s
    (tmp_path / "w.json").write_text(json.dumps(spec))
    return facts_from_file(tmp_path / "w.json", GPUS)


def test_a_budget_and_a_deadline_change_the_pick(tmp_path):
    facts = workload_facts(tmp_path)
    rows = advise(facts, list(INSTANCES.values()), GPUS, "train")
    free = recommend(rows)["train_cheapest"]
    assert free.spot  # spot saves most at the default interruption rate
    on_demand = min((row for row in rows if not math.isnan(row.instance.price_per_hour) and row.fits),
                    key=lambda row: row.run_cost.expected)
    tight = Options(deadline_h=0.5 * free.seconds.expected / 3600)
    quick = recommend(rows, tight)["train_cheapest"]
    assert quick.seconds.expected <= tight.deadline_h * 3600 and quick.row is not free.row
    broke = recommend(rows, Options(budget_usd=0.5 * free.cost.expected))
    assert broke["train_cheapest"] is None and broke["train_fastest"] is None
    assert on_demand.run_cost.expected > free.cost.expected


def test_a_multi_gpu_instance_is_estimated_with_its_link_and_a_data_set_too_big_to_copy_bounds_it(tmp_path):
    facts = workload_facts(tmp_path, data_gb=5000, samples=1_000_000)
    rows = {row.instance.name: row for row in advise(facts, list(INSTANCES.values()), GPUS, "train")}
    p4d = rows["p4d.24xlarge"]
    assert p4d.scaling.gpus == 8 and p4d.scaling.paced_by == "nvlink3" and 6 < p4d.scaling.speedup.expected < 8
    g4dn = rows["g4dn.12xlarge"]
    assert g4dn.scaling.paced_by == "pcie3"
    assert g4dn.scaling.all_reduce_s.expected > 4 * p4d.scaling.all_reduce_s.expected
    assert p4d.placement.where == "local NVMe" and rows["g5.xlarge"].placement.where == "object storage"


def launch(tmp_path, instance: str, spot: bool, usecase: str = "derm") -> tuple[dict, list[dict], dict]:
    facts = RunFacts("0" * 32, {}, usecase=usecase, preset="default", data_bytes=41e9)
    row = next(row for row in advise(facts, [INSTANCES[instance]], GPUS, "train"))
    written = write_launch_files(tmp_path, facts, Choice(row, spot, Range(1, 1, 1), Range(1, 1, 1)), None)
    task = yaml.safe_load((tmp_path / "sky-task.yaml").read_text())
    job = list(yaml.safe_load_all((tmp_path / "k8s-job.yaml").read_text()))
    return task, job, written


def kubernetes_objects(documents: list[dict]) -> list:
    """Each document read by the Kubernetes client's models, as `kubectl` would send them: an unknown or misspelt
    field is dropped by the models, so the round trip must give the document back unchanged."""
    client = pytest.importorskip("kubernetes.client", reason="the kubernetes client (the dev extra) is not installed")
    api = client.ApiClient()
    objects = []
    for document in documents:
        kind = {"Job": "V1Job", "PersistentVolumeClaim": "V1PersistentVolumeClaim"}[document["kind"]]
        found = api.deserialize(json.dumps(document), kind, "application/json")
        assert api.sanitize_for_serialization(found) == document, kind
        objects.append(found)
    return objects


def test_the_launch_files_for_one_gpu_on_spot_resume_and_load_in_the_kubernetes_client(tmp_path):
    task, job, written = launch(tmp_path, "g4dn.xlarge", spot=True)
    assert task["resources"] | {} == {"infra": "aws/us-east-1", "instance_type": "g4dn.xlarge", "accelerators": "T4:1",
                                      "disk_size": 132, "use_spot": True,
                                      "job_recovery": {"strategy": "FAILOVER", "max_restarts_on_errors": 1}}
    assert task["run"].strip() == ".venv/bin/usecases run derm --preset default --resume-if-interrupted"
    assert ".venv/bin/pip install -e '.[all,cuda13]'" in task["setup"]
    assert task["envs"]["USECASES_CHECKPOINT_DIR"] == "/checkpoints" and "/checkpoints" in task["file_mounts"]
    assert task["envs"]["MLFLOW_TRACKING_URI"] and any("cannot resume without one" in line for line in written["lines"])
    claim, batch = kubernetes_objects(job)
    container = batch.spec.template.spec.containers[0]
    assert container.resources.limits == {"nvidia.com/gpu": "1"}
    assert batch.spec.template.spec.restart_policy == "OnFailure"
    assert "usecases run derm --preset default --resume-if-interrupted" in container.command[-1]
    assert {mount.mount_path for mount in container.volume_mounts} == {"/cache", "/dev/shm"}
    assert batch.spec.template.spec.volumes[0].persistent_volume_claim.claim_name == claim.metadata.name
    assert {item.name: item.value for item in container.env}["USECASES_CHECKPOINT_DIR"] == "/cache/checkpoints"


def test_several_gpus_run_under_torchrun_and_a_v100_gets_the_cuda_12_build(tmp_path):
    task, job, written = launch(tmp_path, "p3.8xlarge", spot=False, usecase="scans")
    assert task["resources"]["accelerators"] == "V100:4" and "use_spot" not in task["resources"]
    assert task["run"].startswith(".venv/bin/torchrun --standalone --nproc_per_node 4 -m usecases run scans")
    assert "--index-url https://download.pytorch.org/whl/cu128" in task["setup"] and "'.[all,cuda12]'" in task["setup"]
    assert "file_mounts" not in task and written["extra"] == "cuda12"
    _, batch = kubernetes_objects(job)
    assert batch.spec.template.spec.containers[0].resources.requests["nvidia.com/gpu"] == "4"
    (preferred,) = batch.spec.template.spec.affinity.node_affinity.preferred_during_scheduling_ignored_during_execution
    (expression,) = preferred.preference.match_expressions
    assert (expression.key, expression.values) == ("nvidia.com/gpu.product", ["Tesla-V100-SXM2-16GB"])


def test_gcp_n1_takes_its_gpu_as_an_accelerator_and_names_fit_kubernetes_and_buckets(tmp_path):
    task, job, _ = launch(tmp_path, "n1-standard-8 + 1x nvidia-tesla-t4", spot=True,
                          usecase="a-use-case-with-a-rather-long-name-indeed")
    assert task["resources"]["instance_type"] == "n1-standard-8" and task["resources"]["accelerators"] == "T4:1"
    (bucket,) = [mount["name"] for mount in task["file_mounts"].values()]
    assert len(bucket) <= 63 and bucket.endswith("-ckpt-000000000000")
    assert all(len(document["metadata"]["name"]) <= 63 for document in job)
