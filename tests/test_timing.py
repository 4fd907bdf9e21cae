"""Tests of autoprec.measure.timing (measured layer speed on this device) and of the step
timer.

Measured tests assert orderings with margins, never tight ratios, and print the measured
ratio on failure: the CPU is shared with other test runs. They pin torch to one thread: on a
2-core machine shared with other processes a second OpenMP thread mostly waits for a
preempted sibling, so the timing would measure the neighbours; which format a core runs
faster is a property of the core.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import autoprec
from autoprec.formats import Format, Support
from autoprec.host import supported_formats
from autoprec.measure.timer import Comparison, StepTimer
from autoprec.measure.timing import LayerTime, measure_layers

ALL = ("fp32", "bf16", "fp16", "fp8")


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _linear(d_in: int, d_out: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, d_out))


# ============================================================================ measured, CPU
def test_bf16_against_fp32_is_what_the_cpu_implies(one_thread):
    # Which of the two wins is a property of the core: with BF16 dot-product instructions
    # (Zen 4's AVX512-BF16, AMX) bf16 matmuls are faster than fp32; without them (Zen 3's
    # AVX2, Intel AVX512 parts before Cooper Lake) oneDNN widens BF16 to FP32 around every
    # product and bf16 loses (3.4x on an AVX512 Xeon, ~130x on Zen 3: benchmarks/bench_cpu.py).
    from tests.conftest import host_bf16_is_fast

    fast = host_bf16_is_fast()
    # 1024 -> 4096 at 1024 tokens (8.6 GFLOP) where bf16 is fast, large enough that the
    # matmul, not dispatch or casts, decides; a quarter of each side where it is not, so
    # that ~130x slower bf16 still takes well under a second.
    d_in, d_out, tokens = (1024, 4096, 1024) if fast else (256, 1024, 256)
    model = _linear(d_in, d_out)
    x = torch.randn(tokens, d_in)
    t = measure_layers(model, (x,), ["0"], ("fp32", "bf16"), warmup=1, repeats=3)["0"]
    ratio = t[Format.BF16].seconds / t[Format.FP32].seconds
    detail = (f"bf16 took {ratio:.2f}x the fp32 time on a {tokens}x{d_in}x{d_out} linear (fp32 "
              f"{t[Format.FP32].seconds * 1e3:.2f} ms, bf16 {t[Format.BF16].seconds * 1e3:.2f} "
              f"ms) on a CPU {'with' if fast else 'without'} BF16 dot-product instructions")
    if fast:
        assert ratio < 0.85, detail + "; expected clearly faster"
    else:
        assert ratio > 1.2, detail + "; expected clearly slower"
    for lt in t.values():
        assert lt.source == "measured" and lt.repeats == 3 and not lt.emulated
        assert lt.seconds == lt.raw_seconds > 0 and math.isfinite(lt.spread)


def test_fp16_not_faster_than_bf16(one_thread):
    # A fact only of CPUs without FP16 arithmetic in their matmul units (Zen 3/4, Intel before
    # Sapphire Rapids): oneDNN has no fp16 kernel there. Smaller than the bf16 test on
    # purpose: such a CPU runs fp16 at ~1 GFLOP/s, and a large layer would take a minute.
    from autoprec.host import cpu_features

    if cpu_features().fp16_dot:
        pytest.skip(f"this CPU has FP16 dot-product instructions ({cpu_features().describe()}): "
                    "fp16 may be fast here")
    model = _linear(256, 1024)
    x = torch.randn(256, 256)
    t = measure_layers(model, (x,), ["0"], ("bf16", "fp16"), warmup=1, repeats=3)["0"]
    ratio = t[Format.FP16].seconds / t[Format.BF16].seconds
    assert ratio > 0.9, (f"fp16 took {ratio:.2f}x the bf16 time on a 256x256x1024 linear "
                         f"(bf16 {t[Format.BF16].seconds * 1e3:.2f} ms, fp16 "
                         f"{t[Format.FP16].seconds * 1e3:.2f} ms); on this CPU fp16 should not "
                         "be faster than bf16")


def test_fp8_on_cpu_is_emulated_and_never_faster_than_fp32(one_thread):
    assert supported_formats("cpu")[Format.FP8] is Support.EMULATED
    model = _linear(256, 512)
    x = torch.randn(128, 256)
    # fp8 alone: fp32 is timed anyway for the floor, but only fp8 is reported.
    t = measure_layers(model, (x,), ["0"], ("fp8",), warmup=1, repeats=3)["0"]
    assert list(t) == [Format.FP8]
    lt = t[Format.FP8]
    assert lt.emulated and "emulated" in lt.note
    assert lt.raw_seconds > 0
    both = measure_layers(model, (x,), ["0"], ("fp32", "fp8"), warmup=1, repeats=3)["0"]
    fp32, fp8 = both[Format.FP32], both[Format.FP8]
    assert fp8.seconds >= fp32.seconds, (fp8.seconds, fp32.seconds)
    assert fp8.seconds == max(fp8.raw_seconds, fp32.seconds)
    assert not fp32.emulated


def test_emulated_floor_applies_when_emulation_times_faster(monkeypatch):
    # Emulated fp8 on a real CPU is slower than fp32 anyway, so the floor is checked with
    # fake timings: an emulated format that *measures* faster must still report fp32's time.
    import autoprec.measure.timing as timing

    times = {Format.FP32: 2.0, Format.BF16: 1.5, Format.FP8: 1.0}
    monkeypatch.setattr(timing._FormatRun, "__call__", lambda self: times[self.fmt])
    t = measure_layers(_linear(16, 16), torch.randn(4, 16), ["0"], ("bf16", "fp8"))["0"]
    assert t[Format.FP8].raw_seconds == 1.0 and t[Format.FP8].seconds == 2.0
    assert t[Format.BF16].seconds == t[Format.BF16].raw_seconds == 1.5


def test_fp8_note_names_shapes_the_kernel_cannot_take(one_thread):
    model = _linear(100, 64)  # K = 100 is not a multiple of 16
    t = measure_layers(model, (torch.randn(32, 100),), ["0"], ("fp8",), warmup=0, repeats=1)
    note = t["0"][Format.FP8].note
    assert "1 of 1 matmuls do not run in fp8" in note and "K=100" in note, note


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_measure_layers_on_gpt2_leaves_the_model_unchanged(gpt2, gpt2_batch, one_thread):
    fqns = ["transformer.h.0.attn", "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj",
            "transformer.h.0.ln_1"]
    gpt2.transformer.h[1].train()  # a mixed training flag must survive as it was
    flags = {n: m.training for n, m in gpt2.named_modules()}
    state = {k: v.clone() for k, v in gpt2.state_dict().items()}
    hooks = _hooks(gpt2)
    rng = torch.get_rng_state()

    prof = measure_layers(gpt2, gpt2_batch, fqns, ALL, warmup=1, repeats=3)

    assert list(prof) == fqns
    for fqn in fqns:
        assert set(prof[fqn]) == {Format(f) for f in ALL}
        for fmt, lt in prof[fqn].items():
            assert lt.ok, f"{fqn} in {fmt}: {lt.error}"
            assert lt.fqn == fqn and lt.format is fmt
            assert math.isfinite(lt.seconds) and lt.seconds > 0, (fqn, fmt, lt)
            assert lt.emulated == (fmt is Format.FP8)
    # Unchanged: same weights and buffers, no regions, no hooks, no grads, same flags and RNG.
    after = gpt2.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state)
    assert autoprec.applied_formats(gpt2) == {}
    assert all("forward" not in m.__dict__ for m in gpt2.modules())
    assert _hooks(gpt2) == hooks
    assert all(p.grad is None for p in gpt2.parameters())
    assert {n: m.training for n, m in gpt2.named_modules()} == flags
    assert torch.equal(torch.get_rng_state(), rng)


def test_measure_layers_keeps_existing_grads_and_buffers(one_thread):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 8)).eval()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    grad = model[0].weight.grad
    mean = model[1].running_mean.clone()
    # train=True runs BatchNorm in training mode, which updates running stats: undone after.
    measure_layers(model, torch.randn(16, 32), ["0", "1"], ("fp32", "bf16"), warmup=0, repeats=1)
    assert model[0].weight.grad is grad and torch.equal(grad, torch.ones_like(grad))
    assert torch.equal(model[1].running_mean, mean)
    assert model[1].num_batches_tracked.item() == 0
    assert not model.training


class _Float32Only(nn.Module):
    """A layer written for FP32 only: it refuses the low-precision result autocast gives it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        if y.dtype != torch.float32:
            raise TypeError(f"expected float32 activations, got {y.dtype}")
        return y


