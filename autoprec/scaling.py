"""How a GEMM's operands are scaled: one object per scaling, which every other part reads.

A :class:`Scaling` says what its operands are cast to (``elements``), how many values share a
scale along the contraction (``block``) and what a scale costs (``scale_bytes``), which CUDA
compute capability has tensor-core kernels for it (``capability``), how its scales round
(``roundings``), whether one scale covers the whole tensor (``one_scale``, so the quantized
operand serves any contraction) and whether casting needs a whole-tensor amax first
(``tensor_amax``), how precise it is for the tie-break among equally fast policies
(``precision``), and how it rounds an operand (:meth:`Scaling.round`: the values the GEMM
multiplies, for the emulation) and which GEMMs autoprec's kernels compute with it
(:meth:`Scaling.has_kernel`).

The built-ins, as :class:`autoprec.formats.Gemm` spells them:

- ``none``: not scaled, a plain FP32, BF16 or FP16 GEMM;
- ``tensor``: one FP8 scale ``max / amax`` per tensor;
- ``row``: one per row along the contracted dimension, rounded down to a power of two
  (torchao's rowwise recipes; each GEMM of the backward re-scales along its own contraction);
- ``mx``: OCP MX, 32 FP8 values share an E8M0 power of two (:mod:`autoprec.blockscale`);
- ``nvfp4``: 16 E2M1 values share an E4M3 scale, under an FP32 scale per tensor.

A new scaling is a :class:`Scaling` given to :func:`register_scaling`; a :class:`Gemm
<autoprec.formats.Gemm>` then takes its name, and the formats, the emulation, the cost model
and the memory model read it from here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from autoprec import blockscale
from autoprec._util import quoted

__all__ = [
    "Scaling",
    "register_scaling",
    "unregister_scaling",
    "scaling_named",
    "scalings",
    "NONE",
    "KERNEL_MULTIPLE",
    "shape_multiple",
    "tensorwise_scale",
    "rowwise_scale",
    "quantize",
    "dequantize",
]

# torch's names for the two FP8 encodings of "FP8 Formats for Deep Learning"
# (Micikevicius et al. 2022): E4M3 (max 448, no infinities) for weights and activations,
# E5M2 (max 57344) for gradients.
FP8_E4M3 = torch.float8_e4m3fn
FP8_E5M2 = torch.float8_e5m2
# E2M1 (OCP MX v1.0's FP4: 0, 0.5, 1, 1.5, 2, 3, 4, 6), as torch names its packed dtype (two
# values a byte); operands are emulated as the FP32 values they stand for.
FP4_E2M1 = torch.float4_e2m1fn_x2
FP8_DTYPES = (FP8_E4M3, FP8_E5M2)

# torch._scaled_mm's kernels need M, K and N to be multiples of 16 (forward, dgrad, wgrad).
KERNEL_MULTIPLE = 16

# Lower bound on amax: an all-zero tensor would otherwise give an infinite scale
# (the failure fixed in pytorch/ao#3356 by the same kind of bound).
AMAX_EPS = 1e-12

# (values, gemm, operand dtype, stochastic) -> the FP32 values the GEMM multiplies
Rounder = Callable[[torch.Tensor, object, torch.dtype, bool], torch.Tensor]
# (values, operand dtype, dim) -> FP32 scales that broadcast against the values
Scaler = Callable[[torch.Tensor, torch.dtype, int], torch.Tensor]


def _amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``x.abs().amax()`` (along ``dim``, kept) without ``x.abs()``'s tensor of ``x``'s size:
    the larger of the largest value and minus the smallest, the same value (a NaN too)."""
    if dim is None:
        return torch.maximum(x.amax(), x.amin().neg())
    return torch.maximum(x.amax(dim=dim, keepdim=True), x.amin(dim=dim, keepdim=True).neg())


