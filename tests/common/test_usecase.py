"""The plug-in contract: a package declares its use case once, discovery finds it in a folder or through an entry
point, a broken plug-in is one line and the others still load, and a run undoes the process-wide state it set."""

from __future__ import annotations

import ast
import importlib
import logging
import os
import re
import signal
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from common import runner

from common import usecase
from common.errors import UserError
from common.usecase import RunRequest, UseCase, discover, resolve

COMMON = Path(__file__).resolve().parents[2] / "common"

PLUGIN = '''
from common.config import ConfigModel, RuntimeConfig, TrackingConfig
from common.usecase import UseCase


class Config(ConfigModel):
    runtime: RuntimeConfig = RuntimeConfig()
    tracking: TrackingConfig = TrackingConfig()


USECASE = UseCase.declare(__name__, description="a plug-in for tests", config=Config, primary_metric=("score", "max"),
                          requirements=("numpy>=1",))  # installed: a run checks it
'''

PIPELINE = '''
import logging
import os
import signal
import warnings

import torch

from common.runtime.interrupt import stop_point
from common.usecase import RunResult

SEEN = []


def load_data(config, path):
    if path and path.name == "odd.csv":
        warnings.warn("odd.csv looks odd", UserWarning)
    tags = {"data_source": "test:plugin", "data_sha256": "0" * 64, "data_schema": "x:double,y:long"}
    return None, {**tags, "data_path": str(path)} if path else tags


def run(config, data, job):
    if os.environ.get("PLUGIN_CAP"):  # one model measured, then the time cap's signal
        job.model_done("first", {"score": 0.5})
        os.kill(os.getpid(), signal.SIGUSR1)
        while True:
            stop_point()
    SEEN.append({"threads": torch.get_num_threads(), "deterministic": torch.are_deterministic_algorithms_enabled(),
                 "env": os.environ.get("PLUGIN_RUN_MARK")})
    os.environ["PLUGIN_RUN_MARK"] = "set by a run"
    logging.getLogger("usecases").setLevel(logging.ERROR)
    return RunResult({"model": {"score": 1.0}})
'''


