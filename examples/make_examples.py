"""Writes every file under examples/: `.venv/bin/python examples/make_examples.py` (seeded, so the same files again).

All the data is synthetic, drawn here, so it can be shipped and changed freely: no patient, market or user data.
Each file is in the format its use case's README ("Data") documents for your own data.
"""

from __future__ import annotations

import csv
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def finance(folder: Path) -> None:
    """Two tickers x 700 business days of daily prices from the finance use case's own GJR-GARCH-t simulator
    (volatility clustering, leverage, fat tails; High and Low the extremes of an intraday path), in long format."""
    from usecases.finance.config import Synthetic
    from usecases.finance.data import synthetic_panel

    days = 700
    frame = synthetic_panel(Synthetic(tickers=2, days=days, seed=11)).frame
    frame["date"] = np.tile(pd.bdate_range("2021-01-04", periods=days).strftime("%Y-%m-%d"), 2)
    frame["ticker"] = frame["ticker"].map({"SYN000": "ACME", "SYN001": "GLOBEX"})
    for column in ("open", "high", "low", "close"):
        frame[column] = frame[column].round(2)
    folder.mkdir(parents=True, exist_ok=True)
    frame[["date", "ticker", "open", "high", "low", "close"]].to_csv(folder / "prices.csv", index=False)


def scan(kind: str, rng: np.random.Generator, size: int = 64) -> np.ndarray:
    """A grey 'scan': textured background, and a bright mass: round and smooth-edged (benign) or irregular with
    spikes (malignant), at a random place, size and angle."""
    grid = np.arange(size, dtype=np.float32)
    rows, cols = np.meshgrid(grid, grid, indexing="ij")
    centre = rng.uniform(0.35, 0.65, 2) * size
    radius = rng.uniform(0.12, 0.2) * size
    distance = np.hypot(rows - centre[0], cols - centre[1])
    if kind == "malignant":
        angle = np.arctan2(rows - centre[0], cols - centre[1]) + rng.uniform(0, 2 * math.pi)
        spikes = rng.integers(5, 9)
        radius = radius * (0.8 + 0.45 * np.abs(np.cos(spikes * angle / 2)) ** 4)
    mass = 1 / (1 + np.exp((distance - radius) / (0.6 if kind == "malignant" else 1.8)))
    background = 0.25 + 0.08 * rng.standard_normal((size // 8, size // 8))
    background = np.kron(background, np.ones((8, 8), np.float32))
    image = background + 0.55 * mass + 0.07 * rng.standard_normal((size, size))
    return (np.clip(image, 0, 1) * 255).astype(np.uint8)


def medical(folder: Path) -> None:
    """48 patients, one or two 64x64 grey PNG scans each, benign or malignant by patient; the split is by patient."""
    from PIL import Image

    rng = np.random.default_rng(3)
    shutil.rmtree(folder / "scans", ignore_errors=True)
    (folder / "scans").mkdir(parents=True)
    splits = ["train"] * 32 + ["val"] * 6 + ["test"] * 10
    rows = []
    for index, split in enumerate(splits):
        patient = f"P{index + 1:03d}"
        label = "malignant" if index % 2 else "benign"
        for side in ("left", "right")[: 1 + index % 3 // 2]:
            name = f"scans/{patient.lower()}_{side}.png"
            Image.fromarray(scan(label, rng)).save(folder / name, optimize=True)
            rows.append([name, label, patient, split])
    with (folder / "manifest.csv").open("w", newline="") as file:
        csv.writer(file, lineterminator="\n").writerows([["path", "label", "patient_id", "split"], *rows])


GENRES = ("Drama", "Comedy", "Thriller", "Documentary", "Romance", "Sci-Fi", "Animation", "Western")
WORDS = ("Night", "River", "Garden", "Winter", "Signal", "Harbour", "Echo", "Mirror", "Orchard", "Lantern", "Storm",
         "Atlas", "Meadow", "Circuit", "Compass", "Ember")


def recsys(folder: Path) -> None:
    """300 users x 15 ratings of 400 items, from the recsys use case's latent-factor simulator (taste plus Zipf
    popularity, ratings rising with affinity, times over 2020), with made-up titles."""
    from usecases.recsys.config import Synthetic
    from usecases.recsys.synthetic import synthetic_log

    log = synthetic_log(Synthetic(users=300, items=400, interactions_per_user=15, factors=8, seed=5)).frame
    rng = np.random.default_rng(5)
    titles = {item: f"{WORDS[rng.integers(len(WORDS))]} {WORDS[rng.integers(len(WORDS))]} "
                    f"({2000 + item % 24}, {GENRES[item % len(GENRES)]})" for item in range(1, 401)}
    log = log.rename(columns={"user": "user_id", "item": "item_id"}).sort_values(["timestamp", "user_id"])
    log["rating"] = log["rating"].astype(int)
    log["title"] = log["item_id"].map(titles)
    folder.mkdir(parents=True, exist_ok=True)
    log[["user_id", "item_id", "rating", "timestamp", "title"]].to_csv(folder / "events.csv", index=False)


def slides(folder: Path) -> None:
    """Eight 1024 x 1024 pyramidal tiled TIFF slides at 0.5 microns per pixel (the medical use case's H&E-like
    simulator; positive slides hold tumour-like nuclei clusters), four patients, and labels.csv with the split."""
    from usecases.medical.slides.synthetic import write_slide

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    splits = ["train"] * 4 + ["val"] * 2 + ["test"] * 2
    rows = [["slide", "label", "patient", "split"]]
    for index, split in enumerate(splits):
        label = "tumour" if index % 2 else "normal"
        name = f"case-{index + 1:02d}.tif"
        write_slide(folder / name, 1024, 1024, positive=label == "tumour", seed=100 + index, compression="jpeg")
        rows.append([name, label, f"P{index // 2 + 1:02d}", split])
    with (folder / "labels.csv").open("w", newline="") as file:
        csv.writer(file, lineterminator="\n").writerows(rows)


if __name__ == "__main__":
    chosen = sys.argv[1:] or ["finance", "medical", "recsys", "slides"]
    for name in chosen:
        globals()[name](HERE / name)
        print(f"examples/{name}/ written")
