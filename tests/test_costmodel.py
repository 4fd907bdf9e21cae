"""Tests of autoprec.costmodel: the roofline model of devices that are not here."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from autoprec.costmodel import estimate_layer, estimate_layers, estimate_step
from autoprec.devices import DEVICES, DeviceSpec
from autoprec.formats import Format, Support
from autoprec.measure.capture import capture

ALL = ("fp32", "bf16", "fp16", "fp8")


def _lin(m: int, k: int, n: int, fqn: str = "lin") -> SimpleNamespace:
    return SimpleNamespace(fqn=fqn, kind="linear", matmuls=((1, m, k, n),),
                           flops=2 * m * k * n, bytes=4 * (m * k + k * n + m * n), params=k * n)


def _t(layer, fmt, target) -> float:
    return estimate_layer(layer, fmt, target).seconds


def test_model_large_linear_on_h100_orders_fp8_bf16_fp32():
    big = _lin(4096, 8192, 16384)  # torchao's 1.39x case
    fp32, bf16, fp8 = (_t(big, f, "h100") for f in ("fp32", "bf16", "fp8"))
    assert fp8 < bf16 < fp32
    assert 1.2 < bf16 / fp8 < 2.0, f"fp8 speedup over bf16 {bf16 / fp8:.2f}x (torchao: 1.39x)"


def test_model_small_linear_gains_nothing_from_fp8():
    small = _lin(1024, 2048, 1024)  # torchao measured fp8 at 0.80x of bf16 on H100
    for target in ("h100", "h200"):
        bf16, fp8 = _t(small, "bf16", target), _t(small, "fp8", target)
        assert fp8 >= bf16, f"{target}: fp8 {fp8 * 1e6:.1f} us < bf16 {bf16 * 1e6:.1f} us"


def test_model_crossover_is_monotone_in_size():
    sizes = [256, 512, 1024, 2048, 4096, 8192]
    speedups = [_t(_lin(s, s, s), "bf16", "h100") / _t(_lin(s, s, s), "fp8", "h100")
                for s in sizes]
    assert speedups == sorted(speedups), speedups
    assert speedups[0] < 1 < speedups[-1], speedups


def test_model_fp8_shape_the_kernel_cannot_take_is_priced_as_bf16():
    odd = _lin(1000, 1024, 1024)  # M = 1000 tokens is not a multiple of 16
    fp8 = estimate_layer(odd, "fp8", "h100")
    assert fp8.seconds == _t(odd, "bf16", "h100")
    assert "priced as bf16" in fp8.note and "M=1000" in fp8.note, fp8.note
    assert not fp8.emulated and fp8.source == "model:h100"


def test_model_a100_never_gives_fp8_faster_than_bf16():
    for s in (16, 128, 1024, 4096, 16384):
        layer = _lin(s, s, s)
        fp8 = estimate_layer(layer, "fp8", "a100")
        assert fp8.emulated and "emulated" in fp8.note
        assert fp8.seconds >= _t(layer, "bf16", "a100")
        assert fp8.seconds >= _t(layer, "fp32", "a100")


def test_model_h200_never_slower_than_h100_outside_the_scaled_casts():
    """The H200 is the H100's compute with more bandwidth: nothing is slower on it, except the
    casts into scaled formats, whose H200 speed was measured (MEASURED_H200: slower than the
    H100's, which comes from torchao's roofline) while the H100's was not."""
    layers = [_lin(s, 2 * s, s) for s in (16, 256, 1000, 4096)]
    layers.append(SimpleNamespace(fqn="ln", kind="norm", matmuls=(), flops=0,
                                  bytes=8 * 2048 * 1024, params=2048))
    for layer in layers:
        for fmt in ("fp32", "bf16", "fp16"):
            assert _t(layer, fmt, "h200") <= _t(layer, fmt, "h100"), (layer.matmuls, fmt)
    h100_casts = dataclasses.replace(DEVICES["h200"], cast_efficiency=None)
    for layer in layers:
        for fmt in ALL:
            assert estimate_layer(layer, fmt, h100_casts).seconds <= _t(layer, fmt, "h100")


