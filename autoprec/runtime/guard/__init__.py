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
format under the policy is one of ``GuardConfig.formats`` (fp16, fp8 and bf16 by default).
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
all_reduce(MAX) of a flag per watched layer (and one for poisoned parameters), so every rank
demotes the same layers at the same step and holds the same events and amended policy
(``save_to`` is written by rank 0). Every rank must call ``step()``.
``state_dict()``/``load_state_dict()`` carry the demotions through a checkpoint (see
``autoprec.runtime.integrations`` for the Trainer and Accelerate).

Cost: one fused reduction per watched output, output gradient and own weight gradient, kept on
the device: a count of the values above the limit (or NaN) for fp16 layers (a finite FP32 value
can exceed 65504) and for suspects (it gives the share of failing values), a plain ``sum``
elsewhere (non-finite exactly when a value is; about half the cost). ``step()`` reads them all
with one host sync per device. Nothing is watched while autograd is off (evaluation).
Measured on GPT-2 4x256, batch 16x128, 20 layers watched: about 1-2% of a CPU training step
(``benchmarks/bench_guard.py``).

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
first forward), ``blame`` (a pure function from the checks to the layer at fault), ``ranks``
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
from autoprec.runtime.guard.blame import Failure, Verdict, blame, describe, failing, first_nonfinite
from autoprec.runtime.guard.config import GuardConfig, GuardEvent
from autoprec.runtime.guard.demote import amend, demotion_reason, reapply
from autoprec.runtime.guard.diagnose import Diagnostician, Poisoning
from autoprec.runtime.guard.coverage import Coverage
from autoprec.runtime.guard.record import Recorder
from autoprec.runtime.guard.ranks import Ranks
from autoprec.runtime.guard.state import Ledger, check_version

__all__ = ["GuardConfig", "GuardEvent", "Guard", "get_guard"]

logger = logging.getLogger(__name__)

_GUARD_ATTR = "_autoprec_guard"


def get_guard(model: nn.Module) -> Guard | None:
    """The guard ``autoprec.apply(model, policy, guard=...)`` attached to ``model``, or None;
    ``model`` may be the wrapper (torch.compile, DataParallel, DDP) the policy went through."""
    return rewrite.unwrap(model).__dict__.get(_GUARD_ATTR)


