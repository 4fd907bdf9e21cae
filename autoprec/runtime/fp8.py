"""Scaled low-precision matmul with an explicit backward: real ``torch._scaled_mm`` on CUDA sm_89+ for FP8, exact emulation elsewhere.

The kernels read a format's :class:`~autoprec.formats.Numerics` (what each GEMM's operands are
cast to and how they are scaled: :mod:`autoprec.scaling`, whose scalings say which GEMMs these
kernels compute and how each rounds an operand). Two kernels:

- per-tensor scales on all three GEMMs, any FP8 dtype per operand (the quantized forward
  operands are saved and reused by dgrad and wgrad, the gradient quantized once);
- per GEMM (:class:`_PerGemmMatmul`): the inputs are saved and each GEMM rounds its two
  operands along its own contraction as its :class:`~autoprec.formats.Gemm` says: per-row
  power-of-two scales in E4M3, a per-tensor FP8 scale, MX or NVFP4 blocks
  (:mod:`autoprec.blockscale`, with NVFP4's Hadamard transform and stochastic
  rounding of the gradient operand where the Gemm asks), or none (a BF16 or FP32 GEMM). Any
  mix of these per GEMM is one format (:func:`autoprec.formats.per_gemm`). Block-scaled GEMMs
  are emulated on every device (their real kernels are torchao's, ``engine=torchao``).

The built-in FP8 recipes, with torchao's names (``Float8LinearConfig.from_recipe_name``):

``rowwise``: every operand, gradients included, in E4M3 with one scale per row along the
contracted dimension (so each GEMM of forward, dgrad and wgrad re-quantizes its operands along
its own contraction), scales rounded down to powers of two, BF16 output; native on sm_90+.
``rowwise_with_gw_hp``: the same, with the weight-gradient GEMM in BF16.
``tensorwise`` (as torchao float8's default and Transformer Engine's current scaling):

- forward operands in E4M3, each with its own dynamic per-tensor scale ``448 / amax``;
- the incoming gradient in E5M2 with its own scale ``57344 / amax``, for both the dgrad
  (``grad @ b.T``) and wgrad (``a.T @ grad``) products;
- scales are computed outside autograd from the detached tensors;
- the forward output is BF16 (accumulation in FP32); gradients return in FP32 or the input's
  dtype.

Why the backward is written out: letting autograd differentiate through ``x.to(float8)``
returns the incoming gradient cast to FP8 *without any scale*, so a gradient of 1e-5 rounds
to E4M3's grid near zero (smallest subnormal 2**-9) and vanishes. Here the gradient is scaled
into E5M2's range before it is rounded.

The emulation rounds exactly as the kernel does (quantize -> dequantize in FP32 -> FP32
matmul); it agrees with ``_scaled_mm`` up to accumulation order. It is for numerics only:
it is slower than FP32, never faster.

Shapes the kernel cannot take (any of M, K, N not a multiple of 16, or of the format's block,
32 for MX; M, K and N as :func:`autoprec.runtime.calls.product_of` reads them) run as a BF16
matmul instead, on every device, so that CPU emulation and GPU show the same numerics.
:func:`~autoprec.runtime.calls.fp8_shape_supported` gives the reason.

16-bit GEMMs (a BF16 or FP16 GEMM of a per-GEMM format, those fallbacks, and inside
:func:`emulating` every matmul of a bf16 or fp16 region: :func:`plain_matmul`) compute as a GPU
does: operands rounded to 16 bits, products accumulated in FP32, the result rounded once. Where
the host has no matmul units for the dtype (a CPU without BF16 dot-product instructions runs a
BF16 matmul ~120x slower than FP32) :func:`emulating` has them computed as FP32 matmuls of the
rounded operands: the same values up to accumulation order, at FP32's speed. For numerics only:
a timing must see the host's own kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from autoprec import blockscale
from autoprec.formats import Format, Gemm, Numerics
from autoprec.host import fp8_is_native
from autoprec.runtime.calls import fp8_shape_supported, product_of
from autoprec.scaling import dequantize, quantize, shape_multiple, tensorwise_scale

__all__ = [
    "fp8_matmul",
    "scaled_matmul",
    "plain_matmul",
    "emulating",
    "emulated_dtypes",
    "round_operand",
    "fp8_linear",
]

# The 16-bit dtypes whose GEMMs compute as FP32 matmuls of rounded operands (see `emulating`).
_EMULATED: frozenset[torch.dtype] = frozenset()


def emulated_dtypes() -> frozenset[torch.dtype]:
    """The 16-bit dtypes whose GEMMs compute by FP32 emulation now (process-wide: the
    measurements run in one thread)."""
    return _EMULATED


@contextlib.contextmanager
def emulating(dtypes) -> Iterator[None]:
    """Within: 16-bit GEMMs in ``dtypes`` (``torch.bfloat16``, ``torch.float16``) compute as
    FP32 matmuls of operands rounded to the dtype, the result rounded to it (a GPU's numerics:
    FP32 accumulation, one rounding), and the matmuls of bf16 and fp16 regions
    (:mod:`autoprec.runtime.rewrite`) route through :func:`plain_matmul` to do so. For hosts
    without 16-bit matmul units (:func:`autoprec.host.slow_16bit_dtypes`); numerics only.
    A backward run after the block keeps the forward's choice."""
    global _EMULATED
    bad = [d for d in dtypes if d not in (torch.bfloat16, torch.float16)]
    if bad:
        raise ValueError(f"Only 16-bit GEMMs (torch.bfloat16, torch.float16) can be emulated "
                         f"in FP32; got {bad}.")
    prev, _EMULATED = _EMULATED, frozenset(dtypes)
    try:
        yield
    finally:
        _EMULATED = prev


