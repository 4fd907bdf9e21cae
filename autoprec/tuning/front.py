"""Certifying a tune's winner by paired training (:mod:`autoprec.certification`), and falling back
along the Pareto front when its certificate does not pass: the next-fastest policies, and as a
last resort all-fp32. A policy written after a
fallback carries its own provenance (speed-up, timing, memory, fp8_runs_bf16, verdict), never
the rejected winner's."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from autoprec.policy import Policy, Provenance
from autoprec.pricing import calibration_line
from autoprec.reporter import Reporter
from autoprec.task import Task
from autoprec.tuning.report import TrialResult, TuneResult, fallback_provenance, with_provenance
from autoprec.tuning.space import assignment_policy

__all__ = ["validate_front"]


def validate_front(result: TuneResult, task: Task, *, steps: int, tolerance: float | None = None,
                   max_candidates: int = 3, progress: bool = True) -> TuneResult:
    """Certify the winner against BF16 (:func:`autoprec.certification.certify`, a reference run of
    ``steps`` steps); when its certificate does not pass (fails, or cannot decide), try the
    next-fastest policies on the Pareto front (at most ``max_candidates`` distinct ones), and
    as a last resort all-fp32. Returns the result with ``policy`` (carrying its certificate),
    ``best`` and ``validation`` (the :class:`~autoprec.certification.CertifyResult`) set to what
    passed (``best``: all-fp32's trial, when there is one, after the last resort)."""
    from autoprec.certification import DEFAULT_TOLERANCE, certify

    report = Reporter(progress)
    units = result.units or {u: [u] for u in result.best.assignment}
    winner = result.best
    tol = DEFAULT_TOLERANCE if tolerance is None else tolerance
    rejected: list[tuple[TrialResult, Any]] = []
    for cand in _candidates(result)[:max_candidates]:
        policy = (result.policy if cand.number == winner.number else dataclasses.replace(
            assignment_policy(units, cand.assignment, model_name=result.policy.model_name,
                              fingerprint=result.policy.fingerprint),
            phases=result.policy.phases))  # the winner's phases (--final-phase) too
        report(f"certifying trial {cand.number} ({cand.speedup}) against bf16, from a "
               f"{steps}-step run")
        val = certify(task, policy, steps=steps, tolerance=tol, progress=progress)
        report(val.report())
        if not val.passed:
            rejected.append((cand, val))
            continue
        result.policy = with_provenance(policy, _passed(result, policy, cand, val, rejected,
                                                                steps)).with_certificate(
            val.certificate)
        result.best = cand
        result.validation = val
        return result
    return _all_fp32(result, rejected, steps)


def _candidates(result: TuneResult) -> list[TrialResult]:
    """The winner, then the rest of the Pareto front, fastest first; a repeat of a trial on the
    front is the same policy: validating it again tells nothing."""
    winner = result.best
    out: list[TrialResult] = []
    seen: set[str] = set()
    for t in [winner] + [t for t in result.pareto if t.number != winner.number]:
        key = json.dumps(t.assignment, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _passed(result: TuneResult, policy: Policy, cand: TrialResult, val: Any,
            rejected: list[tuple[TrialResult, Any]], steps: int) -> Provenance:
    """The provenance of the policy whose certificate passed: the tune's, when it is the
    winner; else its own, saying which policies were rejected and why."""
    cert = val.certificate
    section = {"steps": steps, "gap": round(cert.gap, 6), "verdict": cert.verdict,
               "passed": True, "trial": cand.number}
    prov = result.policy.provenance
    if not rejected:  # the winner passed: its provenance is the tune's
        return dataclasses.replace(prov, extra={**prov.extra, "validation": section})
    section["rejected"] = _rejected(rejected)
    verdict = _rejections(rejected, steps) + [
        f"wrote trial {cand.number}, the next-fastest policy on the Pareto front, whose "
        f"certificate passed: {cert.describe()}", _speed_source(result, cand)]
    return fallback_provenance(result, policy, cand, verdict, section)


def _all_fp32(result: TuneResult, rejected: list[tuple[TrialResult, Any]],
              steps: int) -> TuneResult:
    """The last resort: all-fp32, with its own provenance (no speed-up claimed)."""
    fp32 = next((t for t in result.trials if t.finite
                 and all(f == "fp32" for f in t.assignment.values())), None)
    policy = Policy(default="fp32", model_name=result.policy.model_name,
                    fingerprint=result.policy.fingerprint)
    verdict = _rejections(rejected, steps) + [
        f"wrote all-fp32: the certificate of none of the {len(rejected)} Pareto policies tried "
        "passed; "
        "all-fp32 is the tune's FP32 reference, 1.00x its step time and no loss change by "
        "definition, so no speed-up is claimed"]
    section = {"steps": steps, "passed": False,
               "note": "no Pareto policy passed; fell back to fp32", "rejected": _rejected(rejected)}
    result.policy = with_provenance(policy, fallback_provenance(
        result, policy, None, verdict, section, memory=None if fp32 is None else fp32.memory))
    if fp32 is not None:
        result.best = fp32
    result.validation = None
    return result


def _rejected(rejected: list[tuple[TrialResult, Any]]) -> list[dict[str, Any]]:
    return [{"trial": t.number, "gap": _finite(v.certificate.gap),
             "high": _finite(v.certificate.high), "verdict": v.certificate.verdict}
            for t, v in rejected]


def _finite(x: float) -> float | str:
    return round(x, 6) if x == x and abs(x) != float("inf") else str(x)


def _rejections(rejected: list[tuple[TrialResult, Any]], steps: int) -> list[str]:
    """One sentence per policy whose certificate did not pass, the tune's winner first."""
    return [f"the certificate of trial {t.number}"
            + (", the tune's winner" if i == 0 else "")
            + f" ({t.speedup}) did not pass: {v.certificate.describe()}"
            for i, (t, v) in enumerate(rejected)]


def _speed_source(result: TuneResult, trial: TrialResult) -> str:
    """Where the written policy's speed-up comes from."""
    sel = result.selection
    device = result.policy.provenance.device or ""
    if device.startswith("cost model:"):
        target = device[len("cost model:"):].split("(")[0].strip()
        return f"its speed-up is its price, no timing noise ({calibration_line(target)})"
    if sel is not None and trial.number in sel.speedup:
        s = sel.speedup[trial.number]
        return (f"its speed-up {s} is from the final re-timing ({s.rounds} rounds), in which "
                f"trial {sel.winner} led")
    return (f"its speed-up {trial.speedup} is its search-time measurement: it was not among the "
            "policies re-timed at the end, so it is a rough estimate")
