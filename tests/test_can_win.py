""""Can this format win on this layer" is one rule (autoprec.verdict.can_win): a table of
scenarios, each naming the rule that must decide it, and the profile, the search space and
the `show` sentences reading that one rule."""

from __future__ import annotations

import math

import pytest

from autoprec import profile_view
from autoprec.formats import Format
from autoprec.measure.capture import Layer
from autoprec.measure.sensitivity import LayerSensitivity
from autoprec.measure.timing import MEASURED, LayerTime
from autoprec.policy import DEFAULT_MAX_LOSS_INCREASE
from autoprec.profiling import LayerProfile, Profile
from autoprec.tuning.config import Grouping
from autoprec.tuning.space import SearchSpace
from autoprec.verdict import SLOWER_THAN_FP32, Verdict, can_win, unit_can_win

FP32, BF16, FP16, FP8, ROW = Format.FP32, Format.BF16, Format.FP16, Format.FP8, Format.FP8_ROWWISE
PRICED, MEASURED_ON_CPU = "model:h100", MEASURED


def times(source: str = PRICED, emulated: tuple = (), failed: tuple = (), **us: float):
    """format value -> microseconds, as LayerTimes of one layer from ``source``."""
    out = {}
    for name, t in us.items():
        fmt = Format.parse(name.replace("_", ":"))
        bad = fmt.value in failed
        out[fmt] = LayerTime("l", fmt, math.inf if bad else t * 1e-6, math.inf if bad else t * 1e-6,
                             0.0, emulated=fmt.value in emulated, source=source,
                             error="RuntimeError: no kernel" if bad else None)
    return out


def sens(fmt: Format, loss: float = 1e-5, finite: bool = True) -> LayerSensitivity:
    return LayerSensitivity(layer="l", format=fmt, loss_rel_change=loss, grad_rel_error=1e-3,
                            layer_grad_rel_error=None, output_sqnr_db=40.0, act_overflow=None,
                            act_underflow=None, grad_overflow=None, grad_underflow=None,
                            finite=finite, n_batches=1)


BLOCKER = "fp8 needs K and N divisible by 16 (got K=20)"