def tensorwise_scale(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP32 scalar ``fp8_max / amax(x)``; ``x * scale`` fills the FP8 range. No autograd."""
    with torch.no_grad():
        amax = _amax(x.detach()).to(torch.float32).clamp(min=AMAX_EPS)
        return torch.finfo(fp8_dtype).max / amax


def rowwise_scale(x: torch.Tensor, fp8_dtype: torch.dtype, dim: int) -> torch.Tensor:
    """FP32 ``fp8_max / amax(x)`` along ``dim`` (kept, so it broadcasts against ``x``), rounded
    down to a power of two as torchao's rowwise recipes do. No autograd."""
    with torch.no_grad():
        amax = _amax(x.detach(), dim).to(torch.float32)
        scale = torch.finfo(fp8_dtype).max / amax.clamp(min=AMAX_EPS)
        return torch.exp2(torch.floor(torch.log2(scale)))


def quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Round ``x * scale`` to ``fp8_dtype`` (saturating at the format's max)."""
    fp8_max = torch.finfo(fp8_dtype).max
    with torch.no_grad():  # clamped in the product's own memory: one FP32 temporary, not two
        return (x.detach().to(torch.float32) * scale).clamp_(-fp8_max, fp8_max).to(fp8_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP32 values an FP8 tensor stands for (divided in the widened copy's own memory)."""
    return q.to(torch.float32, copy=True).div_(scale)


def shape_multiple(numerics) -> int:
    """What M, K and N of a product must be multiples of in a scaled format (its
    :class:`~autoprec.formats.Numerics`): 16 for ``torch._scaled_mm``, the block for
    block-scaled ones (32 for MX: each of M, K, N is the contraction of one of the three
    GEMMs)."""
    return max(KERNEL_MULTIPLE, numerics.block)


class Scaling(str):
    """One way of scaling a GEMM's operands, equal to (and hashed as) its name, the string a
    :class:`~autoprec.formats.Gemm` is given.

    Args:
        name: how a Gemm names it (``"tensor"``).
        elements: the operand dtypes it casts to (empty: a plain GEMM, any 16- or 32-bit dtype).
        precision: the precision a GEMM gives up, for the tie-break among equally fast
            policies (a 16-bit GEMM 1; FP8 per tensor 2).
        scale: ``(x, dtype, dim) -> scales`` for a scaling with one FP32 scale per tensor or
            per row (the scaled-matmul kernel's operands: ``x * scale`` cast to ``dtype``).
        round: ``(x, gemm, dtype, stochastic) -> values``: the FP32 values the GEMM multiplies
            for ``x`` (contraction along the last dimension); defaults to ``scale``'s
            quantize-dequantize.
        kernel: ``gemm -> bool``: whether autoprec's kernels compute such a GEMM.
        block: values per scale along the contraction (None: no blocks).
        scale_bytes: scale bytes per operand element (``1 / 32`` for an E8M0 byte per 32).
        capability: smallest CUDA compute capability with tensor-core kernels (None: none).
        roundings: how scales may be rounded; the first is the default (``("",)``: one way).
        one_scale: one scale covers the whole tensor, the same along either axis, so a
            quantized operand serves any contraction (and an FP8 all-gather can carry it).
        tensor_amax: casting needs the whole tensor's amax first (a pass of its own).
        transforms: a Gemm may ask for NVFP4's Hadamard transform and stochastic rounding.
    """

    def __new__(cls, name: str, *, elements: tuple[torch.dtype, ...], precision: float,
                scale: Scaler | None = None, round: Rounder | None = None,
                kernel: Callable[[object], bool] | None = None, **facts):
        self = str.__new__(cls, name)
        if scale is None and round is None and elements:
            raise ValueError(f"Scaling {quoted(name)} needs a scale or a round function: how "
                             "the emulation rounds its operands.")
        defaults = dict(block=None, scale_bytes=0.0, capability=None, roundings=("",),
                        one_scale=False, tensor_amax=False, transforms=False)
        unknown = set(facts) - set(defaults)
        if unknown:
            raise TypeError(f"Scaling() got unexpected keywords {sorted(unknown)}")
        for key, value in {**defaults, **facts, "name": name, "elements": tuple(elements),
                           "precision": float(precision), "scale": scale}.items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "_round", round)
        object.__setattr__(self, "_kernel", kernel)
        return self

    def __setattr__(self, key, value):
        raise AttributeError("A Scaling is immutable.")

    def __repr__(self) -> str:
        return f"Scaling({str.__repr__(self)})"

    def __reduce__(self):
        return scaling_named, (str(self),)

    @property
    def is_scaled(self) -> bool:
        """Whether its operands are scaled low precision (FP8, MX, NVFP4, ...)."""
        return bool(self.elements)

    def round(self, x: torch.Tensor, gemm, dtype: torch.dtype, *,
              stochastic: bool = False) -> torch.Tensor:
        """The FP32 values a GEMM with this scaling multiplies in place of its FP32 operand
        ``x`` (contraction along the last dimension; no autograd)."""
        if self._round is not None:
            return self._round(x, gemm, dtype, stochastic)
        if self.scale is None:
            return x.to(dtype).to(torch.float32)
        s = self.scale(x, dtype, -1)
        return dequantize(quantize(x, s, dtype), s)

    @property
    def rounds_by_scale(self) -> bool:
        """Whether :meth:`round` is ``scale``'s quantize-dequantize: each element rounded
        alone, given its tensor's or its row's scale (so a part of a tensor can be rounded
        with the whole's scales)."""
        return self._round is None and self.scale is not None

    def has_kernel(self, gemm) -> bool:
        """Whether autoprec's kernels compute ``gemm`` (a Gemm with this scaling)."""
        return self._kernel is None or bool(self._kernel(gemm))


def _mx_round(x, gemm, dtype, stochastic):
    return blockscale.mx_dequantize(*blockscale.mx_quantize(x, dtype, rounding=gemm.rounding))


def _nvfp4_round(x, gemm, dtype, stochastic):
    ts = blockscale.nvfp4_tensor_scale(x).clamp(min=AMAX_EPS)
    scales, values = blockscale.nvfp4_quantize(x, ts, stochastic=stochastic)
    return blockscale.nvfp4_dequantize(scales, values, ts)


# Precision a GEMM gives up, for the tie-break among equally fast policies: a 16-bit GEMM 1,
# FP8 twice that, a row-scaled FP8 GEMM a quarter less (each row keeps its own range), an MX
# one less again (a scale per 32 values), FP4 three times. Capabilities: the smallest CUDA
# compute capability with tensor-core kernels for GEMMs so scaled (block scales: Blackwell's
# sm_100).
NONE = Scaling("none", elements=(), precision=1.0,
               kernel=lambda g: g.a is g.b and g.a in (torch.float32, torch.bfloat16))
_BUILTINS = (
    NONE,
    Scaling("tensor", elements=FP8_DTYPES, precision=2.0, capability=(8, 9), one_scale=True,
            tensor_amax=True, scale=lambda x, dtype, dim: tensorwise_scale(x, dtype),
            kernel=lambda g: not g.pow2_scales),
    # the row kernel takes E4M3 operands with power-of-two scales only (torchao's recipes)
    Scaling("row", elements=FP8_DTYPES, precision=1.75, capability=(9, 0), scale=rowwise_scale,
            kernel=lambda g: g.pow2_scales and g.a is g.b is FP8_E4M3),
    Scaling("mx", elements=FP8_DTYPES, precision=1.6, capability=(10, 0),
            block=blockscale.MX_BLOCK, scale_bytes=1 / blockscale.MX_BLOCK,
            roundings=("rceil", "floor"), round=_mx_round, kernel=lambda g: not g.pow2_scales),
    Scaling("nvfp4", elements=(FP4_E2M1,), precision=3.0, capability=(10, 0),
            block=blockscale.NVFP4_BLOCK, scale_bytes=1 / blockscale.NVFP4_BLOCK,
            tensor_amax=True, transforms=True, round=_nvfp4_round,
            kernel=lambda g: not g.pow2_scales),
)
_REGISTRY: dict[str, Scaling] = {s.name: s for s in _BUILTINS}


def scalings() -> tuple[Scaling, ...]:
    """The scalings registered now, the built-ins first."""
    return tuple(_REGISTRY.values())


def scaling_named(name: str) -> Scaling:
    """The registered scaling called ``name``; a ValueError naming the known ones if none is."""
    found = _REGISTRY.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"Gemm scaling {quoted(name)} is not one of "
                         f"{', '.join(_REGISTRY)}; register_scaling adds one.")
    return found


def register_scaling(scaling: Scaling) -> Scaling:
    """Make ``scaling`` known by its name (a name already taken is an error)."""
    if not isinstance(scaling, Scaling):
        raise TypeError(f"register_scaling takes a Scaling, not {type(scaling).__name__}.")
    if scaling.name in _REGISTRY:
        raise ValueError(f"Scaling {quoted(scaling.name)} is already registered; give the new "
                         "scaling another name.")
    _REGISTRY[scaling.name] = scaling
    return scaling


def unregister_scaling(scaling: Scaling) -> None:
    """Take a scaling :func:`register_scaling` added out again (tests); the built-ins stay.
    Formats that use it must be unregistered first."""
    if scaling.name in {s.name for s in _BUILTINS}:
        raise ValueError(f"{scaling.name} is a built-in scaling and cannot be unregistered.")
    if _REGISTRY.get(scaling.name) is not scaling:
        raise ValueError(f"{scaling!r} is not registered.")
    del _REGISTRY[scaling.name]
