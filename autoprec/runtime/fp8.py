"""FP8 matmul with an explicit backward: real ``torch._scaled_mm`` on CUDA sm_89+, exact emulation elsewhere.

The kernels read a format's :class:`~autoprec.formats.Numerics` (what each GEMM's operands are
cast to and how they are scaled); :func:`check_kernels` says which numerics they compute. Two
kernels: per-tensor scales on all three GEMMs, any FP8 dtype per operand (the quantized
forward operands are saved and reused by dgrad and wgrad, the gradient quantized once), and
per-row power-of-two scales in E4M3 with the weight-gradient GEMM in FP8 or BF16. The built-in
recipes, with torchao's names (``Float8LinearConfig.from_recipe_name``):

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

Shapes the kernel cannot take (any of M, K, N not a multiple of 16; M, K and N as
:func:`autoprec.runtime.calls.product_of` reads them) run as a BF16 matmul instead, on every
device, so that CPU emulation and GPU show the same numerics.
:func:`~autoprec.runtime.calls.fp8_shape_supported` gives the reason.
"""

from __future__ import annotations

import torch

from autoprec.formats import FP8_E4M3, Format, Gemm, Numerics, fp8_is_native
from autoprec.runtime.calls import fp8_shape_supported, product_of

__all__ = [
    "fp8_matmul",
    "fp8_linear",
    "tensorwise_scale",
    "rowwise_scale",
    "quantize",
    "dequantize",
    "check_kernels",
]

# Lower bound on amax: an all-zero tensor would otherwise give an infinite scale
# (the failure fixed in pytorch/ao#3356 by the same kind of bound).
_AMAX_EPS = 1e-12