def test_a_layer_that_raises_in_a_format_records_the_error():
    model = nn.Sequential(_Float32Only(), nn.Linear(16, 4))
    prof = measure_layers(model, torch.randn(8, 16), ["0", "1"], ("fp32", "bf16"),
                          warmup=0, repeats=2)
    bad = prof["0"][Format.BF16]
    assert not bad.ok and "expected float32 activations" in bad.error
    assert bad.seconds == math.inf
    assert prof["0"][Format.FP32].ok and prof["1"][Format.BF16].ok
    assert autoprec.applied_formats(model[0]) == {}
    assert "forward" not in model[0].__dict__


def test_unknown_fqn_is_a_clear_error(gpt2, gpt2_batch):
    with pytest.raises(ValueError, match=r"no module 'transformer\.h\.0\.atn'.*Did you mean"):
        measure_layers(gpt2, gpt2_batch, ["transformer.h.0.atn"], ("fp32",))


def test_a_module_the_batch_never_calls_is_reported_not_fatal():
    model = nn.ModuleDict({"used": nn.Linear(8, 8), "unused": nn.Linear(8, 8)})
    model.forward = lambda x: model["used"](x)
    prof = measure_layers(model, torch.randn(4, 8), ["used", "unused"], ("fp32",), repeats=1)
    assert prof["used"][Format.FP32].ok
    assert "was not called" in prof["unused"][Format.FP32].error