def _plain_product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` as a GEMM in ``dtype`` computes it, returned in ``dtype``: operands
    and bias cast to ``dtype``, FP32 accumulation, the bias added before the one rounding (a
    linear's epilogue); by FP32 arithmetic on the rounded operands where ``dtype`` is
    emulated. A bias goes with a 2-D ``b`` (a linear, an addmm)."""
    if dtype in _EMULATED:
        out = torch.matmul(a.to(dtype).to(torch.float32), b.to(dtype).to(torch.float32))
        if bias is not None:
            out = out + bias.to(dtype).to(torch.float32)
        return out.to(dtype)
    if bias is not None:
        return torch.nn.functional.linear(a.to(dtype), b.to(dtype).t(), bias.to(dtype))
    return torch.matmul(a.to(dtype), b.to(dtype))


def _col_major(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


def _scaled_mm_2d(qa, sa, qb, sb, out_dtype, bias=None) -> torch.Tensor:
    """``_scaled_mm`` with its layout rules: row-major first operand, column-major second,
    FP32 *inverse* scales."""
    return torch._scaled_mm(qa.contiguous(), _col_major(qb), sa.reciprocal(), sb.reciprocal(),
                            bias=bias, out_dtype=out_dtype)


def _mm(qa, sa, qb, sb, *, native: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 product of quantized operands ``qa [..., M, K]`` and ``qb [..., K, N]`` (batch dims
    already broadcast to each other or ``qb`` 2-D), accumulated in FP32. Scales are scalars
    (tensorwise) or broadcast along rows (``sa [..., M, 1]``, ``sb [..., 1, N]``)."""
    if not native:
        return torch.matmul(dequantize(qa, sa), dequantize(qb, sb)).to(out_dtype)
    # rowwise _scaled_mm returns BF16 only
    kernel_out = out_dtype if sa.dim() == 0 else torch.bfloat16
    if qb.dim() == 2:
        lead = qa.shape[:-1]
        sa2 = sa if sa.dim() == 0 else sa.reshape(-1, 1)
        out = _scaled_mm_2d(qa.reshape(-1, qa.shape[-1]), sa2, qb, sb, kernel_out)
        return out.reshape(*lead, qb.shape[-1]).to(out_dtype)
    # Batched activation x activation products (attention scores): one kernel per matrix.
    a3 = qa.reshape(-1, *qa.shape[-2:])
    b3 = qb.reshape(-1, *qb.shape[-2:])
    n = a3.shape[0]

    sa3, sb3 = _per_matrix(sa, qa.shape, n), _per_matrix(sb, qb.shape, n)
    outs = [_scaled_mm_2d(a3[i], sa3[i], b3[i], sb3[i], kernel_out) for i in range(n)]
    return torch.stack(outs).reshape(*qa.shape[:-1], qb.shape[-1]).to(out_dtype)


def _per_matrix(scale: torch.Tensor, shape: torch.Size, n: int) -> list[torch.Tensor]:
    """The scale of each of the ``n`` matrices of a batched operand of ``shape``."""
    if scale.dim() == 0:
        return [scale] * n
    return list(scale.expand(*shape[:-2], *scale.shape[-2:]).reshape(n, *scale.shape[-2:]))


def _input_grads(ctx, grad_out: torch.Tensor, grad_a, grad_b,
                 bias_sum: torch.dtype = torch.float32) -> tuple:
    """(grad_a, grad_b, grad_bias) in the dtypes of the forward's inputs; the bias gradient
    summed in FP32 and rounded to ``bias_sum`` (a 16-bit layer's: autocast's bias is cast)."""
    _, _, bias_shape = ctx.shapes
    a_dtype, b_dtype, bias_dtype = ctx.dtypes
    grad_bias = None
    if bias_shape is not None and ctx.needs_input_grad[2]:
        grad_bias = grad_out.to(torch.float32).sum_to_size(bias_shape).to(bias_sum).to(bias_dtype)
    return (None if grad_a is None else grad_a.to(a_dtype),
            None if grad_b is None else grad_b.to(b_dtype), grad_bias)


class _FP8Matmul(torch.autograd.Function):
    """``a @ b (+ bias)`` with per-tensor scaled FP8 operands: ``a`` in ``a_dtype``, ``b`` in
    ``b_dtype``, the incoming gradient in ``grad_dtype`` (tensorwise: E4M3, E4M3, E5M2)."""

    @staticmethod
    def forward(ctx, a, b, bias, native, a_dtype, b_dtype, grad_dtype):
        device_type = a.device.type
        with torch.autocast(device_type, enabled=False):
            sa, sb = tensorwise_scale(a, a_dtype), tensorwise_scale(b, b_dtype)
            qa, qb = quantize(a, sa, a_dtype), quantize(b, sb, b_dtype)
            if b.dim() > 2:
                batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
                qa_b = qa.expand(*batch, *qa.shape[-2:])
                qb_b = qb.expand(*batch, *qb.shape[-2:])
            else:
                qa_b, qb_b = qa, qb
            out = _mm(qa_b, sa, qb_b, sb, native=native, out_dtype=torch.float32)
            if bias is not None:
                out = out + bias.to(torch.float32)
            out = out.to(torch.bfloat16)
        ctx.save_for_backward(qa, sa, qb, sb)
        ctx.native, ctx.grad_dtype = native, grad_dtype
        ctx.shapes = (a.shape, b.shape, None if bias is None else bias.shape)
        ctx.dtypes = (a.dtype, b.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qa, sa, qb, sb = ctx.saved_tensors
        a_shape, b_shape, _ = ctx.shapes
        grad_a = grad_b = None
        with torch.autocast(grad_out.device.type, enabled=False):
            sg = tensorwise_scale(grad_out, ctx.grad_dtype)
            qg = quantize(grad_out, sg, ctx.grad_dtype)
            if len(b_shape) == 2:
                g2 = qg.reshape(-1, qg.shape[-1])
                a2 = qa.reshape(-1, qa.shape[-1])
                if ctx.needs_input_grad[0]:
                    grad_a = _mm(g2, sg, qb.t(), sb, native=ctx.native, out_dtype=torch.float32)
                    grad_a = grad_a.reshape(a_shape)
                if ctx.needs_input_grad[1]:
                    grad_b = _mm(a2.t(), sa, g2, sg, native=ctx.native, out_dtype=torch.float32)
            else:
                batch = qg.shape[:-2]
                qa_b = qa.expand(*batch, *qa.shape[-2:])
                qb_b = qb.expand(*batch, *qb.shape[-2:])
                if ctx.needs_input_grad[0]:
                    grad_a = _mm(qg, sg, qb_b.transpose(-1, -2), sb, native=ctx.native,
                                 out_dtype=torch.float32).sum_to_size(a_shape)
                if ctx.needs_input_grad[1]:
                    grad_b = _mm(qa_b.transpose(-1, -2), sa, qg, sg, native=ctx.native,
                                 out_dtype=torch.float32).sum_to_size(b_shape)
        return (*_input_grads(ctx, grad_out, grad_a, grad_b), None, None, None, None)


class _PerGemmMatmul(torch.autograd.Function):
    """``a @ b (+ bias)`` with each GEMM's operands rounded along its own contraction as the
    format's Gemm for it says (:func:`_gemm_product`): the rowwise recipes, the block-scaled
    formats and any per-GEMM mix of them.

    The inputs are saved for backward as they came and cast to FP32 there again (the same
    casts, so the same bits): an FP32 copy would double what a 16-bit input keeps, and for an
    FP32 input ``.to(float32)`` is the input itself, an alias of a forward input that dynamo
    failed to capture (InternalTorchDynamoError tracing a model under the runtime guard).
    A plain 16-bit layer (:func:`plain_matmul`, all three GEMMs in one 16-bit dtype) saves
    its operands cast to that dtype instead, as autocast's kernel does (the same bits: the
    casts round once, and rounding again changes nothing), so that a step measured under
    :func:`emulating` keeps the bytes a native one keeps (:mod:`autoprec.memory`).
    """

    @staticmethod
    def forward(ctx, a, b, bias, native, numerics):
        a_in, b_in = a, b
        low = _plain_dtype(numerics)
        with torch.autocast(a.device.type, enabled=False):
            if numerics.is_scaled:
                out = _gemm_product(*_operands(a, b), numerics.fwd, native)
                if bias is not None:
                    out = out + bias.to(torch.float32)
            else:  # a 16-bit layer (plain_matmul): the bias in the GEMM, as autocast's linear
                if low is not None:  # saved as autocast's kernel saves them
                    a, b = a.detach().to(low), b.detach().to(low)
                out = _plain_product(*_operands(a, b, low or torch.float32),
                                     numerics.fwd.a, bias)
            out = out.to(numerics.output)
        ctx.save_for_backward(a, b)
        ctx.native, ctx.numerics, ctx.emulated = native, numerics, _EMULATED
        ctx.shapes = (a_in.shape, b_in.shape, None if bias is None else bias.shape)
        ctx.dtypes = (a_in.dtype, b_in.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        a_shape, b_shape, _ = ctx.shapes
        num = ctx.numerics
        grad_a = grad_b = None
        # a plain layer multiplies in its dtype (its operands are saved in it, the gradients
        # stay in it: no FP32 copies beside what autocast's kernel keeps)
        low = _plain_dtype(num)
        work = low or torch.float32

        def product(x, y, gemm, grad_operand):
            if low is not None:
                return _plain_product(x, y, low)
            return _gemm_product(x, y, gemm, ctx.native, grad_operand=grad_operand)

        with torch.autocast(grad_out.device.type, enabled=False), emulating(ctx.emulated):
            a32, b32 = _operands(a, b, work)
            g = grad_out.to(work)
            if len(b_shape) == 2:  # leading dims of a fold into M, as in the forward
                g, a32 = g.reshape(-1, g.shape[-1]), a32.reshape(-1, a32.shape[-1])
            if ctx.needs_input_grad[0]:  # dgrad: g @ b^T, contracted over N
                grad_a = product(g, b32.transpose(-1, -2), num.dgrad, 0)
                grad_a = grad_a.reshape(a_shape) if len(b_shape) == 2 else \
                    grad_a.sum_to_size(a_shape)
            if ctx.needs_input_grad[1]:  # wgrad: a^T @ g, contracted over M
                grad_b = product(a32.transpose(-1, -2), g, num.wgrad, 1).sum_to_size(b_shape)
        bias_sum = torch.float32 if num.is_scaled else num.output
        return (*_input_grads(ctx, grad_out, grad_a, grad_b, bias_sum), None, None)


def _plain_dtype(numerics: Numerics) -> torch.dtype | None:
    """The 16-bit dtype of a plain layer's three GEMMs (bf16, fp16), None for any other
    numerics (a scaled format, a per-GEMM mix)."""
    gemms = (numerics.fwd, numerics.dgrad, numerics.wgrad)
    dtype = numerics.fwd.a
    if dtype in (torch.bfloat16, torch.float16) and all(
            not g.is_scaled and g.a is dtype and g.b is dtype for g in gemms):
        return dtype
    return None


def _operands(a: torch.Tensor, b: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` in ``dtype``, batch dimensions broadcast to each other when ``b`` is
    batched (forward and backward build them alike, so both quantize the same values)."""
    a32, b32 = a.detach().to(dtype), b.detach().to(dtype)
    if b.dim() > 2:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a32, b32 = a32.expand(*batch, *a.shape[-2:]), b32.expand(*batch, *b.shape[-2:])
    return a32, b32


def round_operand(x: torch.Tensor, gemm: Gemm, operand: int, *,
                  stochastic: bool = False) -> torch.Tensor:
    """The FP32 values a GEMM multiplies in place of its ``operand`` (0: first, 1: second)
    ``x``, FP32 with the contraction along its last dimension (no autograd): ``x`` cast to the
    Gemm's dtype, or quantized with its scaling and dequantized."""
    dtype = gemm.a if operand == 0 else gemm.b
    with torch.no_grad():
        return gemm.scaling.round(x.detach().to(torch.float32), gemm, dtype,
                                  stochastic=stochastic)