class Guard:
    """Watches a policy-applied model in training and demotes layers that keep failing.

    Made by ``autoprec.apply(model, policy, guard=True | GuardConfig(...))``; get it back with
    :func:`get_guard`. Call :meth:`step` once per training step (after the optimizer step); it
    returns the demotions it made. See the module docstring for what is measured.

    Its parts: ``recorder`` (the checks), ``coverage`` (what is watched), ``ranks``,
    ``diagnostician`` and ``poisoning`` (what cannot be demoted away), ``ledger`` (what a
    checkpoint carries); blame and the demotion's amendment are functions of what these hold.
    """

    def __init__(self, config: GuardConfig | None = None):
        self.config = config or GuardConfig()
        # The policy in force on the model (the original one, amended by each demotion).
        self.policy: Policy | None = None
        self.model: nn.Module | None = None
        # GradScaler consulted by step() when none is passed (set by autoprec.runtime.integrations).
        self.scaler: torch.amp.GradScaler | None = None
        self.recorder = Recorder(self.config.check_gradients)
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
            self.ledger.base = policy
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
        in a row. Call once per optimizer step (after ``scaler.update()``). ``scaler``: the
        GradScaler in use (default: ``self.scaler``); ``step``: the step number to log
        (default: count of calls). Returns the demotions made now."""
        led = self.ledger
        led.step = led.step + 1 if step is None else int(step)
        if self.model is None:
            return []
        if rewrite.applied_policy(self.model) is None:
            self.detach()  # autoprec.remove(model) ran: nothing left to guard
            return []
        self.coverage.hook_found()
        trained, failure, poisoned = self._judge(scaler if scaler is not None else self.scaler)
        blamed = [failure.fqn] if failure is not None else []
        if self.ranks.world() > 1:
            # every rank must reach the same counts, hence the same demotions at the same step
            trained, blamed, poisoned = self.ranks.agree(
                trained, failure.fqn if failure is not None else None, poisoned,
                list(self.recorder.watches), self.model)
        if not trained:
            return []  # no training step since the last call (on any rank)
        if poisoned:
            led.streaks = {}
            self.poisoning.warn(led.step, self.watched)
            return []
        self.poisoning.since = self.poisoning.first = None
        led.streaks = {f: led.streaks.get(f, 0) + 1 for f in blamed}
        due = [f for f in blamed if led.streaks[f] >= self.config.patience]
        if failure is not None and failure.fqn not in due:
            logger.info("autoprec guard: step %d: %s (%s) failed: %s (%d of %d steps before "
                        "demotion)", led.step, failure.fqn, self.watched.get(failure.fqn),
                        describe(failure, self.watched.get(failure.fqn)),
                        led.streaks[failure.fqn], self.config.patience)
        if not due:
            return []
        mine = {} if failure is None else \
            {failure.fqn: (failure.where, describe(failure, self.watched.get(failure.fqn)))}
        seen = self.ranks.gather(mine)
        return [self._demote(f, seen) for f in due]

    def _judge(self, scaler) -> tuple[bool, Failure | None, bool]:
        """This rank's verdict on the step: whether it trained (anything recorded since the
        last call), the layer it blames, and whether the model's parameters are poisoned
        (then it blames none); updates the suspects and warnings."""
        diag = self.diagnostician
        diagnosis = diag.take_pending()
        checks = self.recorder.collect()
        if not checks.trained():
            if diagnosis is not None:
                diagnosis.close()
            return False, None, False
        enabled = scaler is not None and scaler.is_enabled()
        verdict = blame(checks, self.watched, subtree_faults=diag.subtree_faults(),
                        scale=scaler.get_scale if enabled else None,
                        min_loss_scale=self.config.min_loss_scale)
        if verdict.deferred is not None:
            f = verdict.deferred
            logger.debug("autoprec guard: step %d: non-finite %s at %s left to the GradScaler "
                         "(scale %g)", self.ledger.step, f.where, f.fqn, f.scale)
        formats = self.watched
        poisoned = self.poisoning.check(
            self.ledger.step, failing(checks, formats), self.model,
            lambda: first_nonfinite(checks, verdict.failure, formats, self.recorder.finish,
                                    self.coverage.unwatched(), self._format_of))
        if poisoned:
            # every layer now computes from non-finite weights: no verdict, no suspects, no
            # diagnosis (its culprit would be the first layer with weights, not the cause)
            verdict = Verdict()
            if diagnosis is not None:
                diagnosis.close()
            diagnosis = None
        suspects = verdict.cleared | ({verdict.failure.fqn} if verdict.failure else set())
        self.recorder.set_suspects(suspects, self.model)
        diag.watch_subtrees(self.model, suspects, frozenset(self.recorder.watches))
        if not poisoned:
            diag.explain(diagnosis, verdict.origin,
                         failed=verdict.failure is None and bool(verdict.cleared),
                         model=self.model, step=self.ledger.step, format_of=self._format_of)
        return True, verdict.failure, poisoned

    # ---------------------------------------------------------------- demotion
    def _demote(self, fqn: str, seen: list[dict[str, tuple[str, str]]]) -> GuardEvent:
        """Demote ``fqn``; ``seen``: per rank, what it measured at the layers it blamed."""
        led = self.ledger
        ranks = [r for r, d in enumerate(seen) if fqn in d]
        where, described = seen[ranks[0]][fqn]
        old = self.recorder.watches[fqn].format
        new = old.demoted()
        event = GuardEvent(step=led.step, fqn=fqn, old=old, new=new, where=where,
                           reason=demotion_reason(described, led.streaks[fqn], ranks, len(seen)))
        led.events.append(event)
        led.streaks.pop(fqn, None)
        self.recorder.suspects.discard(fqn)
        self._reapply(self.policy.with_layers(amend(self.policy, fqn, new, self.coverage.layers or {})))
        logger.warning("autoprec guard: demoted %s", event)
        if self.config.save_to and self.ranks.writes():
            self.save(self.config.save_to)  # one writer: every rank holds the same policy
        return event

    def _reapply(self, policy: Policy) -> None:
        self._reapplying = True  # the attach inside keeps the base policy and pending state
        try:
            reapply(self.model, self.policy, policy, self.attach)
        finally:
            self._reapplying = False

    # ---------------------------------------------------------------- the amended policy, checkpoints
    def amended_policy(self) -> Policy:
        """The policy in force now: the original with every demotion written into ``layers``,
        and the demotions listed under ``tuned.guard`` (provenance)."""
        if self.policy is None:
            raise RuntimeError("This guard was never attached; autoprec.apply(model, policy, "
                               "guard=True) attaches one.")
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
        return self.ledger.state_dict(self.policy, self.config.formats, self.recorder.suspects,
                                      self.diagnostician.warned)

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
        if restored.amended is not None:
            self._reapply(restored.amended)
        self.recorder.suspects = restored.suspects
        self.diagnostician.watch_subtrees(self.model, restored.suspects,
                                          frozenset(self.recorder.watches))

    def __repr__(self) -> str:
        return (f"<autoprec Guard watching {len(self.recorder.watches)} layers, "
                f"{len(self.events)} demotion(s)>")
