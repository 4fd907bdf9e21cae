"""The CUDA FP8 path: ``torch._scaled_mm`` layouts, scales and shapes.

Two kinds of tests:

- CPU-runnable (everywhere): ``native=True`` forces ``torch._scaled_mm`` on CPU, whose kernel
  accepts any layout, any shape and E5M2 x E5M2. So every call is intercepted (a
  TorchDispatchMode) and checked against the rules the CUDA kernel enforces on Hopper
  (pytorch aten/src/ATen/native/cuda/ScaledBlas.cpp, ``_scaled_mm_out_cuda``): 2-D operands,
  the first row-major and the second column-major (sm_90 accepts only that pair), K and both
  dimensions of the second operand multiples of 16, 16-byte aligned leading dimensions and
  pointers, FP32 single-element (tensorwise) scales, not both operands E5M2, no bias with an
  FP32 output. The results must equal the emulation's, forward and backward.
- GPU-only (skipped with a reason without CUDA): the real kernel agrees with the emulation to
  accumulation rounding, fp8 counts as native on sm_89+, an fp8 policy on GPT-2 runs the kernel,
  odd shapes fall back to bf16; on sm_90+ the rowwise recipes run the kernel and agree with
  their emulation, and torchao's engine agrees with autoprec's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt2
from torch.utils._python_dispatch import TorchDispatchMode

import autoprec
import autoprec.runtime.fp8 as fp8_module
from autoprec import Format, Policy, supported_formats
from autoprec.formats import Support
from autoprec.runtime.calls import fp8_shape_supported
from autoprec.runtime.fp8 import _bf16_matmul, fp8_linear, fp8_matmul

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the real FP8 kernel); CPU tests in this "
                                       "file check the same layouts with torch._scaled_mm on CPU")
needs_fp8_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="needs a CUDA GPU of compute capability >= 8.9 (Ada/Hopper) for FP8 kernels")


def cuda_rule_violations(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None,
                         out_dtype=None, use_fast_accum=False) -> list[str]:
    """What the CUDA ``_scaled_mm`` (tensorwise, sm_90) would reject in this call."""
    bad = []
    if mat1.dim() != 2 or mat2.dim() != 2:
        return [f"operands must be 2-D, got {tuple(mat1.shape)} and {tuple(mat2.shape)}"]
    if mat1.dtype not in _FP8 or mat2.dtype not in _FP8:
        bad.append(f"operands must be float8, got {mat1.dtype} and {mat2.dtype}")
    if mat1.dtype == torch.float8_e5m2 and mat2.dtype == torch.float8_e5m2:
        bad.append("e5m2 x e5m2 is not supported by cuBLASLt")
    (m, k), (k2, n) = mat1.shape, mat2.shape
    if k != k2:
        bad.append(f"inner dimensions differ: {k} vs {k2}")
    if k % 16:
        bad.append(f"K={k} (trailing dimension of mat1) is not a multiple of 16")
    if k2 % 16 or n % 16:
        bad.append(f"mat2 shape {k2}x{n} is not divisible by 16")
    # row-major mat1: unit stride along K, rows at least K apart, 16-byte aligned
    if not (mat1.stride(1) == 1 and mat1.stride(0) >= max(1, k) and mat1.stride(0) % 16 == 0):
        bad.append(f"mat1 {m}x{k} is not row-major (strides {mat1.stride()})")
    # column-major mat2: unit stride along K, columns at least K apart, 16-byte aligned
    if not (mat2.stride(0) == 1 and mat2.stride(1) >= max(1, k2) and mat2.stride(1) % 16 == 0):
        bad.append(f"mat2 {k2}x{n} is not column-major (strides {mat2.stride()})")
    for name, t in (("mat1", mat1), ("mat2", mat2)):
        if t.data_ptr() % 16:
            bad.append(f"{name} data pointer is not 16-byte aligned")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s.dtype != torch.float32 or s.numel() != 1:
            bad.append(f"{name} must be a single float32 (tensorwise), got {s.dtype} "
                       f"{tuple(s.shape)}")
        if s.device != mat1.device:
            bad.append(f"{name} is on {s.device}, operands on {mat1.device}")
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        bad.append(f"out_dtype {out_dtype} is not bf16/fp16/fp32")
    if bias is not None:
        if out_dtype in (None, torch.float32):
            bad.append("bias is not supported with a float32 output")
        if bias.dtype not in (torch.bfloat16, torch.float16):
            bad.append(f"bias must be bf16 or fp16, got {bias.dtype}")
    return bad


class ScaledMMRecorder(TorchDispatchMode):
    """Records every ``aten._scaled_mm`` call (forward and backward) with its operand shapes and
    dtypes, and what CUDA would reject in it."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []
        self.violations: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is torch.ops.aten._scaled_mm:
            a, b = args[0], args[1]
            self.calls.append((tuple(a.shape), tuple(b.shape), a.dtype, b.dtype))
            for v in cuda_rule_violations(*args, **kwargs):
                self.violations.append(f"call {len(self.calls)} {tuple(a.shape)}x"
                                       f"{tuple(b.shape)}: {v}")
        return func(*args, **kwargs)


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _run(make, native: bool):
    """make() -> (leaves, fn(*leaves, native)); returns the output, the leaves' gradients and
    the recorder of the kernel calls."""
    torch.manual_seed(0)
    leaves, fn = make()
    rec = ScaledMMRecorder()
    with rec:
        out = fn(*leaves, native=native)
        torch.manual_seed(1)
        out.backward(torch.randn(out.shape).to(out.dtype))
    return out.detach(), [t.grad for t in leaves], rec


