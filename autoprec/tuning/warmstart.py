"""Warm starts: the policies a study tries first. All-fp32 (the reference, always feasible),
each uniform format, and the solutions of an integer program over the additive profile at
several error budgets."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from autoprec.formats import Format
from autoprec.profiling import Profile
from autoprec.tuning.space import SearchSpace, assignment_policy

__all__ = ["warm_starts", "milp_assignments", "memory_warm_start"]


def milp_assignments(prof: Profile, units: dict[str, list[str]], formats: Sequence[Format],
                     budgets: Sequence[float]) -> list[tuple[float, dict[str, str]]]:
    """Fastest assignment under each error budget, treating the profile as additive.

    minimise   sum_u sum_f t[u,f] x[u,f]
    subject to sum_f x[u,f] = 1            (one format per unit)
               sum_u sum_f e[u,f] x[u,f] <= budget
    with t the profiled layer seconds and e the layer's |relative loss change| (summed over a
    group's layers). Non-finite (layer, format) pairs are excluded.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    names = list(units)
    fmts = list(formats)
    nu, nf = len(names), len(fmts)
    t = np.zeros((nu, nf))
    e = np.zeros((nu, nf))
    allowed = np.ones((nu, nf))
    for i, u in enumerate(names):
        for j, f in enumerate(fmts):
            for fqn in units[u]:
                sec = prof.seconds(fqn, f)
                err = prof.loss_change(fqn, f)
                if not (math.isfinite(sec) and math.isfinite(err)):
                    allowed[i, j] = 0
                    continue
                t[i, j] += sec
                e[i, j] += abs(err)
    c = t.ravel()
    one_each = np.zeros((nu, nu * nf))
    for i in range(nu):
        one_each[i, i * nf:(i + 1) * nf] = 1
    out: list[tuple[float, dict[str, str]]] = []
    for budget in budgets:
        cons = [LinearConstraint(one_each, 1, 1)]
        if budget > 0:
            # scaled so the budget is 1: the solver's absolute feasibility tolerance (~1e-6)
            # would otherwise let errors of that size through
            cons.append(LinearConstraint((e / budget).ravel()[None, :], 0, 1))
            upper = allowed
        else:
            upper = allowed * (e == 0)
        res = milp(c, constraints=cons, integrality=np.ones_like(c),
                   bounds=Bounds(0, upper.ravel()))
        if res.status != 0 or res.x is None:
            continue
        x = res.x.reshape(nu, nf).round()
        choice = {names[i]: fmts[int(np.argmax(x[i]))].value for i in range(nu)}
        if choice not in [c for _, c in out]:
            out.append((budget, choice))
    return out


def warm_starts(prof: Profile, space: SearchSpace, fmts: Sequence[Format],
                budgets: Sequence[float]) -> list[tuple[str, dict[str, str]]]:
    """(origin, assignment) of every distinct warm start, in the order they run: each uniform
    format (fp32 first), then the integer program's solutions (``budgets`` are absolute loss
    budgets). The integer program sees only the formats each unit is offered."""
    out: list[tuple[str, dict[str, str]]] = []
    for f in fmts:
        out.append((f"warm:{f.value}", space.uniform(f)))
    for budget, choice in milp_assignments(prof, space.units, fmts, budgets):
        # a unit the program put in a format the space does not offer it (a shape FP8 does
        # not take, priced like bf16) stays fp32: every warm start is a point of the space
        choice = {u: f if f in space.choices[u] else Format.FP32.value
                  for u, f in choice.items()}
        out.append((f"warm:milp@{budget:.3g}", choice))
    seen: list[dict[str, str]] = []
    distinct = []
    for origin, choice in out:
        if choice not in seen:
            seen.append(choice)
            distinct.append((origin, choice))
    return distinct


def memory_warm_start(memory, space: SearchSpace) -> tuple[str, dict[str, str], int]:
    """("warm:min-memory", assignment, predicted peak bytes): of each uniform format and the
    unit-by-unit smallest mix, the one ``memory`` (an :class:`autoprec.memory.MemoryModel`)
    predicts smallest: the policy that meets a memory budget if any does."""
    fmts = dict.fromkeys(f for c in space.choices.values() for f in c)
    candidates = [memory.lowest(space.choices, space.units),
                  *(space.uniform(Format(f)) for f in fmts)]
    peaks = [memory.predict(assignment_policy(space.units, c)) for c in candidates]
    best = min(range(len(candidates)), key=lambda i: peaks[i])
    return "warm:min-memory", candidates[best], peaks[best]
