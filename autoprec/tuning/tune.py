"""tune(): the Optuna search for a per-layer precision policy, as a short orchestration of the
parts in this package.

    profile (stored in the study) -> search space (space.py) -> warm starts (warmstart.py)
    -> trials: numerics + paired timing (evaluate.py) -> final re-timing (select.py)
    -> the policy with its provenance (report.py)

Each trial is one policy, evaluated for real: its loss and gradients on held-out batches
compared with FP32, and its step time measured against fp32 in interleaved rounds (or priced
by the cost model for a ``target``). Two objectives (step time, loss increase), the budget as
constraints; a non-finite trial is infeasible, never a crash.

The study lives in an Optuna storage (storage.py): a SQLite file beside the output by
default, so an interrupted tune resumes with every completed trial kept; any storage URL
(PostgreSQL, MySQL, ``journal:path``) lets several workers share one study. The profile is
stored in the study's user attributes, so a second worker skips profiling.
"""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from torch import nn

from autoprec import profile_view
from autoprec._util import shown, tensors, worker_id
from autoprec.fingerprint import model_fingerprint
from autoprec.formats import Format, Support
from autoprec.host import supported_formats
from autoprec.measure import shards
from autoprec.measure.deviation import reference_gradients
from autoprec.memory import format_size, memory_model
from autoprec.policy import Interval, Policy
from autoprec.pricing import CostSource
from autoprec.profiling import Profile
from autoprec.profiling import profile as run_profile
from autoprec.reporter import Reporter
from autoprec.task import Task
from autoprec.tuning.config import TuneConfig
from autoprec.tuning.evaluate import Evaluator
from autoprec.tuning.ranks import decided, follow, lead
from autoprec.tuning.report import TrialRecord, TrialResult, TuneResult, pareto, provenance, with_provenance
from autoprec.tuning.select import NOISE_ADVICE, Finalist, select
from autoprec.tuning.share import SharedUnits, unit_studies
from autoprec.tuning.space import SearchSpace, assignment_policy
from autoprec.tuning.storage import StudyHandle, open_storage
from autoprec.tuning.warmstart import memory_warm_start, warm_starts

__all__ = ["tune", "evaluate_policy"]

# A non-finite trial still needs finite objective values for Optuna's samplers.
_PENALTY = 1e6
_FP32_POLICY = Policy(default=Format.FP32)
_COMPLETE = (optuna.trial.TrialState.COMPLETE,)


def tune(task: Task, config: TuneConfig | None = None, *, prof: Profile | None = None,
         progress: bool = True, model: nn.Module | None = None, **options: Any) -> TuneResult:
    """Search a per-layer precision policy for ``task``; see the module docstring.

    Args:
        task: the model, its calibration batches and its loss.
        config: what to search for and how (:class:`TuneConfig`); default ``TuneConfig()``.
        prof: reuses a profile instead of measuring one.
        progress: progress lines on stderr (from rank 0 only).
        model: measure on this build of the task's model instead of building one. A model
            FSDP2 shards (``fully_shard``, every rank of a ``torchrun`` calling ``tune``
            alike, on the same batches): the profile and every trial's numerics are FSDP2
            passes all ranks run together, the numbers one process computes (gradient errors
            and biases to the rounding of FP32 norms); rank 0 alone holds the study, and every
            rank returns its result. Trials are priced (``target=``); memory is not predicted.
        **options: override ``config``'s fields (``n_trials=20``, ``target="h100"``, and
            ``max_loss_increase`` / ``max_grad_error`` for the budget).

    Returns:
        A :class:`~autoprec.tuning.report.TuneResult`: the winning ``policy``, the Pareto
        front, every trial, and how the verdict was reached.

    Raises:
        TypeError: an option that is no field of :class:`TuneConfig`.
        ValueError: for a model FSDP2 shards, no ``target=``, or a ``max_memory`` or
            ``budget_at`` (neither is done there).
    """
    config = (config or TuneConfig()).replace(**options)
    rank = 0
    if model is not None and shards.is_sharded(model):
        _check_sharded(config)
        rank = shards.ranks(model)[0]
    with _Interrupts().installed() as interrupts:
        return _tune(task, config, prof, Reporter(progress and rank == 0), interrupts, model)


