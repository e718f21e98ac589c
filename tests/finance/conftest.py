import pytest

from common.job import Job
from common.runtime.devices import Runtime
from common.tracking.runs import Tracker
from usecases.finance.config import Synthetic
from usecases.finance.data import synthetic_panel


@pytest.fixture(scope="session")
def panel():
    """Two tickers, about four years of GJR-GARCH days: enough for a walk-forward in seconds."""
    return synthetic_panel(Synthetic(tickers=2, days=1000, seed=3)).frame


@pytest.fixture
def cpu_job(tmp_path):
    import torch

    runtime = Runtime(torch.device("cpu"), None)
    return Job(runtime, Tracker(active=False), tmp_path / "checkpoints")


def _perturb_after(panel, cutoff, seed=0):
    """Different closes and wider ranges on every day after `cutoff`, all prices still consistent."""
    import numpy as np

    changed = panel.copy()
    later = changed["date"] > cutoff
    rng = np.random.default_rng(seed)
    changed.loc[later, "close"] *= rng.uniform(0.98, 1.02, later.sum())
    changed.loc[later, "high"] = changed.loc[later, ["high", "close"]].max(axis=1) * rng.uniform(1, 1.02, later.sum())
    changed.loc[later, "low"] = changed.loc[later, ["low", "close"]].min(axis=1)
    return changed


@pytest.fixture
def perturb_after():
    return _perturb_after
