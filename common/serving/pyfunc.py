"""The MLflow pyfunc every use case serves through, and how a run logs it.

A use case's served model subclasses `ServedModel`: it says how to `load` its bundle and how to `answer` a request,
and raises `BadInput` for a request it cannot answer. The base loads the bundle without unpickling anything and
turns `BadInput` into MLflow's INVALID_PARAMETER_VALUE, which the scoring server answers with HTTP 400 and the
one line. `log_served` logs such a model from code (MLflow's models-from-code): the use case's `pyfunc_entry.py`,
its package (and no other use case), `common`, and the bundle as the artifact `bundle`.
"""

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
        """The model as the server will load it: `bundle` through the codec, so that it is probed, timed and
        scored as served."""
        model = cls()
        model.load(decode(encode(bundle)))
        return model

    def load_context(self, context) -> None:
        self.load(load_bundle(context.artifacts[BUNDLE]))

    def load(self, bundle: dict) -> None:
        """Take what the run saved."""
        raise NotImplementedError

    def answer(self, model_input, params: dict | None = None) -> Any:
        """The prediction for one request (`params`: MLflow's inference params, where the signature has them);
        `BadInput` for one that cannot be answered."""
        raise NotImplementedError

    def predict(self, context, model_input: pd.DataFrame, params=None):
        """`model_input` is a DataFrame, or an array under a tensor signature: a hint MLflow infers no schema from
        (without one it warns), so requests are checked against the logged signature and by `answer`."""
        try:
            return self.answer(model_input, params)
        except BadInput as refused:
            raise MlflowException(" ".join(str(refused).splitlines()), error_code=INVALID_PARAMETER_VALUE) from None


def load_served(model_uri: str):
    """MLflow's pyfunc of `model_uri`. From a remote artifact store (a team server's proxied artifacts) MLflow
    downloads it into a temporary folder it never removes: servers restarted and benches rerun left a thousand copies
    of models in /tmp, 700 MB each for a million items, and filled the disk. Here that folder lies in one removed when
    this process exits (it lives as long as the process, since the model's code is imported from it). From a local
    store MLflow reads the model in place, and nothing is copied."""
    folder = tempfile.mkdtemp(prefix="usecases-model-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    default, tempfile.tempdir = tempfile.tempdir, folder  # where MLflow's `create_tmp_dir` makes its download folder
    try:
        return mlflow.pyfunc.load_model(model_uri)
    finally:
        tempfile.tempdir = default


SERVER_SCRATCH = "usecases-serve-"


def server_scratch() -> Path:
    """A temporary folder for a server that MLflow's scoring server replaces this process with (where it downloads
    the model), named by this process's id, which the server keeps; those of servers no longer running are removed
    here first, as nothing runs after the scoring server to remove its own."""
    root = Path(tempfile.gettempdir())
    for folder in root.glob(f"{SERVER_SCRATCH}*"):
        pid = folder.name.removeprefix(SERVER_SCRATCH)
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
    scratch = root / f"{SERVER_SCRATCH}{os.getpid()}"
    scratch.mkdir(exist_ok=True)
    return scratch


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


@dataclass(frozen=True)
class Publication:
    """How a served model is logged: `name` is the run's model it is, `package` the use case's, `requirements` the
    distributions it needs (pinned as installed here), `entry` the file beside the package's `__init__.py` that sets
    the served class (a use case serving two kinds of model has one each), `kind` the kind of model (`Served.kind`),
    `optional_inputs` the input columns marked as not required, `params` (name: default) MLflow's inference params,
    `metadata` what the model's MLmodel carries."""

    name: str
    package: str
    requirements: tuple[str, ...]
    entry: str = ENTRY
    kind: str = ""
    optional_inputs: tuple[str, ...] = ()
    params: dict | None = None
    metadata: dict | None = None


def log_served(model: ServedModel, bundle: dict, example, tracker: Tracker, publication: Publication) -> Served | None:
    """Log `model` (loaded from `bundle`) as the run's `model`, as `publication` says: `example` is probed through
    it and the signature inferred from its answer. Returns what was logged, or None where the tracker does not
    write (another rank, a test)."""
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
            name="model",
            python_model=str(Path(sys.modules[package].__file__).with_name(publication.entry)),
            artifacts={BUNDLE: str(path)},
            signature=signature,
            input_example=example,
            metadata=publication.metadata,
            code_paths=[str(code), str(Path(sys.modules["common"].__file__).parent)],
            pip_requirements=public_requirements(list(publication.requirements)),
        )
    return Served(publication.name, info.model_uri, publication.kind)


def public_requirements(packages: list[str]) -> list[str]:
    """Pins any package index resolves: `torch==2.14.1`, not the local build `torch==2.14.1+cu130`, with the index
    that serves such a build named first (pip reads the line as an option of requirements.txt)."""
    pins, indexes = [], []
    for name in packages:
        public, _, local = version(name).partition("+")
        pins.append(f"{name}=={public}")
        if name == "torch" and local.startswith("cu"):
            indexes.append(f"--extra-index-url https://download.pytorch.org/whl/{local}")
    return indexes + pins


def _stage_package(package: str, folder: Path) -> Path:
    """The top-level package of `package` holding only `package` itself, so that a model of one use case does not
    carry the code of the others: `usecases/__init__.py` (empty) and `usecases/NAME/`, for `usecases.NAME`."""
    parts = package.split(".")
    top = folder / parts[0]
    target = folder.joinpath(*parts)
    for level in range(1, len(parts)):
        (folder.joinpath(*parts[:level])).mkdir(parents=True, exist_ok=True)
        (folder.joinpath(*parts[:level]) / "__init__.py").write_text("")
    shutil.copytree(Path(sys.modules[package].__file__).parent, target,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return top