def _check_sharded(config: TuneConfig) -> None:
    """What a tune of a model FSDP2 shards cannot do, each in one line before any work."""
    if not CostSource.of(config.target).priced:
        raise ValueError("tune(model=...) of a model FSDP2 shards prices its trials for a GPU "
                         "instead of timing steps: pass target= (e.g. 'h100').")
    if config.max_memory is not None:
        raise ValueError("tune(model=...) of a model FSDP2 shards does not predict peak memory "
                         "(its memory model calibrates on one process's step): leave "
                         "max_memory out.")
    if config.budget_at is not None:
        raise ValueError("tune(model=...) of a model FSDP2 shards measures the model as given: "
                         "budget_at trains a build of the task's own; leave it out.")


def _tune(task: Task, config: TuneConfig, prof: Profile | None, log: Reporter,
          interrupts: _Interrupts, model: nn.Module | None = None) -> TuneResult:
    if len(task.batches) < 2:
        raise ValueError("tune needs at least 2 calibration batches: some to profile, "
                         f"some held out to judge policies; the task has {len(task.batches)}.")
    _note_emulated(task, config, log)
    task, calibration, holdout = _measured_on(task, config, log)
    # the study's identity, the profile and the evaluator share one build of the model (a
    # seeded build: the same weights whenever it is built); the profile leaves it as it was
    model = model if model is not None else task.build_model()
    # a sharded model: rank 0 holds the study, and every rank measures (tuning/ranks.py)
    handle: StudyHandle | None = None

    def study_profile() -> Profile | None:
        nonlocal handle
        handle = _open_study(task, model, config, log)
        return _study_profile(handle, prof, log)

    prof = decided(model, study_profile)
    if prof is None:
        prof = _new_profile(handle, task, config, calibration, log, model)
    if handle is not None and "profile" not in handle.study.user_attrs:
        handle.study.set_user_attr("profile", json.dumps(prof.to_dict()))
    space = SearchSpace.build(prof, config.formats, config.grouping, config.couple)
    lone = _describe(space, prof, config, log)
    holdout_gradients = decided(model, lambda: _holdout_gradients(config, model, len(holdout),
                                                                  task.device, log))
    ev = Evaluator(task, holdout, prof=prof, target=config.target,
                   timing=config.timing, model=model, reference_only=lone,
                   holdout_gradients=holdout_gradients)
    # the evaluator owns the model now (prepared for measurement in place)
    if handle is None:  # a rank other than 0 of a sharded model
        return follow(ev.deviation, model)
    return lead(ev, lambda: _search(handle, task, ev, space, config, log, interrupts))


def _describe(space: SearchSpace, prof: Profile, config: TuneConfig, log: Reporter) -> bool:
    """Say what the search space holds; whether it is one policy, all-fp32 (fp32 is always
    offered): the reference, with nothing to time it against."""
    log(f"search space: {len(space.units)} units over {len(prof.layers)} layers x "
        f"{len(config.formats)} formats")
    for line in [*space.split_summary(), *space.pruned_summary()]:
        log(line)
    if space.size == 1:
        log("the search space holds one policy, all-fp32: it is the reference, so it is not "
            "timed against fp32 (its numerics are still measured)")
    return space.size == 1


def _search(handle: StudyHandle, task: Task, ev: Evaluator, space: SearchSpace,
            config: TuneConfig, log: Reporter, interrupts: _Interrupts) -> TuneResult:
    """The trials and the verdict, once the evaluator holds the reference."""
    if ev.aa is not None:
        log(f"timing noise before the search: fp32 against itself {ev.aa} "
            f"(fp32 step {ev.fp32_seconds * 1e3:.0f} ms)")
        if ev.noise > config.timing.noise_limit:
            log(f"warning: this machine is noisy (a tie measured up to {ev.noise:.0%} off): "
                f"timing may not be able to separate policies. What helps: {NOISE_ADVICE}")
    _enqueue_warm_starts(handle, ev.prof, space, config, log)
    _optimize(handle, _Objective(ev, space, config, log, interrupts), space, config, log,
              interrupts)
    return _decide(handle, task, ev, space, config, log)


def _holdout_gradients(config: TuneConfig, model: nn.Module, n_batches: int,
                       device: Any, log: Reporter) -> str:
    """How the trials get the FP32 reference's held-out gradients (SearchConfig.
    holdout_gradients): "kept", "recomputed" beside their own, or "spilled"; "auto" keeps
    them or recomputes them by the memory free on ``device`` now."""
    how, sizes = reference_gradients(config.holdout_gradients, model, n_batches, device)
    if sizes:
        log(f"the FP32 gradients of {n_batches} held-out batch(es) would take "
            f"{format_size(sizes[0])} of the {format_size(sizes[1])} free: each trial computes "
            "each batch's again beside its own (one more FP32 forward and backward per batch; "
            "holdout_gradients='kept' keeps them, 'spilled' keeps them outside memory)")
    return how