# (id, format, times, keywords of can_win, the rule that decides: "" = it can win)
SCENARIOS = [
    ("fp32 is the reference", FP32, times(fp32=10, bf16=1), {}, ""),
    ("fp32 whatever else is known", FP32, times(fp32=10), {"blocker": BLOCKER}, ""),
    ("faster bf16, priced", BF16, times(fp32=10, bf16=5), {}, ""),
    ("faster bf16, measured", BF16, times(MEASURED_ON_CPU, fp32=10, bf16=5), {}, ""),
    ("bf16 slower than fp32 but within 2x: not ruled out before numerics", BF16,
     times(fp32=10, bf16=19), {}, ""),
    ("bf16 at 2x fp32 cannot win", BF16, times(fp32=10, bf16=10 * SLOWER_THAN_FP32), {},
     "slow"),
    ("fp16 34x slower (a CPU without FP16 units), measured", FP16,
     times(MEASURED_ON_CPU, fp32=10, fp16=340), {}, "slow"),
    ("a format that failed to run", FP16, times(fp32=10, fp16=1, failed=("fp16",)), {},
     "slow"),
    ("a failed fp32 reference judges nothing on speed", FP16,
     times(fp32=10, fp16=30, failed=("fp32",)), {}, ""),
    ("emulated fp8 on a CPU, measured", FP8,
     times(MEASURED_ON_CPU, fp32=10, bf16=8, fp8=10, emulated=("fp8",)), {}, "emulated"),
    ("emulated fp8, priced for a device without FP8 units", FP8,
     times(fp32=10, bf16=5, fp8=12, emulated=("fp8",)), {}, "emulated"),
    ("fp8 no faster than bf16", FP8, times(fp32=10, bf16=5, fp8=5), {}, "bf16"),
    ("rowwise fp8 slower than bf16", ROW, times(fp32=10, bf16=5, fp8_rowwise=6), {}, "bf16"),
    ("fp8 faster than bf16", FP8, times(fp32=10, bf16=5, fp8=4), {}, ""),
    ("fp8 with bf16 failed: only fp32 to beat", FP8,
     times(fp32=10, bf16=5, fp8=6, failed=("bf16",)), {}, ""),
    ("fp8 the kernel does not take", FP8, times(fp32=10, bf16=5, fp8=2), {"blocker": BLOCKER},
     "blocked"),
    ("a blocker does not concern bf16", BF16, times(fp32=10, bf16=5), {"blocker": BLOCKER}, ""),
    ("the profile's record wins over the times", BF16, times(fp32=10, bf16=5),
     {"skipped": {BF16: "bf16 cannot win here (recorded)"}}, "skipped"),
    ("numerics measured and fine", BF16, times(fp32=10, bf16=5),
     {"sensitivity": {BF16: sens(BF16)}}, ""),
    ("numerics asked, none measured", BF16, times(fp32=10, bf16=5), {"sensitivity": {}},
     "unmeasured"),
    ("non-finite numerics", FP16, times(fp32=10, fp16=5),
     {"sensitivity": {FP16: sens(FP16, finite=False)}}, "non-finite"),
    ("speed rules come before numerics", FP16, times(fp32=10, fp16=50),
     {"sensitivity": {FP16: sens(FP16, finite=False)}}, "slow"),
    ("over the default budget", BF16, times(fp32=10, bf16=5),
     {"sensitivity": {BF16: sens(BF16, loss=2 * DEFAULT_MAX_LOSS_INCREASE)},
      "max_loss_increase": DEFAULT_MAX_LOSS_INCREASE}, "over budget"),
    ("at the budget is within it", BF16, times(fp32=10, bf16=5),
     {"sensitivity": {BF16: sens(BF16, loss=DEFAULT_MAX_LOSS_INCREASE)},
      "max_loss_increase": DEFAULT_MAX_LOSS_INCREASE}, ""),
    ("a lower loss is no increase", BF16, times(fp32=10, bf16=5),
     {"sensitivity": {BF16: sens(BF16, loss=-5 * DEFAULT_MAX_LOSS_INCREASE)},
      "max_loss_increase": DEFAULT_MAX_LOSS_INCREASE}, ""),
    ("over budget only when the budget is asked", BF16, times(fp32=10, bf16=5),
     {"sensitivity": {BF16: sens(BF16, loss=0.5)}}, ""),
    ("measured but never timed", BF16, times(fp32=10), {"sensitivity": {BF16: sens(BF16)}},
     "untimed"),
    ("untimed before numerics: nothing to judge yet", BF16, times(fp32=10), {}, ""),
]


@pytest.mark.parametrize("fmt,layer_times,kw,rule", [s[1:] for s in SCENARIOS],
                         ids=[s[0] for s in SCENARIOS])
def test_one_rule_decides_each_scenario(fmt, layer_times, kw, rule):
    verdict = can_win(fmt, layer_times, **kw)
    assert verdict.rule == rule, verdict
    assert verdict.can_win is (rule == "")
    assert bool(verdict.why) is (rule != ""), verdict  # a verdict against says why
    if rule == "blocked":
        assert verdict.why == BLOCKER
    if rule == "skipped":
        assert verdict.why == kw["skipped"][fmt]


def test_priced_and_measured_times_are_judged_alike():
    for us in ({"fp32": 10, "bf16": 5, "fp8": 5}, {"fp32": 10, "fp16": 40}, {"fp32": 10, "bf16": 4}):
        fmt = Format.parse(list(us)[-1])
        priced, measured = can_win(fmt, times(PRICED, **us)), can_win(fmt, times(MEASURED, **us))
        assert priced == measured


