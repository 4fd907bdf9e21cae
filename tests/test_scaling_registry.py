"""A new scaling is one object: a toy 128x128-tile scaling with an E4M3 scale per tile (as
DeepSeek-V3 scales its weights, here with the scale itself in E4M3) and a format using it,
both made in this file alone. Gemm validation, the emulation, the cost and memory models,
the exports' refusal and `show` handle them with no edit elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama, train_mlps_in

import autoprec
from autoprec import Policy
from autoprec.cli import main
from autoprec.costmodel import estimate_layer
from autoprec.devices import DEVICES
from autoprec.exporting import ExportError, export
from autoprec.formats import FP8_E4M3, FP8_E5M2, Format, Gemm, Numerics, Support, register, unregister
from autoprec.graph import Layer
from autoprec.memory import MemoryModel, StepMemory
from autoprec.runtime.fp8 import round_operand, scaled_matmul
from autoprec.scaling import Scaling, register_scaling, scaling_named, unregister_scaling

TILE = 128
NAME = "fp8:tiles"


def tile_round(x: torch.Tensor, gemm, dtype: torch.dtype, stochastic: bool) -> torch.Tensor:
    """Each 128x128 tile of the last two dimensions scaled by ``amax / max(dtype)`` rounded to
    E4M3 (at least its smallest subnormal), the values rounded to ``dtype`` and scaled back."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]) if x.dim() != 1 else x.reshape(1, -1)
    rows, cols = x2.shape
    padded = F.pad(x2, (0, -cols % TILE, 0, -rows % TILE))
    r, c = padded.shape
    tiles = padded.reshape(r // TILE, TILE, c // TILE, TILE)
    top = torch.finfo(dtype).max
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    scale = (amax / top).to(FP8_E4M3).to(torch.float32).clamp(min=2.0 ** -9)
    values = (tiles / scale).clamp(-top, top).to(dtype).to(torch.float32) * scale
    return values.reshape(r, c)[:rows, :cols].reshape(shape)


@pytest.fixture
def tiles():
    scaling = register_scaling(Scaling("tile128", elements=(FP8_E4M3, FP8_E5M2), precision=1.9,
                                       block=TILE, scale_bytes=1 / TILE ** 2, round=tile_round))
    gemm = Gemm(FP8_E4M3, FP8_E4M3, "tile128")
    grad = Gemm(FP8_E5M2, FP8_E4M3, "tile128")
    fmt = register(Numerics(name=NAME, label=NAME, fwd=gemm, dgrad=grad,
                            wgrad=Gemm(FP8_E4M3, FP8_E5M2, "tile128"), autocast=torch.bfloat16,
                            output=torch.bfloat16, demotes_to="bf16",
                            recipe=NAME.partition(":")[2]))
    try:
        yield fmt
    finally:
        unregister(fmt)  # the rest of the suite sees the built-ins only
        unregister_scaling(scaling)


def test_a_gemm_takes_a_registered_scaling_only():
    with pytest.raises(ValueError, match="'tile128' is not one of none, tensor, row, mx, nvfp4"):
        Gemm(FP8_E4M3, FP8_E4M3, "tile128")
    with pytest.raises(ValueError, match="built-in"):
        unregister_scaling(scaling_named("row"))


def test_the_gemm_and_format_read_the_scaling(tiles):
    gemm = tiles.numerics.fwd
    assert gemm.scaling is scaling_named("tile128") and gemm.scaling == "tile128"
    assert gemm.is_scaled and gemm.block == TILE and gemm.operand_bytes == 1 + 1 / TILE ** 2
    assert tiles.numerics.is_block_scaled and tiles.numerics.block == TILE
    # no tensor-core kernel is known for it: not native on any GPU
    assert tiles.numerics.cuda_capability is None and not tiles.numerics.saves_quantized
    assert Format.parse(NAME) is tiles and tiles.demoted() is Format.BF16
    with pytest.raises(ValueError, match="takes operands in"):
        Gemm(torch.bfloat16, FP8_E4M3, "tile128")
    with pytest.raises(ValueError, match="tile128 scales take no rounding"):
        Gemm(FP8_E4M3, FP8_E4M3, "tile128", rounding="floor")


def test_emulation_rounds_and_trains_a_step_in_it(tiles):
    torch.manual_seed(0)
    a = torch.randn(256, 384) * torch.tensor([1e-4] * TILE + [1e3] * 2 * TILE)
    b = torch.randn(384, 128)
    fwd = tiles.numerics.fwd
    assert torch.equal(round_operand(a, fwd, 0), tile_round(a, fwd, FP8_E4M3, False))
    want = (tile_round(a, fwd, FP8_E4M3, False)
            @ tile_round(b.t().contiguous(), fwd, FP8_E4M3, False).t()).to(torch.bfloat16)
    got = scaled_matmul(a, b, fmt=tiles)
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    # per tile, not per tensor: the first tile's small values keep their precision (one scale
    # for the whole tensor flushes them to zero)
    small = a[:, :TILE]

    def error(rounded):
        return ((rounded[:, :TILE] - small).norm() / small.norm()).item()

    assert error(round_operand(a, fwd, 0)) < 0.1
    assert error(round_operand(a, Format.FP8.numerics.fwd, 0)) > 0.9

    # 128 wide and 2 x 64 tokens: every MLP product is a whole number of tiles
    train_mlps_in(tiles, n_embd=128, seq_len=64)


def test_cost_model_prices_it_as_emulated_everywhere(tiles):
    layer = Layer(fqn="mlp", kind="linear", module_type="Linear",
                  matmuls=((1, 8192, 4096, 16384),), calls=("linear",),
                  bytes=4 * (8192 * 4096 + 4096 * 16384 + 8192 * 16384), params=4096 * 16384)
    for target in ("h100", "b200"):
        assert DEVICES[target].support[tiles] is Support.EMULATED
        mine = estimate_layer(layer, tiles, target)
        assert mine.emulated and mine.seconds >= estimate_layer(layer, "fp32", target).seconds


def test_memory_model_reads_its_kernel(tiles):
    layer = Layer(fqn="fc", kind="linear", module_type="Linear", matmuls=((1, 128, 256, 384),),
                  calls=("linear",), params=256 * 384)
    model = MemoryModel((layer,), StepMemory(0, 10**6, 10**5))
    # autoprec's per-GEMM kernel saves its inputs as they came, as the rowwise recipe does
    assert model.layer_change(Policy(default=NAME)) == \
        model.layer_change(Policy(default="fp8:rowwise", engine="autoprec"))
    assert model.layer_change(Policy(default=NAME)) != model.layer_change(Policy(default="fp8"))


def test_exports_refuse_it_in_one_line(tiles):
    policy = Policy(default="bf16", layers={"model.layers.*.mlp.*": NAME})
    with pytest.raises(ExportError, match=f"is {NAME}, which torchao's float8 training has no "
                                          "recipe for") as info:
        export(policy, "torchao", model=tiny_llama())
    assert "\n" not in str(info.value)
    with pytest.raises(ExportError, match=f"none computes {NAME}") as info:
        export(policy, "megatron", model=tiny_llama(hidden=128, intermediate=256))
    assert "\n" not in str(info.value)


def test_policy_file_and_show(tiles, tmp_path, capsys):
    policy = Policy(default="bf16", layers={"transformer.h.*.mlp.*": NAME})
    path = tmp_path / "tiles.yaml"
    policy.save(path)
    back = autoprec.load_policy(path)
    assert back == policy and back.format_for("transformer.h.0.mlp.c_fc") is tiles
    assert main(["show", str(path)]) == 0
    assert f"transformer.h.*.mlp.*: {NAME}" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["tensor", "row"])
def test_rounding_an_operand_holds_one_fp32_temporary(name):
    """An FP32-scaled rounding (quantize, then dequantize) clamps in the product's memory and
    divides in the widened copy's: at most its result and the FP8 values (1.25x the operand's
    bytes, traced allocations: no timing), where a new tensor per step held 2.25x; the values
    are those of the step-by-step formula, bit for bit (issue 38: the fold rounds a head)."""
    from autoprec.memory import _peak_above
    from autoprec.scaling import dequantize, quantize

    scaling = scaling_named(name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 1024, generator=g) * 10.0 ** torch.randint(-6, 3, (1024, 1024),
                                                                     generator=g)
    dtype = torch.float8_e4m3fn
    got = []
    peak = _peak_above(lambda: got.append(scaling.round(x, None, dtype)), torch.device("cpu"))
    assert peak <= 1.25 * x.nbytes + 4096, (peak, x.nbytes)
    s = scaling.scale(x, dtype, -1)
    m = torch.finfo(dtype).max
    assert torch.equal(got[0], (x * s).clamp(-m, m).to(dtype).to(torch.float32) / s)
    assert torch.equal(dequantize(quantize(x, s, dtype), s), got[0])