def test_model_norm_and_embedding_are_memory_bound():
    norm = SimpleNamespace(fqn="ln", kind="norm", matmuls=(), flops=5 * 4096 * 1024,
                           bytes=8 * 4096 * 1024, params=2048)
    emb = SimpleNamespace(fqn="wte", kind="embedding", matmuls=(), flops=0,
                          bytes=4 * 4096 * 1024, params=50257 * 1024)
    for layer in (norm, emb):
        times = [_t(layer, f, "h100") for f in ("fp32", "bf16", "fp16")]
        assert max(times) <= 1.05 * min(times), times
        assert "memory-bound" in estimate_layer(layer, "bf16", "h100").note


def test_model_cpu_amx_matches_the_measured_design_numbers():
    big = _lin(2048, 2048, 2048)
    fp32, bf16, fp16 = (_t(big, f, "cpu-amx") for f in ("fp32", "bf16", "fp16"))
    assert bf16 < fp32 < fp16  # AMX BF16 ~6x FP32; FP16 slower than FP32 on that CPU
    assert estimate_layer(big, "fp8", "cpu-amx").emulated


def test_model_unknown_target_lists_the_valid_ones():
    with pytest.raises(ValueError, match="Unknown cost-model target .h800.*h100, h200, b200, b300, a100, cpu-amx"):
        estimate_layer(_lin(16, 16, 16), "bf16", "h800")


def test_device_spec_validates():
    with pytest.raises(ValueError, match="natively but gives no"):
        DeviceSpec(name="x", matmul_flops={"fp32": 1e12}, bandwidth=1e12,
                   support={f: Support.NATIVE for f in Format})
    with pytest.raises(ValueError, match="efficiency"):
        DeviceSpec(name="x", matmul_flops={f: 1e12 for f in Format}, bandwidth=1e12,
                   support={f: Support.NATIVE for f in Format}, efficiency=1.5)
    spec = DeviceSpec(name="mine", matmul_flops={f: 1e12 for f in Format}, bandwidth=1e12,
                      support={f: Support.NATIVE for f in Format})
    assert estimate_layer(_lin(64, 64, 64), "bf16", spec).source == "model:mine"


def test_estimate_step_sums_layers_and_prices_casts_on_edges():
    layers = [_lin(4096, 4096, 4096, "a"), _lin(4096, 4096, 4096, "b")]
    uniform = {"a": "bf16", "b": "bf16"}
    assert estimate_step(layers, uniform, "h100") == pytest.approx(
        sum(_t(x, "bf16", "h100") for x in layers))
    edges = [("a", "b")]
    same = estimate_step(layers, uniform, "h100", edges=edges)
    mixed = estimate_step(layers, {"a": "bf16", "b": "fp32"}, "h100", edges=edges)
    no_cast = estimate_step(layers, {"a": "fp8", "b": "bf16"}, "h100", edges=edges)
    # Dropping the per-layer boundary casts makes the edge-aware sum cheaper than the
    # conservative one; a bf16 -> fp32 edge adds one cast; fp8 -> bf16 needs none.
    assert same < estimate_step(layers, uniform, "h100")
    b_fp32 = estimate_step(layers[1:], {"b": "fp32"}, "h100", edges=[])
    a_bf16 = estimate_step(layers[:1], {"a": "bf16"}, "h100", edges=[])
    assert mixed > a_bf16 + b_fp32
    a_fp8 = estimate_step(layers[:1], {"a": "fp8"}, "h100", edges=[])
    b_bf16 = estimate_step(layers[1:], {"b": "bf16"}, "h100", edges=[])
    assert no_cast == pytest.approx(a_fp8 + b_bf16)
    with pytest.raises(ValueError, match="no format for 1 layer"):
        estimate_step(layers, {"a": "bf16"}, "h100")
    assert estimate_step(layers, {"a": "bf16"}, "h100", default="bf16") == pytest.approx(
        estimate_step(layers, uniform, "h100"))
    with pytest.raises(ValueError, match="names 'c'"):
        estimate_step(layers, {"a": "bf16", "b": "bf16", "c": "fp8"}, "h100")


def test_estimate_layers_is_shaped_like_measure_layers():
    layers = [_lin(64, 64, 64, "a"), _lin(128, 64, 64, "b")]
    prof = estimate_layers(layers, ALL, "h200")
    assert list(prof) == ["a", "b"] and list(prof["a"]) == [Format(f) for f in ALL]
    assert all(lt.source == "model:h200" for d in prof.values() for lt in d.values())


