"""Images from disk on the Dask engine: decoded in parallel, a task per batch of files, into one memory-mapped
uint8 `.npy` per split, cached by the data's digest and the decoding settings. Also the synthetic set written as
PNG files with a manifest (`data.synthetic.as_files`), read back as a user's own would be."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from common.paths import building, cache_dir
from .config import Files, Synthetic
from .images import SPLITS, ImageSet
from .pixels import read_image

log = logging.getLogger(__name__)

FILES_PER_TASK = 512
SHARDS_FORMAT = 1  # bump when what the cache holds changes


def decode_to_shards(files: list[Path], rows: dict[str, np.ndarray], config: Files, sha256: str,
                     client) -> dict[str, np.ndarray]:
    """Each split's images as a memory-mapped (N, size, size, channels) uint8 array, in `rows` order."""
    order = hashlib.sha256(b"".join(rows[split].astype(np.int64).tobytes() + b"|" for split in SPLITS)).hexdigest()
    settings = {"format": SHARDS_FORMAT, "data": sha256, "rows": order, "size": config.image_size,
                "channels": config.channels, "window": [config.window_center, config.window_width]}
    folder = cache_dir("medical-decoded") / hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:20]
    with building(folder, "done") as work:
        if work is None:
            log.info("data: the images decoded earlier, from %s", folder)
        else:
            _decode(files, rows, config, client, work)
    # copy-on-write: writable views for torch, while nothing can change the cached files
    return {split: np.load(folder / f"{split}.npy", mmap_mode="c") for split in SPLITS}


def _decode(files: list[Path], rows: dict[str, np.ndarray], config: Files, client, work: Path) -> None:
    (work / "parts").mkdir()
    shape = (config.image_size, config.image_size, config.channels)
    for split in SPLITS:
        members = rows[split]
        batches = [members[start:start + FILES_PER_TASK] for start in range(0, len(members), FILES_PER_TASK)]
        parts = [work / "parts" / f"{split}-{index:06d}.npy" for index in range(len(batches))]
        client.gather(client.map(_decode_batch, [[files[row] for row in batch] for batch in batches], parts,
                                 config=config, pure=False))
        joined = np.lib.format.open_memmap(work / f"{split}.npy", mode="w+", dtype=np.uint8,
                                           shape=(len(members), *shape))
        start = 0
        for part in parts:
            images = np.load(part)
            joined[start:start + len(images)] = images
            start += len(images)
            part.unlink()
        joined.flush()
        del joined
    (work / "parts").rmdir()
    log.info("data: %d images decoded on Dask into %s", sum(len(rows[split]) for split in SPLITS), work)
    (work / "done").write_text("")


def _decode_batch(files: list[Path], path: Path, config: Files) -> None:
    np.save(path, np.stack([read_image(file, config) for file in files]))


def write_image_folder(config: Synthetic, generate: Callable[[], ImageSet], client=None) -> Path:
    """The synthetic set that `generate` draws, as PNG files with `manifest.csv`, written once per setting."""
    digest = hashlib.sha256(config.model_dump_json().encode()).hexdigest()[:20]
    folder = cache_dir("medical-synthetic") / digest
    with building(folder, "manifest.csv") as work:
        if work is not None:
            generated = generate()
            _write_folder(generated.images, generated.labels, generated.classes, client, work)
    return folder


def _write_folder(images: dict[str, np.ndarray], labels: dict[str, np.ndarray], classes: list[str], client,
                  work: Path) -> None:
    rows, tasks = [], []
    for split in SPLITS:
        for start in range(0, len(labels[split]), FILES_PER_TASK):
            names = [f"{split}/{classes[label]}/{split}-{start + offset:07d}.png"
                     for offset, label in enumerate(labels[split][start:start + FILES_PER_TASK])]
            tasks.append((images[split][start:start + FILES_PER_TASK], names))
            rows += [{"path": name, "label": classes[label], "split": split, "patient_id": Path(name).stem}
                     for name, label in zip(names, labels[split][start:start + FILES_PER_TASK])]
    if client is None:
        for batch, names in tasks:
            _write_pngs(batch, names, work)
    else:
        batches, names = zip(*tasks)  # the pixels go to the workers as data, not inside the task graph
        client.gather(client.map(_write_pngs, client.scatter(list(batches)), names, root=work, pure=False))
    pd.DataFrame(rows).to_csv(work / "manifest.csv", index=False)


def _write_pngs(batch: np.ndarray, names: list[str], root: Path) -> None:
    from PIL import Image

    for image, name in zip(batch, names):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[..., 0]).save(path)
