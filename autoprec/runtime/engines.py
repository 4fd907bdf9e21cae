"""Who runs an fp8 layer: torchao's float8 training for ``nn.Linear`` when it is installed,
autoprec's own FP8 matmul (:mod:`autoprec.runtime.fp8`) for everything else.

The engine is a detail of ``apply``, never of the policy's meaning: both engines compute the
same recipes (torchao's names), and ``tests/test_engines.py`` checks they agree to FP8
rounding. torchao brings its kernels, compile-fused casts and FSDP2 float8 all-gather on a
GPU; where the device has no FP8 kernels it runs with ``emulate=True``.

MXFP8 (``mxfp8``, ``mxfp8:gw_hp``) runs on torchao's ``MXFP8Linear`` with its recipe's
settings (``MXFP8TrainingOpConfig.from_recipe``) only on a Blackwell GPU (compute capability
10.0), where its kernels are; elsewhere the engine ``auto`` gives it to autoprec's emulation and
the engine ``torchao`` is refused in one line. NVFP4 has no torchao recipe here (torchao's
NVFP4 training is Triton-only, without an emulation): autoprec's emulation runs it.

torchao swaps modules (``nn.Linear`` -> ``Float8Linear``, sharing the same weight and bias
``Parameter`` objects, so names, ``state_dict`` and optimizer state are unchanged); autoprec
records each swap and puts the original module back on ``remove``. Nothing here imports
torchao until a policy puts an ``nn.Linear`` in fp8 with the engine ``auto`` or ``torchao``.

Under FSDP2 a ``Float8Linear`` sharded since it was swapped in cannot be swapped back (FSDP
all-gathers into it, not into the original). The runtime guard still has to change such a
layer's format; it re-applies inside :func:`keeping_sharded_swaps`, where the swapped module
stays and a layer no longer in its FP8 recipe computes as ``nn.Linear`` inside its region.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.util
import io
import logging
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from autoprec.formats import Format, Support, torchao_takes
from autoprec.host import supported_formats

__all__ = ["Swap", "torchao_available", "torchao_runs", "engine_for",
           "swap_to_torchao", "restore", "keeping_sharded_swaps", "is_float8_linear",
           "computes_own", "blackwell", "mxfp8_config", "mxfp8_linear",
           "float8_linear_config"]

# Inside keeping_sharded_swaps(): id(Float8Linear) -> its Swap, for the swaps restore() left in
# place because the model was sharded since (None outside: restore refuses those).
_KEPT: contextvars.ContextVar[dict[int, Swap] | None] = contextvars.ContextVar(
    "autoprec_kept_swaps", default=None)


@functools.lru_cache(maxsize=1)
def torchao_available() -> bool:
    """Whether torchao's float8 training imports here (its missing CUDA extensions on a CPU
    machine only warn; that noise is kept out of our output)."""
    if importlib.util.find_spec("torchao") is None:
        return False
    try:
        with _quiet():
            import torchao.float8  # noqa: F401
            try:  # what transformers' quantizers import next (it warns on import, once)
                import torchao.prototype.mx_formats.config  # noqa: F401
            except Exception:  # noqa: BLE001 - a prototype module; only its noise matters
                pass
        return True
    except Exception:  # noqa: BLE001 - any import failure means: not available
        return False


@contextlib.contextmanager
def _quiet():
    """Hold back what importing torchao prints on a machine without its CUDA extensions."""
    levels = {}
    for name in ("torchao", "torch"):
        log = logging.getLogger(name)
        levels[name] = log.level
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def torchao_runs(fmt: Format, *, linear: bool, in_features: int, out_features: int,
                 engine: str) -> bool:
    """Whether ``apply`` gives such a layer (not yet sharded) to torchao: it takes it
    (:func:`~autoprec.formats.torchao_takes`), the policy's engine is not "autoprec" and torchao imports here.
    What :func:`engine_for` decides for a module, for a layer known by its shape (the memory
    model's captured layers)."""
    return (torchao_takes(fmt, linear=linear, in_features=in_features, out_features=out_features)
            and engine != "autoprec" and torchao_available())


def _takes(module: nn.Module, fmt: Format) -> bool:
    linear = isinstance(module, nn.Linear)
    return torchao_takes(fmt, linear=linear, in_features=module.in_features if linear else 0,
                         out_features=module.out_features if linear else 0)


def engine_for(module: nn.Module, fmt: Format, engine: str) -> str:
    """The engine that runs ``module`` in ``fmt``: "torchao" for an ``nn.Linear`` in fp8 when
    the policy's engine allows it, torchao is installed and takes it
    (:func:`~autoprec.formats.torchao_takes`), else "autoprec" (a Linear whose K or N is not
    a multiple of 16 runs in bf16 there, a recipe torchao has no name for in autoprec's FP8
    kernel). Asking for "torchao" where it is not installed is an error that says how to get
    it."""
    kept = (_KEPT.get() or {}).get(id(module))
    if kept is not None:
        # a Float8Linear kept in place (sharded since its swap): it goes on computing its FP8
        # recipe only in that recipe; any other format runs it as nn.Linear (swap_to_torchao)
        return "torchao" if fmt is kept.format and engine != "autoprec" else "autoprec"
    if is_float8_linear(module):
        # built as torchao's Float8Linear (MXFP8Linear, NVFP4Linear) before apply (torchtitan's
        # converters, or the user's convert_to_float8_training): it computes its own format;
        # in any other it runs as nn.Linear (swap_to_torchao)
        return "torchao" if computes_own(module, fmt) else "autoprec"
    if engine == "autoprec" or not _takes(module, fmt):
        return "autoprec"
    if fmt.numerics.is_block_scaled and not blackwell(_device_of(module)):
        if engine == "torchao":
            raise RuntimeError(
                f"The policy asks for the torchao engine (fp8: {{engine: torchao}}) for {fmt}, "
                "whose torchao kernels (MXFP8TrainingOpConfig) need a CUDA device of compute "
                f"capability 10.0 (Blackwell); this layer is on {_device_of(module)}: set the "
                f"engine to auto or autoprec, which emulate {fmt} exactly.")
        return "autoprec"
    if is_sharded(module):
        # FSDP2 keeps a reference to the module that owns each sharded parameter and
        # all-gathers into it; a Float8Linear swapped in after fully_shard would multiply the
        # sharded DTensor weight (a mixed Tensor/DTensor error)
        if engine == "torchao":
            raise RuntimeError(
                "The policy asks for the torchao engine (scaled: {engine: torchao}) but the model "
                "is already sharded (fully_shard): torchao's Float8Linear must be swapped in "
                "first. Apply the policy before fully_shard, or use engine auto or autoprec.")
        warnings.warn(
            "Policy applied after fully_shard: its fp8 nn.Linear layers run on autoprec's FP8 "
            "engine (the same numbers), not torchao's Float8Linear, which must be swapped in "
            "before sharding. Apply the policy before fully_shard to use torchao.", stacklevel=5)
        return "autoprec"
    if torchao_available():
        return "torchao"
    if engine == "torchao":
        raise RuntimeError("The policy asks for the torchao engine (scaled: {engine: torchao}) but "
                           "torchao is not installed: pip install 'autoprec[torchao]', or set "
                           "the engine to auto or autoprec.")
    return "autoprec"


def _device_of(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def blackwell(device: torch.device) -> bool:
    """Whether ``device`` has Blackwell's block-scaled tensor cores (CUDA compute capability
    10.0 or newer), where torchao's MXFP8 kernels run."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (10, 0)


def mxfp8_config(recipe: str, *, emulate: bool = False):
    """torchao's MXFP8 training config for ``nn.Linear`` of ``recipe`` (torchao's name,
    ``MXFP8TrainingOpConfig.from_recipe``); ``emulate``: torchao's own emulated kernels
    (``KernelPreference.EMULATED``, any device)."""
    with _quiet():
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(recipe))
    return dataclasses.replace(config, kernel_preference=KernelPreference.EMULATED) \
        if emulate else config


def mxfp8_linear(linear: nn.Linear, fmt: Format, *, emulate: bool = False) -> nn.Module:
    """torchao's ``MXFP8Linear`` for ``linear`` in ``fmt``'s recipe (:func:`mxfp8_config`: its
    kernel preference, RCEIL scales, the weight gradient in BF16 or not), sharing ``linear``'s
    parameters; ``emulate``: torchao's own emulated kernels (any device, for tests)."""
    with _quiet():
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    config = mxfp8_config(fmt.numerics.torchao_recipe, emulate=emulate)
    with torch.device("meta"):
        out = MXFP8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          kernel_preference=config.kernel_preference,
                          scale_calculation_mode=config.scale_calculation_mode,
                          wgrad_with_hp=config.wgrad_with_hp)
    out.weight, out.bias = linear.weight, linear.bias
    return out


