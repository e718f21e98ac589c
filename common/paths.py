"""Where things live, file digests and atomic writes: what data modules need, without importing MLflow."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

PROJECT_NAME = "gpu-usecases"


def project_root() -> Path:
    """`$USECASES_HOME`, else the clone this code runs from (an editable install), else a per-user data folder.

    The MLflow store and the checkpoints live here, so runs never depend on the folder a command starts in.
    """
    if os.environ.get("USECASES_HOME"):
        return Path(os.environ["USECASES_HOME"]).expanduser()
    clone = Path(__file__).resolve().parents[1]
    if (clone / "pyproject.toml").is_file():
        return clone
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / PROJECT_NAME


def cache_dir(kind: str, configured: Path | None = None, env_var: str | None = None) -> Path:
    """Downloads of data set `kind`: the configured folder, else `$env_var`, else ~/.cache/gpu-usecases/KIND."""
    if configured is not None:
        return Path(configured).expanduser()
    if env_var and os.environ.get(env_var):
        return Path(os.environ[env_var]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / PROJECT_NAME / kind


def data_search_path() -> list[Path]:
    """Read-only folders with copies of public data sets (`$USECASES_DATA_PATH`, separated like PATH), looked in
    after the cache and before a download: a team's shared mirror, or a development copy."""
    return [Path(entry).expanduser() for entry in os.environ.get("USECASES_DATA_PATH", "").split(os.pathsep) if entry]


def file_sha256(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def write_json_atomic(data: dict, path: Path) -> None:
    """Write beside the target, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        json.dump(data, handle, indent=2, allow_nan=True)
    os.replace(handle.name, path)


def git(folder: Path, *args: str) -> str:
    """What `git ARGS` prints in `folder`, or "" where git or the repository is missing."""
    try:
        out = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""
