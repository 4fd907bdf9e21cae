"""validate(): train N steps with a policy and in FP32 from the same initialization, and judge
the loss gap against the run-to-run noise of FP32 itself.

Loss gaps between precisions are noisy: two FP32 runs that differ only in batch order end
a few hundred steps apart by as much as a precision change does. So validation trains three
runs from one initialization:

- ``fp32``:    FP32, batch order A (the reference),
- ``policy``:  the policy, batch order A,
- ``fp32-b``:  FP32, batch order B (the noise run),

and passes when ``gap = (policy - fp32) / fp32`` on held-out batches is at most
``tolerance + noise``, with ``noise = |fp32-b - fp32| / fp32``.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec._util import log
from autoprec.measure.timer import Clock
from autoprec.policy import DEFAULT_MAX_LOSS_INCREASE, Policy
from autoprec.runtime.phases import PhaseSwitcher
from autoprec.runtime.rewrite import apply
from autoprec.task import Task, optimizer_step

__all__ = ["validate", "ValidationResult"]


@dataclass
class ValidationResult:
    """Outcome of :func:`validate`."""

    # training losses per step of each run: "fp32", "policy", "fp32-b"
    curves: dict[str, list[float]]
    # held-out loss at the end of each run
    eval_loss: dict[str, float]
    # median step seconds of each run
    step_seconds: dict[str, float]
    # (policy - fp32) / fp32 on held-out batches
    gap: float
    # |fp32-b - fp32| / fp32: the run-to-run noise
    noise: float
    # allowed gap beyond the noise
    tolerance: float
    steps: int
    passed: bool = field(init=False)

    def __post_init__(self):
        self.passed = math.isfinite(self.gap) and self.gap <= self.tolerance + self.noise

    @property
    def speedup(self) -> float:
        return self.step_seconds["fp32"] / self.step_seconds["policy"]

    def report(self) -> str:
        lines = [f"validation over {self.steps} steps (held-out loss):"]
        for name in ("fp32", "policy", "fp32-b"):
            if name in self.eval_loss:
                lines.append(f"  {name:<7} {self.eval_loss[name]:.4f}   "
                             f"step {self.step_seconds[name] * 1e3:7.1f} ms")
        lines.append(f"  gap {self.gap:+.3%} vs FP32; FP32 run-to-run noise {self.noise:.3%}; "
                     f"tolerance {self.tolerance:.3%} + noise -> "
                     f"{'PASS' if self.passed else 'FAIL'}")
        lines.append(f"  curves: mean train-loss gap over the last quarter "
                     f"{_tail_gap(self.curves['policy'], self.curves['fp32']):+.3%}")
        return "\n".join(lines)


def _tail_gap(a: Sequence[float], b: Sequence[float]) -> float:
    n = max(1, len(a) // 4)
    ma, mb = statistics.fmean(a[-n:]), statistics.fmean(b[-n:])
    return (ma - mb) / abs(mb) if mb else float("nan")


def _stream(task: Task, steps: int, order_seed: int) -> list[Any]:
    """Training batches: the task's own stream if it has one (``Task.train_batches``), else
    its calibration batches in a seeded order."""
    if task.train_batches is not None:
        return list(task.train_batches(steps, order_seed))
    gen = torch.Generator().manual_seed(order_seed)
    n = len(task.batches)
    out = []
    while len(out) < steps:
        out.extend(task.batches[i] for i in torch.randperm(n, generator=gen).tolist())
    return out[:steps]


def train_run(task: Task, policy: Policy | None, batches: Sequence[Any], *,
              eval_batches: Sequence[Any], lr_schedule: bool = True, strict: bool = True,
              on_step: Callable[[int, float], None] | None = None) -> tuple[list, float, float]:
    """Train a fresh model from the task's initialization; returns (losses, eval loss, median
    step seconds, timed by the one step clock). Non-finite losses are kept (the run goes on;
    the verdict will fail). ``strict``: a policy made for another model is an error. A policy
    with phases trains through them: the run's length is ``len(batches)``."""
    model = task.build_model().train()
    clock = Clock(task.device)
    scaler = phases = None
    if policy is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            apply(model, policy, strict=strict)
        for w in caught:  # e.g. fp8 only emulated here: one line, not a warning with source
            if "can only emulate" in str(w.message):
                log(f"validate: note: {w.message}")
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        scaler = policy.grad_scaler(task.device)
        if not scaler.is_enabled():
            scaler = None
        if policy.phases:
            phases = PhaseSwitcher(model, policy, total_steps=len(batches))
    opt = task.make_optimizer(model.parameters())
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=len(batches))
             if lr_schedule else None)
    losses, times = [], []

    def step(batch: Any) -> None:
        loss = task.loss(model, batch)
        optimizer_step(loss, opt, scaler)
        losses.append(float(loss.detach()))

    for i, batch in enumerate(batches):
        if phases is not None and phases.at(i) is not None:
            log(f"validate: step {i}: phase {phases.current} in force")
        torch.manual_seed(task.seed + i)  # dropout masks identical across runs
        times.append(clock.time(lambda b=batch: step(b)))
        if sched is not None:
            sched.step()
        if on_step is not None:
            on_step(i, losses[-1])
    model.eval()
    with torch.no_grad():
        ev = statistics.fmean(float(task.loss(model, b)) for b in eval_batches)
    steady = times[min(3, len(times) - 1):]
    return losses, ev, statistics.median(steady)


def validate(task: Task, policy: Policy, *, steps: int = 100, tolerance: float | None = None,
             eval_batches: Sequence[Any] | None = None, progress: bool = True,
             noise_run: bool = True, strict: bool = True) -> ValidationResult:
    """Train ``steps`` steps in FP32 and with ``policy`` from the same initialization and
    judge the held-out loss gap against FP32's own run-to-run noise (see module docstring).

    ``tolerance`` defaults to the budget the policy was tuned under, else
    :data:`~autoprec.policy.DEFAULT_MAX_LOSS_INCREASE`. ``strict``: a
    policy made for another model (fingerprint, patterns) is an error, as in ``apply``.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"validate needs steps >= 1, got {steps!r}.")
    if tolerance is None:
        budget = policy.provenance.budget
        tolerance = budget.max_loss_increase if budget is not None else DEFAULT_MAX_LOSS_INCREASE
    if eval_batches is None:
        eval_batches = task.eval_batches if task.eval_batches is not None else task.batches[-2:]
    eval_batches = list(eval_batches)
    runs = {"fp32": (None, 0), "policy": (policy, 0)}
    if noise_run:
        runs["fp32-b"] = (None, 1)
    curves, evals, secs = {}, {}, {}
    for name, (pol, order) in runs.items():
        log(f"validate: training {name} for {steps} steps", progress)
        losses, ev, sec = train_run(task, pol, _stream(task, steps, task.seed + 1000 * order),
                                    eval_batches=eval_batches, strict=strict)
        curves[name], evals[name], secs[name] = losses, ev, sec
        log(f"validate: {name}: held-out loss {ev:.4f} ({sec * 1e3:.0f} ms/step)", progress)
    ref = evals["fp32"]
    gap = (evals["policy"] - ref) / abs(ref) if math.isfinite(evals["policy"]) else float("inf")
    noise = abs(evals["fp32-b"] - ref) / abs(ref) if noise_run else 0.0
    return ValidationResult(curves=curves, eval_loss=evals, step_seconds=secs, gap=gap,
                            noise=noise, tolerance=tolerance, steps=steps)
