"""FP8 numerics: the emulation rounds exactly as FP8 does, gradients are scaled E5M2, and the
real kernel (``torch._scaled_mm``, which runs slowly on CPU at small sizes) agrees with it."""

from __future__ import annotations

import pytest
import torch

from autoprec.formats import FP8_E4M3, FP8_E5M2
from autoprec.runtime.calls import fp8_shape_supported
from autoprec.runtime.fp8 import (
    dequantize,
    fp8_linear,
    fp8_matmul,
    quantize,
    tensorwise_scale,
)


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.detach().double(), x.detach().double()
    return float(10 * torch.log10(ref.square().sum() / (ref - x).square().sum()))


def _reference_round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Independent scaled float8 round trip: scale to the format's max, cast, cast back."""
    fmax = torch.finfo(dtype).max
    scale = fmax / x.abs().max().float()
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype).to(torch.float32) / scale


def test_quantized_operands_equal_scaled_float8_round_trip_bit_for_bit():
    for dtype in (FP8_E4M3, FP8_E5M2):
        x = torch.randn(257, 129) * 3.7
        scale = tensorwise_scale(x, dtype)
        ours = dequantize(quantize(x, scale, dtype), scale)
        ref = _reference_round_trip(x, dtype)
        assert torch.equal(ours, ref), f"{dtype}: {(ours != ref).sum()} elements differ"
        # and the values really are on the FP8 grid (not a no-op)
        assert not torch.equal(ours, x)
        grid = (ours * scale).to(dtype).to(torch.float32) / scale
        assert torch.equal(grid, ours)


def test_forward_is_product_of_quantized_operands():
    a = torch.randn(64, 96)
    b = torch.randn(96, 48)
    out = fp8_matmul(a, b, native=False)
    assert out.dtype == torch.bfloat16
    ref = (_reference_round_trip(a, FP8_E4M3).double()
           @ _reference_round_trip(b, FP8_E4M3).double())
    # FP32 accumulation then one BF16 rounding: within one bf16 ulp of the exact product
    rel = ((out.double() - ref).abs() / ref.abs().clamp(min=1e-3)).max().item()
    assert rel <= 2 ** -8 + 1e-6, f"max relative deviation {rel:.3g} exceeds one bf16 ulp"


@pytest.mark.parametrize("shape", [(8, 32, 64), (2, 3, 32, 64)])
def test_gradients_are_straight_through_with_scaled_e5m2_rounding(shape):
    x = (torch.randn(*shape) * 2).requires_grad_()
    w = torch.randn(48, shape[-1], requires_grad=True)
    bias = torch.randn(48, requires_grad=True)
    y = fp8_linear(x, w, bias, native=False)
    g = torch.randn_like(y, dtype=torch.float32) * 0.01
    y.backward(g.to(y.dtype))

    gq = _reference_round_trip(g.to(y.dtype), FP8_E5M2).double()
    xq = _reference_round_trip(x.detach(), FP8_E4M3).double()
    wq = _reference_round_trip(w.detach(), FP8_E4M3).double()
    ref_dx = gq @ wq
    ref_dw = gq.reshape(-1, 48).t() @ xq.reshape(-1, shape[-1])
    for name, got, ref in (("dgrad", x.grad, ref_dx), ("wgrad", w.grad, ref_dw)):
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-6, f"{name} deviates from the E5M2-rounded product by {err:.3g}"
    torch.testing.assert_close(bias.grad, g.reshape(-1, 48).sum(0), rtol=1e-2, atol=1e-3)


def test_tiny_incoming_gradients_still_give_weight_gradients():
    """A gradient of ~1e-5 is below E4M3's smallest subnormal (2**-9): autograd through an
    unscaled float8 cast zeroes it. The scaled E5M2 backward keeps it."""
    x = torch.randn(32, 64)
    w = torch.randn(32, 64, requires_grad=True)
    g = torch.randn(32, 32) * 1e-5

    # The trap: differentiate through `.to(float8)` and the gradient is rounded to FP8 unscaled.
    w_naive = w.detach().clone().requires_grad_()
    naive = x.to(FP8_E4M3).float() @ w_naive.to(FP8_E4M3).float().t()
    naive.backward(g)
    assert w_naive.grad.count_nonzero() == 0, "expected the unscaled cast to zero the gradient"

    fp8_linear(x, w, native=False).backward(g.to(torch.bfloat16))
    ref = g.double().t() @ x.double()
    assert w.grad.count_nonzero() == w.numel()
    assert sqnr_db(ref, w.grad) > 15, f"weight-gradient SQNR {sqnr_db(ref, w.grad):.1f} dB"


