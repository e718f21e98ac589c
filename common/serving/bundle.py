"""The bundle a served model loads, in a form torch's `weights_only` loader reads, so that loading a model never
unpickles anything: tensors and plain data as they are, NumPy arrays as lists with their dtype, SciPy sparse matrices
as their CSR arrays in tensors. Anything else is refused when the bundle is encoded, not when it is served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

PLAIN = (str, bytes, int, float, complex, bool, type(None), torch.Tensor, torch.Size, torch.dtype, torch.device)
CSR, NDARRAY = "__csr__", "__ndarray__"


def save_bundle(bundle: dict, path: Path) -> None:
    torch.save(encode(bundle), path)


def load_bundle(path: str | Path) -> dict:
    """A saved bundle on the CPU; a file holding anything torch would have to unpickle is refused. Its tensors are
    mapped from the file, copy-on-write: the processes that load one file share its pages (a server's workers hold a
    million items' tables once), and a tensor one of them changes becomes that one's own."""
    return decode(torch.load(path, map_location="cpu", weights_only=True, mmap=True))


def encode(value: Any, where: str = "bundle") -> Any:
    """The bundle with its arrays and sparse matrices as plain data and tensors, at any depth."""
    if sp.issparse(value):
        csr = value.tocsr()
        return {CSR: [torch.from_numpy(np.ascontiguousarray(array)) for array in (csr.data, csr.indices, csr.indptr)],
                "shape": list(csr.shape)}
    if isinstance(value, np.ndarray):
        return {NDARRAY: value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {key: encode(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(encode(item, f"{where}[{index}]") for index, item in enumerate(value))
    if isinstance(value, PLAIN) and not isinstance(value, np.generic):  # np.float64 is a float, yet pickled
        return value
    raise TypeError(f"{where}: a {type(value).__module__}.{type(value).__qualname__} cannot be stored without "
                    f"pickling it (store tensors, arrays, sparse matrices or plain data)")


def decode(value: Any) -> Any:
    if isinstance(value, dict) and CSR in value:
        data, indices, indptr = (tensor.numpy() for tensor in value[CSR])
        return sp.csr_matrix((data, indices, indptr), shape=tuple(value["shape"]))
    if isinstance(value, dict) and NDARRAY in value:
        return np.array(value[NDARRAY], dtype=value["dtype"])
    if isinstance(value, dict):
        return {key: decode(item) for key, item in value.items()}
    return type(value)(decode(item) for item in value) if isinstance(value, (list, tuple)) else value
