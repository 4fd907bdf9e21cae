"""Runtime guard: watch the layers a policy runs in low precision, demote the ones that keep failing.

    autoprec.apply(model, policy, guard=True)         # or guard=GuardConfig(patience=3, save_to=...)
    guard = autoprec.get_guard(model)
    for batch in batches:
        loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        guard.step(scaler=scaler)                     # one host sync per training step
    guard.save("policies/my_model.amended.yaml")      # the policy with the demotions written in

What is watched: every module that computes (``autoprec.runtime.calls.layer_kind``, the rule
capture uses too: ``nn.Linear``, HF ``Conv1D``, convolutions, and any module whose own forward
runs a matmul-like call of the registry, such as an attention core running ``q @ k.T``) whose
format under the policy is one of ``GuardConfig.formats`` (fp16, the scaled formats and bf16 by
default).
Modules that compute by their class are known at once; the others are found on the first
training forward, by watching which module runs which registered call (their outputs are
checked from that forward on). Norms and embeddings are not watched: autocast runs them in FP32
in every format.

What counts as a failure, per step and per watched layer:

- its output holds a non-finite value, or a value above what the layer's format holds
  (fp16: 65504; bf16 and fp8: BF16's max, which fp8 layers output; their FP8 operands are
  rescaled per tensor into E4M3/E5M2 range, so a finite operand never overflows FP8 itself);
- the gradient reaching its output (dL/d output, what its backward consumes) is non-finite or
  above that limit, or (fp16 layers) the gradient of its own weights is non-finite (a tied
  weight, such as GPT-2's ``lm_head``/``wte``, is not its own). With an enabled ``GradScaler`` these are
  first the scaler's to handle (it skips the step and halves the scale): they count only once
  its scale is at or below ``GuardConfig.min_loss_scale`` (1.0: the gradient overflows
  unscaled).

Attribution: a non-finite value propagates, so in one step many layers fail because of one. The
guard blames the *first* failing layer in execution order: forward order for outputs (a step
with a failing output is judged on its outputs only), then for gradients a layer whose own
weight gradient fails while the gradient at its output is finite (its backward overflowed),
else the first in backward order whose output gradient fails. A non-finite gradient reaching
the first layer of the backward came from the loss or unwatched layers, except, without an
enabled GradScaler, at an fp16 layer: its output, so the gradient computed for it, is FP16, and
the finite FP32 gradient of the layers after it overflowed there (the forward was finite); it
is blamed (a NaN loss from finite outputs, such as NaN targets, would read the same). A blamed
layer becomes a suspect: from the next step on its inputs are checked as well, and a layer
whose inputs were already non-finite is cleared (the fault lies upstream, perhaps in an
unwatched layer) and the blame moves to the next failing layer. Suspects also get the share of
failing values measured, for the log. A layer blamed ``patience`` steps in a row is demoted one
step (``Format.demoted()``: fp8 -> bf16 -> fp32, fp16 -> fp32) for the rest of the run, by
re-applying the policy amended with ``{fqn: new_format}`` (the module tree, parameters and
``state_dict`` are untouched; a parent's children that inherited its format are pinned to it,
so only the parent's own computation changes).

The predictive check (``GuardConfig.predict``, on by default; ``autoprec.runtime.guard.forecast``)
sees trouble coming, before any non-finite step. Per watched layer it keeps, for the outputs
and (without an enabled GradScaler) the gradients at the output, the step's amax (the mean over
the step's calls), the kurtosis about zero of a fixed 4096-value sample (an outlier statistic)
and, for fp16, the share of the sample's nonzero values below FP16's smallest normal. Over the
last ``window`` (32) steps it fits the trend of ln(amax / limit) (the limit as above: fp16
65504, bf16 and fp8 BF16's max). A layer is demoted (``where="forecast"``) when, on
``patience`` steps in a row, the least-squares slope is positive at t >= 4 over at least half
a window, and both that line and a robust Theil-Sen line reach the limit within ``horizon``
(50) steps; the event gives the trend, e.g. "outputs' amax 4.653e+04 (0.71 of fp16 max 65504),
growing 1.10%/step over 31 steps (t 9.6, fit residual 0.057): reaches 65504 in ~43 steps;
kurtosis 2.74; ...". Kurtosis and underflow are evidence, not triggers (see the forecast
module: a few massive activations, kurtosis in the hundreds, are normal in large trained
transformers; underflow costs precision, not range). With an enabled GradScaler only outputs are forecast: scaled gradients sit near the
range by design (the scaler raises the scale until they overflow), and their overflows are the
scaler's to handle. On the planted drift (``examples/drift.py``) it demoted the layer at step
173, the reactive check at 225 (first overflow 224); on the unplanted model, 1000 steps in
fp16/bf16/fp8, nothing. A layer's history is dropped when its format changes.

Demotions decided outside the guard (autoprec's re-check) are queued with
:meth:`Guard.request_demotion` and made at the next ``step()``; :meth:`Guard.replace_policy`
switches the model to another policy (a phase) keeping the guard's demotions (the safer of
the two formats per layer).

What cannot be demoted away is a WARNING, once: non-finite values that start in a layer the
policy keeps in fp32, in the loss, or in the input batch (named by watching every module on
the next step), and poisoned parameters. Without a GradScaler one non-finite step sends its
gradients through the optimizer into every weight; from then on every layer's output is
non-finite because its weights are, and blaming the first one would demote innocent layers,
one after the other, on a model already lost. So on a failing step (never on a healthy one)
the guard checks the parameters, one max-abs reduction each: non-finite values in the
parameters of more than one module mean poisoned (an optimizer's state, such as Adam's
moments, goes non-finite with the weights, so the parameters tell; the guard does not know
the optimizer). It then demotes nothing and warns once, naming the step since which the
parameters are non-finite (``guard.poisoned_since``) and where the non-finite values began on
that step (``guard.first_nonfinite``: the layer, or None where the guard cannot tell which
unwatched layer it was), that demoting cannot help, and to restore a checkpoint; it judges
again once the parameters are finite (restored). One module's own non-finite parameter (a
bad checkpoint entry) is that module's failure, judged as any other.

Under torch.distributed (DDP, FSDP) each ``step()`` combines the ranks' verdicts with one
all_reduce(MAX) of three flags per watched layer (blamed, forecast to hit, demotion requested:
an OR over ranks) and one for poisoned parameters, so every rank demotes the same layers at
the same step and holds the same events and amended policy
(``save_to`` is written by rank 0). Every rank must call ``step()``.
``state_dict()``/``load_state_dict()`` carry the demotions and the forecast history (at most
``window`` points per layer and kind) through a checkpoint (see
``autoprec.integrations`` for the Trainer and Accelerate).

Cost: one fused reduction per watched output, output gradient and own weight gradient, kept on
the device: a count of the values above the limit (or NaN) for fp16 layers (a finite FP32 value
can exceed 65504) and for suspects (it gives the share of failing values), a plain ``sum``
elsewhere (non-finite exactly when a value is; about half the cost). The predictive check adds,
per watched output (and unscaled output gradient), one amax reduction (``aminmax``) over every
value and a few small ops on its 4096-value sample (in FP64), stacked with the checks: ``step()`` reads them all
with the same one host sync per device, then fits the trends in Python (a few microseconds per
layer; bf16 and fp8 layers far from BF16's range are not fitted). Nothing is watched while
autograd is off (evaluation).
Measured on GPT-2 4x256, batch 16x128, 20 layers watched (``benchmarks/bench_guard.py``, a
2-core Xeon): the reactive checks alone 1.007x [0.968-1.078] the unguarded step, with the
predictive check 1.050x [1.014-1.142] (1.042x [0.988-1.096] the reactive guard's: about 0.2-0.5
ms per watched tensor, mostly its amax pass and the sample's dispatches).

Under ``torch.compile`` the checks add no graph break: while dynamo traces, a watched layer's
output goes through a custom autograd function (``record.SinkReport``) whose backward hands the checks,
forward and backward, to a small leaf tensor of the watch as its gradient; ``step()`` reads
those with the eager records. Python state changes only between steps (suspects, demotions:
a recompile then). The order in which layers ran (for blame) is the one seen eagerly, else the
order modules finish. Modules a compiled first training forward finds to compute by what they
run (attention cores) are hooked at the next ``step()`` (registering a hook while dynamo traces
is a graph break), so that one forward does not check them; with activation checkpointing that
first forward still compiles in pieces (the search's records inside the checkpoint).

The parts, each with one job, composed by :class:`Guard`: ``record`` (the watches' hooks and
the per-step checks, read with one host sync), ``discovery`` (modules found to compute on the
first forward), ``forecast`` (the trends and the predictive verdict), ``blame`` (a pure function from the checks to the layer at fault), ``ranks``
(agreement under torch.distributed), ``diagnose`` (where unexplained non-finite values start,
poisoned parameters), ``demote`` (amend and re-apply the policy) and ``state`` (what a
checkpoint carries, checked when read back).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from autoprec.formats import Format
from autoprec.policy import Policy
from autoprec.runtime import rewrite
from autoprec.runtime.guard.blame import Blame, Failure, blame, describe, failing, first_nonfinite
from autoprec.runtime.guard.coverage import Coverage
from autoprec.runtime.guard.demote import amend, demotion_reason, merge, merge_phases, reapply
from autoprec.runtime.guard.diagnose import Diagnostician, Poisoning
from autoprec.runtime.guard.forecast import Forecaster, Trend
from autoprec.runtime.guard.ranks import Agreed, Ranks
from autoprec.runtime.guard.record import Checks, Recorder
from autoprec.runtime.guard.state import Ledger, check_version
from autoprec.runtime.guard.terms import GuardConfig, GuardEvent, check_where, watched

__all__ = ["GuardConfig", "GuardEvent", "Guard", "Trend", "get_guard"]

logger = logging.getLogger(__name__)

_GUARD_ATTR = "_autoprec_guard"
# Longest reason request_demotion keeps (it goes into events, checkpoints and policy files).
_MAX_REASON = 500


def get_guard(model: nn.Module) -> Guard | None:
    """The guard ``autoprec.apply(model, policy, guard=...)`` attached to ``model``, or None.

    Args:
        model: the model, or the wrapper (torch.compile, DataParallel, DDP) the policy went
            through.

    Returns:
        The :class:`Guard` (call its ``step()`` after each optimizer step), or None when no
        guard is attached.
    """
    return rewrite.unwrap(model).__dict__.get(_GUARD_ATTR)


class Guard:
    """Watches a policy-applied model in training and demotes layers that keep failing.

    Made by ``autoprec.apply(model, policy, guard=True | GuardConfig(...))``; get it back with
    :func:`get_guard`. Call :meth:`step` once per training step (after the optimizer step); it
    returns the demotions it made. See the module docstring for what is measured.

    Its parts: ``recorder`` (the checks), ``forecaster`` (the trends toward each range),
    ``coverage`` (what is watched), ``ranks``,
    ``diagnostician`` and ``poisoning`` (what cannot be demoted away), ``ledger`` (what a
    checkpoint carries); blame and the demotion's amendment are functions of what these hold.
    """

    def __init__(self, config: GuardConfig | None = None):
        self.config = config or GuardConfig()
        # The policy in force on the model (the original one, amended by each demotion).
        self.policy: Policy | None = None
        self.model: nn.Module | None = None
        # GradScaler consulted by step() when none is passed (set by autoprec.integrations).
        self.scaler: torch.amp.GradScaler | None = None
        self.recorder = Recorder(self.config.check_gradients, predict=self.config.predict)
        self.forecaster = Forecaster(self.config.window, self.config.horizon,
                                     self.config.patience)
        # fqn -> (where, reason) of the demotions requested since the last step()
        self._requests: dict[str, tuple[str, str]] = {}
        # the policy replace_policy last switched to (None: the policy attached with)
        self._phase: Policy | None = None
        self.ranks = Ranks(self.config.distributed)
        self.diagnostician = Diagnostician()
        self.poisoning = Poisoning()
        self.ledger = Ledger()
        self.coverage = Coverage(self.recorder, self.config.formats)
        # a state loaded before attach waits here; a re-apply's attach keeps the base policy
        self._pending: dict[str, Any] | None = None
        self._reapplying = False

    @property
    def events(self) -> list[GuardEvent]:
        """Demotions so far, in order."""
        return self.ledger.events

    @property
    def poisoned_since(self) -> int | None:
        """Since which step the parameters are non-finite (None: finite; see Poisoning)."""
        return self.poisoning.since

    @property
    def first_nonfinite(self) -> str | None:
        """Where the non-finite values began on that step (None: cannot tell)."""
        return self.poisoning.first

    @property
    def watched(self) -> dict[str, Format]:
        """fqn -> format of every layer being watched now."""
        return self.recorder.formats

    # ---------------------------------------------------------------- attach / detach
    @classmethod
    def coerce(cls, guard: Any) -> Guard:
        """A guard from what ``apply(..., guard=...)`` accepts: True, a GuardConfig, a Guard."""
        if guard is True:
            return cls()
        if isinstance(guard, GuardConfig):
            return cls(guard)
        if isinstance(guard, Guard):
            return guard
        raise TypeError(f"apply(..., guard={guard!r}): expected True, a GuardConfig, a Guard, "
                        "or None/False for no guard.")

    def attach(self, model: nn.Module, policy: Policy) -> Guard:
        """Watch ``model`` (to which ``policy`` is applied). Called by ``autoprec.apply``."""
        fresh = self.model is not None and self.model is not model
        if fresh:
            self.detach()
            self.coverage.forget()
        self.recorder.start(model, forget_order=fresh)
        self.diagnostician.close()
        self.model, self.policy = model, policy
        if not self._reapplying:
            self.ledger.base, self._phase = policy, None
        self.coverage.attach(model, policy)
        model.__dict__[_GUARD_ATTR] = self
        self.recorder.set_suspects(self.recorder.suspects, model)
        if self._pending is not None and not self._reapplying:
            state, self._pending = self._pending, None
            self._restore(state)
        return self

    def detach(self) -> None:
        """Stop watching (the model keeps its current policy)."""
        self.recorder.remove_hooks()
        self.diagnostician.close()
        if self.model is not None and self.model.__dict__.get(_GUARD_ATTR) is self:
            del self.model.__dict__[_GUARD_ATTR]
        self.model = None
        self.recorder.reset()

    def _format_of(self, fqn: str):
        return self.policy.format_for(fqn) if self.policy is not None else None

    # ---------------------------------------------------------------- the per-step check
    def step(self, *, scaler: torch.amp.GradScaler | None = None,
             step: int | None = None) -> list[GuardEvent]:
        """Judge the training step that just ran; demote layers that failed ``patience`` steps
        in a row, layers forecast to reach their format's range within the horizon on
        ``patience`` steps in a row, and layers whose demotion was requested
        (:meth:`request_demotion`). Call once per optimizer step (after ``scaler.update()``).
        ``scaler``: the GradScaler in use (default: ``self.scaler``); ``step``: the step
        number to log (default: count of calls). Returns the demotions made now."""
        led = self.ledger
        led.step = led.step + 1 if step is None else int(step)
        if self.model is None:
            return []
        if rewrite.applied_policy(self.model) is None:
            self.detach()  # autoprec.remove(model) ran: nothing left to guard
            return []
        self.coverage.hook_found()
        scaler = scaler if scaler is not None else self.scaler
        trained, failure, poisoned, checks = self._judge(scaler)
        foreseen = self._foresee(checks, scaler) if trained and not poisoned else {}
        requested = self._take_requests()
        agreed = Agreed(trained, [failure.fqn] if failure is not None else [], poisoned,
                        list(foreseen), list(requested))
        if self.ranks.world() > 1:
            # every rank must reach the same counts, hence the same demotions at the same step
            agreed = self.ranks.agree(trained, failure.fqn if failure is not None else None,
                                      poisoned, list(self.recorder.watches), self.model,
                                      foreseen=foreseen, requested=requested)
        due = self._blamed_due(agreed, failure)
        asked = [f for f in agreed.requested if f not in due]
        ahead = [f for f in agreed.foreseen if f not in due and f not in asked]
        if not (due or asked or ahead):
            return []
        fmt = self.watched.get
        mine = {"blame": {} if failure is None else
                {failure.fqn: (failure.where, describe(failure, fmt(failure.fqn)))},
                "forecast": {f: ("forecast", f"{t.describe(fmt(f))}; forecast on "
                                             f"{self.forecaster.streaks[f]} steps in a row")
                             for f, t in foreseen.items()},
                "request": requested}
        seen = self.ranks.gather(mine)
        events = [self._demote(f, "blame", seen) for f in due]
        events += [self._demote(f, "request", seen) for f in asked]
        events += [self._demote(f, "forecast", seen) for f in ahead]
        return [e for e in events if e is not None]

    def _blamed_due(self, agreed: Agreed, failure: Failure | None) -> list[str]:
        """The blame streaks after this step's (agreed) verdict, and the layers they make due
        for demotion; warns once about poisoned parameters (then none is due)."""
        led = self.ledger
        if not agreed.trained:
            return []  # no training step since the last call (on any rank)
        if agreed.poisoned:
            led.streaks = {}
            self.poisoning.warn(led.step, self.watched)
            return []
        self.poisoning.since = self.poisoning.first = None
        led.streaks = {f: led.streaks.get(f, 0) + 1 for f in agreed.blamed}
        due = [f for f in agreed.blamed if led.streaks[f] >= self.config.patience]
        if failure is not None and failure.fqn not in due:
            logger.info("autoprec guard: step %d: %s (%s) failed: %s (%d of %d steps before "
                        "demotion)", led.step, failure.fqn, self.watched.get(failure.fqn),
                        describe(failure, self.watched.get(failure.fqn)),
                        led.streaks[failure.fqn], self.config.patience)
        return due

    def _foresee(self, checks: Checks, scaler) -> dict[str, Trend]:
        """Feed the step's forecast summaries to the forecaster; the layers due for a
        predictive demotion, with their evidence. With an enabled GradScaler only outputs are
        forecast: its scaled gradients sit near the range by design (it raises the scale
        until they overflow, then backs off), so their trend is the scaler's, not the
        layer's; and the reactive check leaves their overflows to it too."""
        scaled = scaler is not None and scaler.is_enabled()
        self.recorder.forecast_grads = not scaled
        if not self.config.predict:
            return {}
        stats = {k: v for k, v in checks.forecast.items() if k == "out" or not scaled}
        self.forecaster.observe(self.ledger.step, stats, self.watched)
        due = self.forecaster.due()
        for fqn, trend in self.forecaster.hitting.items():
            if fqn not in due:
                logger.info("autoprec guard: step %d: %s (%s) forecast: %s (%d of %d steps "
                            "before demotion)", self.ledger.step, fqn, self.watched.get(fqn),
                            trend.describe(self.watched.get(fqn)),
                            self.forecaster.streaks[fqn], self.config.patience)
        return due

    def _judge(self, scaler) -> tuple[bool, Failure | None, bool, Checks]:
        """This rank's verdict on the step: whether it trained (anything recorded since the
        last call), the layer it blames, whether the model's parameters are poisoned (then it
        blames none), and the checks read; updates the suspects and warnings."""
        diag = self.diagnostician
        diagnosis = diag.take_pending()
        checks = self.recorder.collect()
        if not checks.trained():
            if diagnosis is not None:
                diagnosis.close()
            return False, None, False, checks
        enabled = scaler is not None and scaler.is_enabled()
        found = blame(checks, self.watched, subtree_faults=diag.subtree_faults(),
                        scale=scaler.get_scale if enabled else None,
                        min_loss_scale=self.config.min_loss_scale)
        if found.deferred is not None:
            f = found.deferred
            logger.debug("autoprec guard: step %d: non-finite %s at %s left to the GradScaler "
                         "(scale %g)", self.ledger.step, f.where, f.fqn, f.scale)
        formats = self.watched
        poisoned = self.poisoning.check(
            self.ledger.step, failing(checks, formats), self.model,
            lambda: first_nonfinite(checks, found.failure, formats, self.recorder.finish,
                                    self.coverage.unwatched(), self._format_of))
        if poisoned:
            # every layer now computes from non-finite weights: no blame, no suspects, no
            # diagnosis (its culprit would be the first layer with weights, not the cause)
            found = Blame()
            if diagnosis is not None:
                diagnosis.close()
            diagnosis = None
        suspects = found.cleared | ({found.failure.fqn} if found.failure else set())
        self.recorder.set_suspects(suspects, self.model)
        diag.watch_subtrees(self.model, suspects, frozenset(self.recorder.watches))
        if not poisoned:
            diag.explain(diagnosis, found.origin,
                         failed=found.failure is None and bool(found.cleared),
                         model=self.model, step=self.ledger.step, format_of=self._format_of)
        return True, found.failure, poisoned, checks

    # ---------------------------------------------------------------- demotion
    def _demote(self, fqn: str, source: str, seen: list[dict[str, Any]]) -> GuardEvent | None:
        """Demote ``fqn`` for ``source`` ("blame", "forecast" or "request"); ``seen``: per
        rank, its evidence by source (Ranks.gather). None: no longer watched (an earlier
        demotion of this step changed it)."""
        led = self.ledger
        watch = self.recorder.watches.get(fqn)
        if watch is None:
            return None
        ranks = [r for r, d in enumerate(seen) if fqn in d[source]]
        where, described = seen[ranks[0]][source][fqn]
        streak = led.streaks.get(fqn, 0) if source == "blame" else None
        event = GuardEvent(step=led.step, fqn=fqn, old=watch.format, new=watch.format.demoted(),
                           where=where,
                           reason=demotion_reason(described, streak, ranks, len(seen)))
        led.events.append(event)
        led.streaks.pop(fqn, None)
        self.recorder.suspects.discard(fqn)
        self.forecaster.forget([fqn])
        self._reapply(self.policy.with_layers(
            amend(self.policy, fqn, event.new, self.coverage.layers or {})))
        logger.warning("autoprec guard: demoted %s", event)
        if self.config.save_to and self.ranks.writes():
            self.save(self.config.save_to)  # one writer: every rank holds the same policy
        return event

    # ---------------------------------------------------------------- asked from outside
    def request_demotion(self, fqn: str, reason: str, *, where: str = "recheck") -> None:
        """Demote ``fqn`` one step (``Format.demoted()``) at the next :meth:`step`, for a
        reason decided outside the guard (autoprec's re-check). Under torch.distributed a
        layer any rank requested is demoted on every rank at that step. It is a GuardEvent
        with ``reason`` and ``where`` (a short label), in the state and the amended policy
        like any demotion. A layer not watched (fp32, or no module that computes) is
        ignored, with an INFO line."""
        wrong = check_where(where)
        if wrong is not None:
            raise ValueError(f"Guard.request_demotion(where=...): {wrong}.")
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"Guard.request_demotion(reason=...) must be text saying why, got "
                             f"{reason!r}.")
        reason = " ".join(reason.split())[:_MAX_REASON]  # one line, bounded
        if fqn not in self.watched:
            logger.info("autoprec guard: demotion of %r requested (%s) is ignored: the guard "
                        "does not watch it (%s)", fqn, reason, self._unwatched(fqn))
            return
        self._requests[fqn] = (where, reason)

    def _unwatched(self, fqn: str) -> str:
        if self.model is None:
            return "not attached to a model"
        if fqn not in dict(self.model.named_modules()):
            return "no module of the model has that name"
        fmt = self._format_of(fqn)
        if not watched(fmt, self.config.formats):
            return f"{fmt} under the policy, not one of the watched formats"
        return "it is not a module that computes"

    def _take_requests(self) -> dict[str, tuple[str, str]]:
        """The requests to apply now: those for layers still watched."""
        requests, self._requests = self._requests, {}
        for fqn in [f for f in requests if f not in self.watched]:
            logger.info("autoprec guard: step %d: the requested demotion of %s is dropped: no "
                        "longer watched (%s)", self.ledger.step, fqn, self._unwatched(fqn))
            del requests[fqn]
        return requests

    def replace_policy(self, policy: Policy) -> None:
        """Switch the model to ``policy`` (a phase switch), keeping every demotion the guard
        made: a demoted layer computes in the safer of ``policy``'s format and the one it was
        demoted to (fp32, then bf16 and fp16, then fp8; on a tie ``policy``'s). The watches
        are made anew from it; the forecast history of layers whose format changed is
        dropped. The checkpointed state keeps the policy first attached (see state_dict)."""
        if self.model is None:
            raise RuntimeError("This guard is not attached; autoprec.apply(model, policy, "
                               "guard=True) attaches one.")
        if not isinstance(policy, Policy):
            raise TypeError(f"Guard.replace_policy(policy=...) takes an autoprec.Policy, got "
                            f"{type(policy).__name__}; load a file with autoprec.load_policy.")
        before = self.watched
        self._phase = policy
        self._reapply(merge(policy, self.demotions(), self.coverage.layers or {}))
        self._formats_changed(before)

    def _formats_changed(self, before: Mapping[str, Format]) -> None:
        """Drop the streaks, suspicions and forecast history of layers whose watched format
        is no longer what it was (``before``)."""
        changed = {f for f, fmt in before.items() if self.watched.get(f) is not fmt}
        self.forecaster.forget(changed)
        self.ledger.streaks = {f: n for f, n in self.ledger.streaks.items() if f not in changed}
        self.recorder.set_suspects(self.recorder.suspects - changed, self.model)

    def demotions(self) -> dict[str, Format]:
        """fqn -> the format the guard last demoted it to."""
        return {e.fqn: e.new for e in self.ledger.events}

    @property
    def trends(self) -> dict[str, list[Trend]]:
        """fqn -> the trends fitted now to its recent amax (outputs, gradients), for the
        layers where there is one (see ``forecast``): the evidence, including kurtosis."""
        return {f: t for f in self.forecaster.history if (t := self.forecaster.trends(f))}

    def _reapply(self, policy: Policy) -> None:
        self._reapplying = True  # the attach inside keeps the base policy and pending state
        try:
            reapply(self.model, self.policy, policy, self.attach)
        finally:
            self._reapplying = False

    # ---------------------------------------------------------------- the amended policy, checkpoints
    def amended_policy(self) -> Policy:
        """The policy in force now: the original with every demotion written into ``layers``,
        and the demotions listed under ``tuned.guard`` (provenance). A policy with phases is
        written whole, each phase keeping the demoted layers in their safer format
        (``demote.merge_phases``), whichever phase the run is in."""
        if self.policy is None:
            raise RuntimeError("This guard was never attached; autoprec.apply(model, policy, "
                               "guard=True) attaches one.")
        base = self.ledger.base
        if base is not None and base.phases:
            return self.ledger.amended_policy(
                merge_phases(base, self.demotions(), self.coverage.layers or {}))
        return self.ledger.amended_policy(self.policy)

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`amended_policy` as a policy file, with the demotions as comments."""
        self.ledger.save(path, self.amended_policy())

    def state_dict(self) -> dict[str, Any]:
        """The guard's state as plain data (str, int, float, list, dict; ``json``- and
        ``torch.load(weights_only=True)``-safe): the policy it was attached with (less its
        provenance), its watched formats, the step, the layer entries its demotions added, the
        demotions, and the per-layer counts and suspects of the steps in progress. Put it in
        a checkpoint; :meth:`load_state_dict` in the resumed run puts the demotions back."""
        if self.ledger.base is None:
            raise RuntimeError("This guard was never attached; autoprec.apply(model, policy, "
                               "guard=True) attaches one.")
        policy = self.policy if self._phase is None else \
            merge(self.ledger.base, self.demotions(), self.coverage.layers or {})
        return self.ledger.state_dict(policy, self.config.formats, self.recorder.suspects,
                                      self.diagnostician.warned,
                                      forecast=self.forecaster.state_dict(), phase=self._phase)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take up the state :meth:`state_dict` returned: the demoted layers are re-applied to
        the model at once (or, before :meth:`attach`, when it attaches). A state this guard
        cannot take up is a :class:`~autoprec.policy.PolicyError` (see ``state.Ledger.plan``),
        and all of it is checked before anything changes."""
        check_version(state)  # its layout and types now; its names once the model is known
        if self.model is None:
            self._pending = dict(state)
            return
        self._restore(state)

    def _restore(self, state: Mapping[str, Any]) -> None:
        restored = self.ledger.plan(state, self.config.formats,
                                    {fqn for fqn, _ in self.model.named_modules()})
        self.ledger.take(restored)
        self.diagnostician.warned = restored.warned
        self.poisoning.clear()
        if restored.attached_to_phase:
            # attached with the policy the run had switched to: merge the demotions into it
            self.ledger.base, self._phase = restored.base, self.policy
            restored.amended = merge(self.policy, self.demotions(), self.coverage.layers or {})
        if restored.amended is not None:
            self._reapply(restored.amended)
        # by the policy's format: attention cores are watched once a training forward finds them
        history = restored.forecast or {}
        self.forecaster.load(history, {f: self._format_of(f) for f in history})
        self.recorder.suspects = restored.suspects
        self.diagnostician.watch_subtrees(self.model, restored.suspects,
                                          frozenset(self.recorder.watches))

    def __repr__(self) -> str:
        return (f"<autoprec Guard watching {len(self.recorder.watches)} layers, "
                f"{len(self.events)} demotion(s)>")
