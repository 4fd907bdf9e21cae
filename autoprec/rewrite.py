"""The rewriting pass: give each module a policy names a precision region around its forward.

``apply(model, policy)`` replaces the *instance* ``forward`` of the root (with the policy's
default format) and of every module a pattern names (with its format), where that format
differs from the one the module would inherit. Nothing else changes: parameters stay FP32
master weights, names, ``state_dict``, hooks and optimizer state are untouched, and
``remove(model)`` restores the original forwards.

Before::                              After::

    model.forward(x)                      model.forward = _Region(orig, bf16)
      lm_head.forward(h)                    with autocast(bf16): orig(x)
                                              lm_head.forward = _Region(orig, fp32)
                                                with autocast(off): orig(h.float())

What a region does, by format:

- ``fp32``: ``torch.autocast(enabled=False)``, floating inputs upcast to FP32.
- ``bf16`` / ``fp16``: ``torch.autocast(dtype=...)``; autocast's per-op rules decide which ops
  run low (matmul, conv, linear) and which stay FP32 (norms, softmax, losses). Embedding
  lookups and norms therefore compute exactly as under plain ``torch.autocast``.
- ``fp8``: as ``bf16``, and the matmul-like calls inside (``F.linear``, ``addmm``, ``mm``,
  ``matmul``, ``@``, ``bmm``) are routed by a ``TorchFunctionMode`` through
  :func:`autoprec.fp8.fp8_matmul`. This reaches functional matmuls in attention and HF's
  ``Conv1D`` (``torch.addmm``) as well as ``nn.Linear``. Convolutions run in bf16 (no FP8
  conv kernels exist in PyTorch).

Regions nest and the innermost wins: a per-thread stack of formats tells the FP8 router
whether the call it sees is in an fp8 region or in a region nested inside one.
"""

from __future__ import annotations

import inspect
import os
import threading
import warnings
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from autoprec.formats import Format, Support, supported_formats
from autoprec.fp8 import fp8_linear, fp8_matmul
from autoprec.policy import Policy, load_policy

__all__ = ["apply", "remove", "applied_formats", "current_format"]

_APPLIED_ATTR = "_autoprec_applied"
_tls = threading.local()


def _stack() -> list[Format]:
    stack = getattr(_tls, "formats", None)
    if stack is None:
        stack = _tls.formats = []
    return stack


def current_format() -> Format | None:
    """The format of the innermost region the calling code runs in (None outside any)."""
    stack = _stack()
    return stack[-1] if stack else None


# ------------------------------------------------------------------------- FP8 routing
def _route_linear(args, kwargs):
    x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if x.dim() < 2 or not x.is_floating_point():
        return NotImplemented
    return fp8_linear(x, weight, bias)


def _route_addmm(args, kwargs):
    if "out" in kwargs or kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        return NotImplemented
    bias, a, b = args[:3]
    if not (a.is_floating_point() and b.is_floating_point()):
        return NotImplemented
    return fp8_matmul(a, b, bias)


def _route_matmul(args, kwargs):
    if kwargs or len(args) != 2:
        return NotImplemented
    a, b = args
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return NotImplemented
    if a.dim() < 2 or b.dim() < 2 or not (a.is_floating_point() and b.is_floating_point()):
        return NotImplemented
    return fp8_matmul(a, b)


_ROUTES = {
    torch.nn.functional.linear: _route_linear,
    torch.addmm: _route_addmm,
    torch.Tensor.addmm: _route_addmm,
    torch.matmul: _route_matmul,
    torch.Tensor.matmul: _route_matmul,
    torch.Tensor.__matmul__: _route_matmul,
    torch.mm: _route_matmul,
    torch.Tensor.mm: _route_matmul,
    torch.bmm: _route_matmul,
    torch.Tensor.bmm: _route_matmul,
}


