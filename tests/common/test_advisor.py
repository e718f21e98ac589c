"""The catalogue, the estimator and its validation on published cross-GPU results (catalog/published.csv:
NVIDIA DeepLearningExamples' ResNet-50 v1.5 and NCF tables)."""

from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd
import pytest
import torch

from common.advisor import Range, Workload, cpu_seconds, data_parallel, estimate, gpu_precision
from common.catalog import FOLDER, INSTANCE_COLUMNS, load_gpus, load_instances, match_gpu
from common.errors import UserError
from common.training import supervised
from common.workload import measure_model

GPUS = load_gpus()
REFERENCE = "V100-16GB-SXM2"  # the measured GPU every other published figure is predicted from


@pytest.mark.parametrize(("name", "expected"), [
    ("V100", "V100-16GB-SXM2"), ("Tesla V100-SXM2-16GB", "V100-16GB-SXM2"), ("Tesla V100-PCIE-32GB", "V100-32GB-PCIe"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB-PCIe"), ("NVIDIA A100-SXM4-40GB", "A100-40GB-SXM"), ("a100 80gb",
                                                                                             "A100-80GB-SXM"),
    ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("H100 PCIe", "H100-PCIe"), ("NVIDIA H200", "H200-SXM"), ("A10G", "A10G"),
    ("NVIDIA A10", "A10"), ("Tesla T4", "T4"), ("L4", "L4"), ("NVIDIA L40S", "L40S"),
])
def test_gpu_names_are_matched_as_nvidia_smi_and_people_write_them(name, expected):
    assert match_gpu(name, GPUS) == expected


def test_an_unknown_gpu_is_one_line_listing_the_known_ones():
    with pytest.raises(UserError, match=r"unknown GPU 'RTX 9090' \(known: T4, A10, A10G"):
        match_gpu("RTX 9090", GPUS)


def test_the_catalogue_has_the_gpus_and_clouds_the_issue_names_with_sources():
    assert {"T4", "A10", "A10G", "L4", "L40S", "V100-16GB-SXM2", "V100-32GB-SXM2", "A100-40GB-SXM", "A100-80GB-SXM",
            "H100-SXM", "H100-PCIe", "H200-SXM"} <= set(GPUS)
    assert not GPUS["T4"].has("bf16") and not GPUS["V100-16GB-SXM2"].has("tf32") and GPUS["A100-40GB-SXM"].has("bf16")
    instances = load_instances(GPUS)
    assert {instance.provider for instance in instances} == {"aws", "gcp", "azure", "alibaba"}
    assert all(instance.source for instance in instances) and all(gpu.source for gpu in GPUS.values())
    assert any(math.isnan(instance.price_per_hour) for instance in instances), "unknown prices stay empty"


def test_a_catalogue_missing_a_column_or_with_a_bad_number_is_one_line(tmp_path):
    table = pd.read_csv(FOLDER / "instances.csv", dtype=str, keep_default_na=False)
    table.drop(columns="vcpus").to_csv(tmp_path / "mine.csv", index=False)
    with pytest.raises(UserError, match=r"mine.csv: missing column 'vcpus' \(the instance catalogue CSV has the "):
        load_instances(GPUS, tmp_path / "mine.csv")
    table.assign(price_per_hour_usd=["cheap"] + list(table["price_per_hour_usd"][1:])).to_csv(tmp_path / "bad.csv",
                                                                                              index=False)
    with pytest.raises(UserError, match=r"bad.csv: column 'price_per_hour_usd', row 1: expected a non-negative "
                                        r"number, got 'cheap'"):
        load_instances(GPUS, tmp_path / "bad.csv")
    assert INSTANCE_COLUMNS[0] == "provider"


def test_mixed_precision_takes_bf16_where_the_gpu_has_it_else_fp16():
    assert gpu_precision("auto", GPUS["T4"]) == "fp16" and gpu_precision("auto", GPUS["A10"]) == "bf16"
    assert gpu_precision("fp32", GPUS["A100-40GB-SXM"], tf32=True) == "tf32"
    assert gpu_precision("fp32", GPUS["V100-16GB-SXM2"], tf32=True) == "fp32"


def test_the_bound_is_compute_memory_or_launches_as_the_workload_says():
    big = Workload("train", 24e9, 2e8, "amp", 256, ops_per_batch=1000)
    streaming = Workload("train", 1e3, 4e7, "amp", 256, ops_per_batch=100)
    tiny = Workload("train", 1e3, 1e3, "amp", 16, ops_per_batch=400)
    gpu = GPUS["A100-80GB-SXM"]
    assert estimate(big, gpu).bound == "compute" and estimate(streaming, gpu).bound == "memory bandwidth"
    assert estimate(tiny, gpu).bound == "launch overhead"
    rate = estimate(big, gpu).samples_per_s
    assert rate.low < rate.expected < rate.high


def test_a_slow_loader_caps_the_rate_and_more_vcpus_lift_the_cap():
    workload = Workload("train", 1e9, 1e6, "amp", 64, loader_samples_per_s=100.0, loader_cores=2)
    four, sixteen = estimate(workload, GPUS["L4"], vcpus=4), estimate(workload, GPUS["L4"], vcpus=16)
    assert four.bound == "input pipeline" and four.samples_per_s.expected == pytest.approx(200)
    assert sixteen.samples_per_s.expected == pytest.approx(800)


