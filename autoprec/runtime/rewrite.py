"""The rewriting pass: give each module a policy names a precision region around its forward.

``apply(model, policy)`` replaces the *instance* ``forward`` of the root (with the policy's
default format) and of every module a pattern names (with its format), where that format
differs from the one the module would inherit. Nothing else changes: parameters stay FP32
master weights, names, ``state_dict``, hooks and optimizer state are untouched, and
``remove(model)`` restores the original forwards.

Before::                              After::

    model.forward(x)                      model.forward = Region(orig, bf16)
      lm_head.forward(h)                    with autocast(bf16): orig(x)
                                              lm_head.forward = Region(orig, fp32)
                                                with autocast(off): orig(h.float())

What a region does, by format:

- ``fp32``: ``torch.autocast(enabled=False)``, floating inputs upcast to FP32.
- ``bf16`` / ``fp16``: ``torch.autocast(dtype=...)``; autocast's per-op rules decide which ops
  run low (matmul, conv, linear) and which stay FP32 (norms, softmax, losses). Embedding
  lookups and norms therefore compute exactly as under plain ``torch.autocast``. Inside
  :func:`autoprec.runtime.fp8.emulating` (the measurements, on a CPU without 16-bit matmul
  units) the region's matmul-like calls are routed as in an fp8 region, to an FP32 emulation
  of the same 16-bit GEMM.
- ``fp8``: as ``bf16``, and the matmul-like calls inside that the call registry
  (:mod:`autoprec.runtime.calls`) gives an FP8 route (``F.linear``, ``addmm``, ``mm``,
  ``matmul``, ``@``, ``bmm``) are routed by a ``TorchFunctionMode`` through
  :func:`autoprec.runtime.fp8.scaled_matmul`. This reaches functional matmuls in attention and
  HF's ``Conv1D`` (``torch.addmm``) as well as ``nn.Linear``. Convolutions, SDPA and
  ``baddbmm`` run in bf16 (PyTorch has no FP8 kernels for them).

Regions nest and the innermost wins. A region carries its format in a ``TorchFunctionMode``
(``_FormatMode``) where that is free or needed: in an fp8 region (its mode is the FP8 router),
in any region opened inside one (its mode, replacing the enclosing one for its extent, routes
nothing), and under ``torch.compile``, where dynamo traces modes away and where a push onto a
Python list inside a checkpointed block would break the graph. Elsewhere (eager mode, no fp8
region open) a per-thread stack carries it, so that an all-bf16 model pays no Python call per
op. :func:`current_format` reads the mode first, then the stack. On a device type without
autocast (``meta``) a region only carries its format and does the fp32 upcasts.

A model wrapped by ``torch.compile``, ``DataParallel`` or ``DistributedDataParallel`` gets its
regions on the module it wraps (:func:`unwrap`), whose names are the policy's; a compiled model
recompiles with them on its next call (dynamo guards on a module's ``forward``).

The public surface other parts use (the guard, the integrations, measurements):
:func:`apply`, :func:`remove`, :func:`applied_policy`, :func:`regions`, :func:`unwrap` and
:class:`Region`.
This module knows nothing of guards; :func:`autoprec.apply` attaches one on top.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import threading
import warnings
from typing import Any

import torch
import torch._functorch.config
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from autoprec.formats import Format, Support
from autoprec.host import supported_formats
from autoprec.policy import Policy, PolicyError, load_policy
from autoprec.runtime import calls, engines
from autoprec.runtime.fp8 import emulated_dtypes, plain_matmul, scaled_matmul
from autoprec.scaling import KERNEL_MULTIPLE

__all__ = [
    "apply",
    "remove",
    "applied_formats",
    "applied_policy",
    "regions",
    "Region",
    "unwrap",
]

_REGIONS_ATTR = "_autoprec_regions"
_SWAPS_ATTR = "_autoprec_swaps"
_POLICY_ATTR = "_autoprec_policy"
_REENTRY_ATTR = "_autoprec_reentry"
_WARN_HOOK_ATTR = "_autoprec_warn_hook"
_STANDALONE_ATTR = "_autoprec_standalone"
_tls = threading.local()


def _stack() -> list[Format]:
    stack = getattr(_tls, "formats", None)
    if stack is None:
        stack = _tls.formats = []
    return stack


class _FormatMode(TorchFunctionMode):
    """A region's format on torch's function-mode stack, where dynamo traces it (a push onto a
    Python list inside a checkpointed block is a side effect dynamo refuses: a graph break).
    In an fp8 region of autoprec's engine (``routes``) it sends the matmul-like calls that the
    registry gives an FP8 route through the FP8 autograd function, and in a bf16 or fp16 region
    inside :func:`autoprec.runtime.fp8.emulating` through :func:`~autoprec.runtime.fp8.
    plain_matmul` (FP32 emulation of the 16-bit GEMM); everything else, and every call in any
    other format, runs as it is (autocast decides the dtype).

    At most one is on the stack: a region replaces the enclosing region's mode for its extent
    (:func:`_enter_mode`), so the innermost region decides alone; a mode nested under another
    would see the calls the inner one passes on, its FP8 function's own matmuls included.
    """

    def __init__(self, fmt: Format, routes: bool):
        super().__init__()
        self.format = fmt
        self.routes = routes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.routes:
            call = calls.lookup(func)
            form = calls.matmul_form(call, args, kwargs) if call is not None else None
            if form is not None and _autocast_on(form[0].device.type):
                if self.format.is_scaled:
                    return scaled_matmul(*form, fmt=self.format)
                return plain_matmul(*form, fmt=self.format)
        return func(*args, **kwargs)


def _autocast_on(device_type: str) -> bool:
    """Whether the region's autocast is in force here: code inside that turns it off (HF
    Llama's rotary embedding did for its frequencies, up to transformers 4.4x) asked for FP32,
    not the region's kernels. A device type without autocast (``meta``) counts as on."""
    return not _has_autocast(device_type) or torch.is_autocast_enabled(device_type)


