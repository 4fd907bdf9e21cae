"""The one timing protocol: interleaved, paired against a reference, robust to bursts of
contention, and honest about its uncertainty.

Every speed figure autoprec reports (a layer's time per format in the profile, a trial's step
time, the final re-timing of the leading policies, validation's step times) comes from here.

The protocol (:class:`Comparison`):

- **Rounds.** Each round runs every candidate, in a fresh random order, ``repeats`` times in a
  row and keeps the *minimum*: contention on a shared machine only ever adds time, so the
  minimum of short repeats is the closest look at the undisturbed cost.
- **Paired.** All candidates and the reference run in every round, so slow drift (clock
  speed, thermal) hits them alike; estimates use the rounds both sides ran in.
- **Robust estimator.** A candidate's time is the 20% quantile of its per-round minima, and
  a ratio is the ratio of two such quantiles. A burst that covers a whole round cannot move
  it unless it covers most rounds; the mean of long runs would take every burst in.
- **Confidence interval.** A paired bootstrap over rounds (rounds resampled jointly for both
  sides) gives a 95% interval of the ratio. A difference whose interval contains 1 is a tie.
- **A/A.** The reference can be run twice as two candidates: their ratio must be 1, and its
  interval is the machine's noise as this measurement sees it (:func:`noise_of`).

These choices were checked on a simulated machine with bursty contention (0.2-2 s bursts
slowing steps 1.5-40x, half the time): the interval covered the true ratio in 93-98% of
runs and never excluded it on the wrong side (``tests/test_timer.py`` keeps that check).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec._util import optimizer_step
from autoprec.formats import Format
from autoprec.policy import Interval, Policy
from autoprec.runtime import rewrite

__all__ = [
    "Clock",
    "Comparison",
    "StepTimer",
    "quantile",
    "ratio_interval",
    "noise_of",
    "rerun_interval",
]

# The quantile of per-round minima that stands for a candidate's time.
QUANTILE = 0.2
# Bootstrap resamples and the interval's coverage.
_RESAMPLES = 400
_CONFIDENCE = 0.95
# the normal's 97.5% quantile (the two-sided 95% interval's)
_Z975 = 1.959964


class Clock:
    """Seconds of one call: ``perf_counter`` on CPU; CUDA events around it on a GPU, where
    kernels run asynchronously (synchronised before and after, so calls never overlap)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def time(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def quantile(xs: Sequence[float], q: float = QUANTILE) -> float:
    """The ``q`` quantile of ``xs`` (linear interpolation, as numpy's default)."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ratio_interval(a: Sequence[float], b: Sequence[float], *, seed: int = 0) -> Interval:
    """``a / b`` from paired per-round times (``a[i]`` and ``b[i]`` from the same round):
    ratio of their 20% quantiles, with a 95% paired-bootstrap interval over rounds."""
    if len(a) != len(b) or not a:
        raise ValueError(f"ratio_interval needs paired, non-empty samples; got {len(a)} and "
                         f"{len(b)} rounds.")
    value = quantile(a) / quantile(b)
    n = len(a)
    if n < 3:
        return Interval(value, 0.0, math.inf, n)  # too few rounds to say anything
    rng = random.Random(seed)
    boot = []
    for _ in range(_RESAMPLES):
        idx = [rng.randrange(n) for _ in range(n)]
        boot.append(quantile([a[i] for i in idx]) / quantile([b[i] for i in idx]))
    tail = (1 - _CONFIDENCE) / 2
    return Interval(value, quantile(boot, tail), quantile(boot, 1 - tail), n)


def noise_of(aa: Interval) -> float:
    """The machine's noise from an A/A interval: the larger distance of its ends from 1
    (0.04: a true tie could be measured up to 4% either way)."""
    return max(abs(aa.high - 1.0), abs(1.0 - aa.low))


def _t975(rounds: int) -> float:
    """Student's t 97.5% quantile for ``rounds - 1`` degrees of freedom (Cornish-Fisher
    expansion about the normal's 1.96; within 2% of the exact value from 5 rounds, 0.2% from
    10)."""
    z, v = _Z975, max(1, rounds - 1)
    return z + (z ** 3 + z) / (4 * v) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * v * v)


def rerun_interval(r: Interval) -> Interval:
    """Where a second measurement of the same ratio, as long as this one and on the machine as
    it was, lands 95% of the time. ``r`` is one run's interval of the ratio itself; a re-run's
    estimate carries its own error besides: the difference of two independent estimates
    spreads sqrt(2) times as wide as one, and symmetrically, and a bootstrap over few rounds is
    itself narrow (Student's t for the normal). So on the log scale around ``r``'s value each
    side is ``r``'s mean half-width times sqrt(2) x t(rounds - 1) / 1.96, and never narrower
    than ``r``'s own side. (Widening each side by its own width, as before, kept a side the
    bootstrap put at the value, as 6 rounds can, at zero: a CI run's tune read 1.2278x
    [1.219-1.2278] and wrote [1.2117-1.2278], as if no re-run could read faster.) On the
    simulated bursty machine of tests/test_timer.py (60 pairs of runs each at 6 and at 10
    rounds) the run's own interval covered the second run's estimate 46/60 times at both,
    this 56/60 at both, the old per-side widening 55/60 at both. Priced (``rounds`` 0) or
    unbounded intervals are returned as they are."""
    if not r.rounds or not (0 < r.low <= r.value <= r.high < math.inf):
        return r
    below, above = math.log(r.value / r.low), math.log(r.high / r.value)
    half = math.sqrt(2) * _t975(r.rounds) / _Z975 * (below + above) / 2
    return Interval(r.value, r.value * math.exp(-max(half, below)),
                    r.value * math.exp(max(half, above)), r.rounds)


@dataclass
class _Candidate:
    run: Callable[[], float]
    # per-round minimum seconds, by round index (a candidate dropped or added later has gaps)
    rounds: dict[int, float]


class Comparison:
    """An interleaved measurement of candidates against a reference (see module docstring).

    ``candidates`` maps a key to a callable that runs one repetition and returns its seconds
    (e.g. ``lambda: clock.time(step)``). The reference is one of the keys. Candidates can be
    dropped from later rounds (:meth:`drop`) and added (:meth:`add`); ratios pair the rounds
    both sides ran in.
    """

    def __init__(self, candidates: Mapping[Hashable, Callable[[], float]], reference: Hashable,
                 *, repeats: int = 2, seed: int = 0):
        if reference not in candidates:
            raise ValueError(f"The reference {reference!r} must be one of the candidates.")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}.")
        self.reference = reference
        self.repeats = repeats
        self.seed = seed
        self._order = random.Random(seed)
        self._all: dict[Hashable, _Candidate] = {k: _Candidate(fn, {})
                                                 for k, fn in candidates.items()}
        self.active: list[Hashable] = list(candidates)
        self.n_rounds = 0
        # seconds spent running each candidate (for budgets)
        self.spent: dict[Hashable, float] = dict.fromkeys(candidates, 0.0)

    # ---------------------------------------------------------------- running
    def add(self, key: Hashable, run: Callable[[], float]) -> None:
        if key not in self._all:
            self._all[key] = _Candidate(run, {})
            self.spent[key] = 0.0
        if key not in self.active:
            self.active.append(key)

    def drop(self, key: Hashable) -> None:
        """Stop running ``key`` (never the reference); its rounds so far are kept."""
        if key != self.reference and key in self.active:
            self.active.remove(key)

    def run(self, rounds: int = 1, *, warmup: bool = False) -> None:
        """Run ``rounds`` more rounds of the active candidates. ``warmup``: one untimed pass of
        each first (one-time costs: allocations, thread pools, caches)."""
        if warmup:
            for key in list(self.active):
                self._all[key].run()
        for _ in range(rounds):
            order = list(self.active)
            self._order.shuffle(order)
            for key in order:
                cand = self._all[key]
                times = [cand.run() for _ in range(self.repeats)]
                self.spent[key] += sum(times)
                cand.rounds[self.n_rounds] = min(times)
            self.n_rounds += 1

    # ---------------------------------------------------------------- estimates
    def samples(self, key: Hashable) -> list[float]:
        """Per-round minima of ``key``, in round order."""
        return [t for _, t in sorted(self._all[key].rounds.items())]

    def seconds(self, key: Hashable) -> float:
        """``key``'s time: the 20% quantile of its per-round minima."""
        return quantile(self.samples(key))

    def ratio(self, key: Hashable, to: Hashable | None = None) -> Interval:
        """Time of ``key`` / time of ``to`` (default: the reference), over paired rounds."""
        to = self.reference if to is None else to
        a, b = self._all[key].rounds, self._all[to].rounds
        common = sorted(set(a) & set(b))
        if not common:
            return Interval(math.nan, 0.0, math.inf, 0)
        return ratio_interval([a[i] for i in common], [b[i] for i in common],
                              seed=self.seed + len(common))

    def speedup(self, key: Hashable, over: Hashable | None = None) -> Interval:
        """How many times faster ``key`` runs than ``over`` (default: the reference)."""
        r = self.ratio(key, over)
        return Interval(1.0 / r.value if r.value else math.inf,
                        1.0 / r.high if r.high else math.inf,
                        1.0 / r.low if r.low else math.inf, r.rounds)

    def rounds_of(self, key: Hashable) -> int:
        return len(self._all[key].rounds)

    def spread(self, key: Hashable) -> float:
        """Interquartile range / median of ``key``'s per-round minima (for tables)."""
        xs = self.samples(key)
        med = quantile(xs, 0.5)
        if len(xs) < 2 or not med > 0:
            return math.nan
        return (quantile(xs, 0.75) - quantile(xs, 0.25)) / med


