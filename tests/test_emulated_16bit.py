"""16-bit GEMMs by FP32 emulation (``runtime.fp8.emulating``): the measurements compute a bf16
or fp16 layer's matmuls as FP32 products of rounded operands where the host has no 16-bit
matmul units (a Zen 3 runs BF16 matmuls ~120x slower than FP32). The values must be the 16-bit
GEMM's: operands rounded, FP32 accumulation, one rounding of the result, the gradients alike."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from autoprec import Policy
from autoprec.formats import Format
from autoprec.host import cpu_features, slow_16bit_dtypes
from autoprec.measure.deviation import DeviationMeter, prepare_for_measurement
from autoprec.runtime import rewrite
from autoprec.runtime.fp8 import emulating, plain_matmul
from examples.data import byte_batches

DTYPES = {torch.bfloat16: Format.BF16, torch.float16: Format.FP16}


def _check(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype,
           bias: torch.Tensor | None = None) -> None:
    """``x`` is the 16-bit GEMM ``a @ b (+ bias)`` from first principles: operands rounded to
    ``dtype``, the products summed exactly (FP64), the bias added, one rounding to ``dtype``;
    but where FP32 accumulation lands on the other side of a rounding boundary (at most 0.5% of
    the elements), each off by at most one unit in the last place plus FP32's summation error
    bound (K * 2**-24 * sum |a||b|)."""
    a, b = a.detach().to(dtype).double(), b.detach().to(dtype).double()
    exact = a @ b
    if bias is not None:
        exact = exact + bias.detach().to(dtype).double()
    ref = exact.to(dtype)
    assert x.dtype == dtype
    differ = x != ref
    assert differ.float().mean() <= 0.005, f"{int(differ.sum())} of {x.numel()} elements differ"
    ulp = torch.finfo(dtype).eps * ref.double().abs().clamp(min=torch.finfo(dtype).tiny)
    fp32_sum = a.shape[-1] * 2.0 ** -24 * (a.abs() @ b.abs())
    assert ((x.double() - ref.double()).abs() <= ulp + fp32_sum).all()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_emulated_linear_is_the_16bit_gemm_forward_and_backward(dtype):
    x = torch.randn(4, 32, 256, requires_grad=True)
    w = torch.randn(96, 256, requires_grad=True)
    b = torch.randn(96, requires_grad=True)
    with emulating({dtype}), torch.autocast("cpu", dtype=dtype):
        y = plain_matmul(x, w.t(), b, fmt=DTYPES[dtype])
    _check(y, x, w.t(), dtype, b)

    g = torch.randn(y.shape).to(dtype)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), g)
    assert (gx.dtype, gw.dtype, gb.dtype) == (torch.float32,) * 3  # the inputs' dtypes
    g2 = g.reshape(-1, 96)
    _check(gx.to(dtype), g, w, dtype)  # dgrad: g @ w
    _check(gw.to(dtype), g2.t(), x.reshape(-1, 256), dtype)  # wgrad: g^T @ x
    _check(gb.to(dtype), torch.ones(1, g2.shape[0]), g2, dtype)  # the bias: a sum of g
    # and the gradients are 16-bit values, as autocast's are
    assert torch.equal(gx, gx.to(dtype).float()) and torch.equal(gw, gw.to(dtype).float())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_emulated_attention_matmul_broadcasts_like_torch(dtype):
    q = torch.randn(2, 4, 32, 64, requires_grad=True)
    k = torch.randn(1, 4, 64, 32, requires_grad=True)  # broadcast over the batch
    with emulating({dtype}), torch.autocast("cpu", dtype=dtype):
        s = plain_matmul(q, k, fmt=DTYPES[dtype])
    _check(s, q, k, dtype)
    g = torch.randn(s.shape).to(dtype)
    gq, gk = torch.autograd.grad(s, (q, k), g)
    assert gq.shape == q.shape and gk.shape == k.shape
    _check(gq.to(dtype), g, k.transpose(-1, -2).expand(2, 4, 32, 64), dtype)
    # k's gradient is summed over the batch it was broadcast along, after each GEMM's rounding
    per_batch = [q[i].transpose(-1, -2).to(dtype).double() @ g[i].double() for i in range(2)]
    want = sum(p.to(dtype).double() for p in per_batch).unsqueeze(0)
    assert (gk.double() - want).abs().max() <= 2 * torch.finfo(dtype).eps * want.abs().max()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_region_routes_its_matmuls_only_inside_emulating(dtype):
    """A bf16/fp16 region computes the same values either way (the native 16-bit kernel or the
    emulation); inside ``emulating`` its matmuls go through the emulation, outside they run on
    autocast's kernels."""
    model = tiny_llama(hidden=64, intermediate=128)
    batch = byte_batches(1, 2, 32, seed=0)[0]
    fmt = DTYPES[dtype]
    rewrite.apply(model, Policy(default=fmt), strict=False)
    seen = []
    import autoprec.runtime.fp8 as fp8

    real = fp8._PerGemmMatmul.apply

    def spy(*args):
        seen.append(args[-1].name)
        return real(*args)

    try:
        fp8._PerGemmMatmul.apply = spy
        native = model(**batch).loss
        assert seen == []
        with emulating({dtype}):
            emulated = model(**batch).loss
        assert seen and set(seen) == {fmt.value}
    finally:
        fp8._PerGemmMatmul.apply = real
        rewrite.remove(model)
    assert abs(float(native) - float(emulated)) <= 1e-3 * abs(float(native))


