"""Where things live, file digests and atomic writes: what data modules need, without importing MLflow."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PROJECT_NAME = "gpu-usecases"


def project_root() -> Path:
    """`$USECASES_HOME`, else the clone this code runs from, else a per-user data folder: where the MLflow store
    and the checkpoints live, whatever folder a command starts in."""
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
    """Read-only copies of public data sets (`$USECASES_DATA_PATH`, like PATH): after the cache, before a download."""
    return [Path(entry).expanduser() for entry in os.environ.get("USECASES_DATA_PATH", "").split(os.pathsep) if entry]


def file_sha256(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def stored_bytes(*paths: Path) -> int:
    """The bytes a run reads from storage: each file's size on disk, a folder's files counted recursively."""
    return sum(entry.stat().st_size for path in map(Path, paths)
               for entry in (path.rglob("*") if path.is_dir() else [path]) if entry.is_file())


def write_json_atomic(data: dict, path: Path) -> None:
    write_text_atomic(json.dumps(data, indent=2, allow_nan=True), path)


def write_text_atomic(text: str, path: Path) -> None:
    """Write beside the target, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        handle.write(text)
    os.replace(handle.name, path)


@contextmanager
def building(folder: Path, marker: str) -> Iterator[Path | None]:
    """Build a cache folder out of sight and publish it whole: yields a work folder to fill (`marker` written last),
    or None when `folder` is complete already. Where another process (on a shared file system too) published it
    first, theirs is kept; work folders left for a day by killed processes are removed."""
    if (folder / marker).exists():
        yield None
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in folder.parent.glob(f"{folder.name}.partial-*"):
        if time.time() - stale.stat().st_mtime > 24 * 3600:
            shutil.rmtree(stale, ignore_errors=True)
    work = folder.with_name(f"{folder.name}.partial-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    work.mkdir()
    try:
        yield work
        if not (work / marker).exists():
            raise RuntimeError(f"{work}: built without its {marker}")
        try:
            work.rename(folder)
        except OSError:
            if not (folder / marker).exists():  # a half folder in the way, not another process's finished one
                shutil.rmtree(folder, ignore_errors=True)
                work.rename(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def git(folder: Path, *args: str) -> str:
    """What `git ARGS` prints in `folder`, or "" where git or the repository is missing."""
    try:
        out = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""