# ------------------------------------------------------------------ a search unit
UNIT = [  # (id, layers' verdicts, unit seconds in the format, in fp32, why not offered)
    ("every layer can win and the unit is faster", [Verdict(BF16), Verdict(BF16)], 1.0, 2.0, ""),
    ("one layer the profile skipped", [Verdict(BF16), Verdict(BF16, "slow", "x")], 1.0, 2.0,
     "cannot win here on speed"),
    ("one layer FP8 does not take", [Verdict(FP8), Verdict(FP8, "blocked", BLOCKER)], 1.0, 2.0,
     "FP8 does not take its matmuls"),
    ("skipped outranks blocked", [Verdict(FP8, "blocked", BLOCKER), Verdict(FP8, "emulated", "e")],
     1.0, 2.0, "cannot win here on speed"),
    ("one layer non-finite", [Verdict(FP16), Verdict(FP16, "non-finite", "nf")], 1.0, 2.0,
     "non-finite"),
    ("faster layers but a slower unit", [Verdict(BF16)], 2.0, 2.0,
     "not faster than fp32 in the profile"),
    ("no finite time", [Verdict(BF16)], math.nan, 2.0, "not faster than fp32 in the profile"),
]


@pytest.mark.parametrize("verdicts,t,t32,why", [u[1:] for u in UNIT], ids=[u[0] for u in UNIT])
def test_a_unit_is_offered_a_format_by_its_layers_verdicts(verdicts, t, t32, why):
    assert unit_can_win(verdicts, t, t32) == why


# ------------------------------------------------------------------ every reader, one rule
def _profile() -> Profile:
    """Three layers in fp32/bf16/fp16/fp8, priced: one fine, one over budget in bf16 and
    non-finite in fp16, one whose fp8 the kernel does not take (K=20)."""
    rows = []
    for fqn, k, loss, finite16 in (("a", 64, 1e-5, True), ("b", 64, 0.05, False),
                                   ("c", 20, 1e-5, True)):
        lp = LayerProfile(Layer(fqn, "linear", "Linear", ((1, 64, k, 64),), flops=2 * 64 * 64 * k))
        lp.times.update(times(fp32=10, bf16=5, fp16=5, fp8=3))
        lp.sensitivity[BF16] = sens(BF16, loss=loss)
        lp.sensitivity[FP16] = sens(FP16, finite=finite16)
        if k == 64:
            lp.sensitivity[FP8] = sens(FP8)
        else:
            lp.skipped[FP8] = lp.fp8_blocker
        rows.append(lp)
    return Profile(task_name="t", model_name="M", device="sim", target="h100",
                   capture_method="hooks", formats=(FP32, BF16, FP16, FP8), layers=rows)


def test_the_profile_the_search_space_and_show_read_the_same_rule():
    prof = _profile()
    assert "multiples of 16" in prof.layer("c").fp8_blocker  # the registry's shape rule
    for lp in prof.layers:
        for fmt in prof.formats:
            verdict = can_win(fmt, lp.times, blocker=lp.fp8_blocker if fmt.is_scaled else "",
                              skipped=lp.skipped, sensitivity=lp.sensitivity)
            assert prof.allows(lp.fqn, fmt) is verdict.can_win, (lp.fqn, fmt)
            budgeted = can_win(fmt, lp.times, blocker=lp.fp8_blocker if fmt.is_scaled else "",
                               skipped=lp.skipped, sensitivity=lp.sensitivity,
                               max_loss_increase=DEFAULT_MAX_LOSS_INCREASE)
            if not budgeted.can_win:
                assert profile_view.reason(prof, lp.fqn, fmt) == budgeted.why
    assert "alone changes the loss by +5.00% (> 1.00%)" in profile_view.reason(prof, "b", BF16)
    assert "non-finite" in profile_view.reason(prof, "b", FP16)
    assert profile_view.reason(prof, "c", FP8) == prof.layer("c").fp8_blocker
    assert "preferred another format" in profile_view.reason(prof, "a", BF16)
    # the table's verdict: the fastest format within the default budget
    verdicts = [line.split()[-1] for line in profile_view.table(prof).splitlines()[2:5]]
    assert verdicts[0] == "fp8" and verdicts[2] == "bf16", profile_view.table(prof)
    space = SearchSpace.build(prof, prof.formats, Grouping.LAYER)
    assert space.choices == {"a": ["fp32", "bf16", "fp16", "fp8"],
                             "b": ["fp32", "bf16", "fp8"], "c": ["fp32", "bf16", "fp16"]}
    assert space.pruned == {"fp16": ["b: non-finite"],
                            "fp8": ["c: cannot win here on speed"]}