def _gemm_product(a: torch.Tensor, b: torch.Tensor, gemm: Gemm, native: bool, *,
                  grad_operand: int | None = None) -> torch.Tensor:
    """``a [..., M, K] @ b [..., K, N]`` in FP32 as ``gemm`` computes it: both operands rounded
    along K (``b`` through its transpose), NVFP4's Hadamard transform first where the Gemm has
    it, stochastic rounding for the gradient operand (``grad_operand``) where it has that. A
    plain GEMM multiplies in its dtype; FP8 GEMMs run ``_scaled_mm`` where ``native``."""
    if not gemm.is_scaled:
        return _plain_product(a, b, gemm.a).float()
    scale = gemm.scaling.scale
    if scale is not None:  # one FP32 scale per tensor or row: the scaled-matmul kernel's
        sa, sb = scale(a, gemm.a, -1), scale(b, gemm.b, -2)
        return _mm(quantize(a, sa, gemm.a), sa, quantize(b, sb, gemm.b), sb, native=native,
                   out_dtype=torch.float32)
    bt = b.transpose(-1, -2)
    if gemm.hadamard:
        a, bt = blockscale.hadamard_transform(a), blockscale.hadamard_transform(bt)
    ra = round_operand(a, gemm, 0, stochastic=gemm.stochastic and grad_operand == 0)
    rb = round_operand(bt, gemm, 1, stochastic=gemm.stochastic and grad_operand == 1)
    return torch.matmul(ra, rb.transpose(-1, -2))


