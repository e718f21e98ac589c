"""The MLflow UI end to end, as a user clicks it: two smoke runs, the experiment's runs table, Compare.

Playwright drives the system's Chromium (`.ci/run` installs it with apt where it is missing); without Playwright or
without any Chromium the test skips and says why. The screenshot of the compare page goes to $TEST_ARTIFACTS_DIR
(`.ci/run` sets it), else to the test's tmp_path; its path is printed either way."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.cli_helpers import usecases
from usecases import finance

USECASE = "finance"
EXPERIMENT = f"gpu-usecases-{USECASE}"
PRIMARY = f"primary/{finance.PRIMARY_METRIC[0]}"  # what the CLI logs as the served model's primary metric
UI_TIMEOUT_MS = 60_000  # the SPA polls forever, so every wait is for `load` plus a selector, never `networkidle`
NO_CHROMIUM = "no Chromium: install it with apt-get install chromium, or run playwright install chromium"


def chromium_executable(playwright) -> str:
    """The system's Chromium (or Chrome), else a browser Playwright downloaded itself; skip when there is none."""
    candidates = [os.environ.get("CHROMIUM")] + [shutil.which(name) for name in
                                                 ("chromium", "chromium-browser", "google-chrome",
                                                  "google-chrome-stable")]
    try:
        candidates.append(playwright.chromium.executable_path)  # there after `playwright install chromium`
    except Exception:  # noqa: BLE001 - Playwright's own browser is optional: a system one will do
        pass
    for path in candidates:
        if path and os.access(path, os.X_OK) and not _snap_launcher(path):
            return path
    pytest.skip(NO_CHROMIUM)


def _snap_launcher(path: str) -> bool:
    """Ubuntu's chromium packages only launch the snap, which Playwright cannot drive."""
    if os.path.realpath(path).startswith("/snap/"):
        return True
    with open(path, "rb") as head:
        start = head.read(4096)
    return start.startswith(b"#!") and b"/snap/" in start


@pytest.fixture
def browser():
    """A headless Chromium under Playwright, started before anything slow so that a missing one skips at once."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.set_default_timeout(UI_TIMEOUT_MS)
    # The experiment's training runs (its bare URL opens the GenAI overview in MLflow 3).
    page.goto(f"{tracking_server}/#/experiments/{experiment.experiment_id}/runs", wait_until="load")
    page.get_by_text(run_names[0], exact=True).first.wait_for()
    # AG Grid renders hidden duplicate checkboxes per row: only the visible ones are the row selectors.
    boxes = page.locator('[role="row"] input[type="checkbox"]:visible:not([aria-label="Select all runs"])')
    assert boxes.count() == 2, f"expected a visible selector per run, found {boxes.count()}"
    for index in range(2):
        boxes.nth(index).check()
    page.get_by_role("button", name="Compare", exact=True).click()
    page.wait_for_url("**/compare-runs?**", wait_until="load")
    page.get_by_text("Run ID:", exact=True).wait_for()
    metric = page.locator("a[title='Plot chart']", has_text=PRIMARY).first
    metric.wait_for()

    screenshot = tmp_path / "browser-compare.png"
    page.screenshot(path=str(screenshot), full_page=True)
    save_artifact(screenshot)

    ids_row = page.locator("tr", has=page.get_by_text("Run ID:", exact=True))
    assert set(ids_row.locator("a").all_inner_texts()) == run_ids
    names_row = page.locator("tr", has=page.get_by_text("Run Name:", exact=True))
    assert sorted(text.strip() for text in names_row.locator("td").all_inner_texts()) == run_names
    assert metric.inner_text().strip() == PRIMARY
    # The metric's chart link covers both runs: each has a value in the compare table.
    assert all(run_id in metric.get_attribute("href") for run_id in run_ids)