class _Frequencies(torch.nn.Module):
    """A product computed with autocast turned off, as HF Llama's rotary embedding computed its
    frequencies up to transformers 4.4x (``with torch.autocast(..., enabled=False):
    inv_freq.float() @ position_ids.float()``)."""

    def __init__(self):
        super().__init__()
        self.inv_freq = torch.nn.Parameter(torch.rand(2, 64, 32))

    def forward(self, positions):
        with torch.autocast("cpu", enabled=False):
            return self.inv_freq.float() @ positions.float()


def test_code_that_turns_autocast_off_keeps_fp32_in_a_routed_region():
    """A product the model computes with autocast off stays FP32 in an fp8 region and in an
    emulated bf16 one: the router takes only what autocast would have lowered (it took it to
    FP8 before)."""
    module = _Frequencies()
    positions = torch.arange(2 * 32 * 48, dtype=torch.float32).reshape(2, 32, 48)
    with torch.no_grad():
        ref = module(positions)
        for fmt, emulated in (("fp8", ()), ("mxfp8", ()), ("bf16", {torch.bfloat16})):
            rewrite.apply(module, Policy(default=fmt), strict=False)
            try:
                with emulating(emulated):
                    got = module(positions)
            finally:
                rewrite.remove(module)
            assert got.dtype == torch.float32
            assert torch.equal(got, ref), fmt


def test_measurements_agree_with_and_without_emulation():
    """DeviationMeter.compare (every sensitivity and trial measurement) on a real HF Llama: the bf16
    and fp16 errors with the host's kernels and with the emulation agree closely (they differ
    only where the kernels' accumulation order differs)."""
    model = prepare_for_measurement(tiny_llama(hidden=128, intermediate=256))
    batches = byte_batches(2, 2, 32, seed=1)

    def loss(m, b):
        return m(**b).loss

    num = DeviationMeter(model, batches, loss)
    for fmt in (Format.BF16, Format.FP16):
        policy = Policy(default=fmt)
        num.emulated = frozenset()
        native = num.compare(policy)
        num.emulated = frozenset({fmt.autocast_dtype})
        emulated = num.compare(policy)
        assert native.finite and emulated.finite
        assert emulated.grad_rel_error == pytest.approx(native.grad_rel_error, rel=0.1)
        assert emulated.loss_rel_change == pytest.approx(native.loss_rel_change, rel=0.5,
                                                         abs=1e-5)