def _bf16_matmul(a, b, bias):
    """The product in BF16 (a shape the scaled kernels cannot take); inside
    :func:`emulating`, the emulated bf16 region's own kernel, so that the two agree exactly."""
    if torch.bfloat16 in _EMULATED:
        return plain_matmul(a, b, bias, fmt=Format.BF16)
    with torch.autocast(a.device.type, enabled=False):
        out = torch.matmul(a.to(torch.bfloat16), b.to(torch.bfloat16))
        if bias is not None:
            out = out + bias.to(torch.bfloat16)
        return out


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                  fmt: Format, native: bool | None = None) -> torch.Tensor:
    """``a @ b + bias`` (``torch.matmul`` broadcasting, both operands at least 2-D) as the
    scaled format ``fmt`` computes it (an FP8 recipe, MXFP8, NVFP4 or a per-GEMM mix; see the
    module docstring). Returns BF16.

    ``native=None`` picks ``torch._scaled_mm`` where the device has kernels for the format
    and the emulation elsewhere; ``native=True`` forces the kernel for FP8 GEMMs (on CPU it
    runs, slowly: useful to test the layout). Shapes the kernel cannot take compute in BF16,
    on every device.
    """
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(f"A scaled matmul needs operands of at least 2 dimensions, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}; 1-D products stay in bf16.")
    num = fmt.numerics
    if not num.is_scaled:
        raise ValueError(f"scaled_matmul computes scaled formats; {fmt} is not one.")
    p = product_of(a.shape, b.shape)
    if not fp8_shape_supported(p.m, p.k, p.n, shape_multiple(num))[0]:
        return _bf16_matmul(a, b, bias)
    if native is None:
        native = fp8_is_native(a.device, fmt)
    if num.saves_quantized:
        return _FP8Matmul.apply(a, b, bias, native, num.fwd.a, num.fwd.b, num.dgrad.a)
    return _PerGemmMatmul.apply(a, b, bias, native, num)


