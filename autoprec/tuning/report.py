"""What a tune reports: each trial as the study keeps it (:class:`TrialRecord`) and as the
result lists it (:class:`TrialResult`), the result (winner, Pareto front, the verdict), the
files beside the policy (Pareto CSV and plot), and the provenance written into the policy."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec._util import atomic_write, brief, number, shown
from autoprec.measure.timer import rerun_interval
from autoprec.policy import Budget, Interval, Policy, Provenance
from autoprec.pricing import CostSource
from autoprec.profiling import Profile
from autoprec.task import Task
from autoprec.tuning.config import TunePaths
from autoprec.tuning.select import Selection

__all__ = ["TrialRecord", "TrialResult", "TuneResult", "pareto", "provenance",
           "fallback_provenance", "with_provenance"]


@dataclass(frozen=True)
class TrialRecord:
    """What one trial measured, as the study keeps it (Optuna user attributes, one key per
    field): written by the trial, copied by a repeat of its policy, read back for the verdict.
    A study is a file anyone may have written, so :meth:`from_attrs` checks every value."""

    # (loss, gradient error, memory, gradient bias) over their limits, each <= 0 within the
    # budget; studies from before the memory (bias) constraint have two (three)
    constraints: tuple[float, ...] = (1.0, 1.0)
    grad_error: float = math.nan
    finite: bool = False
    # speed-up over fp32 with its interval (None: derive it from the step time)
    speedup: Interval | None = None
    predicted: float | None = None
    memory: int | None = None
    origin: str = "search"
    # the gradient bias vs FP32 (None: not measured, as in studies from before it)
    grad_bias: float | None = None

    @property
    def feasible(self) -> bool:
        return self.finite and all(c <= 0 for c in self.constraints)

    def to_attrs(self) -> dict[str, Any]:
        """The user attributes the study keeps this record in."""
        return {"constraints": list(self.constraints), "grad_error": self.grad_error,
                "finite": self.finite,
                "speedup": None if self.speedup is None else self.speedup.to_dict(),
                "predicted": self.predicted, "memory": self.memory, "origin": self.origin,
                "grad_bias": self.grad_bias}

    def write(self, trial: Any) -> None:
        """Store this record in ``trial`` (an ``optuna.Trial``), constraints included."""
        for key, value in self.to_attrs().items():
            trial.set_user_attr(key, value)
        for name, value in zip(("loss_increase", "grad_error", "memory", "grad_bias"),
                               self.constraints):
            trial.set_constraint(name, float(value))

    @classmethod
    def from_trial(cls, trial: Any, where: str = "the study") -> TrialRecord:
        """The record of ``trial`` (an Optuna trial, frozen or running), each value checked:
        a value of the wrong type is a one-line ValueError naming the trial and the key."""
        return cls.from_attrs(trial.user_attrs, f"{where}, trial {trial.number}")

    @classmethod
    def from_attrs(cls, attrs: Any, where: str) -> TrialRecord:
        values: dict[str, Any] = {}
        for key, read in _READERS.items():
            if attrs.get(key) is None:
                continue
            try:
                values[key] = read(attrs[key], key)
            except ValueError as e:
                raise ValueError(f"In {where}: {e} The study was not written by this version of "
                                 "autoprec's tune; give this tune a new --study name or -o path."
                                 ) from None
        return cls(**values)


def _constraints(value: Any, key: str) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)) or not 2 <= len(value) <= 4:
        raise ValueError(f"`{key}` must be a list of 2 to 4 numbers, got {brief(value)}.")
    return tuple(number(v, f"`{key}`") for v in value)


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`{key}` must be true or false, got {brief(value)}.")
    return value


def _count(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{key}` must be a whole number of bytes >= 0, got {brief(value)}.")
    return value


def _text(value: Any, key: str) -> str:
    """Text read back from a study: bounded and escaped (:func:`~autoprec._util.shown`) as it
    is read, since the summary, the log and the CSV print it."""
    if not isinstance(value, str):
        raise ValueError(f"`{key}` must be text, got {brief(value)}.")
    return shown(value)


# How each of a record's keys is read back (None, or missing: the field's default).
_READERS = {"constraints": _constraints, "grad_error": lambda v, k: number(v, f"`{k}`"),
            "finite": _flag, "speedup": lambda v, k: Interval.from_value(v, f"`{k}`"),
            "predicted": lambda v, k: number(v, f"`{k}`"), "memory": _count, "origin": _text,
            "grad_bias": lambda v, k: number(v, f"`{k}`")}


@dataclass(frozen=True)
class TrialResult:
    """One evaluated policy."""

    # Optuna trial number (-1 for an evaluation outside a study).
    number: int
    # search unit (layer fqn or group glob) -> format
    assignment: dict[str, str]
    # step seconds: fp32's x the measured ratio, or the cost model's price for a target
    step_seconds: float
    # speed-up over fp32 with its interval (rounds 0: priced)
    speedup: Interval
    # mean relative loss change vs FP32 on held-out calibration batches
    loss_increase: float
    # relative L2 error of all parameter gradients vs FP32, all held-out batches
    grad_error: float
    # all values finite and within the budget
    feasible: bool
    finite: bool
    # where the trial came from: "warm:fp32", "warm:milp@0.005", "search", ...
    origin: str = "search"
    # the profile's prediction of its step time / fp32's (None: priced, or no prediction)
    predicted: float | None = None
    # predicted peak training-step memory in bytes (autoprec.memory; None: not predicted)
    memory: int | None = None
    # the gradient bias vs FP32 on the held-out batches (nan: not measured)
    grad_bias: float = math.nan

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["speedup"] = self.speedup.to_dict()
        return d

    @classmethod
    def of(cls, trial: Any, fp32_seconds: float, where: str = "the study") -> TrialResult:
        """A complete Optuna trial's result, from its values and its :class:`TrialRecord`."""
        sec, li = trial.values
        rec = TrialRecord.from_trial(trial, where)
        speedup = rec.speedup or Interval(fp32_seconds / sec, fp32_seconds / sec,
                                          fp32_seconds / sec, 0)
        return cls(trial.number, dict(trial.params), sec, speedup, li, rec.grad_error,
                   rec.feasible, rec.finite, rec.origin, rec.predicted, rec.memory,
                   math.nan if rec.grad_bias is None else rec.grad_bias)