def tensorwise_scale(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP32 scalar ``fp8_max / amax(x)``; ``x * scale`` fills the FP8 range. No autograd."""
    with torch.no_grad():
        amax = x.detach().abs().amax().to(torch.float32).clamp(min=_AMAX_EPS)
        return torch.finfo(fp8_dtype).max / amax


def quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Round ``x * scale`` to ``fp8_dtype`` (saturating at the format's max)."""
    fp8_max = torch.finfo(fp8_dtype).max
    with torch.no_grad():
        return (x.detach().to(torch.float32) * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP32 values an FP8 tensor stands for."""
    return q.to(torch.float32) / scale


def rowwise_scale(x: torch.Tensor, fp8_dtype: torch.dtype, dim: int) -> torch.Tensor:
    """FP32 ``fp8_max / amax(x)`` along ``dim`` (kept, so it broadcasts against ``x``), rounded
    down to a power of two as torchao's rowwise recipes do. No autograd."""
    with torch.no_grad():
        amax = x.detach().abs().amax(dim=dim, keepdim=True).to(torch.float32)
        scale = torch.finfo(fp8_dtype).max / amax.clamp(min=_AMAX_EPS)
        return torch.exp2(torch.floor(torch.log2(scale)))


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


def _input_grads(ctx, grad_out: torch.Tensor, grad_a, grad_b) -> tuple:
    """(grad_a, grad_b, grad_bias) in the dtypes of the forward's inputs."""
    _, _, bias_shape = ctx.shapes
    a_dtype, b_dtype, bias_dtype = ctx.dtypes
    grad_bias = None
    if bias_shape is not None and ctx.needs_input_grad[2]:
        grad_bias = grad_out.to(torch.float32).sum_to_size(bias_shape).to(bias_dtype)
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


class _FP8RowwiseMatmul(torch.autograd.Function):
    """``a @ b (+ bias)`` with the rowwise recipes: each GEMM's operands quantized to E4M3 along
    its own contracted dimension; ``gw_hp`` runs the weight-gradient GEMM in BF16.

    The inputs are saved for backward as they came and cast to FP32 there again (the same
    casts, so the same bits): an FP32 copy would double what a 16-bit input keeps, and for an
    FP32 input ``.to(float32)`` is the input itself, an alias of a forward input that dynamo
    failed to capture (InternalTorchDynamoError tracing a model under the runtime guard).
    """

    @staticmethod
    def forward(ctx, a, b, bias, native, gw_hp):
        with torch.autocast(a.device.type, enabled=False):
            out = _rowwise_product(*_fp32_operands(a, b), native)
            if bias is not None:
                out = out + bias.to(torch.float32)
            out = out.to(torch.bfloat16)
        ctx.save_for_backward(a, b)
        ctx.native, ctx.gw_hp = native, gw_hp
        ctx.shapes = (a.shape, b.shape, None if bias is None else bias.shape)
        ctx.dtypes = (a.dtype, b.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        a_shape, b_shape, _ = ctx.shapes
        grad_a = grad_b = None
        with torch.autocast(grad_out.device.type, enabled=False):
            a32, b32 = _fp32_operands(a, b)
            g = grad_out.to(torch.float32)
            if len(b_shape) == 2:  # leading dims of a fold into M, as in the forward
                g, a32 = g.reshape(-1, g.shape[-1]), a32.reshape(-1, a32.shape[-1])
            if ctx.needs_input_grad[0]:  # dgrad: g @ b^T, contracted over N
                grad_a = _rowwise_product(g, b32.transpose(-1, -2), ctx.native)
                grad_a = grad_a.reshape(a_shape) if len(b_shape) == 2 else \
                    grad_a.sum_to_size(a_shape)
            if ctx.needs_input_grad[1]:  # wgrad: a^T @ g, contracted over M
                at = a32.transpose(-1, -2)
                grad_b = (torch.matmul(at.to(torch.bfloat16), g.to(torch.bfloat16)).float()
                          if ctx.gw_hp else _rowwise_product(at, g, ctx.native))
                grad_b = grad_b.sum_to_size(b_shape)
        return (*_input_grads(ctx, grad_out, grad_a, grad_b), None, None)


def _fp32_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` in FP32, batch dimensions broadcast to each other when ``b`` is batched
    (forward and backward build them alike, so both quantize the same values)."""
    a32, b32 = a.detach().to(torch.float32), b.detach().to(torch.float32)
    if b.dim() > 2:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a32, b32 = a32.expand(*batch, *a.shape[-2:]), b32.expand(*batch, *b.shape[-2:])
    return a32, b32


def _rowwise_product(a: torch.Tensor, b: torch.Tensor, native: bool) -> torch.Tensor:
    """``a [..., M, K] @ b [..., K, N]`` in FP32 from E4M3 operands scaled along K: per row of
    ``a``, per column of ``b``."""
    sa, sb = rowwise_scale(a, FP8_E4M3, -1), rowwise_scale(b, FP8_E4M3, -2)
    return _mm(quantize(a, sa, FP8_E4M3), sa, quantize(b, sb, FP8_E4M3), sb, native=native,
               out_dtype=torch.float32)


def _bf16_matmul(a, b, bias):
    with torch.autocast(a.device.type, enabled=False):
        out = torch.matmul(a.to(torch.bfloat16), b.to(torch.bfloat16))
        if bias is not None:
            out = out + bias.to(torch.bfloat16)
        return out


def check_kernels(numerics: Numerics) -> None:
    """A ValueError unless this module's kernels compute ``numerics`` (see the module
    docstring); :func:`autoprec.formats.register` calls it for every new FP8 format."""
    fwd, dgrad, wgrad = numerics.fwd, numerics.dgrad, numerics.wgrad
    if numerics.scaling == "tensor":
        ok = (all(g.scaling == "tensor" and not g.pow2_scales for g in (fwd, dgrad, wgrad))
              and dgrad.b == fwd.b and wgrad.a == fwd.a and dgrad.a == wgrad.b)
    else:
        row = Gemm(FP8_E4M3, FP8_E4M3, "row", pow2_scales=True)
        ok = fwd == row and dgrad == row and wgrad in (row, Gemm(torch.bfloat16, torch.bfloat16))
    if not ok:
        raise ValueError(
            f"autoprec's FP8 kernels do not compute {numerics.label}: they take per-tensor scales "
            "on all three GEMMs (the forward operands reused by dgrad and wgrad, one dtype for "
            "the gradient), or power-of-two row scales in E4M3 with the weight gradient in E4M3 "
            "or BF16. Add a kernel in autoprec/runtime/fp8.py for these numerics.")


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
               native: bool | None = None, recipe: str = "tensorwise") -> torch.Tensor:
    """``a @ b + bias`` (``torch.matmul`` broadcasting, both operands at least 2-D) in FP8
    with ``recipe`` (tensorwise, rowwise, rowwise_with_gw_hp or a registered one; see the
    module docstring).

    ``native=None`` picks ``torch._scaled_mm`` where the device has kernels for the recipe and
    the emulation elsewhere; ``native=True`` forces the kernel (on CPU it runs, slowly: useful
    to test the layout). Shapes the kernel cannot take compute in BF16, on every device.
    Returns BF16.
    """
    fmt = Format.fp8(recipe)
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(f"fp8_matmul needs operands of at least 2 dimensions, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}; 1-D products stay in bf16.")
    p = product_of(a.shape, b.shape)
    if not fp8_shape_supported(p.m, p.k, p.n)[0]:
        return _bf16_matmul(a, b, bias)
    if native is None:
        native = fp8_is_native(a.device, fmt)
    num = fmt.numerics
    if num.saves_quantized:
        return _FP8Matmul.apply(a, b, bias, native, num.fwd.a, num.fwd.b, num.dgrad.a)
    return _FP8RowwiseMatmul.apply(a, b, bias, native, not num.wgrad.is_fp8)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               native: bool | None = None, recipe: str = "tensorwise") -> torch.Tensor:
    """``F.linear`` in FP8: ``x @ weight.T + bias``."""
    return fp8_matmul(x, weight.t(), bias, native=native, recipe=recipe)
