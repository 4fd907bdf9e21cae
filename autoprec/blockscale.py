"""Block-scaled quantization as Blackwell's tensor cores read it, emulated exactly on any device.

Two encodings, each a quantize -> dequantize pair of plain tensor functions (the emulation of a
GEMM is then: quantize both operands along the contraction, dequantize in FP32, FP32 matmul):

- **MX** (OCP Microscaling Formats v1.0): blocks of 32 consecutive values along the last
  dimension share one E8M0 scale (a power of two, ``2**(e - 127)``, byte 255 = NaN); the values
  are E4M3 (MXFP8; E5M2 also allowed) after division by it. The scale's exponent is chosen by
  ``rounding``:

  - ``"floor"``, the OCP spec's (section 6.3): ``floor(log2(amax)) - emax(element)`` (emax 8
    for E4M3: 448 = 1.75 * 2**8), read from amax's FP32 exponent bits; a scaled value above
    the element's maximum saturates to it.
  - ``"rceil"``, NVIDIA's (cuBLAS "1D block quantization", ``cvt.rp.satfinite.ue8m0``): the
    smallest power of two ``s`` with ``amax / s <= max(element)``, i.e.
    ``ceil(log2(amax / max))``, clamped to E8M0's range; an infinite amax gives byte 254, a
    NaN 255. Values are multiplied by the reciprocal, which is taken as 1 where the scale byte
    is 0 (Transformer Engine's ``exp2f_rcp``; such a block is zero or below 2**-127 * 448).
    Floor can overflow the element's range by up to 2x and saturate the block's largest
    values; RCEIL never does (the reason *Recipes for Pre-training LLMs with MXFP8*,
    arXiv 2506.08027, found floor rounding of scales diverging).

- **NVFP4** (NVIDIA): blocks of 16 share an E4M3 scale ``amax / 6`` (round to nearest even,
  clamped to [2**-6, 448]), optionally divided by a per-tensor FP32 scale
  ``amax(tensor) / (448 * 6)`` so that block scales use E4M3's whole range; values are E2M1
  (the grid 0, 0.5, 1, 1.5, 2, 3, 4, 6; round to nearest, ties to even, saturating at 6),
  multiplied by the reciprocal of the combined scale.

Element rounding is round-to-nearest-even everywhere (torch's FP8 casts; :func:`to_e2m1` for
FP4), or for NVFP4's gradients in NVIDIA's recipe stochastic (``stochastic=True``: up with the
probability of the distance to the lower grid point over the step, from a generator of this
module's own, so the model's RNG stream is untouched). NVIDIA's recipe also passes the weight
gradient GEMM's operands through a random Hadamard transform (:func:`hadamard_transform`: per
16 values along the contraction, fixed random signs times the normalized 16-point Hadamard
matrix; orthogonal, so it cancels in the product). ``tests/test_blockscale.py`` checks
crafted blocks against these rules and against torchao's reference implementation, bit for
bit.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["E2M1_GRID", "mx_quantize", "mx_dequantize", "hadamard_transform",
           "nvfp4_tensor_scale", "nvfp4_quantize", "nvfp4_dequantize", "to_e2m1", "seed_rounding",
           "forked_rounding"]

MX_BLOCK = 32
NVFP4_BLOCK = 16
E8M0_BIAS = 127
_E8M0_NAN = 255
_E8M0_INF = 254
# the largest power of two of each element type (448 = 1.75 * 2**8, 57344 = 1.75 * 2**15)
_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
_E4M3_TINY = torch.finfo(torch.float8_e4m3fn).smallest_normal  # 2**-6
E2M1_MAX = 6.0
# the non-negative E2M1 values, by code (bit 0 of the code is the mantissa bit)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"The last dimension ({x.shape[-1]}) of a block-scaled tensor must be a "
                         f"multiple of its block size {block}.")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _e8m0(amax: torch.Tensor, elem: torch.dtype, rounding: str) -> torch.Tensor:
    """The biased E8M0 scale byte of blocks of absolute maximum ``amax`` (FP32), as uint8."""
    if rounding == "rceil":
        descale = amax / torch.finfo(elem).max
        exp = torch.ceil(torch.log2(descale)).clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
        exp = torch.where(torch.isinf(descale), float(_E8M0_INF), exp)
    elif rounding == "floor":
        # floor(log2(amax)) from the FP32 exponent field (a subnormal amax counts as 2**-127)
        pow2 = ((amax.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS
        exp = (pow2 - _EMAX[elem]).clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    else:
        raise ValueError(f"MX scale rounding {rounding!r} is not one of floor, rceil.")
    return torch.where(torch.isnan(amax), float(_E8M0_NAN), exp.float()).to(torch.uint8)


def _pow2(exp: torch.Tensor) -> torch.Tensor:
    """2**(exp - 127) in FP32 for E8M0 bytes (NaN for 255), exact down to 2**-127."""
    scale = torch.ldexp(torch.ones_like(exp, dtype=torch.float32),
                        exp.to(torch.int32) - E8M0_BIAS)
    return torch.where(exp == _E8M0_NAN, float("nan"), scale)


def mx_quantize(x: torch.Tensor, elem: torch.dtype = torch.float8_e4m3fn, *,
                rounding: str = "rceil",
                block: int = MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize ``x`` along its last dimension: ``(scales, values)``, the E8M0 scale bytes
    (uint8, one per block) and the elements (``elem``, the shape of ``x``)."""
    if elem not in _EMAX:
        raise ValueError(f"MX elements {elem} are not one of {', '.join(map(str, _EMAX))}.")
    blocks = _blocks(x, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    exp = _e8m0(amax, elem, rounding)
    scale = _pow2(exp)
    if rounding == "rceil":
        rcp = torch.where(exp == _E8M0_INF, 2.0 ** -E8M0_BIAS, 1.0 / scale)
        rcp = torch.where(exp == 0, 1.0, rcp)
        scaled = blocks * rcp
    else:
        scaled = blocks / scale
    top = torch.finfo(elem).max
    values = scaled.clamp(-top, top).to(elem)  # clamp keeps NaN; E4M3 has no infinities
    return exp.squeeze(-1), values.reshape(x.shape)


def mx_dequantize(scales: torch.Tensor, values: torch.Tensor, *,
                  block: int = MX_BLOCK) -> torch.Tensor:
    """FP32 values of :func:`mx_quantize`'s output."""
    blocks = _blocks(values.float(), block)
    return (blocks * _pow2(scales).unsqueeze(-1)).reshape(values.shape)


# one generator per device for stochastic rounding (seeded once: reproducible per process,
# or per step with seed_rounding)
_GENERATORS: dict[torch.device, torch.Generator] = {}
_SR_SEED = 0x5EED


def seed_rounding(seed: int) -> None:
    """Seed stochastic rounding on every device from ``seed``: two runs that seed each step
    alike (a certificate's policy and reference branches, :mod:`autoprec.certification`) draw the
    same rounding at the same step. Without it the draws follow one seed per process."""
    for device in list(_GENERATORS):
        _GENERATORS[device].manual_seed(seed)
    _next_seed[0] = seed


# the seed a device's generator starts from when it is first used
_next_seed = [_SR_SEED]


@contextlib.contextmanager
def forked_rounding():
    """Stochastic rounding drawn inside leaves the draws after it as they would have been
    (a measurement taken in the middle of training: :class:`autoprec.runtime.bias.BiasWatch`)."""
    states = {device: g.get_state() for device, g in _GENERATORS.items()}
    seed = _next_seed[0]
    try:
        yield
    finally:
        for device in list(_GENERATORS):
            if device in states:
                _GENERATORS[device].set_state(states[device])
            else:
                del _GENERATORS[device]
        _next_seed[0] = seed


def _generator(device: torch.device) -> torch.Generator:
    if device not in _GENERATORS:
        _GENERATORS[device] = torch.Generator(device=device).manual_seed(_next_seed[0])
    return _GENERATORS[device]


def to_e2m1(x: torch.Tensor, *, stochastic: bool = False) -> torch.Tensor:
    """``x`` (FP32) rounded to E2M1's grid, ties to even (or ``stochastic``ally), saturating
    at +-6; as FP32 values.

    The grid's spacing is 0.5 below 2, 1 below 4 and 2 up to 6, so a magnitude rounds to its
    spacing's multiples: ``torch.round`` rounds half to even, and an even multiple is an even
    code (the codes count the grid points in order), so ties go to the even code as the spec
    says; a value rounding up to the next binade (1.75 -> 2, 3.5 -> 4) lands on its first
    point, the same in either spacing."""
    mag = x.abs().clamp(max=E2M1_MAX)
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    if stochastic:  # up with probability (mag - lower) / step: unbiased
        u = torch.rand(x.shape, generator=_generator(x.device), device=x.device)
        out = (torch.floor(mag / step) + (u < torch.frac(mag / step)).float()) * step
    else:
        out = torch.round(mag / step) * step
    out = torch.where(torch.isnan(x), x, out)
    return torch.copysign(out, x)


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor FP32 scale: ``amax / (448 * 6)``, so a block holding the tensor's
    amax gets the largest E4M3 block scale."""
    return x.detach().abs().amax().float() / (_E4M3_MAX * E2M1_MAX)


def nvfp4_quantize(x: torch.Tensor, tensor_scale: torch.Tensor | None = None, *,
                   block: int = NVFP4_BLOCK,
                   stochastic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize ``x`` along its last dimension: ``(scales, values)``, the E4M3 block
    scales (one per block of 16, relative to ``tensor_scale`` when one is given) and the E2M1
    values as FP32 (the shape of ``x``), rounded to nearest or ``stochastic``ally."""
    blocks = _blocks(x, block)
    block_scale = blocks.abs().amax(-1, keepdim=True) / E2M1_MAX
    if tensor_scale is not None:
        block_scale = block_scale / tensor_scale
    scales = block_scale.clamp(_E4M3_TINY, _E4M3_MAX).to(torch.float8_e4m3fn)
    rcp = 1.0 / scales.float()
    if tensor_scale is not None:
        rcp = (1.0 / tensor_scale) / scales.float()
    values = to_e2m1((blocks * rcp).clamp(-E2M1_MAX, E2M1_MAX), stochastic=stochastic)
    return scales.squeeze(-1), values.reshape(x.shape)


def nvfp4_dequantize(scales: torch.Tensor, values: torch.Tensor,
                     tensor_scale: torch.Tensor | None = None, *,
                     block: int = NVFP4_BLOCK) -> torch.Tensor:
    """FP32 values of :func:`nvfp4_quantize`'s output."""
    scale = scales.float().unsqueeze(-1)
    if tensor_scale is not None:
        scale = scale * tensor_scale
    return (_blocks(values, block) * scale).reshape(values.shape)


# the transform's random signs, fixed (as Transformer Engine's are), one per position of a block
_RHT_SIGNS = (1, -1, -1, 1, 1, 1, -1, 1, -1, -1, 1, -1, 1, 1, -1, -1)


def _hadamard_matrix(device: torch.device) -> torch.Tensor:
    """The 16 x 16 random Hadamard matrix ``diag(signs) @ H / 4`` (Sylvester's H): orthonormal."""
    h = torch.ones(1, 1)
    while h.shape[0] < NVFP4_BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.tensor(_RHT_SIGNS, dtype=torch.float32).unsqueeze(1)
    return (signs * h / NVFP4_BLOCK ** 0.5).to(device)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """``x`` (FP32) with each block of 16 along its last dimension multiplied by the random
    Hadamard matrix: applied to both operands along their contraction, it leaves the product
    unchanged (up to rounding) and spreads a block's outlier over the block."""
    blocks = _blocks(x, NVFP4_BLOCK)
    return (blocks @ _hadamard_matrix(x.device)).reshape(x.shape)