def pareto(trials: list[TrialResult]) -> list[TrialResult]:
    """The feasible trials no other is at least as fast and as accurate as (and better in one)."""
    front = []
    for t in trials:
        dominated = any(o.step_seconds <= t.step_seconds and o.loss_increase <= t.loss_increase
                        and (o.step_seconds < t.step_seconds or o.loss_increase < t.loss_increase)
                        for o in trials)
        if not dominated:
            front.append(t)
    return sorted(front, key=lambda t: t.step_seconds)


@dataclass
class TuneResult:
    """What tune() found: the winner, the Pareto front, and how the verdict was reached."""

    policy: Policy
    best: TrialResult
    fp32_seconds: float
    pareto: list[TrialResult]
    trials: list[TrialResult]
    best_warm_start: TrialResult | None
    study_name: str
    storage: str
    profile: Profile | None = None
    validation: Any = None
    # search unit -> the layer fqns it sets
    units: dict[str, list[str]] = field(default_factory=dict)
    # the final re-timing's verdict (None before it ran)
    selection: Selection | None = None

    @property
    def speedup(self) -> Interval:
        """The winner's speed-up over fp32 as finally re-timed, with the interval a re-timing
        as long would land in (:func:`~autoprec.measure.timer.rerun_interval`); the re-timing's
        own confidence interval is ``self.best.speedup``."""
        if self.selection is not None and self.best.number in self.selection.speedup:
            return rerun_interval(self.selection.speedup[self.best.number])
        return self.best.speedup

    @property
    def improvement_over_warm_start(self) -> Interval | None:
        """The winner's speed-up over the best warm start (None when the winner is the warm
        start itself or there is none)."""
        return None if self.selection is None else self.selection.over_warm_start

    def summary(self) -> str:
        from autoprec.memory import format_size

        b = self.best
        distinct = len({json.dumps(t.assignment, sort_keys=True) for t in self.trials})
        priced = self.profile is not None and self.profile.target is not None
        # a price covers the profiled layers' forward + backward, not the rest of the step
        what = "the fp32 time of the priced layers" if priced else "fp32 step time"
        lines = [f"winner: trial {b.number} ({b.origin}): {self.speedup} {what}, "
                 f"loss {b.loss_increase:+.3%}, gradient error {b.grad_error:.3g}"
                 + ("" if b.memory is None else f", peak memory {format_size(b.memory)}"),
                 f"trials: {len(self.trials)} ({distinct} distinct policies, "
                 f"{sum(t.feasible for t in self.trials)} feasible), Pareto front: "
                 f"{len(self.pareto)}"]
        if priced:
            lines.append("  priced: the searched layers' products and casts, forward + backward; "
                         "norms, softmax, the loss and the optimizer are not, so a whole step "
                         "gains less")
        if self.selection is not None:
            lines += [f"  {note}" for note in self.selection.notes]
        return "\n".join(lines)

    def save(self, path: str | os.PathLike, *, plot: bool = True) -> list[str]:
        """Write the policy YAML, the trials as ``<stem>.pareto.csv`` and a
        ``<stem>.pareto.png`` plot beside it (see :class:`TunePaths`). Returns the written
        paths."""
        paths = TunePaths.from_output(path)
        self.policy.save(paths.policy)
        written = [paths.policy, atomic_write(paths.csv, self._csv())]
        if plot:
            png = _plot_front(self, paths.png)
            if png:
                written.append(png)
        return written

    def _csv(self) -> str:
        out = io.StringIO()
        w = csv.writer(out)
        w.writerow(["trial", "origin", "step_seconds", "speedup_vs_fp32", "speedup_low",
                    "speedup_high", "timing_rounds", "predicted_ratio", "loss_increase",
                    "grad_error", "grad_bias", "peak_memory_bytes", "feasible", "on_front",
                    "assignment"])
        front = {t.number for t in self.pareto}
        for t in sorted(self.trials, key=lambda t: t.step_seconds):
            s = t.speedup
            w.writerow([t.number, t.origin, f"{t.step_seconds:.6g}", f"{s.value:.4f}",
                        f"{s.low:.4f}", f"{s.high:.4f}", s.rounds,
                        "" if t.predicted is None else f"{t.predicted:.4f}",
                        f"{t.loss_increase:.6g}", f"{t.grad_error:.6g}",
                        "" if math.isnan(t.grad_bias) else f"{t.grad_bias:.6g}",
                        "" if t.memory is None else t.memory, t.feasible,
                        t.number in front, json.dumps(t.assignment, sort_keys=True)])
        return out.getvalue()