def _innermost_mode() -> tuple[int, _FormatMode] | None:
    """(stack index, mode) of the format mode on torch's function-mode stack (None if none).
    While a mode's own ``__torch_function__`` runs, torch has popped it: not seen there."""
    for i in range(torch._C._len_torch_function_stack() - 1, -1, -1):
        mode = torch._C._get_function_stack_at(i)
        if isinstance(mode, _FormatMode):
            return i, mode
    return None


def _enter_mode(mode: _FormatMode, found: tuple[int, _FormatMode] | None) -> list:
    """Push ``mode`` in place of the enclosing format mode ``found`` (taken off the stack, the
    modes entered above it kept in their order); returns what :func:`_exit_mode` restores."""
    popped = []
    if found is not None:
        for _ in range(torch._C._len_torch_function_stack() - found[0]):
            popped.append(torch._C._pop_torch_function_stack())
        for above in reversed(popped[:-1]):
            torch._C._push_on_torch_function_stack(above)
    torch._C._push_on_torch_function_stack(mode)
    return popped


def _call(fn, *args):
    return fn(*args)


# Runs a region's mode swap with dynamo's side-effect check off for the higher-order op it is
# traced in (a checkpointed block). The swap is a mutation of the function-mode stack, which the
# check refuses (a graph break) when it is the first one dynamo sees in the frame it traces: so
# where the root region, outside the traced frame, did not push its mode inside it, as when the
# root's forward breaks the graph (HF GPT-2's loss with ``labels``; Region.__call__). Safe: a
# swap is undone before the region returns, and a checkpoint's recomputation replays the traced
# ops. Without the function (another torch), the swap runs checked, as it did.
_unchecked = getattr(torch._dynamo.utils, "_disable_side_effect_safety_checks_for_current_subtracer",
                     _call)


def _exit_mode(popped: list) -> None:
    """Undo :func:`_enter_mode`: the region's mode off, the enclosing one back in its place."""
    torch._C._pop_torch_function_stack()
    for _ in popped[:-1]:
        torch._C._pop_torch_function_stack()
    for mode in reversed(popped):
        torch._C._push_on_torch_function_stack(mode)