def _note_emulated(task: Task, config: TuneConfig, log: Reporter) -> None:
    if CostSource.of(config.target).priced:
        return
    support = supported_formats(task.device)
    emulated = [f for f in config.formats if support[f] is not Support.NATIVE]
    if emulated:
        log(f"note: {', '.join(map(str, emulated))} only emulated on {task.device}: measured "
            "slower, so the search will not pick them for speed; pass target=... to price "
            "them for another device.")


# ------------------------------------------------------------------------- study
def _measured_on(task: Task, config: TuneConfig, log: Reporter
                 ) -> tuple[Task, Sequence[Any], Sequence[Any]]:
    """The task to measure (its model trained ``budget_at`` steps when that is set), the
    calibration batches the profile measures on and the held-out batches trials are judged on
    (with ``budget_at``: every calibration batch, and the held batches of the run's stream
    the bias budget was measured on)."""
    if config.budget_at is None:
        n_holdout = min(config.n_holdout, len(task.batches) - 1)
        return task, task.batches[:-n_holdout], task.batches[-n_holdout:]
    from autoprec.budget import DEFAULT_BATCHES, held_batches, trained_model

    step = config.budget_at
    log(f"training {step} steps of a {2 * step}-step bf16 reference run: the profile and every "
        f"trial measure there, trials on {DEFAULT_BATCHES} held batches of its stream "
        f"(budget_at)")
    trained = trained_model(task, step, strict=False)
    return (dataclasses.replace(task, model=trained), task.batches,
            held_batches(task, DEFAULT_BATCHES))


def _identity(task: Task, model: nn.Module) -> dict[str, Any]:
    """What a study's trials are only valid for: the model's layers and the batches' shapes."""
    def shapes(batch: Any) -> list:
        return [list(t.shape) for t in tensors(batch)]

    return {"fingerprint": model_fingerprint(model),
            "batches": shapes(task.batches[0]),
            "shape_batch": None if task.shape_batch is None else shapes(task.shape_batch)}


def _study_name(task: Task, config: TuneConfig, identity: dict[str, Any]) -> str:
    """The study's name: the configured one, else the task's name and a hash of everything
    the study's trials depend on."""
    if config.study_name is not None:
        return config.study_name
    search = config.search
    key = {"formats": [f.value for f in search.formats], "budget": search.budget.to_dict(),
           "target": search.target, "groups": str(search.grouping), **identity}
    if search.couple:
        key["couple"] = [list(c) for c in search.couple]
    if search.sensitivity != "auto":  # the profile stored in the study depends on it
        key["sensitivity"] = search.sensitivity
    if search.max_memory is not None:  # feasibility depends on it
        key["max_memory"] = search.max_memory
    if search.budget_at is not None:  # every measurement depends on it
        key["budget_at"] = search.budget_at
    key = json.dumps(key, sort_keys=True)
    return f"{task.name}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def _open_study(task: Task, model: nn.Module, config: TuneConfig, log: Reporter) -> StudyHandle:
    """The study of this task, model, batch shapes and objective: resumed when it exists, else
    new (saying so when the same task had a study for another model or objective)."""
    storage, url = open_storage(config.storage, config.study.paths(task.name).study_db)
    identity = _identity(task, model)
    name = _study_name(task, config, identity)
    others = [s.study_name for s in storage.get_all_studies() if not unit_studies(s.study_name)]
    sampler = optuna.samplers.TPESampler(seed=config.seed, multivariate=True,
                                         n_startup_trials=8)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                                directions=["minimize", "minimize"], load_if_exists=True)
    stored = study.user_attrs.get("identity")
    if stored is None:
        study.set_user_attr("identity", identity)
        older = [o for o in others if o != name and o.startswith(f"{task.name}-")]
        if older and config.study_name is None:
            log(f"the model, its batch shapes or the objective differ from those of study "
                f"{older[-1]} in {url}: starting a fresh study {name}")
    elif stored != identity:
        what = "model (its layers or weight shapes)" if stored.get("fingerprint") != \
            identity["fingerprint"] else "batch shapes"
        raise ValueError(f"Study {name} in {url} was made for another {what}; its trials do not "
                         "apply to this one. Give this tune a new --study name, or a new -o path "
                         "(the default study lives beside the policy).")
    return StudyHandle(study, storage, url)


