"""FP8 matmul with an explicit backward: real ``torch._scaled_mm`` on CUDA sm_89+, exact emulation elsewhere.

Recipe ("tensorwise", as torchao float8 and Transformer Engine's current scaling):

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

from autoprec.formats import FP8_E4M3, FP8_E5M2, fp8_is_native
from autoprec.runtime.calls import fp8_shape_supported, product_of

__all__ = [
    "fp8_matmul",
    "fp8_linear",
    "tensorwise_scale",
    "quantize",
    "dequantize",
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


def _col_major(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


def _scaled_mm_2d(qa, sa, qb, sb, out_dtype, bias=None) -> torch.Tensor:
    """``_scaled_mm`` with its layout rules: row-major first operand, column-major second,
    FP32 *inverse* scales."""
    return torch._scaled_mm(qa.contiguous(), _col_major(qb), sa.reciprocal(), sb.reciprocal(),
                            bias=bias, out_dtype=out_dtype)


def _mm(qa, sa, qb, sb, *, native: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 product of quantized operands ``qa [..., M, K]`` and ``qb [..., K, N]`` (batch dims
    already broadcast to each other or ``qb`` 2-D), accumulated in FP32."""
    if not native:
        return torch.matmul(dequantize(qa, sa), dequantize(qb, sb)).to(out_dtype)
    if qb.dim() == 2:
        lead = qa.shape[:-1]
        out = _scaled_mm_2d(qa.reshape(-1, qa.shape[-1]), sa, qb, sb, out_dtype)
        return out.reshape(*lead, qb.shape[-1])
    # Batched activation x activation products (attention scores): one kernel per matrix.
    a3 = qa.reshape(-1, *qa.shape[-2:])
    b3 = qb.reshape(-1, *qb.shape[-2:])
    outs = [_scaled_mm_2d(a3[i], sa, b3[i], sb, out_dtype) for i in range(a3.shape[0])]
    return torch.stack(outs).reshape(*qa.shape[:-1], qb.shape[-1])


class _FP8Matmul(torch.autograd.Function):
    """``a @ b (+ bias)`` with FP8 operands; see the module docstring for the recipe."""

    @staticmethod
    def forward(ctx, a, b, bias, native):
        device_type = a.device.type
        with torch.autocast(device_type, enabled=False):
            sa, sb = tensorwise_scale(a, FP8_E4M3), tensorwise_scale(b, FP8_E4M3)
            qa, qb = quantize(a, sa, FP8_E4M3), quantize(b, sb, FP8_E4M3)
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
        ctx.native = native
        ctx.shapes = (a.shape, b.shape, None if bias is None else bias.shape)
        ctx.dtypes = (a.dtype, b.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qa, sa, qb, sb = ctx.saved_tensors
        a_shape, b_shape, bias_shape = ctx.shapes
        a_dtype, b_dtype, bias_dtype = ctx.dtypes
        grad_a = grad_b = grad_bias = None
        with torch.autocast(grad_out.device.type, enabled=False):
            sg = tensorwise_scale(grad_out, FP8_E5M2)
            qg = quantize(grad_out, sg, FP8_E5M2)
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
            if bias_shape is not None and ctx.needs_input_grad[2]:
                grad_bias = grad_out.to(torch.float32).sum_to_size(bias_shape).to(bias_dtype)
        if grad_a is not None:
            grad_a = grad_a.to(a_dtype)
        if grad_b is not None:
            grad_b = grad_b.to(b_dtype)
        return grad_a, grad_b, grad_bias, None


def _bf16_matmul(a, b, bias):
    with torch.autocast(a.device.type, enabled=False):
        out = torch.matmul(a.to(torch.bfloat16), b.to(torch.bfloat16))
        if bias is not None:
            out = out + bias.to(torch.bfloat16)
        return out


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
               native: bool | None = None) -> torch.Tensor:
    """``a @ b + bias`` (``torch.matmul`` broadcasting, both operands at least 2-D) in FP8.

    ``native=None`` picks ``torch._scaled_mm`` on CUDA sm_89+ and the emulation elsewhere;
    ``native=True`` forces the kernel (on CPU it runs, slowly: useful to test the layout).
    Shapes the kernel cannot take compute in BF16, on every device (see module docstring).
    Returns BF16.
    """
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(f"fp8_matmul needs operands of at least 2 dimensions, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}; 1-D products stay in bf16.")
    p = product_of(a.shape, b.shape)
    if not fp8_shape_supported(p.m, p.k, p.n)[0]:
        return _bf16_matmul(a, b, bias)
    if native is None:
        native = fp8_is_native(a.device)
    return _FP8Matmul.apply(a, b, bias, native)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               native: bool | None = None) -> torch.Tensor:
    """``F.linear`` in FP8: ``x @ weight.T + bias``."""
    return fp8_matmul(x, weight.t(), bias, native=native)
