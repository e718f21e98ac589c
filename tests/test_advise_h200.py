"""Issue 31's check of `usecases advise`: from the CPU `default` runs of medical and recsys (kept in tests/data/advisor/
with their source), the whole run on one H200, phase by phase, holds what the first H200 run measured; every
catalogue row gets a whole-run estimate; and the facts a run logged survive their JSON form."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from common.advisor.advise import advise
from common.advisor.catalog import Instance, load_gpus, load_instances
from common.advisor.estimate import HOST_SPEED, Range
from common.advisor.facts import RunFacts
from common.advisor.wholerun import whole_run
from common.runtime.phases import Phase
from common.tools.keep_facts import read_facts, write_facts

GPUS = load_gpus()

DATA = Path(__file__).parent / "data" / "advisor"
ONE_H200 = Instance("lab", "1 x H200", GPUS["H200-SXM"], 1, 16, 128.0, math.nan, "", "issue 31's machine", "")


def kept(name: str) -> tuple[RunFacts, dict]:
    return read_facts(DATA / f"{name}-default-cpu.json")


def h200() -> dict:
    return json.loads((DATA / "h200-figures.json").read_text())


def test_the_kept_runs_say_where_they_come_from():
    figures = h200()
    assert figures["source"]["issue"] == 31 and figures["source"]["commit"].startswith("3df813f")
    assert "H200" in figures["source"]["machine"]
    for name in ("medical", "recsys"):
        facts, rest = kept(name)
        source = rest["source"]
        assert source["usecase"] == name and source["preset"] == "default" and source["device"] == "cpu"
        assert source["commit"] and source["cpu"] and source["date"] and facts.gpu is None and facts.models


def predicted(facts: RunFacts):
    return whole_run(facts, ONE_H200, GPUS, None)


def test_the_prediction_for_one_h200_from_a_cpu_default_run_holds_what_the_h200_measured(monkeypatch):
    """Issue 31: from CPU `default` runs, one H200's ranges hold the H200's figures: medical's training rate (bench)
    and whole run, BPR's epoch (bench) and its full ranking (the CPU run's ranking rate times BPR's device speed-up).
    Without the host's cost per step, or without the phases, the same figures fall outside: the test tests those."""
    figures, (medical, _), (recsys, recsys_kept) = h200(), kept("medical"), kept("recsys")
    resnet = predicted(medical).models["resnet18"]
    rate = Range(*(546 / seconds for seconds in (resnet.epoch_s.high, resnet.epoch_s.expected, resnet.epoch_s.low)))
    assert rate.low <= figures["medical"]["bench_train_samples_per_s"] <= rate.high, rate
    run = predicted(medical).total_s
    assert run.low <= figures["medical"]["run_seconds"] <= run.high, run
    bpr = predicted(recsys).models["bpr"]
    assert bpr.epoch_s.low <= figures["recsys"]["bench_bpr_epoch_seconds"] <= bpr.epoch_s.high, bpr.epoch_s
    ranking = bpr.speedup.scaled(recsys_kept["metrics"]["test/bpr/users_per_s"])
    assert ranking.low <= figures["recsys"]["bench_ranking_users_per_s"] <= ranking.high, ranking

    monkeypatch.setattr("common.advisor.estimate.HOST_SECONDS_PER_OP", (0.0, 0.0, 0.0))
    no_host = predicted(medical).models["resnet18"]
    assert not no_host.epoch_s.low <= 546 / figures["medical"]["bench_train_samples_per_s"] <= no_host.epoch_s.high
    assert predicted(recsys).models["bpr"].epoch_s.high < figures["recsys"]["bench_bpr_epoch_seconds"]
    monkeypatch.undo()
    without_phases = predicted(replace(medical, phases={}, total_seconds=math.nan)).total_s
    assert without_phases.high < figures["medical"]["run_seconds"]


def test_each_phase_scales_as_it_says():
    """`cores` work shares the instance's vCPUs as it shared the run's cores, `serial` work takes what it took at
    another host's speed, `device` work divides by its model's speed-up (the longest-training model's where the
    phase names none), a torch model's fit is its estimated steps and the rest of its fit; the start-ups are added
    once and the phases sum to the run."""
    facts, _ = kept("medical")
    facts = replace(facts, cores=2, phases={"fit/resnet18": Phase(559.0, "device"), "baselines": Phase(80.0, "cores"),
                                            "plots": Phase(3.0, "serial"), "predict": Phase(10.0, "device"),
                                            "replay/resnet18": Phase(20.0, "device")}, total_seconds=700.0)
    whole = predicted(facts)
    phases = {phase.name: phase for phase in whole.phases}
    assert phases["baselines"].seconds.expected == pytest.approx(80 * 2 / 16)
    assert phases["plots"].seconds == Range(3 / HOST_SPEED[2], 3.0, 3 / HOST_SPEED[0])
    speedup = whole.models["resnet18"].speedup
    assert phases["predict"].seconds.expected == pytest.approx(10 / speedup.expected)
    assert phases["replay/resnet18"].model == phases["predict"].model == "resnet18"
    assert phases["replay/resnet18"].seconds.high == pytest.approx(20 / speedup.low)
    assert phases["fit/resnet18"].seconds == whole.models["resnet18"].fit_s == whole.training_s
    assert phases["other"].measured_s == pytest.approx(700 - 559 - 80 - 3 - 10 - 20)
    assert {"start", "gpu start-up"} <= set(phases)
    names = [phase.name for phase in whole.phases]
    assert len(names) == len(set(names)), names  # each phase, and each start-up, once
    assert math.isnan(phases["start"].measured_s) and math.isnan(phases["gpu start-up"].measured_s)  # not in the 700 s
    assert math.fsum(phase.measured_s for phase in whole.phases if not math.isnan(phase.measured_s)) == \
        pytest.approx(700.0)  # every second the run measured, in one phase
    assert speedup.low <= 1 < speedup.expected < speedup.high


def test_every_catalogue_row_has_a_whole_run_estimate_with_training_a_part_of_it():
    instances = load_instances(GPUS)
    for name in ("medical", "recsys"):
        facts, _ = kept(name)
        for row in advise(facts, instances, GPUS, "both"):
            run, training = row.run_seconds, row.train_seconds
            assert 0 < run.low <= run.expected <= run.high < math.inf, (name, row.instance.name)
            assert training.expected < run.expected and row.serve_per_s.expected > 0, (name, row.instance.name)
    assert {"g5.xlarge", "g5.2xlarge", "g5.12xlarge"} <= {instance.name for instance in instances}
    assert GPUS["A10G"].has("fp32") and not math.isnan(GPUS["A10G"].tdp_w)


def test_run_facts_keep_their_phases_through_json(tmp_path):
    facts, rest = kept("medical")
    write_facts(tmp_path / "again.json", facts, rest["source"], rest["metrics"])
    again, rest_again = read_facts(tmp_path / "again.json")
    assert again == facts and rest_again == rest and again.phases["fit/resnet18"].scales == "device"
