"""Evaluating a policy as the search does: its numerics against FP32 on held-out batches (the
comparison the profile uses, :mod:`autoprec.measure.deviation`) and its step time (the one
timing protocol, :mod:`autoprec.measure.timer`, paired against fp32; or the cost model's
price for a ``target``)."""

from __future__ import annotations

import contextlib
import math
import statistics
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from autoprec._util import class_name, model_state, move_to
from autoprec.fingerprint import model_fingerprint
from autoprec.formats import Format
from autoprec.measure.deviation import Deviation, DeviationMeter, prepare_for_measurement, reference_keywords
from autoprec.measure.timer import Comparison, StepTimer, noise_of, quantile
from autoprec.policy import Interval, Policy
from autoprec.pricing import CostSource
from autoprec.profiling import Profile
from autoprec.task import Task, default_loss
from autoprec.tuning.config import TimingConfig
from autoprec.tuning.space import expand

__all__ = ["Evaluator", "Timed"]

FP32 = Policy(default=Format.FP32)


@dataclass(frozen=True)
class Timed:
    """A policy's step time: measured against fp32 (``ratio`` with its interval) or priced."""

    # step seconds / fp32 step seconds, with its 95% interval (rounds=0: priced, exact)
    ratio: Interval
    # ratio x the fp32 step time of this tune (the objective the sampler sees)
    seconds: float
    # the profile's prediction of the ratio (None: no measured profile to predict from)
    predicted: float | None = None
    # the measurement contradicted the prediction even after it was re-measured
    contradicts: bool = False

    @property
    def speedup(self) -> Interval:
        r = self.ratio
        return Interval(1 / r.value, 1 / r.high if r.high else math.inf,
                        1 / r.low if r.low else math.inf, r.rounds)


