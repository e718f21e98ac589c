"""Whole-slide learning as a user runs it: `usecases run medical --preset slides-smoke` (synthetic pyramidal TIFF
slides written once, tiled, stain-normalised, encoded, attention MIL against mean pooling), and a user's slide
folder refused in one line, before any run, for each mistake the issue names."""

import json
import shutil
from pathlib import Path

import mlflow
import numpy as np
import pytest
import tifffile
import torch

from tests.cli_helpers import assert_rejected, private_env, runs, usecases
from usecases.medical.slides.synthetic import write_slide

pytestmark = pytest.mark.starts_first(2)  # the default suite's longest files first (tests/conftest.py)

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "pathology"


@pytest.fixture(scope="module")
def slide_run(tmp_path_factory):
    """(summary, run, environment, stderr) of the slides-smoke preset on a local Dask cluster of two workers, in a
    private store and cache. One run (about 100 s) for the slow tests below: the README's slides-smoke command runs
    it in this process (tests/test_readme_commands.py), tests/test_examples.py the example slides so in the default
    suite, and the cluster path's features are compared with this process's there too."""
    folder = tmp_path_factory.mktemp("slides-smoke")
    env = private_env(folder)
    result = usecases("run", "medical", "--preset", "slides-smoke",
                      "--set", f"data.slides.cache_dir={folder / 'cache'}", "--set", "runtime.engine=dask",
                      "--set", "runtime.workers=2", "--summary", str(folder / "s.json"), timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs("medical", env["MLFLOW_TRACKING_URI"])
    return json.loads((folder / "s.json").read_text()), run, env, result.stderr


@pytest.mark.slow  # the smoke run (about 100 s)
def test_the_smoke_preset_on_the_dask_engine_encodes_on_the_cluster_and_learns(slide_run):
    summary, run, _, stderr = slide_run
    assert "encoded at" in stderr and "on the Dask cluster" in stderr
    models = summary["models"]
    assert models["attention_mil"]["auc"] >= 0.9 and models["mean_pool_logreg"]["auc"] >= 0.9
    assert run.data.tags["engine"] == "dask" and run.data.tags["dask_workers"] == "2"


@pytest.mark.slow  # the smoke run (about 100 s); the default suite serves tests/test_examples.py's slide run
def test_attention_mil_and_the_pooled_baseline_learn_the_slide_signal(slide_run):
    summary, run, _, _ = slide_run
    models = summary["models"]
    assert set(models) == {"attention_mil", "mean_pool_logreg"}
    assert models["attention_mil"]["auc"] >= 0.9 and models["attention_mil"]["val_auc"] >= 0.9
    assert models["attention_mil"]["auc_ci_low"] <= models["attention_mil"]["auc"]
    assert run.data.metrics["tiles_per_s"] > 0 and models["attention_mil"]["tiles"] > 1000
    assert run.data.tags["data_source"] == "synthetic:slides" and run.info.status == "FINISHED"


@pytest.mark.slow  # the smoke run (about 100 s); the default suite serves tests/test_examples.py's slide run
def test_each_test_slide_has_a_heatmap_and_the_slide_model_is_logged_to_serve(slide_run):
    _, run, _, _ = slide_run
    client = mlflow.MlflowClient()
    heatmaps = [item.path for item in client.list_artifacts(run.info.run_id, "heatmaps")]
    assert len(heatmaps) == int(run.data.tags["data_test_slides"]) >= 4
    served = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model").unwrap_python_model()  # no unpickling
    assert type(served).__name__ == "SlideClassifierModel" and 0 < served.threshold < 1
    assert served.settings["stain"] == "macenko" and served.settings["mpp"] == 2.0


@pytest.fixture(scope="module")
def slide_folder(tmp_path_factory):
    """Eight small synthetic slides of four patients, both classes, and a labels.csv naming them."""
    folder = tmp_path_factory.mktemp("user-slides")
    rows = ["slide,label,patient"]
    for index in range(8):
        write_slide(folder / f"s{index}.tif", 512, 512, positive=bool(index % 2), seed=index)
        rows.append(f"s{index}.tif,{index % 2},p{index // 2}")
    (folder / "labels.csv").write_text("\n".join(rows) + "\n")
    return folder


def user_folder(slide_folder: Path, tmp_path: Path, labels: list[str] | None = None, extra: dict | None = None) -> Path:
    folder = tmp_path / "slides"
    shutil.copytree(slide_folder, folder)
    for name, write in (extra or {}).items():
        write(folder / name)
    if labels is not None:
        (folder / "labels.csv").write_text("\n".join(["slide,label,patient", *labels]) + "\n")
    return folder


def rejected(capsys, folder: Path, *names: str) -> str:
    return assert_rejected(capsys, "medical", "run", "medical", "--preset", "slides-smoke", "--data", str(folder),
                           "--set", f"data.slides.cache_dir={folder.parent / 'cache'}", "--set", "data.slides.mpp=0.5",
                           names=names)


def test_data_bytes_count_the_slides_and_labels_read_and_data_samples_the_slides(slide_folder, tmp_path):
    from common.config import load_config
    from usecases.medical import USECASE
    from usecases.medical.pipeline import load_data

    folder = user_folder(slide_folder, tmp_path, [f"s{i}.tif,{i % 2},p{i}" for i in range(8)],
                         {"notes.txt": lambda path: path.write_bytes(b"x" * 5000)})
    config = load_config(USECASE.config, USECASE.presets_dir, "slides-smoke",
                         [f"data.slides.cache_dir={tmp_path / 'cache'}", "data.slides.mpp=0.5"])
    _, tags = load_data(config, folder)
    read = [folder / "labels.csv", *(folder / f"s{index}.tif" for index in range(8))]
    assert tags["data_bytes"] == sum(path.stat().st_size for path in read) and tags["data_samples"] == 8


def test_a_broken_slide_is_named_in_one_line(capsys, slide_folder, tmp_path):
    broken = (lambda path: path.write_bytes(b"II*\x00" + bytes(1000)))
    folder = user_folder(slide_folder, tmp_path, [f"s{i}.tif,{i % 2},p{i}" for i in range(8)] + ["broken.svs,1,p9"],
                         {"broken.svs": broken})
    line = rejected(capsys, folder, "broken.svs")
    assert "damaged" in line or "not a readable" in line


def test_a_labels_file_naming_a_missing_slide_is_one_line(capsys, slide_folder, tmp_path):
    folder = user_folder(slide_folder, tmp_path, [f"s{i}.tif,{i % 2},p{i}" for i in range(8)] + ["gone.svs,1,p9"])
    assert "file not found" in rejected(capsys, folder, "labels.csv", "row 9", "gone.svs")


def test_a_label_column_with_one_class_is_one_line(capsys, slide_folder, tmp_path):
    folder = user_folder(slide_folder, tmp_path, [f"s{i}.tif,1,p{i}" for i in range(8)])
    assert "needs at least 2 classes" in rejected(capsys, folder, "labels.csv")


def test_a_slide_without_a_resolution_is_one_line_when_a_magnification_is_asked(capsys, slide_folder, tmp_path):
    plain = (lambda path: tifffile.imwrite(path, np.full((512, 512, 3), 200, np.uint8), tile=(256, 256),
                                           photometric="rgb"))
    folder = user_folder(slide_folder, tmp_path, [f"s{i}.tif,{i % 2},p{i}" for i in range(8)] + ["plain.tif,1,p9"],
                         {"plain.tif": plain})
    assert "data.slides.mpp=null" in rejected(capsys, folder, "plain.tif", "microns per pixel")


def test_a_slide_without_tissue_is_one_line(capsys, slide_folder, tmp_path):
    blank = (lambda path: tifffile.imwrite(path, np.full((1024, 1024, 3), 245, np.uint8), tile=(256, 256),
                                           photometric="rgb", resolution=(1e4 / 0.5, 1e4 / 0.5),
                                           resolutionunit="CENTIMETER"))
    folder = user_folder(slide_folder, tmp_path, [f"s{i}.tif,{i % 2},p{i}" for i in range(8)] + ["glass.tif,1,p9"],
                         {"glass.tif": blank})
    assert "no tissue found" in rejected(capsys, folder, "glass.tif")


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared pathology slides are absent")
def test_the_shared_broken_slide_beside_real_ones_is_named(capsys, tmp_path):
    folder = tmp_path / "real"
    folder.mkdir()
    for name in ("cmu-1-small-region.svs", "broken.svs"):
        (folder / name).symlink_to(SHARED / name)
    (folder / "labels.csv").write_text("slide,label\ncmu-1-small-region.svs,0\nbroken.svs,1\n")
    rejected(capsys, folder, "broken.svs")


def test_many_slides_are_tiled_on_a_dask_cluster_as_in_this_process(slide_folder, tmp_path, dask_client):
    from distributed import get_task_stream

    from common.config import load_config
    from common.errors import UserError
    from usecases.medical import USECASE
    from usecases.medical.slides.data import load_slides

    def config(cache: str):
        return load_config(USECASE.config, USECASE.presets_dir, "slides-smoke",
                           [f"data.slides.cache_dir={tmp_path / cache}", "data.slides.mpp=0.5"])

    folder = user_folder(slide_folder, tmp_path / "eight", [f"s{i}.tif,{i % 2},p{i}" for i in range(8)])
    alone = load_slides(config("here"), folder)
    with get_task_stream(dask_client) as stream:
        spread = load_slides(config("cluster"), folder, dask_client)
    assert sum(task["key"].startswith("tiles_of") for task in stream.data) == len(alone.paths) == 8
    assert [grid.coords.tolist() for grid in spread.grids] == [grid.coords.tolist() for grid in alone.grids]
    assert spread.split.tolist() == alone.split.tolist() and spread.sha256 == alone.sha256
    broken = user_folder(slide_folder, tmp_path, [f"s{i}.tif,{i % 2},p{i}" for i in range(8)] + ["bad.svs,1,p9"],
                         {"bad.svs": lambda path: path.write_bytes(b"II*\x00" + bytes(1000))})
    with pytest.raises(UserError, match=r"bad\.svs"):
        load_slides(config("broken"), broken, dask_client)


def test_slides_are_encoded_on_a_dask_cluster_as_in_this_process(slide_folder, tmp_path, dask_client):
    """One task per slide on the workers, each reading its slide itself: the same features in slide order, each
    slide's own stain fit applied."""
    from functools import partial

    from distributed import get_task_stream

    from common.config import load_config
    from usecases.medical import USECASE
    from usecases.medical.models import architecture, build_classifier
    from usecases.medical.slides.data import load_slides
    from usecases.medical.slides.features import encode_on_cluster, encode_slides
    from usecases.medical.slides.serving import chosen_tiles, slide_normaliser

    config = load_config(USECASE.config, USECASE.presets_dir, "slides-smoke",
                         [f"data.slides.cache_dir={tmp_path / 'cache'}", "data.slides.mpp=0.5"])
    data = load_slides(config, user_folder(slide_folder, tmp_path, [f"s{i}.tif,{i % 2},p{i}" for i in range(8)]))
    rng = np.random.default_rng(0)
    slides = [chosen_tiles(path, grid, 6, rng) for path, grid in list(zip(data.paths, data.grids))[:4]]  # 2 a class
    normalisers = [slide_normaliser(slide, "macenko", 8, rng) for slide in slides]
    torch.manual_seed(0)
    build = partial(build_classifier, architecture("resnet18", 3, 2, cifar_stem=True, channels_last=False))
    network = build()
    here, _ = encode_slides(network, slides, normalisers, torch.device("cpu"), 5, readers=0)
    with get_task_stream(dask_client) as stream:
        spread, tiles_per_s = encode_on_cluster(dask_client, build, network.state_dict(), slides, normalisers,
                                                torch.device("cpu"), 5)
    assert sum(task["key"].startswith("encode_slide") for task in stream.data) == len(slides) == 4
    assert [bag.shape for bag in spread] == [bag.shape for bag in here] == [(len(s.indices), 512) for s in slides]
    # The same float32 ResNet-18 forward, but on a worker thread, whose kernels may split and order their sums
    # otherwise: each of its ~20 layers' sums of up to 3 * 3 * 512 terms rounds by about sqrt(terms) * eps/2 of the
    # activations' scale (a random walk), ~8e-5 of a bag's largest feature (measured: 1e-7); another slide's stain
    # fit, or none, moves features by tenths
    for mine, theirs in zip(here, spread):
        tolerance = 20 * np.sqrt(3 * 3 * 512) * np.finfo(np.float32).eps / 2 * np.abs(mine).max()
        np.testing.assert_allclose(theirs, mine, rtol=0, atol=tolerance)
    unnormalised, _ = encode_on_cluster(dask_client, build, network.state_dict(), slides, [None] * 4,
                                        torch.device("cpu"), 5)
    assert not np.allclose(unnormalised[0], here[0], atol=1e-3) and tiles_per_s > 0


def test_slides_in_the_folder_but_not_in_the_labels_are_refused_or_skipped_when_asked(capsys, slide_folder, tmp_path):
    from common.config import load_config
    from usecases.medical import USECASE
    from usecases.medical.slides.data import load_slides

    copy = (lambda path: shutil.copy(slide_folder / "s0.tif", path))
    folder = user_folder(slide_folder, tmp_path, [f"s{i}.tif,{i % 2},p{i}" for i in range(8)], {"new-a.tif": copy, "new-b.svs": copy,
                         "notes.txt": lambda path: path.write_text("not a slide")})
    line = rejected(capsys, folder, "2 slide(s) are not in labels.csv (new-a.tif, new-b.svs)")
    assert "--set data.slides.unlabelled=skip" in line
    config = load_config(USECASE.config, USECASE.presets_dir, "slides-smoke",
                         [f"data.slides.cache_dir={tmp_path / 'cache'}", "data.slides.mpp=0.5",
                          "data.slides.unlabelled=skip"])
    data = load_slides(config, folder)
    assert [path.name for path in data.paths] == [f"s{i}.tif" for i in range(8)]
    assert any("2 slide(s) not in labels.csv left out (new-a.tif, new-b.svs" in notice for notice in data.notices)


@pytest.mark.parametrize("pixels_per_cm", [0, 28.35, 4e9])
def test_a_slide_stating_an_implausible_resolution_is_one_line_naming_the_setting(capsys, slide_folder, tmp_path,
                                                                                   pixels_per_cm):
    odd = (lambda path: tifffile.imwrite(path, np.full((512, 512, 3), 200, np.uint8), tile=(256, 256),
                                         photometric="rgb", resolution=(pixels_per_cm, pixels_per_cm),
                                         resolutionunit="CENTIMETER"))
    folder = user_folder(slide_folder, tmp_path, [f"s{i}.tif,{i % 2},p{i}" for i in range(8)] + ["odd.tif,1,p9"],
                         {"odd.tif": odd})
    assert "data.slides.mpp=null" in rejected(capsys, folder, "odd.tif", "not a scanner's resolution")


@pytest.mark.parametrize("mpp", ["0", "0.001", "-1", "500", "nan"])
def test_an_implausible_tile_resolution_is_one_line(capsys, slide_folder, tmp_path, mpp):
    assert_rejected(capsys, "medical", "run", "medical", "--preset", "slides-smoke", "--data",
                    str(user_folder(slide_folder, tmp_path)), "--set", f"data.slides.mpp={mpp}",
                    names=("data.slides.mpp",))


@pytest.mark.slow  # the smoke run (about 100 s); the default suite serves tests/test_examples.py's slide run
def test_the_served_slide_model_answers_each_test_slide_as_the_evaluation_scored_it(slide_run, tmp_path):
    """`usecases serve medical` serves the slides run's champion: over HTTP, every test slide's probability is the
    one the evaluation logged, and bad requests are a 400 with one line."""
    import csv
    import subprocess
    import sys

    from tests.cli_helpers import free_port, stop, wait_until_up
    from tests.test_workbench import post

    _, run, env, _ = slide_run
    logged = mlflow.artifacts.download_artifacts(f"runs:/{run.info.run_id}/slides/test_probabilities.csv",
                                                 tracking_uri=env["MLFLOW_TRACKING_URI"])
    evaluated = {row["slide"]: float(row["probability"]) for row in csv.DictReader(open(logged))}
    assert len(evaluated) >= 2 and run.data.tags["primary_model"] == "attention_mil"
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "usecases", "serve", "medical", "--port", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(f"{url}/ping", process, seconds=180)
        status, answer = post(f"{url}/invocations", {"dataframe_split": {"columns": ["slide"],
                                                                         "data": [[slide] for slide in evaluated]}})
        assert status == 200, answer
        served = {row["slide"]: row for row in answer["predictions"]}
        for slide, probability in evaluated.items():
            assert served[slide]["probability"] == pytest.approx(probability, abs=1e-6), slide
            tiles = json.loads(served[slide]["top_tiles"])
            assert tiles and tiles[0]["attention"] >= tiles[-1]["attention"] and tiles[0]["size"] > 0
        folder = tmp_path / "two-slides"  # a folder is each of its slides
        folder.mkdir()
        for slide in list(evaluated)[:2]:
            (folder / Path(slide).name).symlink_to(slide)
        status, answer = post(f"{url}/invocations", {"dataframe_split": {"columns": ["slide"],
                                                                         "data": [[str(folder)]]}})
        assert status == 200 and len(answer["predictions"]) == 2, answer
        assert {row["slide"]: row["probability"] for row in answer["predictions"]} == pytest.approx(
            {str(folder / Path(slide).name): evaluated[slide] for slide in list(evaluated)[:2]}, abs=1e-6)
        for bad in ({"dataframe_split": {"columns": ["slide"], "data": [["/nowhere/x.svs"]]}},
                    {"dataframe_split": {"columns": ["image"], "data": [["a"]]}},
                    {"dataframe_split": {"columns": ["slide"], "data": [[3]]}}):
            status, answer = post(f"{url}/invocations", bad)
            line = answer["message"].splitlines()[-1]  # MLflow's server puts the request's data before it
            assert status == 400 and "slide" in line, answer
    finally:
        stop(process)