def _plot_front(result: TuneResult, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is a convenience; the CSV carries the data
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ok = [t for t in result.trials if t.feasible]
    bad = [t for t in result.trials if t.finite and not t.feasible]
    ax.scatter([t.speedup.value for t in bad], [t.loss_increase for t in bad], c="lightgray",
               s=14, label="over budget")
    ax.scatter([t.speedup.value for t in ok], [t.loss_increase for t in ok], c="tab:blue",
               s=14, label="feasible")
    front = sorted(result.pareto, key=lambda t: t.speedup.value)
    ax.plot([t.speedup.value for t in front], [t.loss_increase for t in front], "o-",
            c="tab:red", label="Pareto front")
    s = result.speedup
    ax.errorbar([s.value], [result.best.loss_increase],
                xerr=[[max(0.0, s.value - s.low)], [max(0.0, min(s.high, 1e3) - s.value)]],
                fmt="*", ms=14, c="gold", mec="k", zorder=5, label="winner (re-timed)")
    ax.set_xlabel("speed-up vs FP32 (step time)")
    ax.set_ylabel("relative loss change vs FP32")
    ax.set_title(f"autoprec tune: {result.study_name}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    # into memory, then the one atomic write: savefig(path) would open a link planted at path
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    return atomic_write(path, png.getvalue())


def provenance(task: Task, result: TuneResult, budget: Budget, target: str | None,
               prof: Profile, *, bias_batches: int = 0, at: int | None = None) -> Provenance:
    """The policy's ``tuned:`` section: where and how it was tuned, its measured speed-up with
    its interval, and the verdict; where the budget has a bias limit, the winner's bias with
    where it was measured (``at`` steps into a run of twice as many, or at init, on
    ``bias_batches`` held-out batches)."""
    device = CostSource.of(target).provenance_device(task.device, prof.device)
    distinct = len({json.dumps(t.assignment, sort_keys=True) for t in result.trials})
    extra: dict[str, Any] = {"study": {"name": result.study_name, "trials": len(result.trials),
                                       "distinct": distinct}}
    sel = result.selection
    if sel is not None and sel.noise is not None:
        extra["timing"] = {"rounds": sel.rounds, "aa_noise": round(sel.noise, 4),
                           "too_noisy": sel.too_noisy}
        if result.best.speedup.rounds:  # the re-timing's own 95% interval (speedup: a re-run's)
            extra["timing"]["run_interval"] = _ends(result.best.speedup)
        if sel.drift is not None:
            extra["timing"]["fp32_drift"] = [round(x, 3) for x in sel.drift]
    if sel is not None and sel.over_warm_start is not None and sel.over_warm_start.low > 1.0:
        extra["improvement_over_warm_start"] = sel.over_warm_start.to_dict()
    blocked = _fp8_runs_bf16(result.policy, prof)
    if blocked:
        extra["fp8_runs_bf16"] = blocked
    if result.best.memory is not None:
        # predicted for one training step on the calibration batch (autoprec.memory)
        extra["memory"] = {"predicted_peak_bytes": int(result.best.memory)}
    if budget.max_grad_bias is not None and math.isfinite(result.best.grad_bias):
        extra["bias"] = {"grad_bias": round(result.best.grad_bias, 4), "step": at or 0,
                         "run_steps": None if at is None else 2 * at, "batches": bias_batches}
    return Provenance(device=device, torch=str(torch.__version__), task=task.name, budget=budget,
                      speedup=_bounded(result.speedup), loss_increase=result.best.loss_increase,
                      grad_error=result.best.grad_error,
                      verdict=tuple(sel.notes) if sel is not None else (),
                      extra=extra)


def _fp8_runs_bf16(policy: Policy, prof: Profile | None) -> dict[str, str]:
    """The layers ``policy`` puts in fp8 whose matmuls FP8 does not take: they run bf16."""
    if prof is None:
        return {}
    return {lp.fqn: lp.fp8_blocker for lp in prof.layers
            if lp.fp8_blocker and policy.format_for(lp.fqn).is_scaled}


def _ends(speedup: Interval) -> list[float]:
    b = _bounded(speedup)
    return [round(b.low, 4), round(b.high, 4)]


def _bounded(speedup: Interval) -> Interval:
    # an unbounded interval (a zero-width fp32 reference) is written with a finite top
    if not math.isfinite(speedup.high):
        return dataclasses.replace(speedup, high=speedup.value * 1e3)
    return speedup


def fallback_provenance(result: TuneResult, policy: Policy, trial: TrialResult | None,
                        verdict: list[str], validation: dict[str, Any], *,
                        memory: int | None = None) -> Provenance:
    """The ``tuned:`` section of the policy validation fell back to (``trial``: its trial, or
    None for all-fp32): where it was tuned and the study as for the winner, everything else
    its own, never the rejected winner's (its speed-up, timing, memory, fp8_runs_bf16,
    verdict). ``verdict``: why this policy was written; ``validation``: its section;
    ``memory``: all-fp32's predicted peak (its warm-start trial's), when ``trial`` is None."""
    old = result.policy.provenance
    extra: dict[str, Any] = {}
    if old.extra.get("study") is not None:
        extra["study"] = old.extra["study"]
    speedup = loss = grad = None
    if trial is None:
        # all-fp32 is the reference: 1.00x and no loss change by definition, measured by nothing
        loss, grad = 0.0, 0.0
        if memory is not None:
            extra["memory"] = {"predicted_peak_bytes": int(memory)}
    else:
        sel = result.selection
        loss, grad = trial.loss_increase, trial.grad_error
        timed = sel is not None and trial.number in sel.speedup
        speedup = _bounded(rerun_interval(sel.speedup[trial.number]) if timed
                           else trial.speedup)
        if timed and sel.noise is not None:
            extra["timing"] = {"rounds": speedup.rounds, "aa_noise": round(sel.noise, 4),
                               "too_noisy": sel.too_noisy}
            if speedup.rounds:
                extra["timing"]["run_interval"] = _ends(sel.speedup[trial.number])
        if sel is not None and sel.drift is not None:
            extra.setdefault("timing", {})["fp32_drift"] = [round(x, 3) for x in sel.drift]
        if trial.memory is not None:
            extra["memory"] = {"predicted_peak_bytes": int(trial.memory)}
        if isinstance(old.extra.get("bias"), dict) and math.isfinite(trial.grad_bias):
            extra["bias"] = {**old.extra["bias"], "grad_bias": round(trial.grad_bias, 4)}
    blocked = _fp8_runs_bf16(policy, result.profile)
    if blocked:
        extra["fp8_runs_bf16"] = blocked
    extra["validation"] = validation
    return Provenance(device=old.device, torch=old.torch, task=old.task, budget=old.budget,
                      speedup=speedup, loss_increase=loss, grad_error=grad,
                      verdict=tuple(verdict), extra=extra)


def with_provenance(policy: Policy, prov: Provenance) -> Policy:
    """``policy`` carrying ``prov`` as its ``tuned:`` section."""
    return dataclasses.replace(policy, tuned=prov.to_dict())