class StepTimer:
    """Whole training steps of one private model, under any policy: the one step timer.

    Each repetition applies the policy, times one step (forward, backward with the policy's
    loss scaling when it has fp16 layers, optimizer step, zero_grad) and removes the policy.
    The optimizer runs with learning rate 0, so the step costs what a real one does while the
    weights stay put and every policy is timed on the same model.
    """

    def __init__(self, model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any],
                 make_optimizer: Callable[[Any], torch.optim.Optimizer], *,
                 device: torch.device | str):
        self.model = model
        self.batch = batch
        self.loss_fn = loss_fn
        self.make_optimizer = make_optimizer
        # built on the first step after release() (None: released, or no step yet)
        self.optimizer: torch.optim.Optimizer | None = None
        self.device = torch.device(device)
        self.clock = Clock(self.device)

    def release(self) -> None:
        """Drop the optimizer and its state (AdamW's: two tensors the size of each parameter)
        until the next step builds them again: between timings, so that whoever measures
        the same model next has that memory. Rebuilding costs the state's allocation in the
        next step timed, which the estimator's low quantile of per-round minima leaves out
        like any other one-off delay."""
        self.optimizer = None

    def _stepper(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = self.make_optimizer(self.model.parameters())
            for group in self.optimizer.param_groups:
                group["lr"] = 0.0
        return self.optimizer

    def settle(self, *, tolerance: float = 0.05, max_steps: int = 12) -> int:
        """Run untimed fp32 steps until this process has warmed up: until a step comes within
        ``tolerance`` of the fastest so far after at least three, or ``max_steps``. The first
        steps of a process run slow (allocator, thread pools, kernel caches); a comparison
        that starts cold charges that to whichever candidate it times first. Returns the
        steps run."""
        run = self.runner(Policy(default=Format.FP32))
        best, n = math.inf, 0
        while n < max_steps:
            t = run()
            n += 1
            best = min(best, t)
            if n >= 3 and t <= best * (1 + tolerance):
                break
        return n

    def runner(self, policy: Policy) -> Callable[[], float]:
        """A timer candidate: one timed step under ``policy`` per call."""
        scaler = policy.grad_scaler(self.device) if policy.needs_loss_scaling else None

        def step() -> None:
            optimizer_step(self.loss_fn(self.model, self.batch), self._stepper(), scaler)

        def run() -> float:
            rewrite.apply(self.model, policy, strict=False)
            try:
                return self.clock.time(step)
            finally:
                rewrite.remove(self.model)
        return run
