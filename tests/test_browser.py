"""The MLflow UI end to end, as a user clicks it: two smoke runs, the link to the experiment's Training runs (as
`training_runs_links` prints it), the runs table, Compare.

Playwright drives the system's Chromium (`.ci/run` installs it with apt where it is missing); without Playwright or
without any Chromium the test skips and says why. The screenshot of the compare page goes to $TEST_ARTIFACTS_DIR
(`.ci/run` sets it), else to the test's tmp_path; its path is printed either way."""

import contextlib
import math
import os
import shutil
from pathlib import Path

import pytest

from common.tracking.links import training_runs_links
from tests.cli_helpers import mlflow_server, usecases
from usecases import finance

# Chromium against a real server (35 to 40 s): in the slow suite, which CI runs on every landing, to keep the default
# suite under its 8 minutes
pytestmark = [pytest.mark.slow, pytest.mark.starts_first(9)]

USECASE = "finance"
EXPERIMENT = f"gpu-usecases-{USECASE}"
PRIMARY = f"primary/{finance.USECASE.primary_metric[0]}"  # what the CLI logs as the served model's primary metric
METRIC_SCROLLS = 60
SCROLL_METRIC_GRIDS = """() => document.querySelectorAll('.ReactVirtualized__Grid').forEach(grid => {
    grid.scrollTop += 90;
    grid.dispatchEvent(new Event('scroll'));
})"""
UI_TIMEOUT_MS = 60_000  # the SPA polls forever, so every wait is for `load` plus a selector, never `networkidle`
# The compare page lists metric names and values in two virtualized grids, a row's cells sharing its `top`.
METRIC_ROW_VALUES = """name => {
    const row = name.closest('[style*="top"]');
    const grids = [...document.querySelectorAll('.ReactVirtualized__Grid__innerScrollContainer')];
    const values = grids[grids.indexOf(row.parentElement) + 1];
    return [...values.children].filter(cell => cell.style.top === row.style.top).map(cell => cell.innerText.trim());
}"""
NO_CHROMIUM = "no Chromium: install it with apt-get install chromium, or run playwright install chromium"


def chromium_executable(playwright) -> str:
    """The system's Chromium (or Chrome), else a browser Playwright downloaded itself; skip when there is none."""
    candidates = [os.environ.get("CHROMIUM")] + [shutil.which(name) for name in
                                                 ("chromium", "chromium-browser", "google-chrome",
                                                  "google-chrome-stable")]
    with contextlib.suppress(Exception):  # Playwright's own browser, there after `playwright install chromium`
        candidates.append(playwright.chromium.executable_path)
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
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed (pip install -e '.[dev]')")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_executable(playwright))
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def tracking_server(tmp_path):
    folder = tmp_path / "server"
    folder.mkdir()
    with mlflow_server(folder) as url:
        yield url


def save_artifact(source: Path) -> Path:
    folder = os.environ.get("TEST_ARTIFACTS_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        source = Path(shutil.copy2(source, Path(folder) / source.name))
    print(f"\nscreenshot: {source}")
    return source


@pytest.mark.timeout(300)
def test_compare_two_smoke_runs_in_the_mlflow_ui(browser, tracking_server, tmp_path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_server, "USECASES_CHECKPOINT_DIR": str(tmp_path / "ck")}
    for _ in range(2):  # what is browsed is the runs, not the models: one baseline, three epochs
        result = usecases("run", USECASE, "--preset", "smoke", "--set", "baselines.models=[ewma]",
                          "--set", "train.epochs=3", env=env)
        assert result.returncode == 0, result.stderr[-3000:]

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_server)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 2 and all(run.info.status == "FINISHED" and PRIMARY in run.data.metrics for run in runs)
    run_ids = {run.info.run_id for run in runs}
    run_names = sorted(run.info.run_name for run in runs)  # the CLI names both `finance-smoke`
    link = training_runs_links(tracking_server, [USECASE])[USECASE]

    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.set_default_timeout(UI_TIMEOUT_MS)
    try:
        compare_in_the_ui(page, link, run_ids, run_names,
                          [run.data.metrics[PRIMARY] for run in runs], tmp_path / "browser-compare.png")
    except Exception:
        page.screenshot(path=str(tmp_path / "browser-failure.png"))  # where the UI stood when it went wrong
        save_artifact(tmp_path / "browser-failure.png")
        raise


def compare_in_the_ui(page, link, run_ids, run_names, logged, screenshot):
    """Open the use case's Training runs link, select both runs in its table, open Compare, screenshot it and check
    what it shows."""
    page.goto(link, wait_until="load")  # the bare experiment URL would open the GenAI Overview in MLflow 3
    page.get_by_text(run_names[0], exact=True).first.wait_for()
    # The user landed on the runs table, not the Overview: the address kept its runs route and both runs are rows.
    assert page.url.endswith("/runs") or "/runs?" in page.url, page.url
    assert page.locator('[role="row"]', has=page.get_by_text(run_names[0], exact=True)).count() >= 2
    # AG Grid renders hidden duplicate checkboxes per row: only the visible ones are the row selectors.
    boxes = page.locator('[role="row"] input[type="checkbox"]:visible:not([aria-label="Select all runs"])')
    assert boxes.count() == 2, f"expected a visible selector per run, found {boxes.count()}"
    for index in range(2):
        boxes.nth(index).check()
    page.get_by_role("button", name="Compare", exact=True).click()
    page.wait_for_url("**/compare-runs?**", wait_until="load")
    page.get_by_text("Run ID:", exact=True).wait_for()

    # Fold the plots and the (equal) parameters so that one screen shows run ids, names and the metric; the
    # metrics table renders only the rows in view, and a run logs dozens (its workload facts among them).
    for section in ("Visualizations", "Parameters"):
        page.get_by_role("button", name=section, exact=True).click()
    metric = page.locator("a[title='Plot chart']", has_text=PRIMARY).first
    page.locator("a[title='Plot chart']").first.wait_for()
    # The metrics' name and value grids render only the rows in view, and a run logs dozens of metrics (its
    # workload facts among them): scroll both on a row at a time until the metric's row is rendered in each.
    for _ in range(METRIC_SCROLLS):
        if metric.count() and metric.evaluate(METRIC_ROW_VALUES):
            break
        page.evaluate(SCROLL_METRIC_GRIDS)
        page.wait_for_timeout(200)
    metric.wait_for()
    page.screenshot(path=str(screenshot))  # the page scrolls inside <main>: a full_page shot would be no taller
    save_artifact(screenshot)

    ids_row = page.locator("tr", has=page.get_by_text("Run ID:", exact=True))
    assert set(ids_row.locator("a").all_inner_texts()) == run_ids
    names_row = page.locator("tr", has=page.get_by_text("Run Name:", exact=True))
    assert sorted(text.strip() for text in names_row.locator("td").all_inner_texts()) == run_names
    assert metric.is_visible() and metric.inner_text().strip() == PRIMARY
    # The metric's chart link covers both runs, and its row shows each run's value (rounded for display).
    assert all(run_id in metric.get_attribute("href") for run_id in run_ids)
    shown = metric.evaluate(METRIC_ROW_VALUES)
    assert len(shown) == 2 and all(math.isclose(float(text), value, rel_tol=5e-3, abs_tol=5e-4)
                                   for text, value in zip(sorted(shown, key=float), sorted(logged))), (shown, logged)
