"""The workload facts a run logs for `usecases advise`: exact FLOPs on a model whose count is known, traffic and
memory that grow with what they count, and a measurement that leaves the run as it was."""

from __future__ import annotations

import torch
from torch import nn

from common.config import TrainConfig
from common.runtime.devices import Runtime
from common.training.loop import TensorBatches, Trainer, supervised
from common.training.spec import TrainSpec
from common.training.workload import WorkloadProbe, loader_rate, measure_model

CPU = Runtime(torch.device("cpu"), None)


def test_a_linear_layer_counts_its_flops_exactly_and_its_weights_as_traffic():
    model = nn.Linear(4, 3)
    step = supervised(nn.MSELoss())
    batch = (torch.randn(8, 4), torch.randn(8, 3))
    facts = measure_model(model, step, step.predict, batch, torch.optim.SGD(model.parameters(), lr=0.1),
                          torch.device("cpu"), None)
    assert facts["infer_flops_per_sample"] == 2 * 4 * 3  # a multiply and an add per weight
    assert facts["train_flops_per_sample"] == 2 * 2 * 4 * 3  # and backward's weight gradient (the input needs none)
    assert facts["params"] == 15 and facts["weight_bytes"] == 15 * 4 and facts["batch_size"] == 8
    assert facts["train_bytes_per_sample"] > facts["infer_bytes_per_sample"] > 0
    assert facts["train_ops_per_step"] > facts["infer_ops_per_batch"] > 0 and facts["peak_memory_measured"] == 0

    wide = nn.Linear(4, 300)
    wider = measure_model(wide, step, step.predict, (batch[0], torch.randn(8, 300)),
                          torch.optim.SGD(wide.parameters(), lr=0.1), torch.device("cpu"), None)
    assert wider["peak_memory_gb"] > facts["peak_memory_gb"] and wider["train_bytes_per_sample"] > \
        facts["train_bytes_per_sample"]


def test_measuring_leaves_the_random_state_the_weights_and_no_gradients():
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    step = supervised(nn.MSELoss())
    weights = [parameter.detach().clone() for parameter in model.parameters()]
    batches = TensorBatches(torch.randn(64, 4), torch.randn(64, 1), batch_size=16, seed=0)
    rate, first = loader_rate(batches)
    before = torch.get_rng_state()
    measure_model(model, step, step.predict, first, torch.optim.Adam(model.parameters()), torch.device("cpu"), None)
    assert rate > 0 and len(first[0]) == 16
    assert all(parameter.grad is None for parameter in model.parameters())
    assert all(torch.equal(old, new) for old, new in zip(weights, model.parameters()))
    assert torch.equal(before, torch.get_rng_state()), "the dropout of the measured step moved the random state"


def test_the_loop_logs_the_facts_under_the_models_name_and_the_run_goes_on_alike():
    def train(measure: bool):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        logged = {}
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), supervised(nn.MSELoss()), CPU,
                          TrainSpec(TrainConfig(epochs=2), monitor="val/loss", model_name="tiny",
                                    log_metrics=lambda metrics, step: logged.update(metrics)))
        if not measure:
            trainer.callbacks = [callback for callback in trainer.callbacks if not isinstance(callback, WorkloadProbe)]
        batches = TensorBatches(torch.randn(64, 4), torch.randn(64, 1), batch_size=16, seed=0)
        trainer.fit(batches, lambda network: {"val/loss": 1.0})
        return logged, torch.rand(1)

    measured, after_measuring = train(True)
    plain, after_plain = train(False)
    assert torch.equal(after_measuring, after_plain), "the measurement changed the random state of the run"
    assert measured["model/tiny/train_flops_per_sample"] == 2 * 2 * 4
    assert measured["model/tiny/samples_per_epoch"] == 64 and measured["model/tiny/epochs_run"] == 2
    assert measured["model/tiny/loader_samples_per_s"] > 0 and "model/tiny/train_samples_per_s" in measured
    assert not any(key.startswith("model/") for key in plain)