_LOWP_LINEARS = ("Float8Linear", "MXFP8Linear", "NVFP4Linear")


def _torchao_class(module: nn.Module) -> str | None:
    return next((cls.__name__ for cls in type(module).__mro__
                 if cls.__name__ in _LOWP_LINEARS and cls.__module__.startswith("torchao.")), None)


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is one of torchao's low-precision Linears, ``Float8Linear``,
    ``MXFP8Linear`` or ``NVFP4Linear`` (or a subclass: torchtitan's, the one ``fully_shard``
    makes), without importing torchao."""
    return _torchao_class(module) is not None


def computes_own(module: nn.Module, fmt: Format) -> bool:
    """Whether such a module (:func:`is_float8_linear`) computes ``fmt`` itself: a Float8Linear
    a torchao FP8 recipe, an MXFP8Linear MXFP8, an NVFP4Linear (torchtitan's: its Hadamard
    transform and stochastic rounding) nvfp4."""
    name, num = _torchao_class(module), fmt.numerics
    if name == "Float8Linear":
        return num.torchao_recipe is not None and not num.is_block_scaled
    if name == "MXFP8Linear":
        return num.torchao_recipe is not None and num.is_block_scaled
    return name == "NVFP4Linear" and num.torchtitan_linear == name


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module``'s weight is already a DTensor (FSDP2's fully_shard, or tensor
    parallelism)."""
    weight = getattr(module, "weight", None)
    if weight is None or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


