"""The MLflow pyfunc every use case serves through, and how a run logs it: a `ServedModel` says how to `load` its
bundle and `answer` a request, raising `BadInput` for one it cannot answer (HTTP 400 with the one line). `log_served`
logs it from code: the use case's `pyfunc_entry.py`, its package (no other use case's), `common`, and the bundle."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature, infer_signature
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.types import ColSpec, Schema

from common.serving.bundle import decode, encode, load_bundle, save_bundle
from common.tracking.runs import Tracker
from common.usecase import Served

BUNDLE = "bundle"
ENTRY = "pyfunc_entry.py"  # beside the use case's serving code: `mlflow.models.set_model(TheServedModel())`


class BadInput(ValueError):
    """A request the served model cannot answer, said in one line: the client gets HTTP 400 with it."""


class ServedModel(mlflow.pyfunc.PythonModel):
    """A use case's served model: its bundle loaded safely, a bad request refused in one line."""

    @classmethod
    def from_bundle(cls, bundle: dict) -> ServedModel:
        """The model as the server will load it (through the codec), to probe, time and score as served."""
        model = cls()
        model.load(decode(encode(bundle)))
        return model

    def load_context(self, context) -> None:
        self.load(load_bundle(context.artifacts[BUNDLE]))

    def load(self, bundle: dict) -> None:
        raise NotImplementedError

    def answer(self, model_input, params: dict | None = None) -> Any:
        """The prediction for one request (`params`: MLflow's inference params); `BadInput` where it cannot be."""
        raise NotImplementedError

    def predict(self, context, model_input: pd.DataFrame, params=None):
        try:
            return self.answer(model_input, params)
        except BadInput as refused:
            raise MlflowException(" ".join(str(refused).splitlines()), error_code=INVALID_PARAMETER_VALUE) from None


def load_served(model_uri: str):
    """MLflow's pyfunc of `model_uri`. Under a server (`shared_models`), from the one copy its workers share, which
    the first to ask downloads. Else MLflow downloads it into a temporary folder it never removes (restarted servers
    filled /tmp with 450 MB copies): here that folder lies in this process's scratch, removed when it exits (the
    model's code is imported from it) or, where it was killed, by the next process that loads a model."""
    if shared := os.environ.get(SHARED_MODELS):
        return mlflow.pyfunc.load_model(shared_copy(model_uri, Path(shared)))
    folder = process_scratch(MODEL_SCRATCH)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    default, tempfile.tempdir = tempfile.tempdir, str(folder)  # where MLflow's `create_tmp_dir` makes its download
    try:
        return mlflow.pyfunc.load_model(model_uri)
    finally:
        tempfile.tempdir = default


MODEL_SCRATCH, SERVER_SCRATCH = "usecases-model-", "usecases-serve-"
SHARED_MODELS = "USECASES_SHARED_MODELS"  # the folder of the models a server's workers share (`shared_models`)


def shared_models():
    """A folder where a server's workers keep one copy of each model they serve, named in the environment they
    inherit; removed afterwards. Each worker maps the bundle's tensors from that copy (`load_bundle`), so the
    operating system holds the tables once, whatever the number of workers."""
    from common.serving.workers import shared_folder

    return shared_folder(SHARED_MODELS, SERVER_SCRATCH)


def shared_copy(model_uri: str, folder: Path) -> str:
    """The local copy of `model_uri` in `folder`, downloaded by whichever process asks first (the others wait on a
    lock, then read it): complete or absent, never half there."""
    import fcntl
    import hashlib

    name = hashlib.sha256(model_uri.encode()).hexdigest()[:16]
    target = folder / name
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "MLmodel").exists():
            partial = folder / f"{name}.partial-{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            os.replace(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(partial)), target)
            shutil.rmtree(partial, ignore_errors=True)
    return str(target)


def process_scratch(prefix: str) -> Path:
    """A temporary folder named for this process: those of processes no longer running (killed, or replaced by
    MLflow's scoring server, which keeps the id and runs nothing after) are removed here first."""
    import psutil
    root = Path(tempfile.gettempdir())
    for folder in root.glob(f"{prefix}*"):
        pid = folder.name.removeprefix(prefix)
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
    scratch = root / f"{prefix}{os.getpid()}"
    scratch.mkdir(exist_ok=True)
    return scratch


@dataclass(frozen=True)
class Publication:
    """How a served model is logged: `name` is the run's model it is, `requirements` the distributions it needs
    (pinned as installed here), `entry` the file that sets the served class, `params` (name: default) MLflow's
    inference params, `metadata` what the model's MLmodel carries."""

    name: str
    package: str
    requirements: tuple[str, ...]
    entry: str = ENTRY
    kind: str = ""
    optional_inputs: tuple[str, ...] = ()
    params: dict | None = None
    metadata: dict | None = None


def log_served(model: ServedModel, bundle: dict, example, tracker: Tracker, publication: Publication) -> Served | None:
    """Log `model` (loaded from `bundle`): `example` is probed through it and the signature inferred from its answer.
    None where the tracker does not write (another rank, a test)."""
    if not tracker.active:
        return None
    package, params = publication.package, publication.params
    signature = infer_signature(example, model.predict(None, example, params), params)
    if publication.optional_inputs:
        inputs = Schema([ColSpec(spec.type, spec.name, required=spec.name not in publication.optional_inputs)
                         for spec in signature.inputs.inputs])
        signature = ModelSignature(inputs, signature.outputs, signature.params)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "bundle.pt"
        save_bundle(bundle, path)
        code = _stage_package(package, Path(folder) / "code")
        info = mlflow.pyfunc.log_model(
            name="model", python_model=str(Path(sys.modules[package].__file__).with_name(publication.entry)),
            artifacts={BUNDLE: str(path)}, signature=signature, input_example=example, metadata=publication.metadata,
            code_paths=[str(code), str(Path(sys.modules["common"].__file__).parent)],
            pip_requirements=public_requirements(list(publication.requirements)))
    return Served(publication.name, info.model_uri, publication.kind)


def public_requirements(packages: list[str]) -> list[str]:
    """Pins any package index resolves (`torch==2.14.1`, not the local build `torch==2.14.1+cu130`), with the index
    that serves such a build named first."""
    pins, indexes = [], []
    for name in packages:
        public, _, local = version(name).partition("+")
        pins.append(f"{name}=={public}")
        if name == "torch" and local.startswith("cu"):
            indexes.append(f"--extra-index-url https://download.pytorch.org/whl/{local}")
    return indexes + pins


def _stage_package(package: str, folder: Path) -> Path:
    """The top-level package of `package` holding only `package` itself (for `usecases.NAME`, `usecases/__init__.py`
    empty and `usecases/NAME/`), so that a model of one use case does not carry the code of the others."""
    parts = package.split(".")
    for level in range(1, len(parts)):
        folder.joinpath(*parts[:level]).mkdir(parents=True, exist_ok=True)
        (folder.joinpath(*parts[:level]) / "__init__.py").write_text("")
    shutil.copytree(Path(sys.modules[package].__file__).parent, folder.joinpath(*parts),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return folder / parts[0]