def test_budget_stops_a_slow_format_early():
    model = _linear(64, 64)
    prof = measure_layers(model, torch.randn(32, 64), ["0"], ("fp32",), warmup=1, repeats=50,
                          budget_s=1e-9)
    lt = prof["0"][Format.FP32]
    assert lt.ok and lt.repeats == 1 and "budget" in lt.note, lt


def test_layer_time_json_round_trip():
    good = LayerTime("a.b", "bf16", 1.5e-3, 1.5e-3, 0.04, source="model:h100", note="x")
    bad = LayerTime("a.c", Format.FP16, math.inf, math.inf, math.nan, error="TypeError: no")
    for lt in (good, bad):
        text = json.dumps(lt.to_dict(), allow_nan=False)  # strict JSON: no inf / nan
        back = LayerTime.from_dict(json.loads(text))
        assert back.fqn == lt.fqn and back.format is lt.format and back.error == lt.error
        assert back.seconds == lt.seconds and back.note == lt.note
    assert LayerTime.from_dict(good.to_dict()) == good
    with pytest.raises(ValueError, match="source"):
        LayerTime("a", "fp32", 1.0, 1.0, source="guess")
    with pytest.raises(ValueError, match="finite"):
        LayerTime("a", "fp32", math.inf, math.inf)
    with pytest.raises(ValueError, match="Unknown format 'fp9'"):
        LayerTime("a", "fp9", 1.0, 1.0)


