"""Validating a tune's winner by training, and falling back along the Pareto front when it
fails: the next-fastest policies, and as a last resort all-fp32."""

from __future__ import annotations

import dataclasses

from autoprec._util import log as _log
from autoprec.policy import Policy
from autoprec.task import Task
from autoprec.tuning.report import TuneResult
from autoprec.tuning.space import assignment_policy

__all__ = ["validate_front"]


def validate_front(result: TuneResult, task: Task, *, steps: int, tolerance: float | None = None,
                   max_candidates: int = 3, progress: bool = True) -> TuneResult:
    """Validate the winner by training ``steps`` steps; when it fails, try the next-fastest
    policies on the Pareto front (at most ``max_candidates``), and as a last resort all-fp32.
    Returns the result with ``policy``, ``best`` and ``validation`` set to what passed."""
    from autoprec.validation import validate

    units = result.units or {u: [u] for u in result.best.assignment}
    candidates = [result.best] + [t for t in result.pareto if t.number != result.best.number]
    budget = result.policy.provenance.budget
    tol = tolerance if tolerance is not None else (
        budget.max_loss_increase if budget is not None else 0.01)
    for cand in candidates[:max_candidates]:
        policy = (result.policy if cand.number == result.best.number else
                  assignment_policy(units, cand.assignment, model_name=result.policy.model_name,
                                    fingerprint=result.policy.fingerprint))
        _log(f"validating trial {cand.number} ({cand.speedup}) over {steps} steps", progress)
        val = validate(task, policy, steps=steps, tolerance=tol, progress=progress)
        _log(val.report(), progress)
        if val.passed:
            tuned = dict(result.policy.tuned or {})
            tuned["validation"] = {"steps": steps, "gap": round(val.gap, 6),
                                   "noise": round(val.noise, 6), "passed": True,
                                   "trial": cand.number}
            if cand.number != result.best.number:
                tuned["speedup_vs_fp32"] = cand.speedup.to_dict()
                tuned["loss_increase"] = round(cand.loss_increase, 6)
                tuned["grad_error"] = round(cand.grad_error, 6)
            result.policy = dataclasses.replace(policy, tuned=tuned)
            result.best = cand
            result.validation = val
            return result
    result.policy = Policy(default="fp32", model_name=result.policy.model_name,
                           fingerprint=result.policy.fingerprint,
                           tuned={**(result.policy.tuned or {}),
                                  "validation": {"steps": steps, "passed": False,
                                                 "note": "no Pareto policy passed; fell back to "
                                                         "fp32"}})
    result.validation = None
    return result
