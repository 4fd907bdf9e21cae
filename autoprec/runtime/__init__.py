"""What training imports: apply a policy (and optionally a runtime guard) to a model.

Parts, each on its own: :mod:`~autoprec.runtime.calls` (the registry of matmul-like calls),
:mod:`~autoprec.runtime.fp8` (the FP8 autograd function), :mod:`~autoprec.runtime.rewrite`
(precision regions; knows nothing of guards) and :mod:`~autoprec.runtime.guard` (watches and
demotes, through rewrite's public surface only). The training integrations that use them
(plain loops, Accelerate, the HF Trainer: :mod:`autoprec.integrations`; Lightning:
:mod:`autoprec.lightning`) sit above this package, as they also reach the re-check. Imports
torch and yaml only.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from autoprec.policy import Policy
from autoprec.runtime import rewrite
from autoprec.runtime.guard import Guard, GuardConfig, GuardEvent, get_guard
from autoprec.runtime.rewrite import applied_formats, applied_policy

__all__ = ["apply", "remove", "applied_formats", "applied_policy", "get_guard", "Guard",
           "GuardConfig", "GuardEvent"]


def apply(model: nn.Module, policy: Policy | str | os.PathLike, *, strict: bool = True,
          guard: bool | GuardConfig | Guard | None = None,
          engine: str | None = None, standalone: tuple[str, ...] = ()) -> nn.Module:
    """Make ``model`` compute as ``policy`` says; in place, returns ``model``.

    Applying again replaces the previous policy. A model wrapped by ``torch.compile``,
    ``DataParallel`` or ``DistributedDataParallel`` gets the policy (and the guard) on the
    module it wraps, named as the policy names it.

    Args:
        model: the model (or its wrapper).
        policy: a :class:`~autoprec.policy.Policy` or a path to a policy YAML file.
        strict: with ``strict`` (the default) a fingerprint of another model or a pattern that
            matches no module is a :class:`~autoprec.policy.PolicyError`; with
            ``strict=False`` they are warnings.
        guard: ``True`` or a :class:`GuardConfig` attaches a runtime guard that watches the
            low-precision layers in training and demotes those that keep overflowing (see
            :mod:`autoprec.runtime.guard`; :func:`get_guard` returns it); a :class:`Guard`
            re-attaches that guard, keeping its history. ``None`` (the default) or ``False``
            attaches none and detaches a guard a previous ``apply`` attached.
        engine: ``"auto"``, ``"torchao"`` or ``"autoprec"``: overrides the policy's
            ``scaled: {engine: ...}``, who runs its scaled ``nn.Linear`` layers.
        standalone: names modules called outside their parent's forward, which need a region
            of their own (see :func:`autoprec.runtime.rewrite.apply`).

    Returns:
        ``model``, changed in place.

    Raises:
        PolicyError: a policy that cannot be used as written, or (with ``strict``) made for
            another model or with a pattern that matches no module.
    """
    new = Guard.coerce(guard) if guard is not None and guard is not False else None
    rewrite.apply(model, policy, strict=strict, engine=engine, standalone=standalone)
    # a guard watches the module the policy is on: under torch.compile's or (D)DP's wrapper
    inner = rewrite.unwrap(model)
    old = get_guard(inner)
    if old is not None and old is not new:
        old.detach()
    if new is not None:
        new.attach(inner, rewrite.applied_policy(inner))
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: every module gets its original forward back and a runtime guard
    stops watching. No-op if none.

    Args:
        model: the model (or its wrapper) a policy was applied to.

    Returns:
        ``model``, changed in place.
    """
    old: Any = get_guard(rewrite.unwrap(model))
    if old is not None:
        old.detach()
    return rewrite.remove(model)
