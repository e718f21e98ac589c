"""The serving layer: the bundle codec stores every kind of value without a pickle and refuses what would need one;
the pyfunc base loads its bundle safely and answers bad input with HTTP 400 and the use case's one line; a logged
model serves what the probe answered."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, ErrorCode

from common.config import ConfigModel
from common.serving.bundle import decode, encode, load_bundle, save_bundle
from common.serving.pyfunc import (MODEL_SCRATCH, SERVER_SCRATCH, BadInput, Publication, ServedModel, log_served,
                                   process_scratch)
from common.tracking.runs import Tracker, tracked_run
from tests.cli_helpers import mlflow_server


def every_kind() -> dict:
    return {"tensor": torch.arange(6, dtype=torch.float32).reshape(2, 3), "flag": torch.tensor([True, False]),
            "floats": np.array([[0.5, 1.5], [2.5, 3.5]]), "ints": np.array([1, 2, 3], dtype=np.int32),
            "ids": np.array([None, "u1", "u2"], dtype=object), "text": np.array(["a", "bc"]),
            "csr": sp.csr_matrix(np.eye(3, 4, dtype=np.float32)), "csc": sp.csc_matrix(np.eye(2, dtype=np.float64)),
            "nested": {"states": [{"w": torch.ones(2)}], "pair": (np.array([1.0]), "x"), "none": None},
            "plain": ["a", 1, 2.5, True], "dtype": torch.float16}


def assert_same(restored, original) -> None:
    if sp.issparse(original):
        assert sp.isspmatrix_csr(restored) and restored.dtype == original.dtype and restored.shape == original.shape
        assert (restored != original.tocsr()).nnz == 0
    elif isinstance(original, np.ndarray):
        assert restored.dtype == original.dtype and restored.shape == original.shape
        assert restored.tolist() == original.tolist()
    elif isinstance(original, torch.Tensor):
        assert restored.dtype == original.dtype and torch.equal(restored, original)
    elif isinstance(original, dict):
        assert set(restored) == set(original)
        for key in original:
            assert_same(restored[key], original[key])
    elif isinstance(original, (list, tuple)):
        assert type(restored) is type(original) and len(restored) == len(original)
        for pair in zip(restored, original):
            assert_same(*pair)
    else:
        assert restored == original


def test_every_kind_of_value_round_trips_through_a_weights_only_file(tmp_path):
    bundle = every_kind()
    save_bundle(bundle, tmp_path / "bundle.pt")
    assert_same(load_bundle(tmp_path / "bundle.pt"), bundle)
    assert_same(decode(torch.load(tmp_path / "bundle.pt", weights_only=True)), bundle)
    indices = encode({"csr": bundle["csr"]})["csr"]["__csr__"][1]
    assert indices.dtype == torch.int32  # the index type of the matrix, not widened


class Opaque:
    """Anything torch could only store by pickling it."""


@pytest.mark.parametrize(("value", "where"), [(Opaque(), "bundle['model']"),
                                              (np.float64(1.5), "bundle['model']"),
                                              ({"inner": [1, pd.Series([1.0])]}, "bundle['model']['inner'][1]")])
def test_a_value_that_needs_a_pickle_is_refused_when_encoded_naming_where_it_is(value, where):
    with pytest.raises(TypeError) as refused:
        encode({"model": value})
    assert str(refused.value).startswith(f"{where}: a ") and "pickling" in str(refused.value)


def test_a_pickled_file_is_refused_when_loaded(tmp_path):
    torch.save({"model": Opaque()}, tmp_path / "bundle.pt")
    with pytest.raises(pickle.UnpicklingError):
        load_bundle(tmp_path / "bundle.pt")


class Scaler(ServedModel):
    def load(self, bundle: dict) -> None:
        self.weights = bundle["weights"]

    def answer(self, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        if "x" not in model_input.columns:
            raise BadInput(f"input is missing column 'x'\n(got {', '.join(model_input.columns)})")
        return pd.DataFrame({"y": model_input["x"] * float(self.weights.sum())})


def test_bad_input_becomes_an_http_400_with_the_use_cases_line():
    model = Scaler.from_bundle({"weights": np.array([1.0, 2.0])})
    assert model.predict(None, pd.DataFrame({"x": [1.0]}))["y"].tolist() == [3.0]
    with pytest.raises(MlflowException) as refused:
        model.predict(None, pd.DataFrame({"z": [1.0]}))
    assert refused.value.error_code == ErrorCode.Name(INVALID_PARAMETER_VALUE)
    assert refused.value.get_http_status_code() == 400
    assert refused.value.message == "input is missing column 'x' (got z)"  # one line
    with pytest.raises(KeyError):  # a bug is not the client's fault: not a 400
        Scaler.from_bundle({}).predict(None, pd.DataFrame({"x": [1.0]}))


ENTRY = "import mlflow\nfrom servedcase.serving import Scaler\nmlflow.models.set_model(Scaler())\n"
SERVING = '''
import pandas as pd

from common.serving.pyfunc import BadInput, ServedModel


class Scaler(ServedModel):
    def load(self, bundle):
        self.weights = bundle["weights"]

    def answer(self, model_input, params=None):
        if (model_input["x"] < 0).any():
            raise BadInput("x must be at least 0")
        k = model_input["k"] if "k" in model_input.columns else 1
        return pd.DataFrame({"y": model_input["x"] * float(self.weights.sum()) * k})
'''


@pytest.fixture
def servedcase(tmp_path, monkeypatch):
    """A use case package of one served model and its models-from-code entry point, importable."""
    package = tmp_path / "src" / "servedcase"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "serving.py").write_text(textwrap.dedent(SERVING))
    (package / "pyfunc_entry.py").write_text(ENTRY)
    monkeypatch.syspath_prepend(str(package.parent))
    import servedcase.serving

    yield servedcase.serving
    for name in [module for module in sys.modules if module.startswith("servedcase")]:
        del sys.modules[name]


class Config(ConfigModel):
    name: str = "served"


def test_a_logged_model_serves_what_the_probe_answered_and_refuses_with_400(servedcase):
    bundle = {"weights": np.array([1.0, 2.0]), "matrix": sp.csr_matrix(np.eye(2))}
    example = pd.DataFrame({"x": [1.0, 2.0], "k": [2, 2]})
    assert log_served(servedcase.Scaler.from_bundle(bundle), bundle, example, Tracker(active=False),
                      Publication("scaler", "servedcase", ("numpy",))) is None  # another rank writes nothing
    with tracked_run("serving", Config(), {}) as tracker:
        served = log_served(servedcase.Scaler.from_bundle(bundle), bundle, example, tracker, Publication(
            "scaler", "servedcase", ("numpy",), optional_inputs=("k",), metadata={"kind": "test"}))
    assert served.model == "scaler" and served.uri.startswith("models:/")
    model = mlflow.pyfunc.load_model(served.uri)
    assert model.predict(example)["y"].tolist() == [6.0, 12.0]
    assert model.predict(pd.DataFrame({"x": [1.0]}))["y"].tolist() == [3.0]  # k is optional
    assert model.metadata.metadata == {"kind": "test"}
    assert {spec.name: spec.required for spec in model.metadata.get_input_schema().inputs} == {"x": True, "k": False}
    with pytest.raises(MlflowException) as refused:
        model.predict(pd.DataFrame({"x": [-1.0], "k": [1]}))
    assert refused.value.error_code == ErrorCode.Name(INVALID_PARAMETER_VALUE)
    assert refused.value.message == "x must be at least 0"


def test_logged_models_pin_public_versions_and_name_the_index_of_a_cuda_build(monkeypatch):
    from common.serving import pyfunc

    versions = {"torch": "2.14.1+cu130", "numpy": "2.4.6", "mlflow": "3.17.2"}
    monkeypatch.setattr(pyfunc, "version", versions.get)
    assert pyfunc.public_requirements(["torch", "numpy", "mlflow"]) == [
        "--extra-index-url https://download.pytorch.org/whl/cu130", "torch==2.14.1", "numpy==2.4.6", "mlflow==3.17.2"]
    versions["torch"] = "2.13.0+cpu"
    assert pyfunc.public_requirements(["torch"]) == ["torch==2.13.0"]


LOAD = """
import sys, mlflow
from common.serving.pyfunc import load_served
model = (load_served if sys.argv[2] == "ours" else mlflow.pyfunc.load_model)(sys.argv[1])
print(model.predict(__import__("pandas").DataFrame({"x": [1.0]}))["y"].tolist())
"""


@pytest.mark.slow  # a tracking server with proxied artifacts to start: 15 s
def test_a_model_loaded_from_a_team_server_leaves_no_download_behind_once_its_process_ends(servedcase, tmp_path,
                                                                                         monkeypatch):
    """From a server's proxied artifacts, MLflow's own download stays in the temporary folder for good (a thousand of
    them filled the disk); the one `load_served` loads from is removed when the process ends."""
    bundle = {"weights": np.array([1.0, 2.0])}
    (tmp_path / "server").mkdir()
    with mlflow_server(tmp_path / "server") as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        with tracked_run("serving", Config(), {}) as tracker:
            served = log_served(servedcase.Scaler.from_bundle(bundle), bundle, pd.DataFrame({"x": [1.0]}), tracker,
                                Publication("scaler", "servedcase", ("numpy",)))
        root = Path(__file__).resolve().parents[2]
        left = {}
        for loader in ("mlflow", "ours"):
            scratch = tmp_path / loader
            scratch.mkdir()
            env = {**os.environ, "TMPDIR": str(scratch),
                   "PYTHONPATH": os.pathsep.join([str(tmp_path / "src"), str(root)])}
            result = subprocess.run([sys.executable, "-c", LOAD, served.uri, loader], capture_output=True, text=True,
                                    env=env, timeout=120)
            assert result.returncode == 0, result.stderr[-2000:]
            assert result.stdout.strip().splitlines()[-1] == "[3.0]"
            left[loader] = list(scratch.rglob("MLmodel"))
    assert len(left["mlflow"]) == 1 and left["ours"] == [], left


@pytest.mark.parametrize("prefix", [SERVER_SCRATCH, MODEL_SCRATCH])
def test_a_process_scratch_outlives_it_only_until_the_next_one_starts(prefix, tmp_path, monkeypatch):
    """A scoring server (replaced by MLflow's, which runs nothing after) or a server killed with its model's 450 MB
    download leaves its scratch behind: the next process to make one removes those of processes no longer running."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / f"{prefix}{dead.stdout.strip()}" / "model").mkdir(parents=True)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / f"{prefix}{alive.pid}").mkdir()
        (tmp_path / "someone-elses").mkdir()
        scratch = process_scratch(prefix)
        assert scratch == tmp_path / f"{prefix}{os.getpid()}" and scratch.is_dir()
        assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
            [f"{prefix}{alive.pid}", f"{prefix}{os.getpid()}", "someone-elses"])
    finally:
        alive.kill()