def test_the_memory_gate_and_the_parallel_cpu_work():
    assert not estimate(Workload("train", 1e9, 1e6, "amp", 64, peak_memory_gb=30), GPUS["T4"]).fits
    assert estimate(Workload("train", 1e9, 1e6, "amp", 64, peak_memory_gb=30), GPUS["A100-40GB-SXM"]).fits
    assert cpu_seconds(100, True, 2, 8).expected == pytest.approx(25)
    assert cpu_seconds(100, False, 2, 8).expected == pytest.approx(100)
    assert data_parallel(Range(1, 1, 1), 8).expected == pytest.approx(7.2)


def resnet50_facts() -> dict[str, dict[str, float]]:
    """ResNet-50 at 224 px measured on this CPU as the common loop measures a run's model: FLOPs and bytes per
    image for training and inference, in fp32 and in bf16 (the traffic of mixed precision)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=1000)
    step = supervised(torch.nn.CrossEntropyLoss())
    batch = (torch.randn(2, 3, 224, 224), torch.randint(0, 1000, (2,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {name: measure_model(model, step, step.predict, batch, optimizer, torch.device("cpu"), dtype)
            for name, dtype in (("fp32", None), ("amp", torch.bfloat16))}


def ncf_facts() -> dict[str, float]:
    """NeuMF as DeepLearningExamples trains it on MovieLens-20m (138,493 users, 26,744 items; 64 factors, MLP
    256-256-128-64): memory- and launch-bound, unlike ResNet-50."""

    class NeuMF(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gmf_user, self.gmf_item = torch.nn.Embedding(138_493, 64), torch.nn.Embedding(26_744, 64)
            self.mlp_user, self.mlp_item = torch.nn.Embedding(138_493, 128), torch.nn.Embedding(26_744, 128)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                           torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU())
            self.out = torch.nn.Linear(128, 1)

        def forward(self, users, items):
            mlp = self.mlp(torch.cat([self.mlp_user(users), self.mlp_item(items)], -1))
            return self.out(torch.cat([self.gmf_user(users) * self.gmf_item(items), mlp], -1)).squeeze(-1)

    model = NeuMF()
    step = supervised(torch.nn.BCEWithLogitsLoss())
    size = 65_536
    batch = (torch.randint(0, 138_493, (size,)), torch.randint(0, 26_744, (size,)), torch.rand(size).round())
    facts = measure_model(model, step, step.predict, batch, torch.optim.Adam(model.parameters()), torch.device("cpu"),
                          None)
    return Workload("train", facts["train_flops_per_sample"], facts["train_bytes_per_sample"], "fp32", size,
                    weight_bytes=facts["weight_bytes"]).at_batch(1_048_576)


def published_predictions() -> pd.DataFrame:
    """Each published one-GPU figure against its prediction from the V100-16GB figure of the same table and
    setting (framework version, XLA or not)."""
    published = pd.read_csv(FOLDER / "published.csv")
    published = published[published["gpus"] == 1]
    resnet, ncf = resnet50_facts(), ncf_facts()
    rows = []
    for (model, setting, task, precision), group in published.groupby(["model", "setting", "task", "precision"]):
        reference = group[group["gpu"] == REFERENCE]
        if reference.empty:
            continue
        for _, row in group[group["gpu"] != REFERENCE].iterrows():
            if model.startswith("ResNet"):
                facts = resnet["amp" if precision in ("amp", "fp16") else "fp32"]
                kind = "train" if task == "train" else "infer"
                workload = Workload(task, facts[f"{kind}_flops_per_sample"], facts[f"{kind}_bytes_per_sample"],
                                    "amp" if precision == "amp" else precision, 2, weight_bytes=facts["weight_bytes"]
                                    ).at_batch(256)
            else:
                workload = replace(ncf, precision="amp" if precision in ("amp", "fp16") else precision)
            measured = replace(workload, measured_gpu=REFERENCE,
                               measured_samples_per_s=float(reference["samples_per_s"].iloc[0]))
            predicted = estimate(measured, GPUS[match_gpu(row["gpu"], GPUS)], GPUS,
                                 tf32=precision == "tf32").samples_per_s
            rows.append({"model": model, "task": task, "precision": precision, "gpu": row["gpu"],
                         "published": row["samples_per_s"], "low": predicted.low, "expected": predicted.expected,
                         "high": predicted.high})
    table = pd.DataFrame(rows)
    table["error"] = table["expected"] / table["published"] - 1
    return table


def test_predictions_from_a_measured_v100_contain_the_published_figures_of_other_gpus():
    table = published_predictions()
    assert len(table) >= 10 and table["model"].str.startswith("NCF").any() and table["gpu"].nunique() >= 3
    inside = (table["low"] <= table["published"]) & (table["published"] <= table["high"])
    assert inside.all(), table[~inside].to_string()
    assert table["error"].abs().mean() < 0.2