def _study_profile(handle: StudyHandle, prof: Profile | None, log: Reporter) -> Profile | None:
    """The given profile, else the study's (a resumed tune, a second worker), else None."""
    study = handle.study
    if prof is None and "profile" in study.user_attrs:
        prof = Profile.from_dict(json.loads(study.user_attrs["profile"]))
        log(f"reusing the profile stored in study {study.study_name}")
    return prof


def _new_profile(handle: StudyHandle | None, task: Task, config: TuneConfig,
                 batches: Sequence[Any], log: Reporter, model: nn.Module) -> Profile:
    """A profile measured on ``model``: in units claimed through the study's storage, so
    workers started on the same study split them (a killed worker's unit is redone once its
    lease runs out); on a sharded model, by every rank together (``handle`` is None on all
    but rank 0), which divide the layers among themselves."""
    sharded = shards.is_sharded(model)
    log(f"profiling {task.name} ({', '.join(f.value for f in config.formats)}"
        f"{', target ' + config.target if config.target else ''}; sensitivity "
        f"{config.sensitivity}), "
        + ("the layers divided among the ranks FSDP2 shards the model over" if sharded else
           f"shared with any worker on study {handle.study.study_name}"))
    share = None if sharded else SharedUnits(handle.storage, handle.study.study_name,
                                             worker=worker_id(), progress=log.enabled)
    prof = run_profile(task, formats=config.formats, target=config.target, batches=batches,
                       progress=log, sensitivity=config.sensitivity, budget=config.budget,
                       share=share, only_winnable=True, model=model)
    log(profile_view.sensitivity_summary(prof))
    return prof


def _fail_trials(handle: StudyHandle, whose: Callable[[str], bool]) -> list[int]:
    """Mark failed the RUNNING trials whose ``worker`` attribute ``whose`` accepts; returns
    their numbers. Best effort: another worker may finish or fail one at the same time."""
    failed = []
    for t in handle.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        who = t.user_attrs.get("worker")
        if not isinstance(who, str) or not whose(who):
            continue
        try:
            handle.fail(t.number)
        except Exception:  # noqa: BLE001 - finished meanwhile, or the storage is going away
            continue
        failed.append(t.number)
    return failed


def _gone(who: str) -> bool:
    """Whether ``who`` (a worker id, ``host:pid``) is a process of this host that has exited."""
    host, _, pid = who.rpartition(":")
    if host != worker_id().rpartition(":")[0] or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def _enqueue_warm_starts(handle: StudyHandle, prof: Profile, space: SearchSpace,
                         config: TuneConfig, log: Reporter) -> None:
    """All-fp32, each uniform format and the integer program's solutions, once per study; a
    warm start whose trial failed (interrupted, killed) is queued again on a rerun."""
    # a trial left RUNNING by a killed process on this host is failed now rather than after
    # the storage's heartbeat grace period, so its warm start is queued again below
    study = handle.study
    orphans = _fail_trials(handle, _gone)
    if orphans:
        log(f"trial(s) {', '.join(map(str, orphans))} were left running by a process that has "
            "exited: marked failed")
    if not study.user_attrs.get("warm_started"):
        study.set_user_attr("warm_started", True)
        budgets = [b * config.budget.max_loss_increase for b in config.milp_budgets]
        starts = warm_starts(prof, space, config.formats, budgets)
        study.set_user_attr("warm_starts", json.dumps(starts))
        for origin, choice in starts:
            study.enqueue_trial(choice, user_attrs={"origin": origin})
        log(f"enqueued {len(starts)} warm starts")
        return
    live = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.WAITING,
            optuna.trial.TrialState.RUNNING)
    have = [t.params or t.system_attrs.get("fixed_params")
            for t in study.get_trials(deepcopy=False, states=live)]
    lost = [(o, c) for o, c in json.loads(study.user_attrs.get("warm_starts", "[]"))
            if c not in have]
    for origin, choice in lost:
        study.enqueue_trial(choice, user_attrs={"origin": origin})
    if lost:
        log(f"queued {len(lost)} warm start(s) again: their trials did not complete")