@dataclass
class Swap:
    """One module torchao replaced: where it lives and what to put back."""

    parent: nn.Module
    name: str
    original: nn.Module
    replacement: nn.Module
    # the fp8 format (recipe) the replacement computes
    format: Format | None = None


def swap_to_torchao(model: nn.Module, targets: dict[str, Format]) -> list[Swap]:
    """Convert the ``nn.Linear`` modules named in ``targets`` (fqn -> fp8 format) to torchao's
    ``Float8Linear`` with each one's recipe (``emulate=True`` where the device has no kernels
    for it). Returns the swaps, for :func:`restore`. Inside :func:`keeping_sharded_swaps` the
    swaps kept in place come first, and are not converted again."""
    kept = _KEPT.get() or {}
    swaps: list[Swap] = _keep(model, targets, kept) if kept else []
    swaps += _native(model, targets, kept)
    modules = dict(model.named_modules())
    targets = {fqn: f for fqn, f in targets.items()
               if id(modules[fqn]) not in kept and not is_float8_linear(modules[fqn])}
    for fqn in [f for f, fmt in targets.items() if fmt.numerics.is_block_scaled]:
        parent, _, child = fqn.rpartition(".")
        fmt = targets.pop(fqn)
        swaps.append(Swap(model.get_submodule(parent), child, modules[fqn],
                          mxfp8_linear(modules[fqn], fmt), fmt))
        setattr(swaps[-1].parent, child, swaps[-1].replacement)
    if not targets:
        return swaps
    with _quiet():
        from torchao.float8 import convert_to_float8_training
    for fmt in dict.fromkeys(targets.values()):
        names = {fqn for fqn, f in targets.items() if f is fmt}
        device = next((p.device for p in modules[next(iter(names))].parameters()), None)
        config = float8_linear_config(fmt, device)
        before = {fqn: modules[fqn] for fqn in names}
        with _quiet():
            convert_to_float8_training(model, config=config,
                                       module_filter_fn=lambda m, fqn, names=names: fqn in names)
        after = dict(model.named_modules())
        for fqn, original in before.items():
            parent_name, _, child = fqn.rpartition(".")
            swaps.append(Swap(model.get_submodule(parent_name), child, original, after[fqn], fmt))
        modules = after
    return swaps


