"""Choosing the winner (autoprec.tuning.select) on synthetic timings: the final re-timing never
crowns a slower policy, says "tie" when timing cannot tell, prefers the profile's prediction
and then precision among ties, and says when the machine is too noisy to decide."""

from __future__ import annotations

import contextlib

import pytest
from test_timer import BurstyMachine

from autoprec import Policy
from autoprec.measure.capture import Layer
from autoprec.measure.timer import Comparison
from autoprec.policy import Interval
from autoprec.profiling import LayerProfile, Profile
from autoprec.tuning.config import TimingConfig
from autoprec.tuning.select import Finalist, precision_cost, select

PROF = Profile(task_name="t", model_name="M", device="sim", target=None,
               capture_method="hooks", formats=(), layers=[
                   LayerProfile(Layer("a", "linear", "Linear", ((1, 64, 64, 64),),
                                      flops=2 * 64 ** 3)),
                   LayerProfile(Layer("b", "linear", "Linear", ((1, 64, 64, 64),),
                                      flops=2 * 64 ** 3))])


class FakeEvaluator:
    """What select() needs of an Evaluator, timing on a simulated machine: each policy's true
    step time is given, the steps are slowed by bursts."""

    def __init__(self, machine: BurstyMachine, true: dict, tolerance: float = 0.25):
        self.machine, self.true, self.prof = machine, true, PROF
        self.steps = object()  # measured, not priced
        self.reference_only = False  # the finalists are timed against fp32
        self.tolerance = tolerance

    def comparison(self, policies, *, aa=False):
        runs = {"fp32": self.machine.step(self.true["fp32"])}
        if aa:
            runs["fp32 again"] = self.machine.step(self.true["fp32"])
        runs.update({k: self.machine.step(self.true[k]) for k in policies})
        return Comparison(runs, "fp32", repeats=2, seed=0)

    def consistent(self, ratio, predicted):
        return predicted is None or ratio.low / 1.25 <= predicted <= ratio.high * 1.25

    def timing_steps(self):
        return contextlib.nullcontext()  # no model to put back


def _finalists(true: dict) -> list[Finalist]:
    policies = {0: Policy(default="bf16"), 1: Policy(default="bf16", layers={"b": "fp8"}),
                2: Policy(default="fp32", layers={"a": "bf16"})}
    return [Finalist(k, policies[k], 0.001, predicted=true[k] / true["fp32"]) for k in (0, 1, 2)]


@pytest.mark.parametrize("seed", range(12))
def test_never_a_slower_winner_and_claims_only_what_the_interval_shows(seed):
    # trial 1 is truly 3% faster than the warm start 0; trial 2 is far slower
    true = {"fp32": 0.3, 0: 0.15, 1: 0.15 * 0.97, 2: 0.25}
    ev = FakeEvaluator(BurstyMachine(seed, mean_gap=1.0), true)
    sel = select(ev, _finalists(true), [0], TimingConfig(final_rounds=10, max_final_rounds=30,
                                                       final_seconds=1e9))
    assert sel.winner in (0, 1), sel
    assert 2 not in sel.ties
    if sel.winner == 1 and sel.over_warm_start is not None and sel.over_warm_start.low > 1:
        assert any("faster than the best warm start" in n for n in sel.notes)
    else:
        # a tie with the warm start is said as one; no improvement is claimed
        assert not any("faster than the best warm start" in n for n in sel.notes), sel.notes
    if len(sel.ties) > 1:
        # within noise, the profile's prediction decides: trial 1 is predicted 3% faster
        assert sel.winner == 1 and any("within timing noise" in n for n in sel.notes)
    assert sel.speedup[sel.winner].low <= 2.0 * 1.03 / 0.97  # covers the truth or near it


def test_a_tie_goes_to_the_more_precise_policy_when_predictions_agree():
    true = {"fp32": 0.3, 0: 0.15, 1: 0.15, 2: 0.15}
    ev = FakeEvaluator(BurstyMachine(3, mean_gap=1.0), true)
    sel = select(ev, _finalists(true), [0], TimingConfig(final_rounds=10, max_final_rounds=12,
                                                       final_seconds=1e9))
    costs = {f.number: precision_cost(f.policy, PROF) for f in _finalists(true)}
    tied = sorted(sel.ties, key=lambda k: costs[k])
    assert len(sel.ties) >= 2 and sel.winner == tied[0], (sel.ties, costs)
    assert costs[2] < costs[0] < costs[1]


