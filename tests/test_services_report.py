"""The service report of tests/services.py and .ci/services.py: a machine that has a service fails CI where that
service's tests skipped, and says which and why."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.services import summary

ROOT = Path(__file__).resolve().parents[1]


def report(nodeid, when, outcome, service, reason=""):
    longrepr = (nodeid, 1, f"Skipped: {reason}") if outcome == "skipped" else None
    return SimpleNamespace(nodeid=nodeid, when=when, outcome=outcome, skipped=outcome == "skipped",
                           longrepr=longrepr, user_properties=[("service", service)])


def test_each_test_counts_once_by_its_worst_phase():
    stats = {"passed": [report("a", "setup", "passed", "redis"), report("a", "call", "passed", "redis"),
                        report("b", "setup", "passed", "redis"), report("c", "setup", "passed", "postgresql")],
             "failed": [report("b", "teardown", "failed", "redis")],
             "skipped": [report("c", "setup", "skipped", "postgresql", "PostgreSQL is not installed"),
                         report("d", "setup", "skipped", "postgresql", "PostgreSQL is not installed")],
             "": [SimpleNamespace(nodeid="e", user_properties=[]),
                  report("f", "setup", "skipped", "shared-data", "cuCIM is not installed")]}
    assert summary(stats) == {"redis": {"ran": 2, "skipped": 0, "reasons": []},
                              "postgresql": {"ran": 0, "skipped": 2, "reasons": ["PostgreSQL is not installed"]}}


def test_redis_tests_are_grouped_by_the_fixture_they_use():
    from tests.services import services_of

    item = SimpleNamespace(fixturenames=["tmp_path", "redis_url"], iter_markers=lambda name: iter(()))
    assert services_of(item) == {"redis"}
    shared = SimpleNamespace(fixturenames=[], iter_markers=lambda name: iter(
        [pytest.mark.skipif(False, reason="the shared MovieLens copy is absent").mark] if name == "skipif" else []))
    assert services_of(shared) == {"shared-data"}


@pytest.fixture
def ci_services():
    spec = importlib.util.spec_from_file_location("ci_services", ROOT / ".ci" / "services.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_fails_where_a_service_it_has_was_skipped(ci_services, tmp_path, capsys):
    (tmp_path / "default.json").write_text(json.dumps({
        "redis": {"ran": 0, "skipped": 12, "reasons": ["Redis store: no redis-server on PATH"]},
        "shared-data": {"ran": 9, "skipped": 0, "reasons": []}}))
    (tmp_path / "slow.json").write_text(json.dumps({
        "chromium": {"ran": 1, "skipped": 0, "reasons": []},
        "postgresql": {"ran": 0, "skipped": 6, "reasons": ["PostgreSQL is not installed"]},
        "shared-data": {"ran": 4, "skipped": 0, "reasons": []}}))
    assert ci_services.main(str(tmp_path), "chromium", "shared-data") == 0
    out = capsys.readouterr().out
    assert "redis: 0 ran, 12 skipped: Redis store: no redis-server on PATH" in out
    assert "shared-data: 13 ran, 0 skipped" in out
    assert ci_services.main(str(tmp_path), "redis", "chromium") == 1
    assert "this machine has redis, yet tests that need it skipped" in capsys.readouterr().out