def current_format() -> Format | None:
    """The format of the innermost region the calling code runs in (None outside any).

    Read from the format mode where a region carries its format in one, else from the
    per-thread stack (regions outside any fp8 region, in eager mode: see Region.__call__).
    """
    found = _innermost_mode()
    if found is not None:
        return found[1].format
    stack = getattr(_tls, "formats", None)
    return stack[-1] if stack else None


# ------------------------------------------------------------------------- regions
def _device_type(args, kwargs, module: nn.Module) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    for p in module.parameters():
        return p.device.type
    return "cpu"


# device type -> whether it has autocast; filled eagerly (import, apply, each eager region)
_HAS_AUTOCAST: dict[str, bool] = {}


@torch._dynamo.assume_constant_result
def _has_autocast(device_type: str) -> bool:
    """Whether ``device_type`` has autocast, without a graph op under torch.compile.

    ``torch.amp.is_autocast_available`` is a graph op to dynamo. A forward that breaks the
    graph (HF GPT-2's loss with ``labels`` and no ``loss_type``) inside a region makes dynamo
    run the region's own frame eagerly (it cannot resume inside its ``try``) and trace each
    helper it calls as a frame of its own: that op was a graph alone, one graph and one break
    more than the model without a policy. So: a constant where the caller is traced (the
    device type is a constant there, from a guarded tensor device), a dict read where this
    frame is traced alone.
    """
    has = _HAS_AUTOCAST.get(device_type)
    if has is None:
        has = _HAS_AUTOCAST[device_type] = torch.amp.is_autocast_available(device_type)
    return has


for _known in ("cpu", "cuda", "meta"):
    _has_autocast(_known)


def _autocast(device_type: str, fmt: Format):
    """The autocast context of a region (autocast off for fp32); none on a device type that
    has no autocast (``meta``), where the model runs as it would without a policy."""
    if not _has_autocast(device_type):
        return contextlib.nullcontext()
    if fmt.autocast_dtype is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=fmt.autocast_dtype)