def float8_linear_config(fmt: Format, device: torch.device | None):
    """torchao's ``Float8LinearConfig`` of ``fmt``'s recipe for layers that compute on
    ``device``: ``emulate=True`` where it has no FP8 kernels for the recipe (and on the meta
    device or none: not known to have them). The same numbers either way."""
    with _quiet():
        from torchao.float8 import Float8LinearConfig
    config = Float8LinearConfig.from_recipe_name(fmt.numerics.torchao_recipe)
    native = device is not None and device.type != "meta" and \
        supported_formats(device)[fmt] is Support.NATIVE
    return config if native else dataclasses.replace(config, emulate=True)


def _keep(model: nn.Module, targets: dict[str, Format], kept: dict[int, Swap]) -> list[Swap]:
    """The swaps :func:`restore` kept in place, for the policy being applied: a layer still in
    its recipe (in ``targets``) runs its Float8Linear again; any other runs it as nn.Linear, so
    that the region :func:`autoprec.runtime.rewrite.apply` puts around it (or its parent's)
    decides its format. Each stays a swap: removing the policy is still refused."""
    swaps = []
    for fqn, module in model.named_modules():
        swap = kept.get(id(module))
        if swap is None:
            continue
        own = module.__dict__.get("forward")
        if fqn in targets:
            if isinstance(own, _AsLinear):
                del module.forward
        elif not isinstance(own, _AsLinear):
            module.forward = _AsLinear(module)
        swaps.append(swap)
    return swaps


def _native(model: nn.Module, targets: dict[str, Format], kept: dict[int, Swap]) -> list[Swap]:
    """The Float8Linear layers the model was built with (not swapped by autoprec): one in
    ``targets`` computes its recipe; any other runs as ``nn.Linear`` in its region's format,
    recorded as a swap of the module with itself, which :func:`restore` undoes by giving it
    its own forward back."""
    swaps = []
    for fqn, module in model.named_modules():
        if id(module) in kept or not is_float8_linear(module):
            continue
        if isinstance(module.__dict__.get("forward"), _AsLinear):
            del module.forward  # left by a policy applied before
        if fqn not in targets:
            module.forward = _AsLinear(module)
            parent, _, child = fqn.rpartition(".")
            swaps.append(Swap(model.get_submodule(parent), child, module, module))
    return swaps


class _AsLinear:
    """The forward of a kept Float8Linear whose layer left its FP8 recipe: ``nn.Linear``'s,
    on the same (FSDP-gathered) weight and bias. A callable object, not a closure, so that
    ``copy.deepcopy`` rebinds it to the copied module."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return nn.Linear.forward(self.module, *args, **kwargs)


@contextlib.contextmanager
def keeping_sharded_swaps():
    """Re-apply a policy to a model whose Float8Linear swaps were sharded since (FSDP2).

    Inside, :func:`restore` leaves those swaps in place instead of refusing, and the
    ``apply`` that follows keeps them: a layer the new policy leaves in its recipe runs on
    torchao as before, one in another format (a runtime guard's demotion, fp8 -> bf16) runs
    as ``nn.Linear`` in that format. Putting the original ``nn.Linear`` back is no option: FSDP
    all-gathers into the Float8Linear, and the original would train its stale weight."""
    token = _KEPT.set({})
    try:
        yield
    finally:
        _KEPT.reset(token)


def restore(swaps: list[Swap]) -> None:
    """Put back the modules torchao replaced (in reverse order); inside
    :func:`keeping_sharded_swaps`, those sharded since stay."""
    kept = _KEPT.get()
    stale = set()
    for swap in swaps:
        # fully_shard after the swap gave the Float8Linear sharded parameters the original
        # Linear never sees: put back, it would run its stale weight and train nothing
        if is_sharded(swap.replacement) and \
                getattr(swap.original, "weight", None) is not swap.replacement.weight:
            if kept is not None:
                kept[id(swap.replacement)] = swap
                stale.add(id(swap))
                continue
            raise RuntimeError(
                "Cannot remove or re-apply a policy whose fp8 layers run on torchao's "
                "Float8Linear after the model was sharded (fully_shard): apply the final policy "
                "once before fully_shard, or use engine autoprec to change it later.")
    for swap in reversed(swaps):
        if swap.original is swap.replacement:  # a Float8Linear of the model's own (_native)
            if isinstance(swap.original.__dict__.get("forward"), _AsLinear):
                del swap.original.forward
        elif id(swap) not in stale:
            setattr(swap.parent, swap.name, swap.original)