def test_model_prices_a_captured_gpt2_attention(gpt2, gpt2_batch):
    """The cost model takes the real autoprec.measure.capture.Layer of a real model."""
    g = capture(gpt2, gpt2_batch)
    attn = g.layer("transformer.h.0.attn")
    for target in DEVICES:
        for fmt in ALL:
            lt = estimate_layer(attn, fmt, target)
            assert lt.ok and lt.seconds > 0, (target, fmt, lt)
    assert estimate_step(g.layers, {}, "h100", edges=g.edges, default="bf16") > 0



# ------------------------------------------------------------ FP8 recipes against torchao
# (M, K, N) of linears as in Llama-3-8B training at 16K tokens per step (k/v projections:
# N = 8 KV heads x 128 = 1024), the GQA k/v footgun of torchtitan#1207 (N = 512), and square
# shapes from 1024 to 8192
GRID = [(16384, 4096, 4096), (16384, 4096, 1024), (16384, 4096, 512), (16384, 4096, 14336),
        (16384, 14336, 4096), (32768, 4096, 1024), (4096, 4096, 1024), (1024, 1024, 1024),
        (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192)]


def _speedup(m, k, n, recipe, target="h100"):
    from autoprec.costmodel import linear_seconds

    return linear_seconds(m, k, n, "bf16", target) / linear_seconds(m, k, n, f"fp8:{recipe}",
                                                                    target)


def _torchao_speedup(m, k, n, recipe):
    """torchao's own float8 roofline speed-up over BF16 for one linear, forward + backward, as
    its benchmarks/float8/float8_roofline.py computes it (casts not fused with a previous op),
    plus for rowwise what the roofline leaves out and torchao runs: the rescale of the two
    backward GEMMs' BF16 outputs by the row scales (a read and a write of M x K and of K x N,
    torchao.float8.float8_ops.addmm_float8_unwrapped, pytorch/ao#1325), which the model prices
    since the check against torchtitan's measured steps (tests/test_calibration.py)."""
    roofline = pytest.importorskip("torchao.testing.training.roofline_utils")
    import torch

    gpu = "NVIDIA H100"
    bf16 = roofline.get_gemm_time_sympy(m, k, n, torch.bfloat16, None, None, gpu)
    fp8 = roofline.get_gemm_time_sympy(m, k, n, torch.float8_e4m3fn, recipe, None, gpu)
    specs = roofline.get_specs(gpu)
    casts = sum(sum(roofline.get_tensor_memory_traffic_ovhd_s(specs, d0, d1, role, recipe, None))
                for d0, d1, role in ((m, k, "input"), (k, n, "weight"), (m, n, "grad_output")))
    if recipe == "rowwise":
        bw = specs["peak_mem_bw_bytes_sec"] * specs["pct_achievable_mem_bw"]
        casts += 2 * 2 * (m * k + k * n) / bw
    return float(bf16 / (fp8 + casts))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_model_fp8_recipes_within_15_percent_of_torchaos_roofline(recipe):
    for shape in GRID:
        ours, theirs = _speedup(*shape, recipe), _torchao_speedup(*shape, recipe)
        assert abs(ours / theirs - 1) <= 0.15, \
            f"{recipe} {shape}: ours {ours:.2f}x, torchao's roofline {theirs:.2f}x"


def test_model_puts_the_footgun_shapes_on_the_losing_side():
    """torchtitan#1207 / ao#2410: a GQA k/v projection (16384x4096x512) in fp8 runs ~40% slower
    than bf16; 1024^3 is launch- and cast-bound. A large MLP projection wins."""
    for recipe in ("tensorwise", "rowwise"):
        assert _speedup(16384, 4096, 512, recipe) < 0.85, recipe
        assert _speedup(1024, 1024, 1024, recipe) < 0.5, recipe
        assert _speedup(16384, 4096, 14336, recipe) > 1.3, recipe
    # rowwise pays for its scales: never faster than tensorwise where the GEMM dominates
    for shape in [(16384, 4096, 4096), (16384, 4096, 14336), (8192, 8192, 8192)]:
        assert _speedup(*shape, "rowwise") < _speedup(*shape, "tensorwise"), shape