# ------------------------------------------------------------------------- trials
class _Objective:
    """One trial: the sampler's policy, its numerics and its step time."""

    def __init__(self, ev: Evaluator, space: SearchSpace, config: TuneConfig,
                 log: Reporter, interrupts: _Interrupts | None = None):
        self.ev, self.space, self.config, self.log = ev, space, config, log
        self.interrupts = interrupts or _Interrupts()
        # the trial an interrupt stopped mid-way, if one did
        self.abandoned: int | None = None
        # every trial's predicted peak memory (reported; a constraint under max_memory),
        # calibrated on the evaluator's model; none for a sharded model (one process's step)
        self.memory, self.memory_start = None, None
        if not shards.is_sharded(ev.meter.model):
            self._calibrate_memory(config.max_memory)

    def _calibrate_memory(self, limit: int | None) -> None:
        self.memory = memory_model(self.ev.task, self.ev.prof, self.ev.meter.model)
        self.memory_start = memory_warm_start(self.memory, self.space)
        if limit is not None and self.memory_start[2] > limit:
            raise ValueError(f"No policy fits --max-memory {format_size(limit)}: the smallest "
                             f"predicted peak training memory is "
                             f"{format_size(self.memory_start[2])} ({self.memory_start[2]} bytes); "
                             "raise the budget, allow more formats, or use smaller batches.")
        self.log(f"peak training memory: fp32 {format_size(self.memory.predict(_FP32_POLICY))}, "
                 f"smallest predicted {format_size(self.memory_start[2])}")

    def __call__(self, trial: optuna.Trial) -> tuple[float, float]:
        # who runs it: a resume fails at once a trial its predecessor left RUNNING on this host
        try:
            self.interrupts.raise_pending()
            trial.set_user_attr("worker", worker_id())
            return self._measure(trial)
        except KeyboardInterrupt:
            # the process stops mid-trial (a second Ctrl-C, SIGTERM): Optuna marks the trial
            # failed, so a rerun measures it again, and would log the interrupt's traceback
            # as the trial's failure; the caller says what happened instead
            optuna.logging.set_verbosity(optuna.logging.ERROR)
            self.abandoned = trial.number
            raise

    def _measure(self, trial: optuna.Trial) -> tuple[float, float]:
        if self.config.max_memory is not None and self.memory_start is not None:
            # the policy predicted smallest, so a search under a tight budget has a start
            trial.study.enqueue_trial(self.memory_start[1],
                                      user_attrs={"origin": self.memory_start[0]})
            self.memory_start = None
        choice = {u: trial.suggest_categorical(u, c) for u, c in self.space.choices.items()}
        old = _earlier(trial.study, choice)
        if old is not None:
            # The sampler proposed a policy already measured: reuse it instead of re-running.
            record = TrialRecord.from_trial(old, f"study {trial.study.study_name}")
            dataclasses.replace(record, origin=f"repeat of {old.number}").write(trial)
            return tuple(old.values)
        policy = assignment_policy(self.space.units, choice, model_name=self.ev.model_name,
                                   fingerprint=self.ev.fingerprint)
        with self.interrupts.landing():
            dev = self.ev.deviation(policy)
        finite = dev.finite and math.isfinite(dev.loss_rel_change) and \
            math.isfinite(dev.grad_rel_error)
        budget = self.config.budget
        if finite:
            li, ge = dev.loss_rel_change, dev.grad_rel_error
            with self.interrupts.landing():
                timed = self.ev.time(policy)
            sec, speedup, predicted = timed.seconds, timed.speedup, timed.predicted
        else:
            li, ge, sec = _PENALTY, _PENALTY, self.ev.fp32_seconds * 10
            speedup, predicted = Interval(0.1, 0.1, 0.1, 0), None
        mem = None if self.memory is None else self.memory.predict(policy)
        limit = self.config.max_memory
        bias = dev.grad_bias if finite and math.isfinite(dev.grad_bias) else _PENALTY
        cons = (li - budget.max_loss_increase,
                (ge - budget.max_grad_error) if budget.max_grad_error is not None else -1.0,
                (mem - limit) / limit if limit is not None else -1.0)
        if budget.max_grad_bias is not None:
            # only then: a study's trials keep one number of constraints (the bias limit is
            # part of the study's name), which Optuna's samplers need
            cons += (bias - budget.max_grad_bias,)
        # the origin a warm start was enqueued with, else the sampler's
        origin = trial.user_attrs.get("origin")
        record = TrialRecord(constraints=cons, grad_error=ge, finite=finite, speedup=speedup,
                             predicted=predicted, memory=mem,
                             origin=shown(origin) if isinstance(origin, str) else "search",
                             grad_bias=bias)
        record.write(trial)
        self.log(f"trial {trial.number:3d}  {speedup}  loss {li:+.3%}  grad err {ge:.3g}  "
                 f"bias {bias:.3g}  "
                 f"{'' if mem is None else f'memory {format_size(mem)}  '}"
                 f"{'ok' if record.feasible else 'over budget'}  [{record.origin}]")
        return sec, li