@pytest.mark.parametrize("lead", [(32,), (2, 16)])
def test_real_scaled_mm_agrees_with_emulation(lead):
    """``torch._scaled_mm`` (row-major A, column-major B, inverse scales) on the same operands
    gives the emulation's result up to accumulation order, forward and backward."""
    x1 = torch.randn(*lead, 64, requires_grad=True)
    w1 = torch.randn(48, 64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    w2 = w1.detach().clone().requires_grad_()
    g = torch.randn(*lead, 48).to(torch.bfloat16)
    emu = fp8_linear(x1, w1, native=False)
    real = fp8_linear(x2, w2, native=True)
    emu.backward(g)
    real.backward(g)
    for name, a, b in (("out", emu, real), ("dx", x1.grad, x2.grad), ("dw", w1.grad, w2.grad)):
        rel = ((a.double() - b.double()).norm() / a.double().norm()).item()
        assert rel < 4e-3, f"{name}: real vs emulated relative difference {rel:.3g}"


def test_batched_matmul_real_and_emulated_agree():
    q = torch.randn(2, 2, 32, 16)
    k = torch.randn(2, 2, 16, 32)
    emu = fp8_matmul(q, k, native=False)
    real = fp8_matmul(q, k, native=True)
    rel = ((emu.double() - real.double()).norm() / emu.double().norm()).item()
    assert rel < 4e-3, rel


def test_shapes_the_kernel_cannot_take_run_in_bf16_with_a_reason():
    ok, reason = fp8_shape_supported(128, 768, 4)
    assert not ok and "N=4" in reason and "bf16" in reason
    assert fp8_shape_supported(128, 768, 3072) == (True, "")
    x, w = torch.randn(8, 64), torch.randn(4, 64)
    out = fp8_linear(x, w, native=False)
    expected = x.to(torch.bfloat16) @ w.to(torch.bfloat16).t()
    assert torch.equal(out, expected)


def test_zero_and_nonfinite_inputs():
    z = torch.zeros(16, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    out = fp8_linear(z, w, native=False)
    assert torch.isfinite(out).all() and out.abs().max() == 0
    out.float().sum().backward()
    assert torch.isfinite(w.grad).all() and torch.isfinite(z.grad).all()
    bad = torch.randn(16, 32)
    bad[0, 0] = float("inf")
    assert not torch.isfinite(fp8_linear(bad, w.detach(), native=False)).all()


def test_fp8_sqnr_floor_against_float64():
    a, b = torch.randn(128, 256), torch.randn(256, 128)
    ref = a.double() @ b.double()
    s = sqnr_db(ref, fp8_matmul(a, b, native=False))
    assert 20 < s < 40, f"FP8 E4M3 matmul SQNR {s:.1f} dB outside the expected 20-40 dB band"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shapes", [((2, 32, 64), (64, 48)), ((2, 2, 32, 16), (1, 2, 16, 32))])
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_saves_its_inputs_not_fp32_copies(recipe, shapes, dtype):
    """The rowwise function keeps for backward the tensors it was given, nothing more: an FP32
    copy of a BF16 input doubles what the layer keeps, and an FP32 ``.to(float32)`` alias of an
    FP32 input is what dynamo failed to capture under the guard's hooks."""
    a = torch.randn(*shapes[0], dtype=dtype, requires_grad=True)
    b = torch.randn(*shapes[1], dtype=dtype, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fp8_matmul(a, b, native=False, recipe=recipe)
    inputs = {a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()}
    extra = sum(t.untyped_storage().nbytes() for t in saved
                if t.untyped_storage().data_ptr() not in inputs)
    assert len(saved) == 2, f"{recipe} saved {len(saved)} tensors, expected its 2 inputs"
    assert extra == 0, (f"{recipe} saves {extra} B beyond its {dtype} inputs: "
                        f"{[(t.dtype, tuple(t.shape)) for t in saved]}")
    y.float().sum().backward()  # the backward runs from the inputs as saved
    assert a.grad.dtype == dtype and torch.isfinite(a.grad).all() and b.grad.count_nonzero()