def _leaf(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).requires_grad_()


# Each case builds leaf tensors and a function of them whose matmul goes through fp8, with the
# operands reaching fp8_matmul in the layouts real models produce.
LAYOUT_CASES = {
    # nn.Linear: x @ W.T, W stored [N, K] (so b = W.T is column-major already)
    "linear, contiguous": lambda: (
        (_leaf(32, 64), _leaf(48, 64, scale=0.1)),
        lambda x, w, native: fp8_linear(x, w, native=native)),
    # weight stored [K, N] and passed as a transposed view (b = row-major [K, N])
    "linear, transposed weight view": lambda: (
        (_leaf(32, 64), _leaf(64, 48, scale=0.1)),
        lambda x, w, native: fp8_linear(x, w.t(), native=native)),
    # HF Conv1D: torch.addmm(bias, x, W) with W stored [K, N] row-major
    "addmm (Conv1D), row-major weight + bias": lambda: (
        (_leaf(32, 64), _leaf(64, 48, scale=0.1), _leaf(48)),
        lambda x, w, b, native: fp8_matmul(x, w, b, native=native)),
    "linear + bias": lambda: (
        (_leaf(32, 64), _leaf(48, 64, scale=0.1), _leaf(48)),
        lambda x, w, b, native: fp8_linear(x, w, b, native=native)),
    # activation sliced out of a wider tensor: rows 96 apart, not contiguous
    "sliced activation x[:, 16:80]": lambda: (
        (_leaf(32, 96), _leaf(48, 64, scale=0.1)),
        lambda x, w, native: fp8_linear(x[:, 16:80], w, native=native)),
    # every other column: stride 2 along K
    "strided activation x[:, ::2]": lambda: (
        (_leaf(32, 128), _leaf(48, 64, scale=0.1)),
        lambda x, w, native: fp8_linear(x[:, ::2], w, native=native)),
    # a submatrix view of a bigger weight
    "sliced weight W[:48]": lambda: (
        (_leaf(32, 64), _leaf(80, 64, scale=0.1)),
        lambda x, w, native: fp8_linear(x, w[:48], native=native)),
    "batched 3-D input + bias": lambda: (
        (_leaf(2, 16, 64), _leaf(48, 64, scale=0.1), _leaf(48)),
        lambda x, w, b, native: fp8_linear(x, w, b, native=native)),
    # [seq, batch, hidden] permuted to [batch, seq, hidden]: not contiguous, no view to 2-D
    "permuted 3-D input": lambda: (
        (_leaf(16, 2, 64), _leaf(48, 64, scale=0.1)),
        lambda x, w, native: fp8_linear(x.permute(1, 0, 2), w, native=native)),
    # attention scores q @ k.T: batched activation x activation, k.T a transposed view
    "attention q @ k.transpose(-1, -2)": lambda: (
        (_leaf(2, 2, 32, 16), _leaf(2, 2, 32, 16)),
        lambda q, k, native: fp8_matmul(q, k.transpose(-1, -2), native=native)),
    # attention probabilities @ v
    "attention p @ v": lambda: (
        (_leaf(2, 2, 32, 32), _leaf(2, 2, 32, 16)),
        lambda p, v, native: fp8_matmul(p, v, native=native)),
    "broadcast batch (2,1,..) @ (1,3,..)": lambda: (
        (_leaf(2, 1, 32, 16), _leaf(1, 3, 16, 32)),
        lambda a, b, native: fp8_matmul(a, b, native=native)),
    "2-D @ 3-D": lambda: (
        (_leaf(32, 16), _leaf(2, 16, 32)),
        lambda a, b, native: fp8_matmul(a, b, native=native)),
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_native_calls_follow_cuda_layout_rules_and_match_emulation(case):
    out, grads, rec = _run(LAYOUT_CASES[case], native=True)
    assert rec.calls, "native=True must run torch._scaled_mm"
    assert not rec.violations, "\n".join(rec.violations)
    # forward, dgrad and wgrad: the same number of kernels each (one per matrix of a batch)
    assert len(rec.calls) >= 3 and len(rec.calls) % 3 == 0, rec.calls
    assert any(torch.float8_e5m2 in c[2:] for c in rec.calls), "backward must use E5M2"

    emu_out, emu_grads, emu_rec = _run(LAYOUT_CASES[case], native=False)
    assert not emu_rec.calls
    assert out.dtype == emu_out.dtype == torch.bfloat16 and out.shape == emu_out.shape
    assert _rel(out, emu_out) < 4e-3, f"forward differs by {_rel(out, emu_out):.3g}"
    for i, (g, e) in enumerate(zip(grads, emu_grads)):
        assert g is not None and e is not None, f"leaf {i} got no gradient"
        assert g.shape == e.shape
        assert _rel(g, e) < 1e-3, f"gradient of leaf {i} differs by {_rel(g, e):.3g}"


@pytest.mark.parametrize("m,k,n,bad", [(24, 64, 48, "M=24"), (32, 40, 48, "K=40"),
                                       (32, 64, 20, "N=20"), (8, 8, 8, "M=8, K=8, N=8")])
def test_shapes_not_multiple_of_16_fall_back_to_bf16_with_the_reason(m, k, n, bad):
    ok, reason = fp8_shape_supported(m, k, n)
    assert not ok and bad in reason and "bf16" in reason and "multiples of 16" in reason
    x, w = _leaf(m, k), _leaf(n, k, scale=0.1)
    rec = ScaledMMRecorder()
    with rec:
        out = fp8_linear(x, w, native=True)
        out.float().sum().backward()
    assert not rec.calls, "a shape the kernel cannot take must not reach torch._scaled_mm"
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, x.detach().bfloat16() @ w.detach().bfloat16().t())
    assert x.grad is not None and w.grad is not None