def _earlier(study: optuna.Study, choice: dict[str, str]) -> optuna.trial.FrozenTrial | None:
    for old in study.get_trials(deepcopy=False, states=_COMPLETE):
        if old.params == choice:
            return old
    return None


class _Stop:
    """Stops the study once ``target`` distinct policies are complete (a repeated proposal
    reuses its earlier measurement and does not count), after ``cap`` attempts in this run
    (a sampler that keeps proposing measured policies), or on an interrupt."""

    def __init__(self, target: int, cap: int, interrupts: _Interrupts):
        self.target, self.cap, self.interrupts, self.attempts = target, cap, interrupts, 0

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        self.attempts += 1
        if (_distinct(study) >= self.target or self.attempts >= self.cap
                or self.interrupts.count or self.interrupts.pending is not None):
            study.stop()


def _distinct(study: optuna.Study) -> int:
    """Distinct policies measured (two workers may measure one at the same time)."""
    return len({tuple(sorted(t.params.items()))
                for t in study.get_trials(deepcopy=False, states=_COMPLETE)})


def _optimize(handle: StudyHandle, objective: _Objective, space: SearchSpace,
              config: TuneConfig, log: Reporter, interrupts: _Interrupts) -> None:
    study = handle.study
    n_trials = config.n_trials
    if space.size < n_trials:
        log(f"the search space holds only {space.size} "
            f"{'policy' if space.size == 1 else 'policies'}: running {space.size} "
            f"{'trial' if space.size == 1 else 'trials'}")
        n_trials = space.size
    done = _distinct(study)
    remaining = max(0, n_trials - done)
    if done:
        log(f"resuming study {study.study_name}: {done} distinct policies measured, "
            f"{remaining} to go")
    if not remaining:
        return
    stop = _Stop(n_trials, cap=3 * remaining + 8, interrupts=interrupts)
    try:
        with warnings.catch_warnings(), interrupts.during():
            # said once above; every trial would repeat it
            warnings.filterwarnings("ignore", message=".*can only emulate.*")
            study.optimize(objective, timeout=config.timeout, catch=(RuntimeError,),
                           callbacks=[stop])
            interrupts.raise_pending()
    except KeyboardInterrupt:
        # an interrupt between Optuna's bookkeeping steps can leave this process's trial
        # RUNNING: fail it too, so the rerun queues its warm start again
        _fail_trials(handle, lambda who: who == worker_id())
        if objective.abandoned is not None:
            log(f"trial {objective.abandoned} abandoned: marked failed, a rerun measures it "
                "again")
        raise
    finally:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    if interrupts.count:
        raise KeyboardInterrupt(f"interrupted after {_distinct(study)} distinct policies")
    if _distinct(study) < n_trials and stop.attempts >= stop.cap:
        log(f"the sampler kept proposing policies it had measured: stopping at "
            f"{_distinct(study)} distinct policies")


# seconds between raising a Ctrl-C again that something swallowed (see _Interrupts)
_AGAIN_S = 2.0


