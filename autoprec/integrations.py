"""Training with a policy: a plain PyTorch loop, Accelerate, and the HF Trainer.

The policy decides each layer's format through its regions; the training framework must not
decide them a second time, and fp16 layers need the loss scaling the policy describes.

Plain PyTorch::

    model, scaler, guard = training_kit(model, policy, guard=True)
    for batch in batches:
        loss = model(**batch).loss
        scaler.scale(loss).backward()      # a pass-through when no layer is fp16
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if guard is not None:
            guard.step()                   # one host sync; demotes layers that keep failing

Accelerate: apply *before* ``accelerator.prepare`` and use ``mixed_precision="no"``::

    accelerator = Accelerator(mixed_precision="no")
    model, scaler, guard = training_kit(model, policy, accelerator=accelerator, guard=True)
    model, opt = accelerator.prepare(model, opt)
    ...
    accelerator.backward(scaler.scale(loss))
    scaler.step(opt)
    scaler.update()

``mixed_precision="bf16"`` adds nothing (the policy's root region sits inside Accelerate's
autocast and wins; an fp32 region turns autocast off) but casts every output to FP32.
``"fp16"`` on a GPU makes Accelerate scale the loss with its own GradScaler (its settings come
from ``GradScalerKwargs``, not the policy); ``training_kit`` then hands back a disabled scaler
so the loss is not scaled twice. On a CPU, Accelerate's ``"fp16"`` does nothing at all (no
autocast, no scaler). ``"fp8"`` swaps modules and is refused.

HF Trainer: pass ``PolicyCallback(policy)`` in ``Trainer(callbacks=[...])`` (it applies the
policy in ``on_init_end``, before the Trainer's Accelerator prepares the model) and leave
``bf16`` and ``fp16`` False; or call ``use_policy(trainer, policy)`` before ``trainer.train()``.

``PolicyCallback(policy, follow_bias=N)`` (a policy with phases, no guard) measures the
gradient bias every N steps on the first batches of the run and brings the final phase forward
when a reading reaches the budget (:class:`autoprec.runtime.bias.BiasWatch`; ``FollowBias``
sets the threshold and the number of held batches); the checkpoint then carries where it
moved it (``autoprec_phases.json``), and a resumed run keeps it. Lightning's callback takes
the same argument.

Checkpoints carry the guard's state (its demotions), so a resumed run starts with them: the
Trainer callback writes ``autoprec_guard.json`` into each ``checkpoint-N`` folder and reads it
back on ``train(resume_from_checkpoint=...)``; with Accelerate, ``training_kit`` registers the
guard (and the policy's GradScaler) with ``accelerator.register_for_checkpointing`` (a
checkpoint saved before it did loads with them fresh, and a warning); a plain loop puts
``guard.state_dict()`` in its checkpoint and calls ``guard.load_state_dict`` on resume.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from typing import Any, NamedTuple

import torch
from torch import nn

from autoprec._util import atomic_write, call_model, device_of, loss_of, read_json
from autoprec.policy import Policy, PolicyError, load_policy
from autoprec.runtime import apply
from autoprec.runtime.guard import Guard, GuardConfig, get_guard
from autoprec.runtime.rewrite import applied_policy
from autoprec.runtime.rewrite import unwrap as rewrite_unwrap
from autoprec.runtime.switcher import PhaseSwitcher, get_phases

# PolicyCallback is built on first access (module __getattr__ below)
__all__ = ["TrainingKit", "training_kit", "PolicyCallback", "use_policy",  # noqa: F822
           "GUARD_STATE_FILE", "save_guard_state", "load_guard_state", "start_phases",
           "make_rechecker", "init_follow_bias", "follow_bias"]

logger = logging.getLogger(__name__)

# What the Trainer callback writes beside trainer_state.json in each checkpoint folder.
GUARD_STATE_FILE = "autoprec_guard.json"
# ... and, once a bias watch moved the final phase forward, where it moved it to.
PHASES_STATE_FILE = "autoprec_phases.json"
# where training_kit keeps the Rechecker it made, on the model
_RECHECKER_ATTR = "_autoprec_rechecker"


class TrainingKit(NamedTuple):
    """What a training loop needs to train with a policy."""

    # The model, with the policy applied (the same object that was passed in).
    model: nn.Module
    # The GradScaler to use: the policy's when any layer is fp16, else a disabled pass-through.
    scaler: torch.amp.GradScaler
    # The runtime guard, or None when none was asked for.
    guard: Guard | None

    @property
    def rechecker(self):
        """The :class:`~autoprec.recheck.Rechecker` ``recheck_every=N`` made, or None."""
        return rewrite_unwrap(self.model).__dict__.get(_RECHECKER_ATTR)

    @property
    def phases(self) -> PhaseSwitcher | None:
        """The phase switcher of a policy with phases (call ``kit.phases.at(step)`` before each
        step), or None."""
        return get_phases(self.model)


def _check_accelerator(accelerator: Any, model: nn.Module) -> None:
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    if mp == "fp8":
        raise PolicyError(
            "Accelerator(mixed_precision='fp8') swaps every Linear for Transformer Engine or "
            "torchao modules, overriding the policy's per-layer formats. Use "
            "mixed_precision='no': the policy's fp8 layers already compute in FP8.")
    if "_original_forward" in model.__dict__:
        raise PolicyError(
            "The model was already prepared by an Accelerator with mixed precision: its autocast "
            "would sit inside the policy's root region and decide the formats of every layer the "
            "policy does not name. Apply the policy before accelerator.prepare(model).")
    if mp in ("bf16", "fp16"):
        logger.info("Accelerator(mixed_precision=%r) with a policy: the policy's regions decide "
                    "each layer's format; mixed_precision='no' keeps that explicit.", mp)


def training_kit(model: nn.Module, policy: Policy | str | os.PathLike, *,
                 device: torch.device | str | None = None, strict: bool = True,
                 guard: bool | GuardConfig | Guard | None = None,
                 accelerator: Any = None, total_steps: int | None = None,
                 recheck_every: int | None = None) -> TrainingKit:
    """Apply ``policy`` to ``model`` and return it with the GradScaler its ``loss_scaling``
    describes (enabled only when a layer is fp16) and the runtime guard.

    Args:
        model: the model to train.
        policy: a :class:`~autoprec.policy.Policy` or a path to a policy YAML file.
        device: where training runs (default: the model's parameters' device).
        strict: as in :func:`~autoprec.runtime.apply`: a policy made for another model, or a
            pattern that matches no module, is an error.
        guard: ``True`` or a :class:`~autoprec.runtime.guard.GuardConfig` attaches the
            runtime guard (see :mod:`autoprec.runtime.guard`); a ``Guard`` re-attaches it.
        accelerator: an ``accelerate.Accelerator`` the model will be prepared with *after*
            this call. Its ``mixed_precision`` is checked ("no" recommended, "fp8" refused),
            and when it scales the loss itself (``"fp16"`` on a GPU) the returned scaler is a
            disabled pass-through so the loss is not scaled twice; the guard then reads
            Accelerate's scale.
        total_steps: the run's optimizer steps, for a policy with phases by fraction of the
            run; a policy with phases gets a :class:`~autoprec.runtime.switcher.PhaseSwitcher`
            (``kit.phases``: call ``kit.phases.at(step)`` before each step, with the optimizer
            steps done).
        recheck_every: ``N`` (needs ``guard``): ``kit.rechecker`` is a
            :class:`~autoprec.recheck.Rechecker`; call ``kit.rechecker.maybe(model, batch,
            step)`` after each optimizer step, before ``guard.step()``, which applies its
            demotions.

    Returns:
        A ``TrainingKit``, ``(model, scaler, guard)``: the model with the policy applied (the
        same object), the GradScaler to use, and the guard or None; ``kit.phases`` and
        ``kit.rechecker`` as above.

    Raises:
        PolicyError: a policy that cannot be applied, an accelerator in fp8 or already
            prepared with mixed precision, or ``recheck_every`` without a guard.
    """
    if not isinstance(policy, Policy):
        policy = load_policy(policy)
    if accelerator is not None:
        _check_accelerator(accelerator, model)
        device = accelerator.device
    apply(model, policy, strict=strict, guard=guard)
    if policy.phases:
        PhaseSwitcher(model, policy, total_steps=total_steps)
    rechecker = make_rechecker(policy, recheck_every, guard)
    if rechecker is not None:
        rewrite_unwrap(model).__dict__[_RECHECKER_ATTR] = rechecker
    device = torch.device(device) if device is not None else device_of(model)
    outer = getattr(accelerator, "scaler", None) if accelerator is not None else None
    if outer is not None:
        scaler = torch.amp.GradScaler(device.type, enabled=False)
    else:
        scaler = policy.grad_scaler(device)
    g = get_guard(model)
    if g is not None:
        g.scaler = outer if outer is not None else scaler
    if accelerator is not None:
        # accelerator.save_state()/load_state() then carry the guard's demotions and the
        # policy's loss scale (Accelerate saves only its own scaler)
        _register_for_checkpointing(accelerator, [*([g] if g is not None else []),
                                                  *([scaler] if scaler.is_enabled() else [])])
    return TrainingKit(model, scaler, g)


def _register_for_checkpointing(accelerator: Any, objects: list) -> None:
    """Register ``objects`` (the guard, the policy's GradScaler) with the accelerator, and let
    its ``load_state`` take up a checkpoint saved before they were registered."""
    register = getattr(accelerator, "register_for_checkpointing", None)
    if register is None or not objects:
        return
    register(*objects)
    if isinstance(getattr(accelerator, "_custom_objects", None), list) and \
            hasattr(accelerator, "register_load_state_pre_hook"):
        compat = _OlderCheckpoints(accelerator, objects)
        accelerator.register_load_state_pre_hook(compat.before_load)
        accelerator.register_save_state_pre_hook(compat.before_save)


class _OlderCheckpoints:
    """Loads into an Accelerator that registers autoprec's objects a checkpoint that holds none.

    Accelerate loads ``custom_checkpoint_<i>.pkl`` into the i-th registered object and refuses
    a folder whose count differs, in a multi-line RuntimeError raised after it has already
    loaded the model and optimizer. A checkpoint ``save_state`` wrote before ``training_kit``
    registered the guard and GradScaler lacks exactly those: the resumed run then starts them
    fresh, as it did when checkpoints never carried them, with a warning, and they are
    registered again for the next ``save_state``. Any other count is refused in one line
    before anything is loaded. Works on the accelerator's list of registered objects (no
    public way to leave some out of one load).
    """

    def __init__(self, accelerator: Any, objects: list):
        self.accelerator = accelerator
        self.objects = objects
        self.left_out: list[tuple[int, Any]] = []  # (index, object) taken out for one load

    def _restore(self) -> None:
        registered = self.accelerator._custom_objects
        for index, obj in self.left_out:
            registered.insert(index, obj)
        self.left_out = []

    def before_save(self, models, weights, output_dir) -> None:
        self._restore()

    def before_load(self, models, input_dir) -> None:
        self._restore()
        registered = self.accelerator._custom_objects
        found = sum(re.fullmatch(r"custom_checkpoint_\d+\.pkl", f) is not None
                    for f in os.listdir(input_dir))
        ours = [i for i, obj in enumerate(registered) if any(obj is o for o in self.objects)]
        names = " and ".join(_checkpoint_name(registered[i]) for i in ours)
        if found == len(registered) or not ours:
            return
        if found != len(registered) - len(ours):
            raise PolicyError(
                f"{input_dir} holds {found} custom states (custom_checkpoint_*.pkl) but this "
                f"Accelerator registers {len(registered)}, autoprec's {names} among them "
                "(training_kit registers them): resume with the guard= and policy the "
                "checkpoint was saved with (fp16 layers register the GradScaler).")
        warnings.warn(
            f"{input_dir} holds no autoprec state (saved before training_kit registered the "
            f"{names} for checkpointing): loading it without them, so the guard starts with "
            "no demotions and the GradScaler at the policy's init_scale; the next save_state "
            "carries them.", stacklevel=3)
        self.left_out = [(i, registered[i]) for i in ours]
        for i in reversed(ours):
            del registered[i]


def _checkpoint_name(obj: Any) -> str:
    return "guard" if isinstance(obj, Guard) else "GradScaler"


def save_guard_state(guard: Guard, checkpoint_dir: str | os.PathLike) -> str:
    """Write ``guard.state_dict()`` as JSON to ``checkpoint_dir/autoprec_guard.json``; returns
    the path."""
    path = os.path.join(os.fspath(checkpoint_dir), GUARD_STATE_FILE)
    atomic_write(path, json.dumps(guard.state_dict(), indent=1) + "\n")
    return path


def load_guard_state(guard: Guard, checkpoint_dir: str | os.PathLike) -> bool:
    """Load ``checkpoint_dir/autoprec_guard.json`` into ``guard`` (its demotions are re-applied
    to the model). False when the folder holds no such file; a PolicyError naming the file
    when it cannot be read or was saved for another policy."""
    path = os.path.join(os.fspath(checkpoint_dir), GUARD_STATE_FILE)
    if not os.path.isfile(path):
        return False
    try:
        state = read_json(path, "guard state")  # bounded size and nesting
        guard.load_state_dict(state)
    except (ValueError, KeyError, TypeError) as e:  # PolicyError is a ValueError
        raise PolicyError(f"{path}: {e}" if isinstance(e, PolicyError) else
                          f"{path} is not a readable guard state ({type(e).__name__}: {e}); "
                          "delete it to resume without the guard's demotions.") from None
    return True


def use_policy(trainer: Any, policy: Policy | str | os.PathLike, *, strict: bool = True,
               guard: bool | GuardConfig | Guard | None = None) -> Any:
    """One line for an existing ``transformers.Trainer``: applies ``policy`` to
    ``trainer.model`` now (call it before ``trainer.train()``, which prepares the model) and
    adds a :class:`PolicyCallback` that steps the guard with the Trainer's loss scale.
    Returns the callback (``callback.guard`` is the guard)."""
    callback = _policy_callback_class()(policy, strict=strict, guard=guard)
    callback._trainer = trainer
    callback._apply(trainer.model)
    trainer.add_callback(callback)
    return callback


def _make_policy_callback():
    from transformers import TrainerCallback

    class PolicyCallback(TrainerCallback):
        """A ``transformers.TrainerCallback`` that trains the Trainer's model under a policy.

        ``Trainer(model, args, callbacks=[PolicyCallback(policy, guard=True)])`` applies the
        policy in ``on_init_end``, before the Trainer's Accelerator prepares the model, and
        steps the guard in ``on_step_end``. Leave ``TrainingArguments(bf16=False,
        fp16=False)``: the policy decides the formats. ``bf16=True`` is harmless when the
        policy was applied first (its regions win over Accelerate's autocast) but only adds
        casts. For fp16 layers, loss scaling comes from ``fp16=True`` on a GPU (Accelerate's
        GradScaler, torch's defaults); on a CPU the Trainer has none, and the callback warns.

        ``recheck_every=N`` (with a guard) re-checks the policy's layers on the step's batch
        every N steps (:class:`autoprec.recheck.Rechecker`, on a private copy of the weights);
        the guard demotes what breaks the budget at that step, on every rank. A policy with
        phases switches at ``state.global_step`` (``on_step_begin``), the run's length being
        ``max_steps`` (or what the Trainer computes from ``num_train_epochs``); a resumed run
        starts in the phase of its resumed step. ``follow_bias=N``: see the module docstring.

        Added later (``trainer.add_callback``) it applies the policy in ``on_train_begin``,
        after the model was prepared; refused when the Trainer runs in bf16/fp16 (Accelerate's
        autocast would sit inside the policy's regions): use :func:`use_policy` instead.

        Args:
            policy: a :class:`~autoprec.policy.Policy` or a path to a policy YAML file.
            strict: as in :func:`~autoprec.runtime.apply`.
            guard: ``True`` or a :class:`~autoprec.runtime.guard.GuardConfig` attaches the
                runtime guard, stepped in ``on_step_end``.
            recheck_every: ``N`` (with a guard): re-check every N steps, as above.
            follow_bias: ``N`` (a policy with phases, no guard): see the module docstring.

        Raises:
            PolicyError: ``recheck_every`` without a guard, or a policy file that cannot be
                read.
        """

        def __init__(self, policy: Policy | str | os.PathLike, *, strict: bool = True,
                     guard: bool | GuardConfig | Guard | None = None,
                     recheck_every: int | None = None, follow_bias: Any = None):
            _init_callback(self, policy, strict, guard, recheck_every)
            init_follow_bias(self, follow_bias)

        def _apply(self, model: nn.Module) -> None:
            _apply_in_callback(self, model)

        def _scaler(self, args=None):
            return _callback_scaler(self._trainer, args)

        def on_init_end(self, args, state, control, model=None, **kwargs):
            self._apply(model)

        def load_guard_state(self, checkpoint_dir: str | os.PathLike) -> None:
            """Take up the guard state of a checkpoint outside ``output_dir``, before train()."""
            _load_into_callback(self, checkpoint_dir)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            _begin_training(self, args, state, model)

        def on_step_begin(self, args, state, control, **kwargs):
            if self.phases is not None:
                self.phases.at(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            _end_step(self, args, state)

        def on_save(self, args, state, control, **kwargs):
            _save_state(self, args, state)

    return PolicyCallback


def _end_step(callback: Any, args: Any, state: Any) -> None:
    """PolicyCallback.on_step_end: the re-check, the guard's step, the bias watch."""
    if callback.rechecker is not None and callback._batch is not None:
        callback.rechecker.maybe(callback.guard.model, callback._batch, state.global_step)
    if callback.guard is not None:
        callback.guard.step(step=state.global_step, scaler=callback._scaler(args))
    follow_bias(callback, callback._model, callback._batch, state.global_step)


def _save_state(callback: Any, args: Any, state: Any) -> None:
    """PolicyCallback.on_save: the guard's state and a moved phase, into the checkpoint."""
    _save_guard(callback, args, state)
    _save_phases(callback, args, state)


def _init_callback(callback: Any, policy, strict: bool, guard, recheck_every) -> None:
    """PolicyCallback's fields."""
    callback.policy = policy if isinstance(policy, Policy) else load_policy(policy)
    callback.strict = strict
    callback.guard_arg = guard
    # re-check the policy's layers every N steps on the step's batch (autoprec.recheck)
    callback.rechecker = make_rechecker(callback.policy, recheck_every, guard)
    callback._batch = None
    callback.guard = None
    # the policy's phases, switched at the Trainer's global_step (None: no phases)
    callback.phases = None
    callback._trainer = callback._model = None
    callback._warned = callback._restored = False  # restored: the guard's state was loaded


def _begin_training(callback: Any, args: Any, state: Any, model: nn.Module | None) -> None:
    """PolicyCallback.on_train_begin: apply, resume the guard, start the phases and re-checks."""
    callback._apply(model)
    _resume_guard(callback, args, state)
    callback.phases = start_phases(callback, model, state.max_steps, state.global_step)
    _resume_phases(callback, args, state)
    callback._model = model
    if (callback.rechecker is not None or callback.follow_bias is not None) and model is not None:
        _capture_batches(callback, model)
    if callback.policy.needs_loss_scaling and callback._scaler(args) is None \
            and not callback._warned:
        callback._warned = True
        _warn_unscaled_fp16()


def init_follow_bias(owner: Any, value: Any) -> None:
    """An integration's ``follow_bias`` fields, checked: a policy with phases, no guard."""
    from autoprec.runtime.bias import FollowBias

    try:
        owner.follow_bias = FollowBias.coerce(value)
    except ValueError as e:
        raise PolicyError(f"{e}.") from None
    owner.bias_watch, owner._held = None, []
    if owner.follow_bias is None:
        return
    if not owner.policy.phases:
        raise PolicyError("follow_bias brings the policy's final phase forward: give a policy "
                          "with phases (autoprec tune --final-phase 0.9:bf16 writes one).")
    if owner.guard_arg:
        raise PolicyError("follow_bias does not run with a runtime guard: pass guard=None.")


def follow_bias(owner: Any, model: nn.Module | None, batch: Any, step: int) -> None:
    """After optimizer step ``step``, for an integration with ``follow_bias``: keep the run's
    first batches as the held set, then a reading every N steps (which may move the final
    phase forward)."""
    cfg = owner.follow_bias
    if cfg is None or batch is None or model is None:
        return
    if owner.bias_watch is None:
        owner._held.append(_detached(batch))
        if len(owner._held) < cfg.batches:
            return
        from autoprec.runtime.bias import BiasWatch  # measurement code: when asked for

        owner.bias_watch = BiasWatch(model, owner._held, _model_loss, every=cfg.every,
                                     threshold=cfg.threshold)
    owner.bias_watch.after_step(step)


def _detached(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.detach().clone()
    if isinstance(batch, dict):
        return {k: _detached(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_detached(v) for v in batch)
    return batch


def _model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of an HF model called as the Trainer calls it (labels in the batch), the
    call dispatched as everywhere else (``_util.call_model``)."""
    loss = loss_of(call_model(model, batch))
    if loss is None:
        raise ValueError("follow_bias: the model's output on a held batch has no loss; the "
                         "held batches are the run's own, so give them labels as the Trainer "
                         "does.")
    return loss


def _save_phases(callback: Any, args: Any, state: Any) -> None:
    """Where a bias watch moved the final phase, beside trainer_state.json."""
    phases, folder = callback.phases, _checkpoint_dir(args, state)
    if phases is None or phases.brought_forward is None or not args.should_save \
            or not os.path.isdir(folder):
        return
    atomic_write(os.path.join(folder, PHASES_STATE_FILE),
                 json.dumps(phases.state_dict(), indent=1) + "\n")


def _resume_phases(callback: Any, args: Any, state: Any) -> None:
    """Resumed at step N: a final phase a bias watch had moved is moved again, and the model
    put in the phase in force at N."""
    if callback.phases is None or not state.global_step:
        return
    path = os.path.join(_checkpoint_dir(args, state), PHASES_STATE_FILE)
    if not os.path.isfile(path):
        return
    try:
        callback.phases.load_state_dict(read_json(path, "phase state"))
    except (ValueError, KeyError, TypeError) as e:  # PolicyError is a ValueError
        raise PolicyError(f"{path} is not a readable phase state ({type(e).__name__}: {e}); "
                          "delete it to resume with the phases the policy plans.") from None
    callback.phases.at(state.global_step)


def make_rechecker(policy: Policy, every: int | None, guard: Any):
    """The :class:`~autoprec.recheck.Rechecker` an integration's ``recheck_every`` asks for."""
    if every is None:
        return None
    if not guard:
        raise PolicyError(f"recheck_every={every!r} hands its demotions to the runtime guard: "
                          "pass guard=True as well.")
    from autoprec.recheck import Rechecker  # measurement code: only when asked for

    return Rechecker(policy, every=every)


def _capture_batches(owner: Any, model: nn.Module) -> None:
    """Keep a reference to the last training batch the model was called with (the Trainer
    does not hand its callbacks the batch), for the re-check at the step's end."""
    def keep(module, args, kwargs):
        if torch.is_grad_enabled() and module.training:
            owner._batch = dict(kwargs) if kwargs else (args[0] if len(args) == 1 else args)

    inner = rewrite_unwrap(model)
    if getattr(owner, "_capture", None) is None:
        owner._capture = inner.register_forward_pre_hook(keep, with_kwargs=True)


def start_phases(owner: Any, model: nn.Module | None, total: int | None,
                  step: int) -> PhaseSwitcher | None:
    """The phase switcher of an integration's policy, made when training starts (the run's
    length is known then) and put in the phase of ``step`` (a resumed run's)."""
    if model is None or not owner.policy.phases:
        return None
    phases = get_phases(model)
    if phases is None or phases.total_steps != total:
        phases = PhaseSwitcher(model, owner.policy, total_steps=total)
    phases.at(step)
    return phases


def _checkpoint_dir(args: Any, state: Any) -> str:
    """The folder the Trainer saves step ``state.global_step`` in (no hyperparameter search)."""
    return os.path.join(args.output_dir, f"checkpoint-{state.global_step}")


def _save_guard(callback: Any, args: Any, state: Any) -> None:
    # beside trainer_state.json; every rank holds the same guard state, one writes it
    folder = _checkpoint_dir(args, state)
    if callback.guard is not None and args.should_save and os.path.isdir(folder):
        save_guard_state(callback.guard, folder)


def _load_into_callback(callback: Any, checkpoint_dir: str | os.PathLike) -> None:
    if callback.guard is None:
        raise PolicyError("PolicyCallback(..., guard=None) has no guard state to load; pass "
                          "guard=True.")
    if not load_guard_state(callback.guard, checkpoint_dir):
        raise PolicyError(f"{os.path.join(checkpoint_dir, GUARD_STATE_FILE)} does not exist; "
                          "name the checkpoint folder a guarded run wrote.")
    callback._restored = True


def _resume_guard(callback: Any, args: Any, state: Any) -> None:
    """Resumed at step N (``train(resume_from_checkpoint=...)``): the callback cannot see the
    folder, so it takes the guard state of ``output_dir/checkpoint-N``."""
    if callback.guard is None or callback._restored or not state.global_step:
        return
    callback._restored = True
    folder = _checkpoint_dir(args, state)
    if not load_guard_state(callback.guard, folder):
        warnings.warn(
            f"Resumed at step {state.global_step} but {folder} holds no {GUARD_STATE_FILE}: the "
            "guard starts without the demotions it had. Call "
            "callback.load_guard_state(CHECKPOINT_DIR) before train() when the checkpoint lies "
            "elsewhere.", stacklevel=3)


def _apply_in_callback(callback, model: nn.Module | None) -> None:
    """PolicyCallback's apply: once, and refused inside an Accelerator's mixed precision."""
    if model is None or applied_policy(model) is not None:
        return  # already applied (e.g. on_init_end, then on_train_begin)
    if "_original_forward" in model.__dict__:
        raise PolicyError(
            "PolicyCallback was added after the Trainer's Accelerator prepared the "
            "model with mixed precision (TrainingArguments bf16 or fp16): its autocast "
            "would sit inside the policy's regions and decide the format of every layer "
            "the policy does not name. Pass the callback in Trainer(callbacks=[...]), "
            "call autoprec.integrations.use_policy(trainer, policy) before train(), or "
            "set bf16=False and fp16=False.")
    apply(model, callback.policy, strict=callback.strict, guard=callback.guard_arg)
    callback.guard = get_guard(model)


def _callback_scaler(trainer, args=None):
    """The GradScaler the Trainer's Accelerator scales the loss with, if the callback can see
    it (it knows the Trainer: use_policy)."""
    accelerator = getattr(trainer, "accelerator", None)
    scaler = getattr(accelerator, "scaler", None)
    if scaler is None and trainer is None and args is not None and args.fp16 \
            and torch.cuda.is_available():
        # Accelerate scales the loss but this callback cannot see its scaler: the
        # guard judges outputs only (use_policy(trainer, ...) lets it see the scale)
        return _UnknownScale()
    return scaler


def _warn_unscaled_fp16() -> None:
    warnings.warn(
        "The policy puts layers in fp16 but this Trainer scales no loss: fp16 "
        "gradients may underflow. On a GPU set TrainingArguments(fp16=True) "
        "(Accelerate's GradScaler); on a CPU Accelerate has no loss scaling, so "
        "prefer bf16 for those layers.", stacklevel=3)


class _UnknownScale:
    """Stands for a GradScaler the callback cannot see (``fp16=True`` on a GPU, callback passed
    to ``Trainer(callbacks=...)``): the guard leaves every gradient failure to it."""

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return float("inf")


def _policy_callback_class():
    cls = globals().get("PolicyCallback")
    if cls is None:
        cls = _make_policy_callback()
        cls.__module__ = __name__
        globals()["PolicyCallback"] = cls
    return cls


def __getattr__(name: str):
    # PolicyCallback subclasses transformers.TrainerCallback; building it on first use keeps
    # `import autoprec.integrations` free of the transformers import (about a second).
    if name == "PolicyCallback":
        return _policy_callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