def test_leading_dims_fold_into_m_for_the_rule():
    # 3 x 5 rows: M = 15, not a multiple of 16, though K and N are fine
    x, w = _leaf(3, 5, 64), _leaf(48, 64, scale=0.1)
    rec = ScaledMMRecorder()
    with rec:
        out = fp8_linear(x, w, native=True)
    assert not rec.calls and out.shape == (3, 5, 48)
    assert torch.equal(out, _bf16_matmul(x.detach(), w.detach().t(), None))
    # attention with T = 24: batched products check their own M (= T), not the batch
    q, kk = _leaf(2, 2, 24, 16), _leaf(2, 2, 24, 16)
    with rec:
        fp8_matmul(q, kk.transpose(-1, -2), native=True)
    assert not rec.calls
    # 2 x 8 rows: M = 16 is fine
    with rec:
        fp8_linear(_leaf(2, 8, 64), w, native=True)
    assert len(rec.calls) == 1 and not rec.violations


def test_gpt2_under_fp8_policy_runs_scaled_mm_in_valid_layouts(monkeypatch):
    """The whole routed path (F.linear, HF Conv1D's addmm, attention matmuls), forward and
    backward, with the kernel forced on CPU: every call obeys the CUDA rules, and the loss
    matches the emulated policy's."""
    from examples.data import byte_batches

    batch = byte_batches(1, 2, 32, seed=0)[0]  # M = 64 tokens
    losses = {}
    for native in (False, True):
        monkeypatch.setattr(fp8_module, "fp8_is_native", lambda device, fmt=None, native=native: native)
        model = tiny_gpt2(seq_len=32).train()
        with pytest.warns(UserWarning, match="can only emulate"):
            # autoprec's engine everywhere (lm_head included): its kernel calls are the subject
            autoprec.apply(model, Policy(default="fp8", engine="autoprec"))
        rec = ScaledMMRecorder()
        with rec:
            loss = model(**batch).loss
            loss.backward()
        losses[native] = float(loss.detach())
        if not native:
            assert not rec.calls
            continue
        assert not rec.violations, "\n".join(rec.violations[:10])
        # per block: c_attn, c_proj, c_fc, c_proj (1 kernel each) and q@k.T, p@v (one per
        # batch x head = 4 each); plus lm_head; times 3 (forward, dgrad, wgrad)
        per_block = 4 + 2 * (2 * 2)
        assert len(rec.calls) == 3 * (2 * per_block + 1), len(rec.calls)
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert abs(losses[True] - losses[False]) < 1e-3 * abs(losses[False]), losses


