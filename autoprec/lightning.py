"""Lightning: train a LightningModule's model under a policy, with the runtime guard.

    trainer = L.Trainer(callbacks=[AutoprecCallback("policies/gpt2_bytes.yaml", guard=True)],
                        precision="32-true")
    trainer.fit(lit_module, loader)

A callback, not a precision plugin: Lightning lets a Trainer have one precision plugin, chosen
by ``precision=``, and the policy has to sit beside it (``"32-true"``: the policy alone decides
every layer's format). The callback

- applies the policy in ``setup`` (or right after ``configure_model`` when the LightningModule
  builds its model there), before the strategy moves the model to the device, wraps it (DDP)
  and configures the optimizers: torchao's ``Float8Linear`` swaps happen before anything holds
  the modules;
- steps the guard once per optimizer step (``on_train_batch_end`` after ``global_step`` moved,
  so gradient accumulation counts its micro-batches as one step), with the Trainer's
  GradScaler where its precision has one;
- keeps the guard's state in Lightning checkpoints (``state_dict``/``load_state_dict``, the
  way Lightning persists callback state under ``checkpoint["callbacks"]``): a resumed fit
  re-applies the demotions already made;
- writes the amended policy when ``fit`` ends;
- switches a policy's phases at ``global_step`` (the run's length: ``max_steps``, else
  Lightning's ``estimated_stepping_batches``); a resumed fit starts in its step's phase;
- with ``follow_bias=N`` (a policy with phases, no guard; the batches as the LightningModule
  hands them, which the model must take as keyword arguments with labels, as HF models do),
  measures the gradient bias every N optimizer steps and brings the final phase forward when
  it reaches the budget (:class:`autoprec.runtime.bias.BiasWatch`); the checkpoint carries the
  move.

``precision``: ``"32-true"`` (recommended), ``"bf16-mixed"`` (harmless: Lightning's autocast
wraps the policy's root region and the innermost region wins, but it adds casts) or
``"16-mixed"`` (on a GPU Lightning's GradScaler scales the loss, with torch's defaults, not the
policy's ``loss_scaling``). The others are refused: ``"16-true"``/``"bf16-true"``/``"64-true"``
cast the parameters themselves (no FP32 master weights for the policy's regions), and
``"transformer-engine"`` swaps every Linear, overriding the policy.

Which module the policy is applied to: ``module="model"`` names it (an attribute path of the
LightningModule). Without it, the callback picks the submodule of the class the policy was
tuned for (``model: {name: ...}``), else the LightningModule itself or the one child of it whose
module names every pattern of the policy matches.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from torch import nn

from autoprec.integrations import follow_bias, init_follow_bias, make_rechecker, start_phases
from autoprec.policy import Policy, PolicyError, load_policy
from autoprec.runtime import apply
from autoprec.runtime.guard import Guard, GuardConfig, get_guard
from autoprec.runtime.rewrite import applied_policy
from autoprec.runtime.switcher import PhaseSwitcher

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError as e:  # one line, with the fix, instead of a traceback into Lightning
    raise ImportError(
        "autoprec.lightning needs Lightning, which is not installed: pip install "
        "lightning (or pip install -e \".[lightning]\" in an autoprec checkout).") from e

__all__ = ["AutoprecCallback"]

logger = logging.getLogger(__name__)

# Trainer precisions that leave the parameters in FP32 and every module in place.
_ALLOWED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


class AutoprecCallback(pl.Callback):
    """Applies ``policy`` to the LightningModule's model and steps its runtime guard.

    ``guard``: ``True`` or a :class:`~autoprec.runtime.guard.GuardConfig` (see
    :mod:`autoprec.runtime.guard`); ``callback.guard`` is the guard once ``fit`` set it up.
    ``module``: attribute path of the model the policy was made for (``"model"`` for a
    LightningModule holding an HF model as ``self.model``); default: found as the module
    docstring says. ``engine`` overrides the policy's FP8 engine. ``amended_to``: where the
    amended policy is written at the end of ``fit`` (default ``<log_dir>/autoprec.amended.yaml``;
    written only with a guard). ``recheck_every=N`` (with a guard): every N optimizer steps the
    policy's layers are re-checked on that step's batch (:class:`autoprec.recheck.Rechecker`,
    the batch as the LightningModule passes it to the model) and the guard demotes what
    breaks the budget.
    """

    def __init__(self, policy: Policy | str | os.PathLike, *, guard: bool | GuardConfig | None = None,
                 module: str | None = None, strict: bool = True, engine: str | None = None,
                 amended_to: str | os.PathLike | None = None, recheck_every: int | None = None,
                 follow_bias: Any = None):
        self.policy = policy if isinstance(policy, Policy) else load_policy(policy)
        self.guard_arg = guard
        # re-check the policy's layers every N steps on the step's batch (autoprec.recheck)
        self.rechecker = make_rechecker(self.policy, recheck_every, guard)
        init_follow_bias(self, follow_bias)
        self._pending_phases: dict[str, Any] | None = None
        self.module = module
        self.strict = strict
        self.engine = engine
        self.amended_to = os.fspath(amended_to) if amended_to is not None else None
        self.guard: Guard | None = None
        # the model the policy was applied to; global_step when the guard last stepped
        self.target: nn.Module | None = None
        self._last_step: int | None = None
        # the policy's phases, switched at trainer.global_step (None: no phases)
        self.phases: PhaseSwitcher | None = None
        # guard state from a checkpoint, kept until the guard exists
        self._pending_state: dict[str, Any] | None = None
        self._wrapped: pl.LightningModule | None = None

    # ---------------------------------------------------------------- applying
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _check_precision(trainer, self.policy)
        if is_overridden("configure_model", pl_module) and self._wrapped is None:
            # The model may not exist yet: apply right after configure_model, which Lightning
            # calls after this hook and before the strategy configures the optimizers.
            original = pl_module.configure_model

            def configure_model() -> None:
                original()
                self._apply(trainer, pl_module)

            pl_module.configure_model = configure_model
            self._wrapped = pl_module
            return
        self._apply(trainer, pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._wrapped is not None:
            self._wrapped.__dict__.pop("configure_model", None)
            self._wrapped = None

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        target = self._find_target(pl_module)
        if applied_policy(target) is not None and get_guard(target) is self.guard:
            return  # applied by an earlier stage (fit, then validate) of this callback
        apply(target, self.policy, strict=self.strict, guard=self.guard_arg, engine=self.engine)
        self.target, self.guard = target, get_guard(target)
        if self.guard is not None:
            self.guard.scaler = trainer.scaler
            if self._pending_state is not None:
                self.guard.load_state_dict(self._pending_state)
                self._pending_state = None
        if self.policy.needs_loss_scaling and trainer.scaler is None:
            warnings.warn(
                f"The policy puts layers in fp16 but Trainer(precision={trainer.precision!r}) "
                "scales no loss: fp16 gradients may underflow. On a GPU use precision="
                "'16-mixed' (Lightning's GradScaler); on a CPU prefer bf16 for those layers.",
                stacklevel=2)

    def _find_target(self, pl_module: pl.LightningModule) -> nn.Module:
        name = type(pl_module).__name__
        if self.module is not None:
            try:
                return pl_module.get_submodule(self.module)
            except AttributeError:
                children = ", ".join(n for n, _ in pl_module.named_children()) or "none"
                raise PolicyError(
                    f"AutoprecCallback(module={self.module!r}): {name} has no submodule "
                    f"`{self.module}` (its children: {children}); name the attribute that holds "
                    "the model the policy was made for.") from None
        return _guess_target(pl_module, self.policy)

    # ---------------------------------------------------------------- phases
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else \
            int(trainer.estimated_stepping_batches)
        self.phases = start_phases(self, self.target, total, trainer.global_step)
        if self.phases is not None and self._pending_phases is not None:
            self.phases.load_state_dict(self._pending_phases)  # a final phase a watch moved
            self.phases.at(trainer.global_step)
        self._pending_phases = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self.phases is not None:
            self.phases.at(trainer.global_step)

    # ---------------------------------------------------------------- the guard
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last_step:
            return  # a micro-batch of gradient accumulation
        self._last_step = trainer.global_step
        follow_bias(self, self.target, batch, trainer.global_step)
        if self.guard is None:
            return
        if self.rechecker is not None:
            self.rechecker.maybe(self.target, batch, trainer.global_step)
        self.guard.step(step=trainer.global_step, scaler=trainer.scaler)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard is None or not trainer.is_global_zero:
            return
        path = self.amended_to or os.path.join(trainer.log_dir or trainer.default_root_dir,
                                               "autoprec.amended.yaml")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.guard.save(path)
        logger.info("autoprec: wrote the policy in force at the end of fit (%d demotion(s)) to %s",
                    len(self.guard.events), path)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        state = {"guard": self.guard.state_dict()} if self.guard is not None else {}
        if self.phases is not None and self.phases.brought_forward is not None:
            state["phases"] = self.phases.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_phases = state_dict.get("phases")  # taken up when training starts
        state = state_dict.get("guard")
        if state is None:
            return
        if self.guard is None:
            self._pending_state = state  # restored before the policy was applied: load it then
        else:
            self.guard.load_state_dict(state)


def _check_precision(trainer: pl.Trainer, policy: Policy) -> None:
    precision = str(trainer.precision)
    if precision not in _ALLOWED_PRECISIONS:
        raise PolicyError(
            f"Trainer(precision={precision!r}) does not go with an autoprec policy: it casts the "
            "parameters or swaps modules itself, overriding the policy's per-layer formats. Use "
            "precision='32-true' (the policy decides every layer's format).")
    if precision != "32-true":
        logger.info("Trainer(precision=%r) with a policy: the policy's regions decide each "
                    "layer's format; precision='32-true' keeps that explicit.", precision)


def _guess_target(pl_module: pl.LightningModule, policy: Policy) -> nn.Module:
    """The module the policy was made for, when ``module=`` was not given (see the module
    docstring)."""
    if policy.model_name:
        found = [m for m in pl_module.modules() if type(m).__name__ == policy.model_name]
        if len(found) == 1:
            return found[0]
    candidates = [pl_module, *(m for _, m in pl_module.named_children())]
    for candidate in candidates:
        if not policy.resolve(candidate)[1]:
            return candidate
    names = ", ".join(f"`{p}`" for p in list(policy.layers)[:3])
    children = ", ".join(n for n, _ in pl_module.named_children()) or "none"
    where = f" in {policy.source}" if policy.source else ""
    raise PolicyError(
        f"The policy{where} names layers ({names}) that match no module of "
        f"{type(pl_module).__name__} nor of any of its children ({children}): pass "
        "AutoprecCallback(policy, module='<attribute holding the model the policy was made "
        "for>').")
