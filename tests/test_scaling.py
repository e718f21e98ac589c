"""`usecases bench scale NAME`: the scale preset at several sizes on each engine, each run its own process, and
one NAME-scale run with the table and the log-log plot of cost against size."""

import io

import mlflow
import pandas as pd
import pytest

from common.errors import UserError
from tests.cli_helpers import assert_rejected, runs, usecases

pytest.importorskip("distributed")


@pytest.mark.slow  # 40 s: two sizes on two engines; the engines themselves are tested in the default suite
def test_the_cost_growth_of_both_engines_is_one_run_with_its_table_and_plot(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    result = usecases("bench", "scale", "recsys", "--sizes", "1,2", "--base", "200", "--set", "models=[pop]",
                      "--set", "data.synthetic.items=2000", "--set", "runtime.workers=1")
    assert result.returncode == 0, result.stderr[-2000:]
    (run,) = runs("recsys-scale")
    assert run.info.status == "FINISHED" and run.data.tags["scale_key"] == "data.synthetic.users"
    artifacts = {item.path for item in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"scale.csv", "cost_vs_size.png"} <= artifacts
    table = pd.read_csv(io.StringIO(mlflow.artifacts.load_text(f"{run.info.artifact_uri}/scale.csv")))
    assert sorted(zip(table["engine"], table["data.synthetic.users"])) == [
        ("dask", 200), ("dask", 400), ("pandas", 200), ("pandas", 400)]
    assert (table["status"] == "finished").all() and (table["peak_rss_gb"] > 0).all()
    assert run.data.metrics["scale/dask/x2/time_s"] > 0 and run.data.metrics["scale/pandas/x1/per_s"] > 0
    sized = runs("recsys")
    assert len(sized) == 4 and {r.data.params["data.synthetic.users"] for r in sized} == {"200", "400"}


def test_several_size_keys_grow_together_and_the_throughput_counts_them_all(monkeypatch):
    """Medical scales its three splits at once: --base sets the first key's 1x value, the others keep their share."""
    from common.tools import scale_bench as scaling
    from usecases.medical import USECASE

    asked = []

    def run_one(usecase, overrides, values, multiple, engine, folder, timeout_s):
        asked.append((engine, values))
        return {"engine": engine, "multiple": multiple, **values, "status": "finished", "time_s": 2.0,
                "peak_rss_gb": 1.0, "per_s": sum(values.values()) / 2.0}

    monkeypatch.setattr(scaling, "_one", run_one)
    table = scaling.scale_bench(USECASE, ["train.epochs=1"], [1, 4], ["pandas"], 400, None)
    assert asked == [("pandas", {"data.synthetic.train": 400, "data.synthetic.val": 50, "data.synthetic.test": 50}),
                     ("pandas", {"data.synthetic.train": 1600, "data.synthetic.val": 200, "data.synthetic.test": 200})]
    assert list(table["per_s"]) == [250.0, 1000.0]
    (run,) = runs("medical-scale")
    assert run.data.tags["scale_key"] == "data.synthetic.train" and run.data.tags["scale_base"] == "400"


def test_a_use_case_without_a_size_to_scale_or_bad_sizes_is_one_line(capsys):
    from dataclasses import replace

    from common.tools.scale_bench import scale_bench
    from usecases.medical import USECASE

    with pytest.raises(UserError, match="'medical' declares no size to scale"):
        scale_bench(replace(USECASE, scale=None), [], [1], ["pandas"], None, None)
    assert_rejected(capsys, "recsys", "bench", "scale", "recsys", "--sizes", "1,x", names=("--sizes 1,x",))
    assert_rejected(capsys, "recsys", "bench", "scale", "recsys", "--scale-engines", "spark",
                    names=("--scale-engines takes pandas, dask",))
