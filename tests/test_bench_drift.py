"""benchmarks/bench_drift.py on a tiny GPT-2: its run, rank statistics, planted-drift table and
JSON, quickly (the real run is the example's 4x256 model, see BENCHMARKS.md)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

import autoprec
from autoprec.formats import Format
from autoprec.measure.sensitivity import LayerSensitivity
from examples.data import byte_batches
from examples.drift import DRIFT_LAYER
from examples.gpt2_bytes import make_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import bench_drift  # noqa: E402  (after the path set-up above)


def tiny_task() -> autoprec.Task:
    return autoprec.Task(model=lambda: make_model(2, 64, 1, 64),
                         batches=byte_batches(1, 4, 64, seed=1), name="gpt2-2x64",
                         train_batches=lambda n, seed: byte_batches(n, 4, 64, seed=seed))


@pytest.fixture(scope="module")
def planted():
    # aimed to overflow at step 20: the profile at step 40 must see it, the one at 0 cannot
    settings = bench_drift.Settings(steps=(40,), modes=("exact", "fast"), planted=True,
                                    overflow_at=20)
    return bench_drift.run(tiny_task(), settings, log=lambda line: None), settings


def test_bootstrap_interval_holds_the_spearman_and_an_identical_ranking_is_one():
    xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    value, low, high = bench_drift.bootstrap_rho(xs, [2 * x for x in xs])
    assert value == 1.0 and low == pytest.approx(1.0) and high == pytest.approx(1.0)
    value, low, high = bench_drift.bootstrap_rho(xs, [0.5, 0.2, 0.1, 0.9, 0.3, 0.8])
    assert low <= value <= high and high - low > 0.1, (value, low, high)
    assert math.isnan(bench_drift.rho([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))


def test_steps_and_modes_are_checked_in_one_line():
    with pytest.raises(ValueError, match="--steps must be strictly increasing"):
        bench_drift.Settings(steps=(1000, 200))
    with pytest.raises(ValueError, match="--mode slow is not a sensitivity mode"):
        bench_drift.Settings(modes=("slow",))
    assert bench_drift.step_pairs([0, 200, 1000]) == [(0, 200), (0, 1000), (200, 1000)]


def test_the_planted_drift_shows_in_the_late_profile_only(planted):
    result, settings = planted
    cps = result["checkpoints"]
    assert list(cps) == [0, 40]
    rows = bench_drift.planted_rows(result, "exact")
    first, last = (cps[s]["modes"]["exact"][DRIFT_LAYER][Format.FP16] for s in (0, 40))
    # at step 0 the drifted layer is ~1.01**20 below FP16's max: nothing overflows yet
    assert cps[0]["drift_amax"] < bench_drift.FP16_MAX and first.act_overflow == 0.0, rows[0]
    assert cps[40]["drift_amax"] > bench_drift.FP16_MAX, rows[-1]
    assert last.act_overflow > 0.0 and last.verdict in ("overflow", "non-finite"), rows[-1]
    assert rows[-1][4] == f"1/{len(result['layers'])}", rows[-1]  # the worst fp16 layer


def test_every_table_and_the_json_have_every_step_and_format(planted, tmp_path):
    result, settings = planted
    n_pairs = len(bench_drift.step_pairs(list(result["checkpoints"])))
    assert len(bench_drift.rank_rows(result, "fast")) == n_pairs * len(bench_drift.FORMATS)
    text = bench_drift.report(result, settings)
    for heading in ("exact mode: Spearman", "fast mode: each profile", "drifted layer",
                    "fast estimate vs exact"):
        assert heading in text
    path = tmp_path / "drift.json"
    bench_drift.write_json(path, bench_drift.raw(result, settings, elapsed=1.0))
    data = json.loads(path.read_text())
    rows = data["checkpoints"]["40"]["rows"]["exact"]
    assert len(rows) == len(result["layers"]) * len(bench_drift.FORMATS)
    again, same = bench_drift.load_raw(str(path))
    assert same == settings and bench_drift.report(again, same) == text
    back = [LayerSensitivity.from_dict(r) for r in rows]
    assert any(r.layer == DRIFT_LAYER and r.format is Format.FP16 and not r.finite or
               r.layer == DRIFT_LAYER and r.format is Format.FP16 and r.act_overflow > 0
               for r in back)


def test_a_file_that_is_no_saved_run_is_refused_in_one_line(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"benchmark": "bench_drift", "settings": {"steps": [5]}}')
    with pytest.raises(ValueError, match="is not a readable bench_drift result"):
        bench_drift.load_raw(str(path))
    path.write_text('{"layers": []}')
    with pytest.raises(ValueError, match="is not a bench_drift result"):
        bench_drift.load_raw(str(path))