def test_too_noisy_says_so_with_the_spread_and_what_helps():
    true = {"fp32": 0.3, 0: 0.15, 1: 0.15 * 0.97, 2: 0.25}
    ev = FakeEvaluator(BurstyMachine(0, mean_gap=0.1, worst=40), true)
    sel = select(ev, _finalists(true), [0], TimingConfig(final_rounds=4, max_final_rounds=6,
                                                       final_seconds=1e9, noise_limit=0.05))
    assert sel.too_noisy and sel.noise > 0.05
    note = sel.notes[0]
    assert "too noisy" in note and "quiet machine" in note and "--target" in note, note


def test_the_best_warm_start_is_the_one_fastest_when_re_timed():
    # warm starts 2 (fp32 with one bf16 layer) and 0 (all-bf16): in the search, a burst made 0
    # look slower than 2; both are finalists, and the claim is made against 0, truly the faster
    true = {"fp32": 0.3, 0: 0.15, 1: 0.15 * 0.7, 2: 0.25}
    ev = FakeEvaluator(BurstyMachine(5, mean_gap=1.0), true)
    sel = select(ev, _finalists(true), [2, 0], TimingConfig(final_rounds=10, max_final_rounds=30,
                                                            final_seconds=1e9))
    assert sel.winner == 1 and sel.warm == 0, sel
    note = next(n for n in sel.notes if "best warm start" in n)
    assert "(trial 0)" in note, note
    assert sel.over_warm_start.value < 0.25 / (0.15 * 0.7)  # not measured against the slow one


def _fp32_against_bf16(seed: int, factor: float):
    """The final selection between all-fp32 (trial 0, its regions costing 2%) and all-bf16
    (trial 1, ``factor`` x the fp32 step), both warm starts, on a noisy machine."""
    true = {"fp32": 0.3, 0: 0.3 * 1.02, 1: 0.3 * factor}
    policies = {0: Policy(default="fp32"), 1: Policy(default="bf16")}
    finalists = [Finalist(k, policies[k], 0.001 * k, predicted=true[k] / true["fp32"])
                 for k in (0, 1)]
    ev = FakeEvaluator(BurstyMachine(seed, mean_gap=1.0), true)
    return select(ev, finalists, [0, 1], TimingConfig(final_rounds=6, max_final_rounds=10,
                                                      final_seconds=1e9))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("factor, winner", [(0.85, 1), (1.05, 0)])
def test_a_policy_clearly_faster_or_slower_than_fp32_is_decided_so(seed, factor, winner):
    # the rule below, where its outcome is not in doubt: bf16 15% faster than fp32 wins with
    # an interval that excludes 1; 5% slower, all-fp32 wins
    sel = _fp32_against_bf16(seed, factor)
    assert sel.winner == winner, sel
    if winner == 1:
        assert sel.speedup[1].low > 1.0, sel
    else:
        assert sel.speedup[0] == Interval(1.0, 1.0, 1.0, 0), sel.speedup


@pytest.mark.parametrize("seed", range(6))
def test_a_policy_not_faster_than_fp32_beyond_noise_loses_to_all_fp32(seed):
    # trial 1 (bf16) is truly 1% faster than fp32, trial 0 is all-fp32 (the regions cost 2%)
    sel = _fp32_against_bf16(seed, 0.99)
    # bf16 is written only with an interval over fp32 that excludes 1; else fp32, said so
    if sel.winner == 1:
        assert sel.speedup[1].low > 1.0, sel
    else:
        assert sel.winner == 0 and sel.speedup[1].low <= 1.0
        assert "not faster than fp32 beyond timing noise" in sel.notes[0], sel.notes
        # all-fp32 is the reference: written as 1 exactly, not as its A/A-like timing
        assert sel.speedup[0] == Interval(1.0, 1.0, 1.0, 0), sel.speedup
        assert any("speed-up 1 by construction" in n for n in sel.notes), sel.notes