def test_numerics_emulates_what_this_host_has_no_units_for():
    host = cpu_features()
    model = prepare_for_measurement(tiny_llama())
    num = DeviationMeter(model, byte_batches(1, 1, 8, seed=0), lambda m, b: m(**b).loss)
    assert (torch.bfloat16 in num.emulated) is not host.bf16_dot
    assert (torch.float16 in num.emulated) is not host.fp16_dot
    assert slow_16bit_dtypes("meta") == frozenset()


def test_emulating_refuses_other_dtypes_and_restores():
    with pytest.raises(ValueError, match="Only 16-bit GEMMs"):
        with emulating({torch.float32}):
            pass
    from autoprec.runtime.fp8 import emulated_dtypes

    with emulating({torch.bfloat16}):
        with emulating({torch.float16}):
            assert emulated_dtypes() == {torch.float16}
        assert emulated_dtypes() == {torch.bfloat16}
    assert emulated_dtypes() == frozenset()
    with pytest.raises(ValueError, match="computes bf16 and fp16"):
        plain_matmul(torch.ones(2, 2), torch.ones(2, 2), fmt=Format.FP32)


def _saved_bytes(fn) -> tuple[int, set[torch.dtype]]:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs, and
    their dtypes (parameters and inputs included: they are what the step keeps alive)."""
    storages: dict[int, int] = {}
    dtypes: set[torch.dtype] = set()

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        dtypes.add(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values()), dtypes


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_emulated_linear_saves_what_autocasts_kernel_saves(dtype):
    """Under emulation a 16-bit linear keeps for backward the 16-bit copies of its input and
    weight that autocast's kernel keeps, not the FP32 tensors: a step measured under
    emulation (autoprec.memory) holds the bytes a native step holds."""
    x = torch.randn(64, 256, requires_grad=True)
    lin = torch.nn.Linear(256, 512)

    def native():
        with torch.autocast("cpu", dtype=dtype):
            return lin(x)

    def emulated():
        with emulating({dtype}), torch.autocast("cpu", dtype=dtype):
            return plain_matmul(x, lin.weight.t(), lin.bias, fmt=DTYPES[dtype])

    want, want_dtypes = _saved_bytes(native)
    got, got_dtypes = _saved_bytes(emulated)
    assert want_dtypes == got_dtypes == {dtype}
    assert got == want == 2 * (64 * 256 + 512 * 256)
    # an input that is already 16-bit is kept as it is, no copy
    x16 = x.detach().to(dtype).requires_grad_()
    got, _ = _saved_bytes(lambda: plain_matmul(x16, lin.weight.t(), fmt=DTYPES[dtype]))
    assert got == 2 * (64 * 256 + 512 * 256)


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_emulated_step_memory_is_the_native_steps(policy):
    """The traced peak of a real HF Llama training step (autoprec.memory.measure_step_memory)
    with its 16-bit GEMMs emulated against the same step on autocast's kernels: within 5%
    (the emulation's FP32 temporaries, one at a time; benchmarks/bench_memory.py measures the
    gap at larger widths), and exactly the fp32 step's bytes when nothing is 16-bit."""
    import copy

    from autoprec.memory import measure_step_memory
    from autoprec.task import default_loss

    model = prepare_for_measurement(tiny_llama(hidden=128, intermediate=448))
    batch = byte_batches(1, 4, 64, seed=0)[0]

    def peak(pol: str, emulate: bool) -> int:
        return measure_step_memory(copy.deepcopy(model), batch, Policy(default=pol),
                                   default_loss, lambda p: torch.optim.AdamW(p, lr=1e-3),
                                   emulate=emulate).peak

    native, emulated = peak(policy, False), peak(policy, True)
    assert abs(emulated / native - 1) <= 0.05, (native, emulated)
    fp32 = peak("fp32", False)
    assert native < fp32  # the 16-bit copies are what the step saves: a real difference
    assert peak("fp32", True) == fp32
