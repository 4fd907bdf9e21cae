"""Switching a model between a policy's phases at the step boundaries (see :mod:`autoprec.phases`).

    autoprec.apply(model, policy)                       # the first phase
    phases = PhaseSwitcher(model, policy, total_steps=10_000)
    for step in range(start, 10_000):
        phases.at(step)                                 # before the step's forward
        ...forward, backward, optimizer step...

The integrations (``training_kit``, the HF Trainer's ``PolicyCallback``, Lightning's
``AutoprecCallback``) make the switcher and call ``at`` themselves, with the step count they
keep; :func:`get_phases` returns the one on a model.

A switch re-applies the next phase's policy exactly as ``autoprec.apply`` would at that step
(the module tree, parameters, optimizer state untouched), so training through a boundary
computes bit for bit what stopping and applying the next phase's policy computes. With a
runtime guard, the guard makes the switch (``Guard.replace_policy``) and keeps its demotions:
a demoted layer computes in the safer of its demoted format and the phase's. Under
``torch.compile`` a switch is one recompile (the regions change, as with a demotion). Under
FSDP2, every switch works on autoprec's FP8 engine, and with the engine ``auto`` (a Linear that
starts FP8 after ``fully_shard`` runs on autoprec's engine, the same numbers). With ``scaled:
{engine: torchao}`` a Linear cannot start FP8 after ``fully_shard`` (torchao swaps the module, and FSDP
already holds the old one): the switcher refuses that phase in one line at start-up, before the
first step. A torchao layer fp8 in an earlier phase and bf16 later is fine: its sharded
Float8Linear runs as ``nn.Linear`` in its new format.

Resuming: the phase is a function of the step, so a resumed run calls ``at(step)`` with the
resumed step count and switches straight to the phase in force (``state_dict`` records the
phase and the run's length, and a resume with another ``total_steps`` is refused in one line,
since the phases' boundaries would move).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from autoprec._util import shown
from autoprec.phases import phase_index
from autoprec.policy import Policy, PolicyError
from autoprec.runtime import engines, rewrite
from autoprec.runtime.guard import get_guard
from autoprec.runtime.guard.demote import reapply

__all__ = ["PhaseSwitcher", "get_phases"]

logger = logging.getLogger(__name__)

_PHASES_ATTR = "_autoprec_phases"
_STATE_VERSION = 1


def get_phases(model: nn.Module) -> PhaseSwitcher | None:
    """The :class:`PhaseSwitcher` made for ``model`` (or the module a wrapper holds), or None."""
    return rewrite.unwrap(model).__dict__.get(_PHASES_ATTR)


class PhaseSwitcher:
    """Puts ``model`` in the phase of ``policy`` that the step count says. ``model`` must have
    ``policy`` applied (its first phase). ``total_steps``: the run's optimizer steps (needed by
    phases given as a fraction of the run)."""

    def __init__(self, model: nn.Module, policy: Policy, *, total_steps: int | None = None):
        self.model = rewrite.unwrap(model)
        self.policy = policy
        self.total_steps = total_steps
        self.starts = policy.phase_starts(total_steps)
        self.current = 0
        # the step a BiasWatch brought the final phase forward to (None: as the policy says)
        self.brought_forward: int | None = None
        self._check(self.model, policy)
        self.model.__dict__[_PHASES_ATTR] = self
        if len(self.starts) > 1:
            logger.info("autoprec: %d phases, starting at steps %s", len(self.starts),
                        ", ".join(map(str, self.starts)))

    # ---------------------------------------------------------------- checks at start-up
    def _check(self, model: nn.Module, policy: Policy) -> None:
        """Every phase's patterns against the model, and the switches FSDP2 + torchao cannot
        make, before the first step."""
        for i in range(1, len(self.starts)):
            phase = policy.phase(i)
            unused = [p for p in phase.resolve(model)[1] if p in policy.phases[i - 1].layers]
            if unused:
                names = ", ".join(n for n, _ in list(model.named_modules())[1:4])
                raise PolicyError(
                    f"Phase {i} ({policy.phases[i - 1].describe()})"
                    f"{f' in {policy.source}' if policy.source else ''} "
                    f"names `{unused[0]}`, which matches no module of {type(model).__name__} "
                    f"(module names look like {names}, ...): fix or delete the pattern.")
            for fqn, module in model.named_modules():
                if not fqn or not engines.is_sharded(module) or engines.is_float8_linear(module):
                    continue
                fmt = phase.format_for(fqn)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # auto's fallback: said at the switch
                        engines.engine_for(module, fmt, policy.engine)
                except RuntimeError as e:
                    raise PolicyError(
                        f"Phase {i} ({policy.phases[i - 1].describe()}) puts `{fqn}` in {fmt}, "
                        f"which cannot start after sharding: {e}") from None

    # ---------------------------------------------------------------- the switch
    def index_at(self, step: int) -> int:
        """The phase in force when ``step`` optimizer steps are done."""
        return phase_index(self.starts, int(step))

    def at(self, step: int) -> int | None:
        """Call before the step that follows ``step`` completed optimizer steps: switches the
        model to the phase in force then, if it is another; returns the new phase's index, or
        None when nothing changed."""
        index = self.index_at(step)
        if index == self.current:
            return None
        self._switch(index, step)
        return index

    def _switch(self, index: int, step: int) -> None:
        new = self.policy.phase(index)
        guard = get_guard(self.model)
        if guard is not None:
            guard.replace_policy(new)
        else:
            before = rewrite.applied_policy(self.model)
            if before is None:
                raise PolicyError("The model has no policy applied (autoprec.remove ran?): "
                                  "a phase switch re-applies one; apply the policy again.")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                reapply(self.model, before, new, lambda m, p: None)
        # a phase's name comes from the policy file: escaped on its way to the log
        what = shown(self.policy.phases[index - 1].describe()) if index else "the first phase"
        logger.warning("autoprec: step %d: phase %d (%s) in force", step, index, what)
        self.current = index

    def bring_final_forward(self, step: int) -> None:
        """Start the final phase at ``step`` optimizer steps (a phase planned later starts no
        later than it) and switch to it now; the checkpointed state keeps the move."""
        if len(self.starts) < 2:
            raise PolicyError("The policy has no later phase to bring forward.")
        if not (isinstance(step, int) and 1 <= step < self.starts[-1]):
            return  # at or past its planned start: the schedule already has it
        self._move_final(step)
        self.at(step)

    def _move_final(self, step: int) -> None:
        self.starts = [min(s, step) for s in self.starts[:-1]] + [step]
        self.brought_forward = step

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint: the phase in force, the run's length, and where a
        BiasWatch moved the final phase."""
        return {"version": _STATE_VERSION, "phase": self.current, "total_steps": self.total_steps,
                "starts": list(self.starts), "brought_forward": self.brought_forward}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check a checkpoint's phase state against this run; the phase itself follows from the
        step (the next :meth:`at`)."""
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise PolicyError(f"Not an autoprec phase state (version {_STATE_VERSION}): "
                              f"{type(state).__name__}; resume without it or from its run.")
        moved = state.get("brought_forward")
        if moved is not None and isinstance(moved, int) and 1 <= moved < self.starts[-1]:
            self._move_final(moved)  # the next `at` switches to it
        starts = state.get("starts")
        if starts != list(self.starts):
            raise PolicyError(
                f"The checkpoint's run switches phases at steps {starts} (total_steps "
                f"{state.get('total_steps')}), this one at {self.starts} (total_steps "
                f"{self.total_steps}): resume with the run's total_steps and policy.")

    def __repr__(self) -> str:
        return (f"<autoprec PhaseSwitcher phase {self.current} of {len(self.starts)}, starts "
                f"{self.starts}>")

