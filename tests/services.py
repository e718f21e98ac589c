"""Which service-backed tests ran and which skipped, and why: a group per service a test needs (Redis, PostgreSQL,
Chromium, the shared data sets), printed at the end of every pytest run and written as JSON where
`USECASES_SERVICES_REPORT` names a file, so that `.ci/run` can say so and fail where a service it has was skipped.

A test belongs to a group by the fixture it uses (`redis_url`, `postgres`, `browser`), by a `service(NAME)` marker,
or, for the shared data, by a `skipif` whose reason names `shared`."""

import json
import os
from collections import defaultdict

import pytest

SERVICE_FIXTURES = {"redis_url": "redis", "postgres": "postgresql", "browser": "chromium"}
SERVICES = ("redis", "postgresql", "chromium", "shared-data")
SERVICE_WORDS = {"redis": ("redis",), "postgresql": ("postgres",), "chromium": ("chromium", "playwright"),
                 "shared-data": ("shared",)}


def services_of(item) -> set[str]:
    found = {SERVICE_FIXTURES[name] for name in item.fixturenames if name in SERVICE_FIXTURES}
    found |= {marker.args[0] for marker in item.iter_markers("service")}
    if any("shared" in str(marker.kwargs.get("reason", "")) for marker in item.iter_markers("skipif")):
        found.add("shared-data")
    return found


def pytest_configure(config):
    config.addinivalue_line("markers", "service(NAME): the test needs the service NAME (" + ", ".join(SERVICES) + ")")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The groups travel with each report (user_properties reach the xdist controller)."""
    outcome = yield
    report = outcome.get_result()
    for service in sorted(services_of(item)):
        report.user_properties.append(("service", service))


def _about(service: str, reason: str) -> bool:
    """Whether a skip is for want of the service (a test of the shared data may also skip without cuCIM, say)."""
    return any(word in reason.lower() for word in SERVICE_WORDS[service])


def _outcomes(stats) -> dict[str, dict[str, tuple[str, str]]]:
    """service -> nodeid -> (outcome, skip reason): a test's worst phase decides its outcome."""
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    found: dict[str, dict[str, tuple[str, str]]] = defaultdict(dict)
    for reports in stats.values():
        for report in reports:
            services = [value for name, value in getattr(report, "user_properties", ()) if name == "service"]
            if not services or not hasattr(report, "outcome"):
                continue
            if report.outcome == "passed" and report.when != "call":
                continue
            reason = str(report.longrepr[2]).removeprefix("Skipped: ") if report.skipped and isinstance(
                report.longrepr, tuple) else ""
            for service in services:
                if report.skipped and not _about(service, reason):
                    continue
                earlier = found[service].get(report.nodeid)
                if earlier is None or rank[report.outcome] > rank[earlier[0]]:
                    found[service][report.nodeid] = (report.outcome, reason)
    return found


def summary(stats) -> dict[str, dict]:
    """Per service: how many of its tests ran (passed or failed), how many skipped, and each distinct skip reason."""
    result = {}
    for service, tests in sorted(_outcomes(stats).items()):
        reasons = sorted({reason for outcome, reason in tests.values() if outcome == "skipped"})
        result[service] = {"ran": sum(outcome != "skipped" for outcome, _ in tests.values()),
                           "skipped": sum(outcome == "skipped" for outcome, _ in tests.values()),
                           "reasons": reasons}
    return result


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    groups = summary(terminalreporter.stats)
    terminalreporter.section("service-backed tests")
    for service in SERVICES:
        group = groups.get(service)
        if group is None:
            terminalreporter.write_line(f"{service}: no test of this run needs it")
            continue
        why = f" ({'; '.join(group['reasons'])})" if group["reasons"] else ""
        terminalreporter.write_line(f"{service}: {group['ran']} ran, {group['skipped']} skipped{why}")
    path = os.environ.get("USECASES_SERVICES_REPORT")
    if path:
        with open(path, "w") as out:
            json.dump(groups, out, indent=1)