def test_one_layer_policy_runs_exactly_its_three_kernels(monkeypatch):
    from examples.data import byte_batches

    monkeypatch.setattr(fp8_module, "fp8_is_native", lambda device, fmt=None: True)
    batch = byte_batches(1, 2, 32, seed=0)[0]
    model = tiny_gpt2(seq_len=32).train()
    with pytest.warns(UserWarning, match="can only emulate"):
        autoprec.apply(model, Policy(default="fp32",
                                     layers={"transformer.h.0.mlp.c_fc": "fp8"}))
    rec = ScaledMMRecorder()
    with rec:
        model(**batch).loss.backward()
    assert not rec.violations, rec.violations
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    # forward x[64,64] @ W[64,256]; dgrad g[64,256] @ W.T; wgrad x.T[64,64] @ g[64,256]
    assert rec.calls == [((64, 64), (64, 256), e4, e4), ((64, 256), (256, 64), e5, e4),
                         ((64, 64), (64, 256), e4, e5)], rec.calls


def test_cpu_counts_fp8_as_emulated():
    assert supported_formats("cpu")[Format.FP8] is Support.EMULATED


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_asking_for_cuda_formats_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        supported_formats("cuda")


# ============================================================================ GPU only
@needs_cuda
@pytest.mark.gpu
def test_cuda_supported_formats_says_fp8_native_on_sm89_plus():
    cap = torch.cuda.get_device_capability()
    sup = supported_formats("cuda")
    assert sup[Format.FP32] is Support.NATIVE and sup[Format.FP16] is Support.NATIVE
    expected = Support.NATIVE if cap >= (8, 9) else Support.EMULATED
    assert sup[Format.FP8] is expected, (cap, sup)
    assert fp8_module.fp8_is_native("cuda") == (cap >= (8, 9))


@needs_fp8_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 512, 384), (4, 128, 768, 256), "attention"])
def test_cuda_native_agrees_with_emulation_to_accumulation_rounding(shape):
    """Same operands, real kernel vs emulation: the difference is accumulation order (and the
    odd bf16 rounding flip of the output), far below FP8's own rounding error."""
    torch.manual_seed(0)
    dev = "cuda"
    if shape == "attention":
        a = torch.randn(2, 4, 256, 64, device=dev)
        b = torch.randn(2, 4, 256, 64, device=dev) / 8

        def op(x, y, native):
            return fp8_matmul(x, y.transpose(-1, -2), native=native)

        def exact(x, y):
            return x @ y.transpose(-1, -2)
    else:
        *lead, k, n = shape
        a = torch.randn(*lead, k, device=dev)
        b = torch.randn(n, k, device=dev) / k ** 0.5

        def op(x, y, native):
            return fp8_linear(x, y, native=native)

        def exact(x, y):
            return x @ y.t()
    g = None
    results = {}
    for native in (False, True):
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        rec = ScaledMMRecorder()
        with rec:
            out = op(x, y, native)
            if g is None:
                g = torch.randn(out.shape, device=dev).to(out.dtype)
            out.backward(g)
        torch.cuda.synchronize()
        assert bool(rec.calls) == native
        results[native] = (out.detach(), x.grad, y.grad)
    x64, y64 = a.double().requires_grad_(), b.double().requires_grad_()
    ref = exact(x64, y64)
    ref.backward(g.double())
    for i, name in enumerate(("out", "dgrad", "wgrad")):
        diff = _rel(results[True][i], results[False][i])
        fp8_err = _rel(results[False][i], (ref, x64.grad, y64.grad)[i])
        assert diff < 1e-2, f"{name}: real vs emulated {diff:.3g}"
        assert diff < 0.25 * fp8_err, f"{name}: real vs emulated {diff:.3g} is not small " \
                                      f"next to FP8's own error {fp8_err:.3g}"