def _quiet_interrupts(hook: Callable, unraisable: Any) -> None:
    """sys.unraisablehook during a tune: a KeyboardInterrupt a destructor swallowed is raised
    again (_Interrupts), so its "Exception ignored in ..." traceback is not printed."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        hook(unraisable)


class _Interrupts:
    """Ctrl-C during the search finishes the running trial and stops the study cleanly (so no
    trial is left half-written); a second Ctrl-C exits at once. Elsewhere (profiling, the
    final re-timing) an interrupt stops at once: nothing in the study is at risk there.

    A SIGTERM handler that raises (the ``autoprec`` command's) is deferred during the search
    until it can land inside a trial's measurement, where Optuna marks the trial failed (a
    rerun measures it again): one arriving in a storage write (Optuna's bookkeeping, a
    trial's records) stops the study and is raised as the next measurement or trial starts,
    or as the search returns."""

    def __init__(self):
        self.count = 0
        self.searching = False
        self.measuring = False
        # (handler, signum, frame) of a deferred SIGTERM
        self.pending: tuple[Callable, int, Any] | None = None
        self._term: Callable | None = None
        # the interrupt raised again until tune() returns (see _raise_again_later)
        self.closed = False
        self._again = False

    def _handler(self, signum, frame) -> None:
        if self._again:  # raised again by the timer, not a new Ctrl-C
            self._again = False
            self._raise_again_later()
            raise KeyboardInterrupt
        self.count += 1
        if self.count > 1 or not self.searching:
            if self.count > 1:
                print("\ninterrupted again: exiting now", file=sys.stderr, flush=True)
                os._exit(130)
            self._raise_again_later()
            raise KeyboardInterrupt
        # the _Stop callback stops the study after the running trial (Study.stop() here would
        # raise outside Optuna's loop: just before it starts or after it ends)
        print("\ninterrupt: finishing the running trial, then stopping (Ctrl-C again to quit "
              "at once)", file=sys.stderr, flush=True)

    def _raise_again_later(self) -> None:
        """A KeyboardInterrupt raised while a destructor or a GC callback runs is swallowed
        ("Exception ignored in ...") and the tune goes on: seen in CI, a Ctrl-C lost in a
        regex object's __del__ while the profile waited a minute for another worker's unit.
        Until tune() returns, the interrupt is raised again every _AGAIN_S."""
        timer = threading.Timer(_AGAIN_S, self._raise_again)
        timer.daemon = True
        timer.start()

    def _raise_again(self) -> None:
        if not self.closed:
            self._again = True
            _thread.interrupt_main()  # runs _handler in the main thread

    def _term_handler(self, signum, frame) -> None:
        if self.measuring:
            self._term(signum, frame)
            return
        self.pending = (self._term, signum, frame)

    def raise_pending(self) -> None:
        """Run the deferred SIGTERM handler, if a SIGTERM came."""
        if self.pending is not None:
            handler, signum, frame = self.pending
            self.pending = None
            handler(signum, frame)

    @contextlib.contextmanager
    def installed(self):
        """Handle SIGINT while tuning, in the main thread, unless someone else handles it."""
        ours = (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        hook = sys.unraisablehook
        if ours:
            signal.signal(signal.SIGINT, self._handler)
            sys.unraisablehook = functools.partial(_quiet_interrupts, hook)
        try:
            yield self
        finally:
            self.closed = True
            if ours:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                sys.unraisablehook = hook

    @contextlib.contextmanager
    def during(self):
        """The search: a first Ctrl-C finishes the running trial, a SIGTERM is deferred."""
        self.searching = True
        term = (signal.getsignal(signal.SIGTERM)
                if threading.current_thread() is threading.main_thread() else None)
        defer = callable(term)
        if defer:
            self._term = term
            signal.signal(signal.SIGTERM, self._term_handler)
        try:
            yield
        finally:
            self.searching = False
            if defer and signal.getsignal(signal.SIGTERM) == self._term_handler:
                signal.signal(signal.SIGTERM, term)

    @contextlib.contextmanager
    def landing(self):
        """A trial's measurement: where a SIGTERM may land. Not Optuna's or the trial's storage
        writes: an exception raised inside a commit leaves the storage's session unusable, and
        Optuna then cannot mark the trial failed (it stays RUNNING)."""
        self.measuring = True
        try:
            self.raise_pending()
            yield
        finally:
            self.measuring = False


# ------------------------------------------------------------------------- the verdict
def _decide(handle: StudyHandle, task: Task, ev: Evaluator, space: SearchSpace,
            config: TuneConfig, log: Reporter) -> TuneResult:
    study = handle.study
    trials = [TrialResult.of(t, ev.fp32_seconds, f"study {study.study_name}")
              for t in study.get_trials(deepcopy=False, states=_COMPLETE)]
    feasible = [t for t in trials if t.feasible]
    if not feasible:
        raise RuntimeError(
            f"No feasible policy in study {study.study_name} ({len(trials)} trials): even "
            "all-fp32 broke the budget, which means the loss is noisy between identical runs. "
            "Check that the task's loss is deterministic (dropout off, fixed data).")
    warm = [t for t in feasible if t.origin.startswith("warm")]
    warm_picks = _best_warm_starts(warm)
    finalists = _finalists(feasible, warm_picks, ev, space, config.timing.finalists)
    drift = ev.drift()
    if drift is not None and max(drift[1] - 1, 1 - drift[0]) > config.timing.noise_limit:
        log(f"timing noise during the search: the trials' fp32 steps took {drift[0]:.2f}-"
            f"{drift[1]:.2f}x the calibrated time (10-90%); trial speeds are rough, the final "
            "re-timing decides")
    if not ev.reference_only and ev.steps is not None:  # priced trials are not re-timed
        log(f"re-timing {len(finalists)} leading policies against fp32 until the verdict is "
            "significant")
    sel = select(ev, finalists, [t.number for t in warm_picks], config.timing, log=log)
    sel.drift = drift
    by_number = {t.number: t for t in trials}
    best_warm = None if sel.warm is None else by_number[sel.warm]
    best = dataclasses.replace(by_number[sel.winner], speedup=sel.speedup[sel.winner])
    policy = next(f.policy for f in finalists if f.number == sel.winner)
    result = TuneResult(policy=policy, best=best, fp32_seconds=sel.fp32_seconds,
                        pareto=pareto(feasible), trials=trials, best_warm_start=best_warm,
                        study_name=study.study_name, storage=handle.url, profile=ev.prof,
                        units=space.units, selection=sel)
    result.policy = with_provenance(policy, provenance(
        task, result, config.budget, config.target, ev.prof,
        bias_batches=len(ev.meter.batches), at=config.budget_at))
    return result


def _best_warm_starts(warm: list[TrialResult]) -> list[TrialResult]:
    """The feasible warm starts fastest as measured in the search and as the profile predicts
    (one search-time step can land in a burst of contention, so both are re-timed), and the
    all-fp32 one, which a policy not faster than fp32 beyond noise must lose to."""
    if not warm:
        return []
    picks = [min(warm, key=lambda t: t.step_seconds)]
    predicted = [t for t in warm if t.predicted is not None]
    if predicted:
        picks.append(min(predicted, key=lambda t: t.predicted))
    picks += [t for t in warm if t.origin == f"warm:{Format.FP32.value}"]
    out: list[TrialResult] = []
    for t in picks:
        _add_distinct(out, t)
    return out


def _add_distinct(picked: list[TrialResult], t: TrialResult) -> None:
    """Append ``t`` unless a trial of the same assignment is already picked."""
    if t.assignment not in [p.assignment for p in picked]:
        picked.append(t)


def _finalists(feasible: list[TrialResult], warm: list[TrialResult], ev: Evaluator,
               space: SearchSpace, n: int) -> list[Finalist]:
    """The warm starts ``warm``, the ``n`` fastest distinct feasible trials as measured, and
    the feasible trial the profile predicts fastest."""
    picked: list[TrialResult] = list(warm)
    for t in sorted(feasible, key=lambda t: t.step_seconds):
        if len(picked) >= n + len(warm):
            break
        _add_distinct(picked, t)
    predicted = [t for t in feasible if t.predicted is not None]
    if predicted:
        _add_distinct(picked, min(predicted, key=lambda t: t.predicted))
    out = []
    for t in picked:
        policy = assignment_policy(space.units, t.assignment, model_name=ev.model_name,
                                   fingerprint=ev.fingerprint)
        out.append(Finalist(t.number, policy, t.loss_increase, ev.predicted_ratio(policy),
                            t.step_seconds))
    return out


def evaluate_policy(task: Task, policy: Policy, *, prof: Profile | None = None,
                    target: str | None = None, holdout: Sequence[Any] | None = None,
                    config: TuneConfig | None = None) -> TrialResult:
    """Evaluate one policy as a trial of tune() would."""
    config = config or TuneConfig(target=target)
    task, _, held = _measured_on(task, config, Reporter(False))
    prof = prof if prof is not None else run_profile(task, progress=False, target=target,
                                                     only_winnable=True)
    ev = Evaluator(task, holdout if holdout is not None else held, prof=prof,
                   target=target, timing=config.timing)
    timed = ev.time(policy)
    dev = ev.deviation(policy)
    finite = dev.finite
    feasible = finite and config.budget.allows(dev.loss_rel_change, dev.grad_rel_error,
                                               dev.grad_bias)
    return TrialResult(-1, {}, timed.seconds, timed.speedup, dev.loss_rel_change,
                       dev.grad_rel_error, feasible, finite, "evaluate", timed.predicted,
                       grad_bias=dev.grad_bias)