class _FP8Router(TorchFunctionMode):
    """Sends matmul-like calls made inside an fp8 region through the FP8 autograd function."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = _ROUTES.get(func)
        if route is not None and current_format() is Format.FP8:
            out = route(args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


# ------------------------------------------------------------------------- regions
def _device_type(args, kwargs, module: nn.Module) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    for p in module.parameters():
        return p.device.type
    return "cpu"


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
        return value.float()
    return value


class _Region:
    """The forward of a module under a policy: ``orig`` run inside a region of ``fmt``.

    A callable object rather than a closure so that ``copy.deepcopy(model)`` rebinds
    ``orig`` to the copied module.
    """

    def __init__(self, module: nn.Module, orig, fmt: Format, fqn: str, cast_out: bool = False):
        self.orig = orig
        # Callers that read `inspect.signature(model.forward)` (HF Trainer drops batch keys the
        # forward does not name) must see the original signature, not (*args, **kwargs).
        try:
            self.__signature__ = inspect.signature(orig)
        except (TypeError, ValueError):
            pass
        self.fmt = fmt
        self.fqn = fqn
        self.module = module
        # Inside an fp32 region autocast is off, so a bf16 output reaching an fp32 op would be
        # a dtype error: a low-precision region nested in fp32 hands back FP32 tensors.
        self.cast_out = cast_out

    def __call__(self, *args, **kwargs):
        fmt = self.fmt
        device_type = _device_type(args, kwargs, self.module)
        stack = _stack()
        stack.append(fmt)
        try:
            if fmt is Format.FP32:
                args, kwargs = tree_map(_upcast, args), tree_map(_upcast, kwargs)
                with torch.autocast(device_type, enabled=False):
                    return self.orig(*args, **kwargs)
            with torch.autocast(device_type, dtype=fmt.autocast_dtype):
                if fmt is Format.FP8:
                    with _FP8Router():
                        out = self.orig(*args, **kwargs)
                else:
                    out = self.orig(*args, **kwargs)
        finally:
            stack.pop()
        return tree_map(_upcast, out) if self.cast_out else out

    def __repr__(self):
        return f"<autoprec region {self.fmt.value} around {self.fqn or 'root'}>"


def _install(module: nn.Module, fmt: Format, fqn: str, record: list, cast_out: bool) -> None:
    had_own = "forward" in module.__dict__
    orig = module.__dict__["forward"] if had_own else module.forward
    region = _Region(module, orig, fmt, fqn, cast_out)
    record.append((module, had_own, orig, region))
    module.forward = region


def apply(model: nn.Module, policy: Policy | str | os.PathLike, *, strict: bool = True,
          guard: Any = None) -> nn.Module:
    """Make ``model`` compute as ``policy`` says; in place, returns ``model``.

    ``policy`` is a :class:`Policy` or a path to a policy YAML file. With ``strict`` (the
    default) a fingerprint of another model or a pattern that matches no module is a
    :class:`~autoprec.policy.PolicyError`; with ``strict=False`` they are warnings. Applying
    again replaces the previous policy.

    ``guard``: ``True`` or a :class:`~autoprec.guard.GuardConfig` attaches a runtime guard
    that watches the low-precision layers in training and demotes those that keep overflowing
    (see :mod:`autoprec.guard`; ``autoprec.guard.get_guard(model)`` returns it); a
    :class:`~autoprec.guard.Guard` re-attaches that guard, keeping its history. ``None`` (the
    default) or ``False`` attaches none and detaches a guard a previous ``apply`` attached.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply(model, policy) needs an nn.Module, got {type(model).__name__}.")
    new_guard = None
    if guard is not None and guard is not False:
        from autoprec.guard import Guard  # imported here: autoprec.guard imports this module

        new_guard = Guard._coerce(guard)
    if not isinstance(policy, Policy):
        policy = load_policy(policy)
    assigned = policy.check_model(model, strict=strict)
    _remove_regions(model)

    if policy.default is Format.FP8 or Format.FP8 in assigned.values():
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type != "meta" and supported_formats(device)[Format.FP8] is not Support.NATIVE:
            warnings.warn(
                f"Policy{' ' + policy.source if policy.source else ''} puts layers in fp8, "
                f"which {device} can only emulate: numerics are exact FP8, but those layers run "
                "slower than fp32, not faster. Use a CUDA GPU of compute capability >= 8.9 for "
                "real FP8 speed.", stacklevel=2)

    record: list = []
    modules = dict(model.named_modules())
    # Parents before children, so each region knows the format it would inherit.
    for fqn, module in modules.items():
        own = assigned.get(fqn, policy.default if fqn == "" else None)
        if own is None:
            continue
        inherited = None if fqn == "" else policy.format_for(fqn.rpartition(".")[0])
        if own is inherited:
            continue  # same format as the enclosing region: a region would only cost time
        _install(module, own, fqn, record,
                 cast_out=inherited is Format.FP32 and own is not Format.FP32)
    setattr(model, _APPLIED_ATTR, record)
    model._autoprec_policy = policy
    old_guard = model.__dict__.get("_autoprec_guard")
    if old_guard is not None and old_guard is not new_guard:
        old_guard.detach()
    if new_guard is not None:
        new_guard.attach(model, policy)
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: every module gets its original forward back and a runtime guard
    stops watching. No-op if none."""
    guard = model.__dict__.get("_autoprec_guard")
    if guard is not None:
        guard.detach()
    return _remove_regions(model)


def _remove_regions(model: nn.Module) -> nn.Module:
    record = model.__dict__.get(_APPLIED_ATTR)
    if not record:
        return model
    for module, had_own, orig, _ in reversed(record):
        if had_own:
            module.forward = orig
        else:
            module.__dict__.pop("forward", None)
    model.__dict__.pop(_APPLIED_ATTR, None)
    model.__dict__.pop("_autoprec_policy", None)
    return model


def applied_formats(model: nn.Module) -> dict[str, Format]:
    """fqn -> format of each region :func:`apply` installed on ``model`` ('' is the root)."""
    record = model.__dict__.get(_APPLIED_ATTR) or []
    return {region.fqn: region.fmt for _, _, _, region in record}