class Evaluator:
    """Holds the task's model as the tune built it, the FP32 reference on the held-out batches
    and, when measuring, a step timer on the same model and the fp32 step time; evaluates
    policies."""

    def __init__(self, task: Task, holdout: Sequence[Any], *, prof: Profile,
                 target: str | None, timing: TimingConfig, model: nn.Module | None = None,
                 reference_only: bool = False, holdout_gradients: str = "kept"):
        """``model``: a fresh build of the task's model to measure on (prepared for
        measurement in place, so no one else's), or None to build one. ``reference_only``:
        every policy evaluated is all-fp32, the reference itself (a search space of one
        policy), so nothing is timed against fp32 and there is no A/A check: the fp32 step is
        timed once, for the report. ``holdout_gradients``: the FP32 reference's gradients on
        the held-out batches "kept", "recomputed" beside each trial's (:class:`DeviationMeter`
        ``per_batch``) or kept outside the device's memory, "spilled" (``spill``)."""
        self.task, self.prof, self.target, self.timing = task, prof, target, timing
        self.reference_only = reference_only
        # called with each policy before its comparison runs (rank 0 of a sharded tune tells
        # the other ranks, which run the same FSDP2 passes beside it: tuning/ranks.py)
        self.announce: Callable[[Policy], None] | None = None
        self.source = CostSource.of(target)
        model = prepare_for_measurement(model if model is not None else task.build_model())
        self.fingerprint = model_fingerprint(model)
        self.model_name = class_name(model)
        self.meter = DeviationMeter(model, [move_to(b, task.device) for b in holdout],
                                 task.loss_fn or default_loss, seed=task.seed,
                                 **reference_keywords(holdout_gradients))
        self.steps: StepTimer | None = None
        self.aa: Interval | None = None
        # each trial's fp32 step time / the calibrated one: the machine's noise during the
        # search, as the trials' own fp32 anchors saw it
        self.fp32_drift: list[float] = []
        if self.source.measured:
            self.steps = StepTimer(model, task.example_batch(),
                                   task.loss_fn or default_loss, task.make_optimizer,
                                   device=task.device)
        self.fp32_seconds = self._calibrate()

    def _calibrate(self) -> float:
        """The fp32 step time, and the machine's noise as an A/A check of fp32 against itself
        sees it (before the search)."""
        if self.steps is None:
            return self.prof.estimate_step(expand(FP32, self.prof), self.target)
        with self.timing_steps():
            # the fp32 step time every trial is scaled by must not be a cold process's
            self.steps.settle()
            if self.reference_only:
                run = self.steps.runner(FP32)  # warm: settle() ran fp32 steps
                return statistics.median(run() for _ in range(3))
            check = Comparison({"fp32": self.steps.runner(FP32),
                                "fp32 again": self.steps.runner(FP32)},
                               "fp32", repeats=self.timing.repeats, seed=self.task.seed)
            check.run(max(6, self.timing.final_rounds), warmup=True)
        self.aa = check.ratio("fp32 again")
        return check.seconds("fp32")

    @contextlib.contextmanager
    def timing_steps(self) -> Iterator[None]:
        """Training steps timed on the model the numerics are compared on: afterwards its
        weights, buffers and gradients are as before. The timed optimizer runs at learning
        rate 0, but a user's optimizer may still move weights (weight decay outside the
        learning rate, a NaN times 0), so the values wait outside the device's memory meanwhile
        (:func:`~autoprec._util.model_state`), not in a second copy of the model; and the
        timer's optimizer state is dropped afterwards, so the comparisons and the memory model
        that use the model next do not hold it too. The FP32 reference's held-out gradients, when
        kept, wait outside it too: the timed step needs the room they take."""
        try:
            with model_state(self.steps.model, spill=True), self.meter.kept_outside():
                yield
        finally:
            self.steps.release()

    @property
    def noise(self) -> float | None:
        """The A/A noise measured before the search (None when priced)."""
        return None if self.aa is None else noise_of(self.aa)

    def drift(self) -> tuple[float, float] | None:
        """The 10% and 90% quantiles of the trials' fp32 step time over the calibrated one
        (None before any measured trial)."""
        if not self.fp32_drift:
            return None
        return quantile(self.fp32_drift, 0.1), quantile(self.fp32_drift, 0.9)

    # ---------------------------------------------------------------- numerics
    def deviation(self, policy: Policy) -> Deviation:
        """``policy`` against FP32 on the held-out batches, the gradient bias included."""
        if self.announce is not None:
            self.announce(policy)
        return self.meter.compare(policy, bias=True)

    # ---------------------------------------------------------------- time
    def predicted_ratio(self, policy: Policy) -> float | None:
        """The profile's prediction of ``policy``'s step time over fp32's: the fp32 step with
        each profiled layer's time swapped for its time in the policy's format."""
        if self.source.priced or not math.isfinite(self.fp32_seconds):
            return None
        fmts = expand(policy, self.prof)
        fp32 = {f: Format.FP32 for f in fmts}
        layers, layers32 = self.prof.layer_seconds(fmts), self.prof.layer_seconds(fp32)
        if not (math.isfinite(layers) and math.isfinite(layers32)):
            return None
        rest = max(0.0, self.fp32_seconds - layers32)
        return (rest + layers) / (rest + layers32)

    def consistent(self, ratio: Interval, predicted: float | None) -> bool:
        """Whether a measured ratio agrees with the profile's prediction, within its own
        interval widened by the profile's tolerance."""
        if predicted is None:
            return True
        tol = 1 + self.timing.model_tolerance
        return ratio.low / tol <= predicted <= ratio.high * tol

    def comparison(self, policies: Mapping[Hashable, Policy], *, aa: bool = False,
                   repeats: int | None = None) -> Comparison:
        """A timing comparison of ``policies`` against fp32 (key "fp32"); ``aa`` adds fp32
        again (key "fp32 again"), the A/A check."""
        runners = {"fp32": self.steps.runner(FP32)}
        if aa:
            runners["fp32 again"] = self.steps.runner(FP32)
        runners.update({k: self.steps.runner(p) for k, p in policies.items()})
        return Comparison(runners, "fp32", repeats=repeats or self.timing.repeats,
                          seed=self.task.seed)

    def time(self, policy: Policy) -> Timed:
        """One trial's step time: priced, or measured in a few rounds paired with fp32 and
        re-measured once more when it contradicts the profile's prediction."""
        if self.steps is None:
            sec = self.prof.estimate_step(expand(policy, self.prof), self.target)
            r = sec / self.fp32_seconds
            return Timed(Interval(r, r, r, 0), sec)
        if self.reference_only:  # the same step as the reference: 1 by construction
            return Timed(Interval(1.0, 1.0, 1.0, 0), self.fp32_seconds, 1.0)
        predicted = self.predicted_ratio(policy)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*can only emulate.*")
            cmp = self.comparison({"trial": policy}, repeats=self.timing.trial_repeats)
            with self.timing_steps():
                cmp.run(self.timing.trial_rounds)
                ratio = cmp.ratio("trial")
                if not self.consistent(ratio, predicted) and self.timing.recheck_rounds:
                    cmp.run(self.timing.recheck_rounds)
                    ratio = cmp.ratio("trial")
        self.fp32_drift.append(cmp.seconds("fp32") / self.fp32_seconds)
        return Timed(ratio, ratio.value * self.fp32_seconds, predicted,
                     not self.consistent(ratio, predicted))