def plain_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                 fmt: Format) -> torch.Tensor:
    """``a @ b + bias`` (both operands at least 2-D) as autocast computes it in ``fmt``'s
    16-bit dtype (bf16, fp16): operands and bias rounded, FP32 accumulation, the result and the
    gradients rounded to the dtype, each GEMM by FP32 emulation where :func:`emulating` says.
    The router of a bf16 or fp16 region inside :func:`emulating`."""
    num = fmt.numerics
    if num.is_scaled or num.autocast is None:
        raise ValueError(f"plain_matmul computes bf16 and fp16 GEMMs; {fmt} is not one.")
    return _PerGemmMatmul.apply(a, b, bias, False, num)


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
               native: bool | None = None, recipe: str = "tensorwise") -> torch.Tensor:
    """``a @ b + bias`` in FP8 with ``recipe`` (tensorwise, rowwise, rowwise_with_gw_hp or a
    registered one): :func:`scaled_matmul` of ``Format.fp8(recipe)``."""
    return scaled_matmul(a, b, bias, fmt=Format.fp8(recipe), native=native)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               native: bool | None = None, recipe: str = "tensorwise") -> torch.Tensor:
    """``F.linear`` in FP8: ``x @ weight.T + bias``."""
    return fp8_matmul(x, weight.t(), bias, native=native, recipe=recipe)