def _tokens_fit_fp8(args: tuple, kwargs: dict) -> bool:
    """Whether a linear's input has a token count (M, its leading dims) the FP8 kernel takes."""
    x = args[0] if args else next(iter(kwargs.values()), None)
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] == 0:
        return False
    return (x.numel() // x.shape[-1]) % KERNEL_MULTIPLE == 0


def _to_bf16(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(torch.bfloat16)
    return value


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
        return value.float()
    return value


# AOTAutograd's config where it has backward_pass_autocast (see Region.__call__), and dynamo's
# frame callback (None or False while no compiled call can compile); unused on a torch without
_BACKWARD_AUTOCAST: Any = torch._functorch.config
if not hasattr(_BACKWARD_AUTOCAST, "backward_pass_autocast"):
    _BACKWARD_AUTOCAST = None
_frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", lambda: None)


class Region:
    """The forward of a module under a policy: ``orig`` run inside a region of ``fmt``.

    A callable object rather than a closure so that ``copy.deepcopy(model)`` rebinds
    ``orig`` to the copied module.
    """

    def __init__(self, module: nn.Module, orig, fmt: Format, fqn: str, *, cast_out: bool,
                 had_own: bool, engine: str = "autoprec"):
        self.orig = orig
        # Callers that read `inspect.signature(model.forward)` (HF Trainer drops batch keys the
        # forward does not name) must see the original signature, not (*args, **kwargs).
        try:
            self.__signature__ = inspect.signature(orig)
        except (TypeError, ValueError):
            pass
        self.format = fmt
        self.fqn = fqn
        self.module = module
        # Hand back FP32 tensors (see _casts_out: nested in fp32, or in the other 16-bit dtype)
        self.cast_out = cast_out
        # Whether the module had an instance forward of its own before (restored by remove).
        self.had_own = had_own
        # "torchao": the module is torchao's Float8Linear and computes its FP8 itself; inside it
        # nothing is routed (its format says bf16, the autocast dtype around it)
        self.engine = engine

    def __call__(self, *args, **kwargs):
        fmt = self.format
        run = self.orig
        torchao = self.engine == "torchao"
        if torchao and not _tokens_fit_fp8(args, kwargs):
            # a token count the kernel cannot take (M not a multiple of 16): a plain bf16
            # linear, as autoprec's own engine runs such a shape
            torchao, fmt = False, Format.BF16
            run = functools.partial(nn.Linear.forward, self.module)
        if torchao:
            # torchao's Float8Linear computes its own FP8 from a BF16 input (what it gets
            # under CUDA autocast or FSDP2's bf16 parameters) and returns BF16, with autocast
            # off so that its emulated matmuls stay exact; nothing in it is routed again
            args, kwargs = tree_map(_to_bf16, args), tree_map(_to_bf16, kwargs)
        elif fmt is Format.FP32:
            args, kwargs = tree_map(_upcast, args), tree_map(_upcast, kwargs)
        region = _autocast(_device_type(args, kwargs, self.module),
                           Format.FP32 if torchao else fmt)
        compiling = torch.compiler.is_compiling()
        own, routes = (Format.BF16 if torchao else fmt), _routes(fmt, torchao, compiling)
        found = _innermost_mode()
        # The format travels in a mode where the router has to see the calls anyway (an fp8
        # region, a region inside one) and under torch.compile (traced away: free at run
        # time; dynamo refuses the list push inside a checkpointed block, a graph break).
        # Elsewhere a mode would cost a Python call per op in eager mode (a measurable share of
        # a small model's step): the per-thread stack carries it, always outside every format
        # mode.
        in_mode = routes or found is not None or compiling
        if in_mode:
            popped = _unchecked(_enter_mode, _FormatMode(own, routes), found)
        else:
            _stack().append(own)
        # Where ``run`` breaks the graph (HF GPT-2's loss path warns once when no loss_type is
        # set), dynamo cannot resume inside this ``try``: it runs this frame eagerly and traces
        # the forward as frames of their own, as it would without a policy. A frame split at the
        # call instead would cost two graphs more (autocast's enter and exit on either side).
        # So nothing this frame calls may be a graph op when traced alone (_has_autocast).
        # AOTAutograd then traces the backward of the graphs it compiles inside this region
        # under the region's autocast, which eager never does (pytorch#179804): an fp32 layer's
        # gradients in bf16. Its backward_pass_autocast="off" is eager's rule; set for the call
        # where dynamo runs this frame (its frame callback is set), inline: a helper's frame
        # would be traced on its own, is_compiling() true in it.
        backward = contextlib.nullcontext()
        if not compiling and _BACKWARD_AUTOCAST is not None and _frame_callback() \
                and _BACKWARD_AUTOCAST.backward_pass_autocast != "off":
            backward = _BACKWARD_AUTOCAST.patch(backward_pass_autocast="off")
        try:
            with region, backward:
                out = run(*args, **kwargs)
        except RuntimeError as e:
            if fmt is Format.FP32:
                _explain_low_weights(self, e)
            raise
        finally:
            if in_mode:
                _unchecked(_exit_mode, popped)
            else:
                _stack().pop()
        return tree_map(_upcast, out) if self.cast_out else out

    def __repr__(self):
        engine = " (torchao)" if self.engine == "torchao" else ""
        return f"<autoprec region {self.format.value}{engine} around {self.fqn or 'root'}>"


def _routes(fmt: Format, torchao: bool, compiling: bool) -> bool:
    """Whether a region's mode routes its matmul-like calls: an fp8 region of autoprec's
    engine, and a bf16/fp16 one whose GEMMs are emulated in FP32 (fp8.emulating: the
    measurements, in eager mode)."""
    if torchao:
        return False
    return fmt.is_scaled or (not compiling and fmt.autocast_dtype in emulated_dtypes())


def _explain_low_weights(region: Region, error: RuntimeError) -> None:
    """An fp32 layer whose weights arrive in 16 bits (FSDP2's ``MixedPrecisionPolicy(
    param_dtype=torch.bfloat16)`` gathers them so) fails with a dtype mismatch deep in torch:
    say which layer and what to do instead."""
    low = next((p.dtype for p in region.module.parameters()
                if p.dtype in (torch.bfloat16, torch.float16)), None)
    if low is None:
        return
    raise RuntimeError(
        f"`{region.fqn or '(root)'}` is fp32 under the policy, but its weights arrive in {low} "
        "(FSDP2 MixedPrecisionPolicy(param_dtype=...) gathers them so): give the fully_shard "
        "unit that holds it no param_dtype (examples/train_fsdp.py's shard(..., "
        "param_dtype=...) gathers only the bf16/fp8 linears in 16 bits), or put the layer in "
        f"bf16. ({type(error).__name__}: {str(error).splitlines()[0][:200]})") from error


class _Reentry(Region):
    """The forward of a module inside an fp8 region that has no region of its own.

    Activation checkpointing recomputes a module's forward during backward, outside the region
    that enclosed it in the forward pass: ``torch.utils.checkpoint`` restores the autocast
    state but not the region's format mode (the FP8 router) nor the per-thread stack, so the
    recomputed matmuls would run in bf16 (a CheckpointError without reentrant, silently
    different gradients with it). HF's ``gradient_checkpointing_enable`` checkpoints a layer's
    class forward, inside the instance forward a region replaces, so even a layer's own region
    is not re-entered. In the forward pass :func:`current_format` already says this format and
    this is a pass-through; in a recomputation it opens the region again. (Under torch.compile
    the recomputation replays the traced graph: no Python runs again.)
    """

    def __call__(self, *args, **kwargs):
        if current_format() is self.format:
            return self.orig(*args, **kwargs)
        return super().__call__(*args, **kwargs)


def _casts_out(own: Format, inherited: Format | None) -> bool:
    """Whether a region hands back FP32: when nested in fp32 (autocast off there: a bf16
    tensor reaching an fp32 op is a dtype error) or in a region of the other 16-bit dtype
    (autocast's promoting ops, ``cat`` in a rotary embedding, reject a bf16 tensor inside an
    fp16 region and vice versa)."""
    if inherited is None or own is Format.FP32:
        return False
    return inherited is Format.FP32 or inherited.autocast_dtype != own.autocast_dtype


def _install(module: nn.Module, fmt: Format, fqn: str, cast_out: bool,
             engine: str = "autoprec", kind: type[Region] = Region) -> Region:
    had_own = "forward" in module.__dict__
    orig = module.__dict__["forward"] if had_own else module.forward
    region = kind(module, orig, fmt, fqn, cast_out=cast_out, had_own=had_own, engine=engine)
    module.forward = region
    return region


def _warn_emulated_fp8(model: nn.Module, policy: Policy, assigned: dict[str, Format]) -> None:
    """Warn that the policy's fp8 layers are only emulated on the model's device. A model on
    the meta device (torchtitan builds it there, then materialises it) is not on its device
    yet: the warning waits for its first forward, on the device it was materialised on."""
    fp8 = [f for f in {policy.default, *assigned.values()} if f.is_scaled]
    if not fp8:
        return
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "meta":
        _say_emulated(policy, fp8, device, stacklevel=4)
        return

    def first_forward(module, args):
        model.__dict__.pop(_WARN_HOOK_ATTR).remove()
        now = next((p.device for p in module.parameters()), torch.device("cpu"))
        if now.type != "meta":
            _say_emulated(policy, fp8, now, stacklevel=2)

    model.__dict__[_WARN_HOOK_ATTR] = model.register_forward_pre_hook(first_forward)


def _say_emulated(policy: Policy, fp8: list[Format], device: torch.device, stacklevel: int) -> None:
    support = supported_formats(device)
    if any(support[f] is not Support.NATIVE for f in fp8):
        warnings.warn(
            f"Policy{' ' + policy.source if policy.source else ''} puts layers in fp8, "
            f"which {device} can only emulate: numerics are exact FP8, but those layers run "
            "slower than fp32, not faster. Use a CUDA GPU of compute capability >= 8.9 for "
            "real FP8 speed.", stacklevel=stacklevel)


def _wrapped(model: nn.Module) -> nn.Module | None:
    """The module ``model`` wraps if it is a wrapper that renames modules, else None."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return model._orig_mod
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return model.module
    return None


def unwrap(model: nn.Module) -> nn.Module:
    """The module under the wrappers that rename a model's modules: ``torch.compile``'s
    ``OptimizedModule`` (``_orig_mod.``), ``DataParallel`` and ``DistributedDataParallel``
    (``module.``), through any nesting of them; ``model`` itself when it is none of them.

    :func:`apply` and the functions that read what it did work on this module: its names are
    the policy's, and its forwards are the ones the wrappers call (dynamo guards on a module's
    forward, so a model compiled before ``apply`` recompiles with the regions on its next call).
    """
    while (inner := _wrapped(model)) is not None:
        model = inner
    return model


def _check_wrappers(model: nn.Module) -> None:
    while model is not None:
        if isinstance(model, nn.DataParallel) and len(model.device_ids) > 1:
            # replicate() copies each module's __dict__, the regions with it, and a region
            # calls the forward of the module it was made for: the original's, on the first
            # device's weights, in every replica
            raise PolicyError(
                f"autoprec.apply cannot put a policy under DataParallel over "
                f"{len(model.device_ids)} devices (device_ids={list(model.device_ids)}): its "
                "per-step copies of the model would all run the first device's layers. Use "
                "DistributedDataParallel (one process per GPU) and apply the policy in each "
                "process, or DataParallel over one device.")
        model = _wrapped(model)


def apply(model: nn.Module, policy: Policy | str | os.PathLike, *,
          strict: bool = True, engine: str | None = None,
          standalone: tuple[str, ...] = ()) -> nn.Module:
    """Make ``model`` compute as ``policy`` says; in place, returns ``model``.

    ``policy`` is a :class:`Policy` or a path to a policy YAML file. With ``strict`` (the
    default) a fingerprint of another model or a pattern that matches no module is a
    :class:`~autoprec.policy.PolicyError`; with ``strict=False`` they are warnings. ``engine``
    ("auto", "torchao" or "autoprec") overrides the policy's ``scaled: {engine: ...}``: who runs
    its scaled formats' ``nn.Linear`` layers. Applying again replaces the previous policy.

    A model wrapped by ``torch.compile``, ``DataParallel`` or ``DistributedDataParallel`` gets
    the policy on the module it wraps (:func:`unwrap`): the patterns and the fingerprint are
    checked against that module's names, and :func:`remove` takes it off the same way. Returns
    ``model`` as passed, wrapper included.

    ``standalone``: fqns of modules something calls outside their parent's forward
    (torchtitan's ChunkedLossWrapper calls ``lm_head`` itself, after the model's forward has
    returned): each gets a region of its own even where its format is its parent's.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply(model, policy) needs an nn.Module, got {type(model).__name__}.")
    _check_wrappers(model)
    wrapper, model = model, unwrap(model)
    if not isinstance(policy, Policy):
        policy = load_policy(policy)
    if engine is not None:
        policy = dataclasses.replace(policy, engine=engine)  # checked as the file's is
    assigned = policy.check_model(model, strict=strict)
    # a re-apply (a guard's demotion, a phase switch) keeps the modules named standalone
    standalone = tuple(standalone) or model.__dict__.get(_STANDALONE_ATTR, ())
    _remove_regions(model)
    _warn_emulated_fp8(model, policy, assigned)
    # fp8 nn.Linear layers go to torchao where the engine says so (modules swapped, the same
    # parameters); each gets a region of its own, in which nothing is routed again
    torchao = {fqn: policy.format_for(fqn) for fqn, module in model.named_modules()
               if fqn and engines.engine_for(module, policy.format_for(fqn),
                                             policy.engine) == "torchao"}
    swaps = engines.swap_to_torchao(model, torchao)
    installed = _install_regions(model, policy, assigned, torchao, standalone)
    model.__dict__[_REGIONS_ATTR] = installed
    model.__dict__[_REENTRY_ATTR] = _install_reentry(model, policy, installed)
    model.__dict__[_SWAPS_ATTR] = swaps
    model.__dict__[_POLICY_ATTR] = policy
    if standalone:
        model.__dict__[_STANDALONE_ATTR] = standalone
    for device_type in {p.device.type for p in model.parameters()}:
        _has_autocast(device_type)  # read by each region: filled eagerly, see _has_autocast
    return wrapper


def _install_regions(model: nn.Module, policy: Policy, assigned: dict[str, Format],
                     torchao: dict[str, Format], standalone: tuple[str, ...]) -> list[Region]:
    """A region on each module whose format differs from the one it inherits (and on each
    torchao layer and each ``standalone`` module), parents first, so that each knows the
    format it would inherit."""
    installed: list[Region] = []
    for fqn, module in model.named_modules():
        own = assigned.get(fqn, policy.default if fqn == "" else None)
        if fqn in torchao:
            own = torchao[fqn]
        if own is None and fqn in standalone:
            own = policy.format_for(fqn)
        if own is None:
            continue
        inherited = None if fqn == "" else policy.format_for(fqn.rpartition(".")[0])
        if own is inherited and fqn not in torchao and fqn not in standalone:
            continue  # same format as the enclosing region: a region would only cost time
        installed.append(_install(module, own, fqn, cast_out=_casts_out(own, inherited),
                                  engine="torchao" if fqn in torchao else "autoprec"))
    return installed


def _install_reentry(model: nn.Module, policy: Policy, installed: list[Region]) -> list[Region]:
    """A :class:`_Reentry` on every module that inherits an fp8 format, so that a checkpointed
    recomputation entering at any of them computes in fp8 again; not listed by
    :func:`regions` (they change no format)."""
    own = {id(region.module) for region in installed}
    return [_install(module, fmt, fqn, cast_out=False, kind=_Reentry)
            for fqn, module in model.named_modules()
            if fqn and id(module) not in own and (fmt := policy.format_for(fqn)).is_scaled]


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: every module gets its original forward back. No-op if none.
    Through the wrappers :func:`apply` looks past; returns ``model`` as passed."""
    _remove_regions(unwrap(model))
    return model


def _remove_regions(model: nn.Module) -> nn.Module:
    # swaps first: restore refuses (sharded since) before anything has changed
    engines.restore(model.__dict__.get(_SWAPS_ATTR) or [])
    for region in reversed([*(model.__dict__.get(_REGIONS_ATTR) or []),
                            *(model.__dict__.get(_REENTRY_ATTR) or [])]):
        if region.had_own:
            region.module.forward = region.orig
        else:
            region.module.__dict__.pop("forward", None)
    hook = model.__dict__.pop(_WARN_HOOK_ATTR, None)
    if hook is not None:
        hook.remove()
    for key in (_REGIONS_ATTR, _REENTRY_ATTR, _SWAPS_ATTR, _POLICY_ATTR, _STANDALONE_ATTR):
        model.__dict__.pop(key, None)
    return model


def applied_policy(model: nn.Module) -> Policy | None:
    """The policy :func:`apply` applied to ``model`` (None when none is)."""
    return unwrap(model).__dict__.get(_POLICY_ATTR)


def regions(model: nn.Module) -> list[Region]:
    """The regions :func:`apply` installed on ``model``, parents first."""
    return list(unwrap(model).__dict__.get(_REGIONS_ATTR) or [])


def applied_formats(model: nn.Module) -> dict[str, Format]:
    """fqn -> format of each region :func:`apply` installed on ``model`` ('' is the root).

    Args:
        model: a model a policy was applied to.

    Returns:
        Each region's fqn -> its format; empty when no policy is applied.
    """
    return {region.fqn: region.format for region in regions(model)}
