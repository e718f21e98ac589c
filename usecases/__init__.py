"""The use cases, imported by name only when run, so the CLI can set up cuDF before pandas loads.

Each use case package provides `DESCRIPTION`, `PRESETS_DIR`, `Config` and optionally `summary_columns(config)` for
the printed table; its `pipeline` module provides `load_data(config, path)` and `run(config, data, job)`, and an
optional `benchmark` module `benchmark(config, data, job)` for `usecases bench`. Adding one means adding its
folder and a line here.
"""

import importlib
from types import ModuleType

from common.errors import UserError

USECASES = {
    "finance": "usecases.finance",
    "medical": "usecases.medical",
    "recsys": "usecases.recsys",
}


def load_usecase(name: str) -> ModuleType:
    if name not in USECASES:
        raise UserError(f"unknown use case '{name}' (available: {', '.join(USECASES)})")
    return importlib.import_module(USECASES[name])
