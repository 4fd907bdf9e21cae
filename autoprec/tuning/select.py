"""Choosing the winner: re-time the leading policies until the verdict is significant, and
never crown a winner on noise.

1. **Finalists**: the warm starts that were fastest as measured during the search and as the
   profile predicts, and all-fp32 (a single search-time step can land in a burst of
   contention, so the best warm start is the one fastest when re-timed here); the fastest
   feasible trials as measured during the search; the feasible trial the profile predicts
   fastest; plus fp32 (the reference) and fp32 again (the A/A check of the machine's noise).
2. **Adaptive re-measurement**: interleaved rounds (:mod:`autoprec.measure.timer`) until the
   leader is significantly faster (its interval of the ratio excludes 1) than every other
   finalist and than the best warm start, and no contender's measurement contradicts the
   profile's prediction beyond its interval; or a cap on rounds or seconds is hit. Finalists
   significantly slower than the leader stop being timed.
3. **Decision**: among the finalists within noise of the leader, prefer the one the profile
   predicts faster, then the more precise one (less of its matmul work in low precision, then
   the smaller loss change), and say so. A leader not faster than fp32 beyond noise loses to
   the all-fp32 finalist (when there is one): precision is not traded for nothing.
4. **Noise**: noise never stops the re-timing early (more rounds narrow the intervals). When,
   at the end, the A/A check says the machine was too noisy to tell (``noise_limit``), the
   verdict says so, with the measured spread and what helps, claims nothing beyond the
   intervals, and breaks ties by the measured point estimates rather than the profile (which
   was measured on the same noisy machine).

With a cost-model ``target`` the prices are exact: the cheapest feasible policy wins, ties go
to the more precise one.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from autoprec.formats import Format
from autoprec.measure.timer import noise_of
from autoprec.policy import Interval, Policy
from autoprec.pricing import calibration_line, priced_tie
from autoprec.profiling import Profile
from autoprec.tuning.config import TimingConfig
from autoprec.tuning.evaluate import Evaluator
from autoprec.tuning.space import expand

__all__ = ["Finalist", "Selection", "select", "precision_cost", "NOISE_ADVICE"]

NOISE_ADVICE = ("run the tune on a quiet machine (no other jobs on its cores), pin it to "
                "cores of its own (taskset) with OMP_NUM_THREADS set to their number, or price "
                "speed with a cost model (--target) instead of measuring it")



@dataclass
class Finalist:
    """A policy the final re-timing compares."""

    # the trial number, the key of the timing comparison
    number: int
    policy: Policy
    # measured loss change (for the precision tie-break)
    loss_increase: float
    # the profile's prediction of its step time / fp32's (None when priced)
    predicted: float | None = None
    # the trial's own (search-time) step seconds
    seconds: float = math.inf


@dataclass
class Selection:
    """The verdict of the final re-timing."""

    # trial number of the winner
    winner: int
    # speed-up over fp32 of each finalist, with its interval
    speedup: dict[int, Interval]
    # fp32 step seconds as re-timed
    fp32_seconds: float
    # the winner's speed-up over the best warm start (None: the winner is it, or no warm start)
    over_warm_start: Interval | None = None
    # the trial number of the best warm start, as re-timed (or priced)
    warm: int | None = None
    # A/A check (fp32 against itself) in this re-timing, and the noise it implies
    aa: Interval | None = None
    noise: float | None = None
    # rounds the winner was timed in
    rounds: int = 0
    # finalists within noise of the leader (the winner among them)
    ties: list[int] = field(default_factory=list)
    # the verdict, in sentences
    notes: list[str] = field(default_factory=list)
    # too noisy to decide by timing
    too_noisy: bool = False
    # the trials' fp32 step over the calibrated one during the search (10%, 90% quantiles)
    drift: tuple[float, float] | None = None


def precision_cost(policy: Policy, prof: Profile) -> float:
    """Matmul FLOPs run in low precision, weighted by how much precision each format gives up
    (``Numerics.precision_rank``: per GEMM fp8 twice bf16/fp16, a quarter less with row
    scales; the mean of a layer's three GEMMs), as a share of all: 0 for all-fp32."""
    total = sum(lp.layer.flops for lp in prof.layers) or 1
    return sum(lp.layer.flops * fmt.numerics.precision_rank
               for lp, fmt in zip(prof.layers, expand(policy, prof).values())) / total


def _prefer(candidates: list[Finalist], prof: Profile) -> list[Finalist]:
    """Candidates in order of preference: those the profile predicts fastest (within 2% of the
    best prediction) first, the more precise before the less, then the smaller loss change;
    then the rest by prediction."""
    def pred(f: Finalist) -> float:
        return f.predicted if f.predicted is not None else math.inf

    best = min(pred(f) for f in candidates)
    near = [f for f in candidates if pred(f) <= best * 1.02]
    rest = [f for f in candidates if f not in near]
    return (sorted(near, key=lambda f: (precision_cost(f.policy, prof), abs(f.loss_increase)))
            + sorted(rest, key=pred))


def select(ev: Evaluator, finalists: list[Finalist], warms: Sequence[int], cfg: TimingConfig,
           *, log: Callable[[str], None] = lambda msg: None) -> Selection:
    """Decide the winner among ``finalists`` (``warms``: the trial numbers of the warm starts
    among them; the best of them is the one fastest here); see the module docstring."""
    by_number = {f.number: f for f in finalists}
    if ev.steps is None:
        return _select_priced(ev, finalists, warms)
    if ev.reference_only:
        return _select_reference(ev, finalists, warms)
    with warnings.catch_warnings(), ev.timing_steps():
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        cmp = ev.comparison({f.number: f.policy for f in finalists}, aa=True)
        cmp.run(cfg.final_rounds, warmup=True)
        started = time.perf_counter()
        while True:
            state = _State(cmp, by_number, ev, warms, cfg)
            # a noisy machine is no reason to stop: more rounds are what narrows the intervals
            done = (state.decided or state.equivalent) and not state.contradicting
            spent = time.perf_counter() - started
            if done or cmp.n_rounds >= cfg.max_final_rounds or spent >= cfg.final_seconds:
                break
            for number in state.beaten:
                if number != state.warm:
                    cmp.drop(number)  # its rounds so far still count
            cmp.run(min(4, cfg.max_final_rounds - cmp.n_rounds))
            odd = (f", {len(state.contradicting)} contradict the profile"
                   if state.contradicting else "")
            log(f"re-timing: {cmp.n_rounds} rounds; leader trial {state.leader} at "
                f"{cmp.speedup(state.leader)} fp32 ({len(state.contenders)} within noise{odd})")
    return _verdict(state, cmp, by_number, ev, state.warm, cfg)


class _State:
    """Where the re-timing stands after some rounds."""

    def __init__(self, cmp, by_number: dict[int, Finalist], ev: Evaluator,
                 warms: Sequence[int], cfg: TimingConfig):
        keys = list(by_number)
        self.speedup = {k: cmp.speedup(k) for k in keys}
        # the best warm start is the one fastest in this re-timing
        self.warm = warm = max(warms, key=lambda k: self.speedup[k].value) if warms else None
        self.leader = max(keys, key=lambda k: self.speedup[k].value)
        # finalists the leader is significantly faster than
        self.beaten = [k for k in keys if k != self.leader
                       and cmp.ratio(self.leader, k).high < 1.0]
        self.contenders = [k for k in keys if k not in self.beaten]
        self.contradicting = [k for k in self.contenders
                              if not ev.consistent(cmp.ratio(k), by_number[k].predicted)]
        self.decided = len(self.contenders) == 1 and (warm is None or warm == self.leader
                                                      or warm in self.beaten)
        # the contenders are as fast as the leader within `equivalence`, with confidence
        eq = 1 + cfg.equivalence
        ratios = [cmp.ratio(k, self.leader) for k in self.contenders if k != self.leader]
        self.equivalent = bool(ratios) and all(1 / eq <= r.low and r.high <= eq for r in ratios)
        self.aa = cmp.ratio("fp32 again")

    def too_noisy(self, cfg: TimingConfig) -> bool:
        return self.aa.rounds >= 3 and noise_of(self.aa) > cfg.noise_limit


def _verdict(state: _State, cmp, by_number: dict[int, Finalist], ev: Evaluator,
             warm: int | None, cfg: TimingConfig) -> Selection:
    noise = noise_of(state.aa)
    too_noisy = state.too_noisy(cfg)
    contenders = [by_number[k] for k in state.contenders]
    if too_noisy:
        # the per-layer profile was measured on the same noisy machine: the timing of the
        # policies themselves, many interleaved rounds, is the better evidence left
        ranked = sorted(contenders, key=lambda f: (-state.speedup[f.number].value,
                                                   precision_cost(f.policy, ev.prof)))
    else:
        ranked = _prefer(contenders, ev.prof)
    winner = ranked[0].number
    notes = []
    # a policy not shown faster than fp32 is not worth its lost precision: all-fp32 wins ties
    exact = [k for k, f in by_number.items() if precision_cost(f.policy, ev.prof) == 0]
    kept_fp32 = bool(exact) and winner not in exact and state.speedup[winner].low <= 1.0
    if kept_fp32:
        notes.append(f"the fastest policy (trial {winner}, {state.speedup[winner]} fp32 after "
                     f"{cmp.n_rounds} rounds) is not faster than fp32 beyond timing noise: kept "
                     f"trial {exact[0]}, all-fp32")
        winner = exact[0]
    elif too_noisy:
        notes.append(f"the machine was too noisy to decide by timing: fp32 measured against "
                     f"itself came out at {state.aa} after {cmp.n_rounds} rounds (a true tie "
                     f"measured up to {noise:.0%} off); of the {len(ranked)} policies timing "
                     "could not tell apart, the fastest as measured was kept (the per-layer "
                     f"profile was measured on the same machine). What helps: {NOISE_ADVICE}")
    elif len(ranked) > 1:
        same = (f" (all within {cfg.equivalence:.0%} of each other)" if state.equivalent
                else "")
        notes.append(f"{len(ranked)} policies were within timing noise of each other{same} after "
                     f"{cmp.n_rounds} rounds (trials {', '.join(map(str, state.contenders))}); "
                     f"kept trial {winner}: the profile predicts it "
                     f"{'faster' if _faster_predicted(ranked) else 'as fast'}"
                     f"{'' if _faster_predicted(ranked) else ', and it is the more precise'}")
    if len(ranked) == 1 and not too_noisy and not kept_fp32 and len(by_number) > 1:
        notes.append(f"faster than every other finalist beyond timing noise after "
                     f"{cmp.n_rounds} rounds (fp32 against itself: {state.aa})")
    if winner in state.contradicting:
        f = by_number[winner]
        notes.append(f"its measured step time ({cmp.ratio(winner)} of fp32) disagrees with the "
                     f"profile's prediction ({f.predicted:.2f} of fp32) after {cmp.n_rounds} "
                     "rounds; the measurement was kept")
    speedup = _as_written(state.speedup, by_number[winner], notes)
    over = None
    if warm is not None and warm != winner:
        over = cmp.speedup(winner, over=warm)
        if over.low > 1.0:
            notes.append(f"faster than the best warm start (trial {warm}) by {over}")
        else:
            notes.append(f"ties with the best warm start (trial {warm}): {over}, an interval "
                         "that includes 1")
    return Selection(winner=winner, speedup=speedup, fp32_seconds=cmp.seconds("fp32"),
                     over_warm_start=over, warm=warm, aa=state.aa, noise=noise,
                     rounds=cmp.rounds_of(winner), ties=list(state.contenders), notes=notes,
                     too_noisy=too_noisy)


def _as_written(speedup: dict[int, Interval], winner: Finalist,
                notes: list[str]) -> dict[int, Interval]:
    """The finalists' speed-ups as the verdict gives them: an all-fp32 winner is the reference
    itself, 1 by construction (timed against the reference it is an A/A check, whose spread is
    not a speed-up), and says so."""
    if winner.policy.formats_used() != {Format.FP32}:
        return dict(speedup)
    notes.append(f"the winner is all-fp32, the reference: speed-up 1 by construction (timed "
                 f"against the reference: {speedup[winner.number]})")
    return {**speedup, winner.number: Interval(1.0, 1.0, 1.0, 0)}


def _faster_predicted(ranked: list[Finalist]) -> bool:
    a, b = ranked[0].predicted, ranked[1].predicted
    return a is not None and b is not None and a < b / 1.02


def _select_reference(ev: Evaluator, finalists: list[Finalist],
                      warms: Sequence[int]) -> Selection:
    """The search space held one policy, all-fp32: the reference itself, nothing to re-time."""
    winner = finalists[0].number
    return Selection(winner=winner, speedup={f.number: Interval(1.0, 1.0, 1.0, 0)
                                             for f in finalists},
                     fp32_seconds=ev.fp32_seconds, warm=winner if winner in warms else None,
                     notes=["the search space held one policy, all-fp32 (no other format can "
                            "win on this device): it is the reference, so nothing was re-timed"])


def _select_priced(ev: Evaluator, finalists: list[Finalist],
                   warms: Sequence[int]) -> Selection:
    prices = {f.number: ev.prof.estimate_step(expand(f.policy, ev.prof), ev.target)
              for f in finalists}
    warm = min(warms, key=lambda k: prices[k]) if warms else None
    best = min(prices.values())
    tied = [f for f in finalists if prices[f.number] <= best * (1 + 1e-9)]
    winner = sorted(tied, key=lambda f: (precision_cost(f.policy, ev.prof),
                                         abs(f.loss_increase)))[0].number
    speedup = {k: Interval(ev.fp32_seconds / p, ev.fp32_seconds / p, ev.fp32_seconds / p, 0)
               for k, p in prices.items()}
    over = None
    notes = [f"{calibration_line(ev.target)}; no timing noise"]
    if warm is not None and warm != winner:
        r = prices[warm] / prices[winner]
        over = Interval(r, r, r, 0)
        tie = priced_tie(prices[warm], prices[winner], ev.target)
        notes.append(f"{r:.3f}x the best warm start's price (trial {warm})"
                     + (": a tie, inside the cost model's calibration error" if tie else ""))
    return Selection(winner=winner, speedup=speedup, fp32_seconds=ev.fp32_seconds,
                     over_warm_start=over, warm=warm, ties=[f.number for f in tied],
                     notes=notes)
