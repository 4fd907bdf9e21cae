"""profile(): the per-layer table on real models, saved and loaded, deterministic, and a
planted FP16 overflow flagged on exactly one layer."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from tasks import overflow_gpt2_task, tiny_gpt2_task

from autoprec import Format, profile_view
from autoprec.formats import FP8_FORMATS
from autoprec.profiling import Profile, profile

TESTS = os.path.dirname(os.path.abspath(__file__))
CONSOLE = os.path.join(os.path.dirname(sys.executable), "autoprec")


@pytest.fixture(scope="module")
def tiny_prof():
    # the tune's profile: numerics only of the formats that can win on this device
    return profile(tiny_gpt2_task(), progress=False, repeats=2, only_winnable=True)


def test_profile_covers_every_matmul_layer(tiny_prof):
    model = tiny_gpt2_task().build_model()
    conv1d = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    attn = [n for n, m in model.named_modules() if type(m).__name__ == "GPT2Attention"]
    assert {lp.fqn for lp in tiny_prof.layers} == set(conv1d) | set(attn) | {"lm_head"}
    # embeddings and norms are captured but not searched: their format changes nothing
    assert tiny_prof.fixed["transformer.wte"] == "embedding"
    assert tiny_prof.fixed["transformer.ln_f"] == "norm"
    for lp in tiny_prof.layers:
        assert set(lp.times) == {Format.FP32, Format.BF16, Format.FP16, *FP8_FORMATS}
        assert all(t.seconds > 0 for t in lp.times.values())
        for f in FP8_FORMATS:  # every recipe: never reported as fast on this CPU
            assert lp.times[f].emulated
            assert lp.times[f].seconds >= lp.times[Format.FP32].seconds
        # timed first, then (only_winnable) only the formats that can win are measured: on
        # this CPU fp8 is emulated and fp16 (no FP16 matmul units) is many times slower
        assert "emulated" in lp.skipped[Format.FP8]
        assert Format.FP8 not in lp.sensitivity and not tiny_prof.allows(lp.fqn, Format.FP8)
        t16, t32 = lp.times[Format.FP16].seconds, lp.times[Format.FP32].seconds
        assert (Format.FP16 in lp.skipped) is (t16 >= 2 * t32), (lp.fqn, t16 / t32)
        assert (Format.FP16 in lp.sensitivity) is (Format.FP16 not in lp.skipped)
        assert Format.BF16 in lp.sensitivity or Format.BF16 in lp.skipped
    assert "cannot win here" in profile_view.reason(tiny_prof, "lm_head", Format.FP16) or \
        Format.FP16 in tiny_prof.layer("lm_head").sensitivity
    assert "skip" in profile_view.table(tiny_prof)


def test_profile_round_trips_and_prints(tmp_path, tiny_prof):
    path = tmp_path / "p.json"
    tiny_prof.save(path)
    again = Profile.load(path)
    assert again.to_dict() == tiny_prof.to_dict()
    table = profile_view.table(tiny_prof)
    assert "transformer.h.0.mlp.c_fc" in table and "verdict" in table
    with pytest.raises(KeyError, match="not in the profile"):
        tiny_prof.layer("transformer.h.9.mlp")


def test_two_profiles_give_identical_errors(tiny_prof):
    # Sensitivity must not depend on which run measured it. Both compared profiles are priced
    # for h100, so every format is measured whatever this CPU is fast at (a measured profile
    # on a CPU without BF16 instructions skips every format: nothing can beat fp32 there).
    other = profile(tiny_gpt2_task(), progress=False, repeats=1, target="h100")
    again = profile(tiny_gpt2_task(), progress=False, repeats=1, target="h100")
    # priced for h100, the half formats can win on every layer (fp8's casts cost more than
    # its GEMMs save at this width, so the price skips it)
    assert all({Format.BF16, Format.FP16} <= set(lp.sensitivity) for lp in other.layers)
    compared = 0
    for a, b in zip(other.layers, again.layers):
        assert a.fqn == b.fqn and set(a.sensitivity) == set(b.sensitivity)
        assert {f: e.to_dict() for f, e in a.sensitivity.items()} == \
               {f: e.to_dict() for f, e in b.sensitivity.items()}, a.fqn
        compared += len(a.sensitivity)
    assert compared >= 2 * len(other.layers) > 0
    # what the measured profile did measure agrees with the priced one (the same numerics)
    for a, b in zip(tiny_prof.layers, other.layers):
        common = set(a.sensitivity) & set(b.sensitivity)
        assert {f: a.sensitivity[f].to_dict() for f in common} == \
               {f: b.sensitivity[f].to_dict() for f in common}, a.fqn


def test_planted_fp16_overflow_is_flagged_on_that_layer_only():
    prof = profile(overflow_gpt2_task(), formats=("fp32", "bf16", "fp16"), progress=False,
                   target="h100")
    flagged = [(lp.fqn, f) for lp in prof.layers for f, e in lp.sensitivity.items() if not e.finite]
    assert flagged == [("transformer.h.1.mlp.c_proj", Format.FP16)]
    lp = prof.layer("transformer.h.1.mlp.c_proj")
    assert lp.sensitivity[Format.BF16].finite
    assert lp.sensitivity[Format.FP16].act_overflow > 0
    assert not prof.allows("transformer.h.1.mlp.c_proj", Format.FP16)
    assert "non-finite" in profile_view.reason(prof, "transformer.h.1.mlp.c_proj", Format.FP16)
    assert math.isinf(prof.loss_change("transformer.h.1.mlp.c_proj", Format.FP16))


def test_a_profile_measures_every_requested_format_and_says_which_cannot_win():
    # the analyzer's default: every format's numerics on every layer, even those that cannot
    # win on this CPU (fp8 emulated, and fp16 where it is slow), each verdict still saying why
    prof = profile(tiny_gpt2_task(), progress=False, repeats=1)
    for lp in prof.layers:
        assert not lp.skipped, (lp.fqn, lp.skipped)
        assert set(lp.sensitivity) == {Format.BF16, Format.FP16, *FP8_FORMATS}, lp.fqn
        verdict = lp.verdict(Format.FP8)
        assert verdict.rule == "emulated" and "not measured" not in verdict.why, verdict
    assert "skip" not in profile_view.table(prof).split("\nerr:")[0]


def _profile_command(tmp_path, task: str, *args: str) -> subprocess.CompletedProcess:
    """`autoprec profile` on a task of tests/tasks.py, writing tmp_path/p.json."""
    (tmp_path / "t.py").write_text(f"from tasks import {task} as task\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, str(tmp_path)]))
    out = subprocess.run([CONSOLE, "profile", f"{tmp_path / 't.py'}:task", *args, "-o",
                          str(tmp_path / "p.json")], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


@pytest.mark.slow
def test_the_profile_command_flags_a_planted_fp16_overflow_on_this_cpu(tmp_path):
    # measured on this CPU, where fp16 cannot win on speed: its overflow is flagged anyway
    out = _profile_command(tmp_path, "overflow_gpt2_task", "--formats", "fp32", "bf16", "fp16")
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert "NONFINITE" in rows["transformer.h.1.mlp.c_proj"], out.stdout
    assert "fp16 non-finite" in rows["transformer.h.1.mlp.c_proj"], out.stdout
    assert sum("NONFINITE" in line for line in rows.values()) == 1, out.stdout
    prof = Profile.load(tmp_path / "p.json")
    flagged = [(lp.fqn, f) for lp in prof.layers for f, e in lp.sensitivity.items() if not e.finite]
    assert flagged == [("transformer.h.1.mlp.c_proj", Format.FP16)]
    assert all(Format.FP16 in lp.sensitivity for lp in prof.layers)


@pytest.mark.slow
def test_the_tune_keeps_skipping_what_cannot_win_and_a_flag_opts_the_profile_into_it(tmp_path):
    _profile_command(tmp_path, "tiny_gpt2_task", "--formats", "fp32", "fp8", "--only-winnable")
    prof = Profile.load(tmp_path / "p.json")
    assert all(not (set(lp.sensitivity) & set(FP8_FORMATS)) for lp in prof.layers)
    assert all("emulated" in lp.skipped[Format.FP8] for lp in prof.layers)


def test_each_units_measurement_is_freed_before_the_next_unit():
    """A unit's measurement (a model copy and FP32 reference gradients per batch) lives in
    reference cycles: left to Python's collector, which runs by object counts, the next unit's
    was built beside it (a 3-layer Llama-3-8B-wide profile ran out of 24 GB). With automatic
    collection off, none is left after any unit."""
    import gc

    from autoprec.measure.deviation import DeviationMeter

    alive = []

    def share(units, work):
        rows = []
        for unit in units:
            rows += work(unit)
            alive.append(sum(isinstance(o, DeviationMeter) for o in gc.get_objects()))
        return rows, [{"layers": len(u), "by": "test", "tries": 1} for u in units]

    gc.collect()
    gc.disable()
    try:
        profile(tiny_gpt2_task(), formats=("fp32", "bf16"), target="h100", progress=False,
                share=share)
    finally:
        gc.enable()
    assert len(alive) >= 2 and alive == [0] * len(alive)