@needs_fp8_gpu
@pytest.mark.gpu
def test_cuda_gpt2_layer_under_fp8_policy_runs_scaled_mm():
    from autoprec.task import move_to
    from examples.data import byte_batches

    batch = move_to(byte_batches(1, 2, 32, seed=0)[0], "cuda")
    model = tiny_gpt2(seq_len=32).cuda().train()
    autoprec.apply(model, Policy(default="bf16", layers={"transformer.h.0.mlp.c_fc": "fp8"}))
    rec = ScaledMMRecorder()
    with rec:
        loss = model(**batch).loss
        loss.backward()
    torch.cuda.synchronize()
    assert torch.isfinite(loss)
    assert not rec.violations, rec.violations
    assert len(rec.calls) == 3, rec.calls  # c_fc forward, dgrad, wgrad
    # uniform fp8: every block's projections and attention products
    model = tiny_gpt2(seq_len=32).cuda().train()
    autoprec.apply(model, Policy(default="fp8"))
    with rec:
        model(**batch).loss.backward()
    assert len(rec.calls) > 3 and not rec.violations


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(24, 64, 48), (32, 40, 48), (32, 64, 20)])
def test_cuda_odd_shapes_fall_back_to_bf16(m, k, n):
    x = torch.randn(m, k, device="cuda", requires_grad=True)
    w = torch.randn(n, k, device="cuda", requires_grad=True)
    rec = ScaledMMRecorder()
    with rec:
        out = fp8_linear(x, w)
        out.float().sum().backward()
    assert not rec.calls
    assert torch.equal(out, x.detach().bfloat16() @ w.detach().bfloat16().t())
    assert torch.isfinite(w.grad).all()


@needs_cuda
@pytest.mark.gpu
def test_cuda_measure_layers_times_fp8_as_native():
    from autoprec.measure.timing import measure_layers
    from autoprec.task import move_to
    from examples.data import byte_batches

    batch = move_to(byte_batches(1, 2, 32, seed=0)[0], "cuda")
    model = tiny_gpt2(seq_len=32).cuda()
    times = measure_layers(model, batch, ["transformer.h.0.mlp.c_fc"], warmup=1, repeats=3)
    t = times["transformer.h.0.mlp.c_fc"]
    native = torch.cuda.get_device_capability() >= (8, 9)
    assert t[Format.FP8].emulated is not native
    assert all(x.ok and x.seconds > 0 for x in t.values())


needs_sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
    reason="needs a CUDA GPU of compute capability >= 9.0 (Hopper) for rowwise FP8 kernels")


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_cuda_rowwise_recipes_run_the_kernel_and_agree_with_emulation(recipe):
    torch.manual_seed(0)
    a = torch.randn(4, 128, 768, device="cuda")
    b = torch.randn(256, 768, device="cuda") / 768 ** 0.5
    g = torch.randn(4, 128, 256, device="cuda").to(torch.bfloat16)
    results = {}
    for native in (False, True):
        x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
        rec = ScaledMMRecorder()
        with rec:
            out = fp8_linear(x, w, native=native, recipe=recipe)
            out.backward(g)
        torch.cuda.synchronize()
        assert bool(rec.calls) == native
        results[native] = (out.detach(), x.grad, w.grad)
    assert supported_formats("cuda")[Format.fp8(recipe)] is Support.NATIVE
    for i, name in enumerate(("out", "dgrad", "wgrad")):
        diff = _rel(results[True][i], results[False][i])
        assert diff < 1e-2, f"{recipe} {name}: real vs emulated {diff:.3g}"


@needs_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_cuda_torchao_engine_agrees_with_autoprecs(recipe):
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    lin = torch.nn.Linear(768, 256, bias=False).cuda()
    x = torch.randn(4, 128, 768, device="cuda").to(torch.bfloat16)
    outs = {}
    for engine in ("autoprec", "torchao"):
        model = torch.nn.Sequential(lin)
        autoprec.apply(model, Policy(default=f"fp8:{recipe}", engine=engine))
        assert (type(model[0]).__name__ == "Float8Linear") == (engine == "torchao")
        with torch.no_grad():
            outs[engine] = model(x).float()
        autoprec.remove(model)
    exact = x.double() @ lin.weight.double().t()
    diff, err = _rel(outs["torchao"], outs["autoprec"]), _rel(outs["autoprec"], exact)
    assert diff < 0.25 * err, f"{recipe}: engines differ by {diff:.3g}, FP8 error {err:.3g}"