def test_step_timer_times_policies_without_moving_the_weights(gpt2, gpt2_batch):
    state = {k: v.clone() for k, v in gpt2.state_dict().items()}
    timer = StepTimer(gpt2, gpt2_batch, lambda m, b: m(**b).loss,
                      lambda p: torch.optim.AdamW(p, lr=1e-2), device="cpu")
    fp16 = autoprec.Policy(default="bf16", layers={"lm_head": "fp16"},
                           loss_scaling={"init_scale": 1024.0})
    cmp = Comparison({"fp32": timer.runner(autoprec.Policy(default="fp32")),
                      "bf16": timer.runner(autoprec.Policy(default="bf16")),
                      "fp16 head": timer.runner(fp16)}, "fp32", repeats=1)
    cmp.run(3)
    for key in ("fp32", "bf16", "fp16 head"):
        assert math.isfinite(cmp.seconds(key)) and cmp.seconds(key) > 0, key
        assert cmp.rounds_of(key) == 3
    assert cmp.ratio("fp32").value == 1.0
    after = gpt2.state_dict()
    # learning rate 0: a step costs what a real one does, and the weights stay put
    assert all(torch.equal(state[k], after[k]) for k in state), "weights changed"
    assert autoprec.applied_formats(gpt2) == {}, "the timer left a policy applied"


def test_measure_layers_refuses_a_model_with_a_policy_applied(gpt2, gpt2_batch):
    autoprec.apply(gpt2, autoprec.Policy(default="bf16", layers={"lm_head": "fp32"}))
    with pytest.raises(ValueError, match=r"policy applied \(at \(root\)\).*autoprec.remove"):
        measure_layers(gpt2, gpt2_batch, ["lm_head"], ("fp32", "bf16"))
    assert autoprec.applied_formats(gpt2) == {"": Format.BF16, "lm_head": Format.FP32}

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_layers_on_cuda():
    model = _linear(1024, 4096).cuda()
    x = torch.randn(4096, 1024, device="cuda")
    t = measure_layers(model, (x,), ["0"], ALL, warmup=2, repeats=5)["0"]
    native_fp8 = supported_formats("cuda")[Format.FP8] is Support.NATIVE
    assert t[Format.FP8].emulated is not native_fp8
    assert t[Format.BF16].seconds < 0.7 * t[Format.FP32].seconds, t




class _Ran:
    def __init__(self, error=None):
        self.error = error


def test_a_format_far_slower_in_its_warm_up_run_is_not_timed_further():
    from autoprec.measure.timing import _CLEARLY_SLOWER, _slow_in_warmup

    runs = {f: _Ran() for f in (Format.FP32, Format.BF16, Format.FP16)}
    t32 = 0.01
    warm = {Format.FP32: t32, Format.BF16: 3 * t32, Format.FP16: 2 * _CLEARLY_SLOWER * t32}
    assert _slow_in_warmup(warm, runs) == {Format.FP16: 2 * _CLEARLY_SLOWER}
    # at the threshold it is timed (the rounds decide), and a failed format is the rounds' too
    warm[Format.FP16] = _CLEARLY_SLOWER * t32
    assert _slow_in_warmup(warm, runs) == {}
    warm[Format.FP16] = 100 * t32
    assert _slow_in_warmup(warm, {**runs, Format.FP16: _Ran("RuntimeError: no")}) == {}
    # no usable fp32 warm-up: nothing is judged from it
    assert _slow_in_warmup({**warm, Format.FP32: math.inf}, runs) == {}
    assert _slow_in_warmup({}, runs) == {}


def test_a_layer_timed_on_its_warm_up_only_says_so_and_keeps_a_finite_time():
    # whichever formats this CPU runs far slower than fp32, each is timed once, says so,
    # and keeps its (slow) time, so the profile's verdict on it is "slow", not "failed"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    times = measure_layers(model, torch.randn(64, 256), ["0", "1"],
                           [Format.FP32, Format.BF16, Format.FP16], repeats=3)
    for layer in times.values():
        t32 = layer[Format.FP32]
        for fmt, t in layer.items():
            assert t.ok and math.isfinite(t.seconds), (fmt, t)
            if "warm-up run" in t.note:
                assert t.repeats == 1 and t.seconds > t32.seconds, (fmt, t)
            else:
                assert t.repeats >= 1
