"""tune(): the Optuna search for a per-layer precision policy.

Each trial is one policy: one categorical per searchable layer (or per group of same-role
layers, e.g. ``transformer.h.*.mlp.c_fc``). It is evaluated for real: applied to the live
model, its training step timed on the device (or priced by the cost model for ``target``),
its loss and gradients on held-out calibration batches compared with FP32. Two objectives
(step time, loss increase), the error budgets as constraints (``constraints_func``); a
non-finite trial is infeasible, never a crash.

Warm starts (``enqueue_trial``): all-fp32, each uniform format, and the solutions of an integer
program (``scipy.optimize.milp``) over the additive per-layer profile at several error budgets.

The study lives in an Optuna storage: a SQLite file beside the output by default, so an
interrupted tune resumes with every completed trial kept; any storage URL (PostgreSQL, MySQL,
``journal:path``) lets several workers share one study. The profile is stored in the study's
user attributes, so a second worker skips profiling.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optuna
import torch

from autoprec.formats import FORMAT_ORDER, Format, Support, supported_formats
from autoprec.policy import Policy, model_fingerprint
from autoprec.profile import Profile
from autoprec.profile import profile as run_profile
from autoprec.rewrite import apply, remove
from autoprec.sensitivity import prepare_for_measurement
from autoprec.task import Task, optimizer_step

__all__ = ["tune", "TuneResult", "TrialResult", "evaluate_policy", "group_layers",
           "milp_assignments", "open_storage"]

# A non-finite trial still needs finite objective values for Optuna's samplers.
_PENALTY = 1e6
# optuna 5 moved constraints from the sampler's constraints_func to Trial.set_constraint
_NEW_CONSTRAINTS = hasattr(optuna.trial.Trial, "set_constraint")


def _set_constraints(trial, cons) -> None:
    if _NEW_CONSTRAINTS and cons is not None:
        trial.set_constraint("loss_increase", float(cons[0]))
        trial.set_constraint("grad_error", float(cons[1]))


@dataclass(frozen=True)
class TrialResult:
    """One evaluated policy."""

    # Optuna trial number (-1 for an evaluation outside a study).
    number: int
    # search unit (layer fqn or group glob) -> format
    assignment: dict[str, str]
    # median training-step seconds (measured), or the cost model's estimate for `target`
    step_seconds: float
    # FP32 step seconds / step_seconds
    speedup: float
    # mean relative loss change vs FP32 on held-out calibration batches
    loss_increase: float
    # relative L2 error of all parameter gradients vs FP32
    grad_error: float
    # all values finite and within the budgets
    feasible: bool
    finite: bool
    # where the trial came from: "warm:fp32", "warm:milp@0.005", "search", ...
    origin: str = "search"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class TuneResult:
    """What tune() found: the winner, the Pareto front, and how the search went."""

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

    @property
    def improvement_over_warm_start(self) -> float:
        """Best warm start's step time / the winner's (1.0: the search found nothing faster)."""
        if self.best_warm_start is None:
            return float("nan")
        return self.best_warm_start.step_seconds / self.best.step_seconds

    def summary(self) -> str:
        b = self.best
        lines = [
            f"winner: trial {b.number} ({b.origin}): {b.speedup:.2f}x FP32 step time, "
            f"loss {b.loss_increase:+.3%}, gradient error {b.grad_error:.3g}",
            f"trials: {len(self.trials)} ({sum(t.feasible for t in self.trials)} feasible), "
            f"Pareto front: {len(self.pareto)}",
        ]
        if self.best_warm_start is not None:
            lines.append(f"best warm start: {self.best_warm_start.origin} at "
                         f"{self.best_warm_start.speedup:.2f}x; the search improved on it by "
                         f"{self.improvement_over_warm_start:.3f}x")
        return "\n".join(lines)

    def save(self, path: str | os.PathLike, *, plot: bool = True) -> list[str]:
        """Write the policy YAML, the Pareto front as ``<stem>.pareto.csv`` and a
        ``<stem>.pareto.png`` plot beside it. Returns the written paths."""
        path = os.fspath(path)
        self.policy.save(path)
        stem = os.path.splitext(path)[0]
        written = [path, f"{stem}.pareto.csv"]
        with open(written[1], "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["trial", "origin", "step_seconds", "speedup_vs_fp32", "loss_increase",
                        "grad_error", "feasible", "on_front", "assignment"])
            front = {t.number for t in self.pareto}
            for t in sorted(self.trials, key=lambda t: t.step_seconds):
                w.writerow([t.number, t.origin, f"{t.step_seconds:.6g}", f"{t.speedup:.4f}",
                            f"{t.loss_increase:.6g}", f"{t.grad_error:.6g}", t.feasible,
                            t.number in front, json.dumps(t.assignment, sort_keys=True)])
        if plot:
            png = _plot_front(self, f"{stem}.pareto.png")
            if png:
                written.append(png)
        return written


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
    ax.scatter([t.speedup for t in bad], [t.loss_increase for t in bad], c="lightgray",
               s=14, label="over budget")
    ax.scatter([t.speedup for t in ok], [t.loss_increase for t in ok], c="tab:blue", s=14,
               label="feasible")
    front = sorted(result.pareto, key=lambda t: t.speedup)
    ax.plot([t.speedup for t in front], [t.loss_increase for t in front], "o-", c="tab:red",
            label="Pareto front")
    ax.scatter([result.best.speedup], [result.best.loss_increase], marker="*", s=160,
               c="gold", edgecolors="k", zorder=5, label="winner (re-timed with fp32)")
    ax.set_xlabel("speed-up vs FP32 (step time)")
    ax.set_ylabel("relative loss change vs FP32")
    ax.set_title(f"autoprec tune: {result.study_name}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------- search space
def group_layers(fqns: Sequence[str], groups: bool | str | dict | None = "auto",
                 *, max_units: int = 16) -> dict[str, list[str]]:
    """Search units: unit name -> the layer fqns it sets.

    ``groups=False``: one unit per layer. ``True``: same-role layers share one unit, named by
    their glob (numeric path components become ``*``: ``transformer.h.*.mlp.c_fc``).
    ``"auto"``: per layer while there are at most ``max_units`` layers, grouped beyond.
    A dict maps unit names (globs) to fqn lists and is used as given.
    """
    if isinstance(groups, dict):
        return {k: list(v) for k, v in groups.items()}
    if groups == "auto":
        groups = len(fqns) > max_units
    if not groups:
        return {f: [f] for f in fqns}
    out: dict[str, list[str]] = {}
    for f in fqns:
        key = ".".join("*" if part.isdigit() else part for part in f.split("."))
        out.setdefault(key, []).append(f)
    return out


def _assignment_policy(units: dict[str, list[str]], choice: dict[str, str], *,
                       model_name: str, fingerprint: str) -> Policy:
    """The policy for one trial: the most common format becomes the default (fewer regions,
    fewer casts), every unit that differs is listed."""
    counts: dict[str, int] = {}
    for unit, fmt in choice.items():
        counts[fmt] = counts.get(fmt, 0) + len(units[unit])
    order = {f.value: i for i, f in enumerate(FORMAT_ORDER)}
    default = max(counts, key=lambda f: (counts[f], -order[f]))
    layers = {unit: fmt for unit, fmt in choice.items() if fmt != default}
    # A unit left at the default must still be listed when an enclosing unit (an attention
    # module around its projections) is listed with another format: regions nest.
    nested = Policy(default=default, layers=layers)
    for unit, fmt in choice.items():
        if fmt == default and any(nested.format_for(f).value != fmt for f in units[unit]):
            layers[unit] = fmt
    layers = {u: layers[u] for u in choice if u in layers}
    return Policy(default=default, layers=layers, model_name=model_name, fingerprint=fingerprint)


# ------------------------------------------------------------------------- integer program
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
    out = []
    for budget in budgets:
        cons = [LinearConstraint(one_each, 1, 1)]
        if budget > 0:
            # scaled so the budget is 1: the solver's absolute feasibility tolerance (~1e-6)
            # would otherwise let errors of that size through
            cons.append(LinearConstraint((e / budget).ravel()[None, :], 0, 1))
            upper = allowed
        else:
            upper = allowed * (e == 0)
        res = milp(c, constraints=cons, integrality=np.ones_like(c), bounds=Bounds(0, upper.ravel()))
        if res.status != 0 or res.x is None:
            continue
        x = res.x.reshape(nu, nf).round()
        choice = {names[i]: fmts[int(np.argmax(x[i]))].value for i in range(nu)}
        if choice not in [c for _, c in out]:
            out.append((budget, choice))
    return out


# ------------------------------------------------------------------------- evaluation
class _Evaluator:
    """Holds the live model, the FP32 reference and a timing copy; evaluates policies."""

    def __init__(self, task: Task, holdout: Sequence[Any], *, target: str | None,
                 prof: Profile, timing_repeats: int = 3):
        self.task = task
        self.holdout = list(holdout)
        self.target = target
        self.prof = prof
        self.timing_repeats = timing_repeats
        # train mode, dropout off, BatchNorm statistics frozen: the same state the profile's
        # sensitivity runs use, so trials are deterministic and comparable
        self.model = prepare_for_measurement(task.build_model())
        self.fingerprint = model_fingerprint(self.model)
        self.model_name = type(self.model).__name__
        self.ref_losses, self.ref_grads = self._losses_and_grads()
        if target is None:
            self.timing_model = copy.deepcopy(self.model)
            self.optimizer = task.make_optimizer(self.timing_model.parameters())
            for g in self.optimizer.param_groups:
                g["lr"] = 0.0  # the step's full cost, without drifting the timing copy's weights
        fp32 = Policy(default="fp32")
        if target is None:
            self.step_seconds(fp32)  # one-time costs (thread pools, allocator) first
        self.fp32_seconds = self.step_seconds(fp32)

    def _losses_and_grads(self):
        losses, grads = [], None
        for i, batch in enumerate(self.holdout):
            torch.manual_seed(self.task.seed + i)
            self.model.zero_grad(set_to_none=True)
            loss = self.task.loss(self.model, batch)
            loss.backward()
            losses.append(float(loss.detach()))
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                              .double() for p in self.model.parameters()])
            grads = flat if grads is None else grads + flat
        self.model.zero_grad(set_to_none=True)
        return losses, grads

    def numerics(self, policy: Policy) -> tuple[float, float]:
        apply(self.model, policy)
        try:
            losses, grads = self._losses_and_grads()
        finally:
            remove(self.model)
        rel = [(lo - r) / abs(r) for lo, r in zip(losses, self.ref_losses)]
        loss_increase = float(np.mean(rel))
        if not torch.isfinite(grads).all():
            return loss_increase, float("inf")
        grad_error = float((grads - self.ref_grads).norm() / self.ref_grads.norm().clamp(min=1e-30))
        return loss_increase, grad_error

    def step_seconds(self, policy: Policy) -> float:
        if self.target is not None:
            return self.prof.estimate_step(_expand(policy, self.prof), self.target)
        model, opt = self.timing_model, self.optimizer
        apply(model, policy)
        batch = self.task.example_batch()
        sync = torch.cuda.synchronize if self.task.device.type == "cuda" else (lambda: None)
        try:
            times = []
            for i in range(1 + self.timing_repeats):
                sync()
                t0 = time.perf_counter()
                optimizer_step(self.task.loss(model, batch), opt)
                sync()
                if i:  # the first call warms up caches and autocast's weight-cast cache
                    times.append(time.perf_counter() - t0)
        finally:
            remove(model)
        return float(np.median(times))


def _expand(policy: Policy, prof: Profile) -> dict[str, Format]:
    return {lp.fqn: policy.format_for(lp.fqn) for lp in prof.layers}


def evaluate_policy(task: Task, policy: Policy, *, prof: Profile | None = None,
                    target: str | None = None, holdout: Sequence[Any] | None = None
                    ) -> TrialResult:
    """Evaluate one policy as tune() would (for tests and `autoprec show --evaluate`)."""
    prof = prof if prof is not None else run_profile(task, progress=False)
    ev = _Evaluator(task, holdout if holdout is not None else task.batches[-2:], target=target,
                    prof=prof)
    sec = ev.step_seconds(policy)
    li, ge = ev.numerics(policy)
    finite = math.isfinite(li) and math.isfinite(ge)
    return TrialResult(-1, {}, sec, ev.fp32_seconds / sec, li, ge, finite, finite, "evaluate")


# ------------------------------------------------------------------------- storage
def open_storage(storage: str | None, default_path: str) -> tuple[Any, str]:
    """An Optuna storage from a URL, ``journal:<path>``, or None (SQLite at default_path)."""
    if storage is None:
        storage = f"sqlite:///{os.path.abspath(default_path)}"
    if storage.startswith("journal:"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        path = storage.split(":", 1)[1]
        return JournalStorage(JournalFileBackend(path)), storage
    if storage.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(storage[len("sqlite:///"):]) or ".", exist_ok=True)
    # heartbeat: a worker killed mid-trial leaves a RUNNING trial; after the grace period the
    # next worker marks it FAILED instead of waiting for it forever.
    kwargs = dict(heartbeat_interval=30, grace_period=120,
                  engine_kwargs={} if storage.startswith("sqlite") else {"pool_pre_ping": True})
    for attempt in range(6):
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*heartbeat_interval.*")
                return optuna.storages.RDBStorage(storage, **kwargs), storage
        except Exception as e:  # noqa: BLE001
            # Workers starting together on a fresh database race to create Optuna's schema;
            # the loser sees a unique-constraint or "already exists" error (PostgreSQL, SQLite)
            # and succeeds once the tables exist.
            text = f"{type(e).__name__} {e}"
            racing = any(m in text for m in ("IntegrityError", "already exists",
                                             "UniqueViolation", "database is locked"))
            if attempt == 5 or not racing:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------- tune
def _log(msg: str, progress: bool) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def tune(task: Task, *, formats: Sequence[Format | str] = ("fp32", "bf16", "fp16", "fp8"),
         max_loss_increase: float = 0.01, max_grad_error: float | None = 0.25,
         n_trials: int = 40, timeout: float | None = None, storage: str | None = None,
         study_name: str | None = None, target: str | None = None, seed: int = 0,
         groups: bool | str | dict = "auto", output: str | None = None,
         prof: Profile | None = None, progress: bool = True,
         budgets: Sequence[float] = (0.25, 0.5, 1.0), n_holdout: int = 2) -> TuneResult:
    """Search a per-layer precision policy for ``task``; see the module docstring.

    ``max_loss_increase``: relative loss change vs FP32 allowed on held-out batches (0.01 = 1%).
    ``max_grad_error``: relative L2 error of all parameter gradients allowed (None: no limit).
    ``n_trials``: total trials in the study, warm starts included; a resumed study runs only
    the rest. ``target``: price step time with the cost model of that device ("h100", ...)
    instead of measuring it here. ``output``: the policy path; the default SQLite storage lives
    beside it (``<output stem>.study.db``).
    """
    fmts = [Format.parse(f) for f in formats]
    if Format.FP32 not in fmts:
        fmts.insert(0, Format.FP32)  # the reference and the always-feasible fallback
    if target is None:
        support = supported_formats(task.device)
        emulated = [f for f in fmts if support[f] is not Support.NATIVE]
        if emulated:
            _log(f"note: {', '.join(map(str, emulated))} only emulated on {task.device}: measured "
                 "slower, so the search will not pick them for speed; pass target=... to "
                 "price them for another device.", progress)
    if len(task.batches) < 2:
        raise ValueError("tune needs at least 2 calibration batches: some to profile, "
                         f"some held out to judge policies; the task has {len(task.batches)}.")
    n_holdout = min(n_holdout, len(task.batches) - 1)
    holdout = task.batches[-n_holdout:]
    output = output or f"autoprec-{re.sub(r'[^A-Za-z0-9_.-]', '_', task.name)}.yaml"
    storage_obj, storage_url = open_storage(storage, os.path.splitext(output)[0] + ".study.db")

    objective_key = json.dumps({"formats": [f.value for f in fmts], "mli": max_loss_increase,
                                "mge": max_grad_error, "target": target, "groups": str(groups)},
                               sort_keys=True)
    if study_name is None:
        digest = hashlib.sha256(objective_key.encode()).hexdigest()[:8]
        study_name = f"{task.name}-{digest}"

    def constraints(trial: optuna.trial.FrozenTrial) -> Sequence[float]:
        return trial.user_attrs.get("constraints", (_PENALTY, _PENALTY))

    if _NEW_CONSTRAINTS:
        # optuna >= 5: constraints are set on the trial (Trial.set_constraint)
        sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=8)
    else:
        sampler = optuna.samplers.TPESampler(seed=seed, constraints_func=constraints,
                                             multivariate=True, n_startup_trials=8)
    study = optuna.create_study(study_name=study_name, storage=storage_obj, sampler=sampler,
                                directions=["minimize", "minimize"], load_if_exists=True)

    # The profile: reuse the study's (resume, second worker), else measure and store it.
    if prof is None and "profile" in study.user_attrs:
        prof = Profile.from_dict(json.loads(study.user_attrs["profile"]))
        _log(f"reusing the profile stored in study {study_name}", progress)
    if prof is None:
        _log(f"profiling {task.name} ({', '.join(f.value for f in fmts)}"
             f"{', target ' + target if target else ''})", progress)
        prof = run_profile(task, formats=fmts, target=target, batches=task.batches[:-n_holdout],
                           progress=progress)
    if "profile" not in study.user_attrs:
        study.set_user_attr("profile", json.dumps(prof.to_dict()))

    searchable = [lp.fqn for lp in prof.searchable()]
    units = group_layers(searchable, groups)
    _log(f"search space: {len(units)} units over {len(searchable)} layers x "
         f"{len(fmts)} formats", progress)

    ev = _Evaluator(task, holdout, target=target, prof=prof)
    fp32_seconds = ev.fp32_seconds

    pruned: dict[str, list[str]] = {}

    def unit_formats(unit: str) -> list[str]:
        # A format is offered for a unit when its numerics stayed finite, its matmuls can
        # really run in it, and it is faster than fp32 on the unit's layers as profiled: a
        # format slower than fp32 is dominated (fp32 has zero error), so offering it would only
        # spend trials (fp16 on CPUs without FP16 matmul units, emulated fp8).
        allowed = [Format.FP32.value]
        t32 = sum(prof.seconds(fqn, Format.FP32) for fqn in units[unit])
        for f in fmts:
            if f is Format.FP32:
                continue
            if not all(prof.allows(fqn, f) for fqn in units[unit]):
                pruned.setdefault(f.value, []).append(unit)
                continue
            t = sum(prof.seconds(fqn, f) for fqn in units[unit])
            if not (math.isfinite(t) and t < t32):
                pruned.setdefault(f.value, []).append(unit)
                continue
            allowed.append(f.value)
        return allowed

    choices = {u: unit_formats(u) for u in units}
    for f, us in pruned.items():
        _log(f"not offered: {f} on {len(us)} of {len(units)} units (non-finite, kernel cannot "
             "take the shape, or not faster than fp32 in the profile)", progress)
    study.set_user_attr("choices", json.dumps(choices))

    def objective(trial: optuna.Trial):
        choice = {u: trial.suggest_categorical(u, choices[u]) for u in units}
        # The sampler may propose a policy already measured: reuse it instead of re-running.
        for old in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            if old.params == choice:
                for key in ("constraints", "grad_error", "finite", "step_seconds"):
                    trial.set_user_attr(key, old.user_attrs.get(key))
                _set_constraints(trial, old.user_attrs.get("constraints"))
                trial.set_user_attr("origin", f"repeat of {old.number}")
                return tuple(old.values)
        policy = _assignment_policy(units, choice, model_name=ev.model_name,
                                    fingerprint=ev.fingerprint)
        li, ge = ev.numerics(policy)
        finite = math.isfinite(li) and math.isfinite(ge)
        sec = ev.step_seconds(policy) if finite else fp32_seconds * 10
        if not finite:
            li, ge = _PENALTY, _PENALTY
        cons = (li - max_loss_increase,
                (ge - max_grad_error) if max_grad_error is not None else -1.0)
        trial.set_user_attr("constraints", cons)
        _set_constraints(trial, cons)
        trial.set_user_attr("grad_error", ge)
        trial.set_user_attr("finite", finite)
        trial.set_user_attr("step_seconds", sec)
        trial.set_user_attr("origin", trial.user_attrs.get("origin", "search"))
        feasible = finite and all(c <= 0 for c in cons)
        _log(f"trial {trial.number:3d}  {fp32_seconds / sec:5.2f}x  loss {li:+.3%}  "
             f"grad err {ge:.3g}  {'ok' if feasible else 'over budget'}"
             f"  [{trial.user_attrs.get('origin', 'search')}]", progress)
        return sec, li

    # Warm starts, once per study.
    if not study.user_attrs.get("warm_started"):
        study.set_user_attr("warm_started", True)
        warm: list[tuple[str, dict[str, str]]] = []
        for f in fmts:
            warm.append((f"warm:{f.value}", {u: (f.value if f.value in choices[u] else "fp32")
                                             for u in units}))
        for budget_frac, choice in milp_assignments(prof, units, fmts,
                                                    [b * max_loss_increase for b in budgets]):
            warm.append((f"warm:milp@{budget_frac:.3g}", choice))
        seen = []
        for origin, choice in warm:
            if choice in seen:
                continue
            seen.append(choice)
            study.enqueue_trial(choice, user_attrs={"origin": origin})
        _log(f"enqueued {len(seen)} warm starts", progress)

    done = len([t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE])
    space = math.prod(len(c) for c in choices.values())
    if space < n_trials:
        _log(f"the search space holds only {space} policies: running {space} trials", progress)
        n_trials = space
    remaining = max(0, n_trials - done)
    if done:
        _log(f"resuming study {study_name}: {done} trials complete, {remaining} to go", progress)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        # said once above; every trial would repeat it
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        if remaining:
            study.optimize(objective, n_trials=remaining, timeout=timeout, catch=(RuntimeError,),
                           callbacks=[optuna.study.MaxTrialsCallback(
                               n_trials, states=(optuna.trial.TrialState.COMPLETE,))])
        result = _result(study, units, ev, fp32_seconds, prof, storage_url)
        if target is None:
            _final_retime(result, ev, progress=progress)
    result.policy = dataclasses.replace(result.policy, tuned=_provenance(
        task, result, target, max_loss_increase, max_grad_error, prof))
    return result


def _final_retime(result: TuneResult, ev: _Evaluator, *, candidates: int = 4, rounds: int = 3,
                  progress: bool = True) -> None:
    """Each trial was timed once, a few steps, on a shared machine: re-time the fastest
    feasible policies and FP32 round-robin, and let the medians pick the winner."""
    feasible = sorted((t for t in result.trials if t.feasible), key=lambda t: t.step_seconds)
    picked: list[TrialResult] = []
    if result.best_warm_start is not None:
        picked.append(result.best_warm_start)
    for t in feasible:
        if t.assignment not in [p.assignment for p in picked]:
            picked.append(t)
        if len(picked) == candidates + 1:
            break
    policies = {t.number: _assignment_policy(result.units, t.assignment,
                                             model_name=ev.model_name,
                                             fingerprint=ev.fingerprint) for t in picked}
    policies[-1] = Policy(default="fp32")
    samples: dict[int, list[float]] = {k: [] for k in policies}
    for _ in range(rounds):
        for k, pol in policies.items():
            samples[k].append(ev.step_seconds(pol))
    med = {k: float(np.median(v)) for k, v in samples.items()}
    fp32 = med.pop(-1)
    best_number = min(med, key=med.get)
    by_number = {t.number: t for t in picked}
    retimed = {k: dataclasses.replace(by_number[k], step_seconds=v, speedup=fp32 / v)
               for k, v in med.items()}
    result.fp32_seconds = fp32
    result.best = retimed[best_number]
    if result.best_warm_start is not None:
        result.best_warm_start = retimed[result.best_warm_start.number]
    result.policy = policies[best_number]
    # speed-ups of every trial are re-expressed against the re-timed FP32 anchor
    _log("re-timed the fastest feasible policies round-robin with fp32: " + ", ".join(
        f"trial {k} {fp32 / v:.2f}x" for k, v in med.items()), progress)


def _trial_result(t: optuna.trial.FrozenTrial, fp32_seconds: float) -> TrialResult:
    sec, li = t.values
    ge = t.user_attrs.get("grad_error", float("nan"))
    finite = bool(t.user_attrs.get("finite", False))
    cons = t.user_attrs.get("constraints", (1, 1))
    return TrialResult(t.number, dict(t.params), sec, fp32_seconds / sec, li, ge,
                       finite and all(c <= 0 for c in cons), finite,
                       t.user_attrs.get("origin", "search"))


def _result(study, units, ev: _Evaluator, fp32_seconds, prof, storage_url) -> TuneResult:
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    trials = [_trial_result(t, fp32_seconds) for t in complete]
    feasible = [t for t in trials if t.feasible]
    if not feasible:
        raise RuntimeError(
            f"No feasible policy in study {study.study_name} ({len(trials)} trials): even "
            "all-fp32 broke the budget, which means the loss is noisy between identical runs. "
            "Check that the task's loss is deterministic (dropout off, fixed data).")
    best = min(feasible, key=lambda t: (t.step_seconds, t.loss_increase))
    front = _pareto(feasible)
    warm = [t for t in feasible if t.origin.startswith("warm")]
    best_warm = min(warm, key=lambda t: t.step_seconds) if warm else None
    policy = _assignment_policy(units, best.assignment, model_name=ev.model_name,
                                fingerprint=ev.fingerprint)
    return TuneResult(policy=policy, best=best, fp32_seconds=fp32_seconds, pareto=front,
                      trials=trials, best_warm_start=best_warm, study_name=study.study_name,
                      storage=storage_url, profile=prof, units=units)


def _pareto(trials: list[TrialResult]) -> list[TrialResult]:
    front = []
    for t in trials:
        dominated = any(o.step_seconds <= t.step_seconds and o.loss_increase <= t.loss_increase
                        and (o.step_seconds < t.step_seconds or o.loss_increase < t.loss_increase)
                        for o in trials)
        if not dominated:
            front.append(t)
    return sorted(front, key=lambda t: t.step_seconds)


def _provenance(task, result: TuneResult, target, mli, mge, prof) -> dict:
    if target is not None:
        device = f"cost model: {target} (numerics on {task.device})"
    elif task.device.type == "cuda":
        device = torch.cuda.get_device_name(task.device)
    else:
        device = prof.device
    return {
        "device": device,
        "torch": str(torch.__version__),
        "task": task.name,
        "objective": {"max_loss_increase": mli, "max_grad_error": mge},
        "metrics": {"speedup_vs_fp32": round(result.best.speedup, 4),
                    "loss_increase": round(result.best.loss_increase, 6),
                    "grad_error": round(result.best.grad_error, 6)},
        "study": {"name": result.study_name, "trials": len(result.trials)},
        # layers the policy puts in fp8 whose matmuls the FP8 kernel cannot take: they run bf16
        **({"fp8_runs_bf16": blocked} if (blocked := {
            lp.fqn: lp.fp8_blocker for lp in prof.layers
            if lp.fp8_blocker and result.policy.format_for(lp.fqn) is Format.FP8}) else {}),
    }


def validate_front(result: TuneResult, task: Task, *, steps: int, tolerance: float | None = None,
                   max_candidates: int = 3, progress: bool = True) -> TuneResult:
    """Validate the winner by training ``steps`` steps; when it fails, try the next-fastest
    policies on the Pareto front (at most ``max_candidates``), and as a last resort all-fp32.
    Returns the result with ``policy``, ``best`` and ``validation`` set to what passed."""
    from autoprec.validate import validate

    units = result.units or {u: [u] for u in result.best.assignment}
    candidates = [result.best] + [t for t in result.pareto if t.number != result.best.number]
    tol = tolerance
    if tol is None:
        tol = float(((result.policy.tuned or {}).get("objective") or {})
                    .get("max_loss_increase", 0.01))
    for cand in candidates[:max_candidates]:
        policy = (result.policy if cand.number == result.best.number else
                  _assignment_policy(units, cand.assignment, model_name=result.policy.model_name,
                                     fingerprint=result.policy.fingerprint))
        _log(f"validating trial {cand.number} ({cand.speedup:.2f}x) over {steps} steps",
             progress)
        val = validate(task, policy, steps=steps, tolerance=tol, progress=progress)
        _log(val.report(), progress)
        if val.passed:
            tuned = dict(result.policy.tuned or {})
            tuned["validation"] = {"steps": steps, "gap": round(val.gap, 6),
                                   "noise": round(val.noise, 6), "passed": True,
                                   "trial": cand.number}
            tuned["metrics"] = {**tuned.get("metrics", {}),
                                "speedup_vs_fp32": round(cand.speedup, 4),
                                "loss_increase": round(cand.loss_increase, 6)}
            result.policy = dataclasses.replace(policy, tuned=tuned)
            result.best = cand
            result.validation = val
            return result
    fp32 = Policy(default="fp32", model_name=result.policy.model_name,
                  fingerprint=result.policy.fingerprint,
                  tuned={**(result.policy.tuned or {}),
                         "validation": {"steps": steps, "passed": False,
                                        "note": "no Pareto policy passed; fell back to fp32"}})
    result.policy = fp32
    result.validation = None
    return result