def write_plugin(folder: Path, name: str, presets: dict[str, str], init: str = PLUGIN) -> Path:
    package = folder / name
    (package / "presets").mkdir(parents=True)
    (package / "__init__.py").write_text(init)
    (package / "pipeline.py").write_text(PIPELINE)
    (package / "README.md").write_text(f"# {name}\n\nA plug-in written by a test, to check the contract.\n")
    for preset, text in presets.items():
        (package / "presets" / f"{preset}.yaml").write_text(textwrap.dedent(text))
    return package


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """A folder package `testcases` with one good and one broken use case in it, importable."""
    root = tmp_path / "src"
    (root / "testcases").mkdir(parents=True)
    (root / "testcases" / "__init__.py").write_text("")
    write_plugin(root / "testcases", "good", {"one": "runtime: {cpu_threads: 1}\n", "plain": "runtime: {}\n"})
    write_plugin(root / "testcases", "broken", {"smoke": "{}\n"}, init="import no_such_module_anywhere\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(usecase, "installed_entry_points", lambda: [])  # only these, not the installed ones
    yield root / "testcases"
    for name in [module for module in sys.modules if module.startswith("testcases")]:
        del sys.modules[name]


def test_declare_takes_the_name_and_folder_from_the_package(plugins):
    declared = importlib.import_module("testcases.good").USECASE
    assert isinstance(declared, UseCase)
    assert (declared.name, declared.package) == ("good", "testcases.good")
    assert declared.presets_dir == plugins / "good" / "presets"
    assert declared.summary() == "A plug-in written by a test, to check the contract."
    assert declared.requirements == ("numpy>=1",) and declared.columns(None) is None


def test_a_broken_plugin_is_one_line_and_the_others_still_load(plugins):
    found = discover("testcases", plugins)
    assert set(found) == {"good", "broken"}
    assert "testcases.good" not in sys.modules and "testcases.broken" not in sys.modules  # nothing imported yet
    assert resolve("good", found).name == "good" and found["good"].origin.startswith("folder ")
    with pytest.raises(UserError) as error:
        resolve("broken", found)
    assert "'broken'" in str(error.value) and "no_such_module_anywhere" in str(error.value)
    assert "\n" not in str(error.value)
    loaded = usecase.load_all(found)
    assert isinstance(loaded["good"], UseCase) and isinstance(loaded["broken"], UserError)
    with pytest.raises(UserError, match="unknown use case 'nope'"):
        resolve("nope", found)


SERVER_WITHOUT_BENCH = '''
def serve(settings):
    return 0


def default_events(tracking_uri):
    return "events.db"
'''


def test_a_server_without_the_plugin_protocol_is_one_line_when_discovered(plugins):
    """A use case's server.py is checked against `ServerPlugin` from its source, before anything of it runs."""
    (plugins / "good" / "server.py").write_text(SERVER_WITHOUT_BENCH)
    with pytest.raises(UserError) as refused:
        resolve("good", discover("testcases", plugins))
    assert "testcases.good.server does not define bench_requests" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert "testcases.good.server" not in sys.modules
    (plugins / "good" / "server.py").write_text(SERVER_WITHOUT_BENCH + "\n\ndef bench_requests(loaded, count, seed):\n"
                                                "    return []\n")
    found = resolve("good", discover("testcases", plugins))
    from common.server_plugin import ServerPlugin

    assert isinstance(found.server(), ServerPlugin)


def test_server_settings_are_checked_once_and_travel_as_one_value(monkeypatch):
    from types import SimpleNamespace

    from common.server_plugin import ServerSettings, check_retrieval

    with pytest.raises(UserError, match="--batch-ms must be at least 0, got -1"):
        ServerSettings("runs:/x/model", batch_ms=-1)
    with pytest.raises(UserError, match="--retrieval fast: expected one of exact, ann"):  # the plug-in's modes
        check_retrieval(SimpleNamespace(RETRIEVALS=("exact", "ann")), ["fast"])
    with pytest.raises(UserError, match="--retrieval ann: this use case's server serves one way only"):
        check_retrieval(SimpleNamespace(), ["ann"])
    settings = ServerSettings("runs:/x/model", port=5009, workers=3, events="redis://h:6379/0", batch_ms=2.0,
                              ann_index=Path("index.faiss"))
    monkeypatch.delenv("USECASES_SERVE_SETTINGS", raising=False)
    settings.to_environment()
    assert ServerSettings.from_environment() == settings and settings.ann_index == "index.faiss"


def test_an_installed_package_registers_through_its_entry_point(plugins, monkeypatch):
    class Dist:
        name, version = "acme-usecases", "2.0"

    class Point:
        name, value, dist = "external", "testcases.good", Dist()

    monkeypatch.setattr(usecase, "installed_entry_points", lambda: [Point()])
    found = discover(None, None)
    assert list(found) == ["external"] and found["external"].origin == "entry point of acme-usecases 2.0"
    assert found["external"].load().package == "testcases.good"


def test_a_name_claimed_by_a_folder_and_another_entry_point_is_a_conflict_not_a_silent_pick(plugins, monkeypatch):
    class Point:
        name, value, dist = "good", "elsewhere.good", None

    monkeypatch.setattr(usecase, "installed_entry_points", lambda: [Point()])
    found = discover("testcases", plugins)
    with pytest.raises(UserError, match="taken by elsewhere.good and testcases.good"):
        found["good"].load()
    assert found["broken"].origin.startswith("folder ")


def test_a_folder_without_a_usecase_declaration_is_reported(plugins):
    (plugins / "good" / "__init__.py").write_text("VALUE = 1\n")
    with pytest.raises(UserError, match="declares no USECASE"):
        discover("testcases", plugins)["good"].load()


def test_two_runs_in_one_process_each_get_their_own_settings(plugins, monkeypatch):
    """`usecases demo` runs one use case after another: a preset's threads, deterministic algorithms, environment
    and log levels must not leak into the next run."""
    monkeypatch.delenv("PLUGIN_RUN_MARK", raising=False)
    good = importlib.import_module("testcases.good").USECASE
    seen = importlib.import_module("testcases.good.pipeline").SEEN
    threads = torch.get_num_threads()
    level = logging.getLogger("usecases").level
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(2)
    try:
        runner.run_usecase(RunRequest(good, "one", ["runtime.deterministic=false"], device="cpu"))
        runner.run_usecase(RunRequest(good, "plain", device="cpu"))
        assert seen[0] == {"threads": 1, "deterministic": False, "env": None}
        assert seen[1] == {"threads": 2, "deterministic": True, "env": None}
        assert torch.get_num_threads() == 2 and torch.are_deterministic_algorithms_enabled() == deterministic
        assert "PLUGIN_RUN_MARK" not in os.environ and logging.getLogger("usecases").level == level
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_a_run_at_its_time_cap_finishes_with_the_models_it_measured_and_reaches_the_results_page(
        plugins, monkeypatch, tmp_path):
    """gpu-check's SIGUSR1: the run stops at its next safe point, ends FINISHED with its one measured model, tagged
    `capped`, registers nothing, and `usecases report` gives it a row that says so."""
    import mlflow

    from common.runtime.interrupt import stop_on_signals, stop_requested
    from common.tracking import results

    good = importlib.import_module("testcases.good").USECASE
    monkeypatch.setenv("PLUGIN_CAP", "1")
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        stop_on_signals()
        summary = runner.run_usecase(RunRequest(good, "plain", device="cpu", summary=tmp_path / "s.json"))
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert summary["models"] == {"first": {"score": 0.5}} and summary["capped"] is True and not stop_requested()
    (run,) = mlflow.search_runs(experiment_names=["gpu-usecases-good"], output_format="list")
    assert run.info.status == "FINISHED" and run.data.tags["capped"] == "true"
    assert run.data.metrics["test/first/score"] == 0.5 and "primary_model" not in run.data.tags
    page = results.report("good", good.primary_metric, mlflow.get_tracking_uri(), tmp_path / "pages").read_text()
    assert "0.5000" in page and re.search(r"\| \d+ s \(capped\) \|", page)


def test_a_run_logs_its_data_as_a_dataset_input_in_a_training_experiment(plugins):
    import mlflow

    good = importlib.import_module("testcases.good").USECASE
    result = runner.run_usecase(RunRequest(good, "plain", device="cpu"))
    run = mlflow.get_run(result["run_id"])
    (dataset_input,) = run.inputs.dataset_inputs
    assert dataset_input.dataset.name == "test:plugin" and dataset_input.dataset.digest == "0" * 12
    assert '"x"' in dataset_input.dataset.schema and dataset_input.tags[0].value == "training"
    assert dataset_input.dataset.source_type == "code" and "test:plugin" in dataset_input.dataset.source
    experiment = mlflow.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert experiment.tags["mlflow.note.content"] == "A plug-in written by a test, to check the contract."


def test_a_run_on_a_file_names_the_file_as_its_dataset_source(plugins, tmp_path):
    import mlflow

    good = importlib.import_module("testcases.good").USECASE
    (tmp_path / "events.csv").write_text("x,y\n1.0,2\n")
    result = runner.run_usecase(RunRequest(good, "plain", device="cpu", data=tmp_path / "events.csv"))
    (dataset_input,) = mlflow.get_run(result["run_id"]).inputs.dataset_inputs
    assert (tmp_path / "events.csv").resolve().as_uri() in dataset_input.dataset.source


def test_warnings_raised_while_loading_reach_the_user_once_the_data_passed(plugins, tmp_path):
    """Held back during loading (a rejected input is one error line), then replayed under the user's own filters."""
    good = importlib.import_module("testcases.good").USECASE
    (tmp_path / "odd.csv").write_text("x,y\n1.0,2\n")
    with pytest.warns(UserWarning, match="odd.csv looks odd"):
        runner.run_usecase(RunRequest(good, "plain", device="cpu", data=tmp_path / "odd.csv"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="odd.csv looks odd"):
            runner.run_usecase(RunRequest(good, "plain", device="cpu", data=tmp_path / "odd.csv"))


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args \
                and isinstance(node.args[0], ast.Constant):
            modules.add(node.args[0].value)
    return modules


@pytest.mark.parametrize("path", sorted(COMMON.glob("*.py")), ids=lambda path: path.name)
def test_common_never_imports_a_use_case(path):
    assert not {module for module in imported_modules(path) if module.split(".")[0] == "usecases"}


def test_what_data_modules_import_from_common_does_not_import_mlflow():
    import subprocess

    code = "import sys, common.paths, common.config, common.errors; print('mlflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr

