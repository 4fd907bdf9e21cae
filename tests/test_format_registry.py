"""A new format is one factory entry plus its kernels: a toy FP8 recipe (E4M3 everywhere, one
scale per tensor on all three GEMMs) registered here alone, and the policy file, `show`, the
cost and memory models, the exports and the emulation all handle it with no edit elsewhere."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import yaml
from conftest import tiny_llama, train_mlps_in
from torch import nn

import autoprec
from autoprec import Policy
from autoprec.cli import main
from autoprec.costmodel import estimate_layer, estimate_step
from autoprec.devices import DEVICES
from autoprec.exporting import ExportError, export
from autoprec.formats import (FORMAT_ORDER, FP8_E4M3, FP8_E5M2, Format, Gemm, Numerics,
                              Support, register, unregister)
from autoprec.graph import Layer
from autoprec.memory import MemoryModel, StepMemory
from autoprec.runtime.engines import engine_for
from autoprec.runtime.fp8 import fp8_linear

TOY = "fp8:toy_e4m3"


def toy_numerics(name: str = TOY) -> Numerics:
    e4m3 = Gemm(FP8_E4M3, FP8_E4M3, "tensor")
    return Numerics(name=name, label=name, fwd=e4m3, dgrad=e4m3, wgrad=e4m3,
                    autocast=torch.bfloat16, output=torch.bfloat16, demotes_to="bf16",
                    recipe=name.partition(":")[2])


@pytest.fixture
def toy():
    fmt = register(toy_numerics())
    try:
        yield fmt
    finally:
        unregister(fmt)  # the rest of the suite sees the built-ins only


def test_registering_adds_a_format_and_unregistering_takes_it_out():
    before = tuple(Format)  # the built-ins, and any per-GEMM mix an earlier test made
    fmt = register(toy_numerics())
    try:
        assert Format.parse(TOY) is fmt and Format(TOY) is fmt
        assert [f for f in Format if f not in before] == [fmt]
        assert fmt.is_scaled and fmt.recipe == "toy_e4m3" and fmt.demoted() is Format.BF16
        assert Format.fp8("toy_e4m3") is fmt and fmt.max_value == 448.0
        assert pickle.loads(pickle.dumps(fmt)) is fmt and copy.deepcopy([fmt])[0] is fmt
        with pytest.raises(ValueError, match="already registered"):
            register(toy_numerics())
    finally:
        unregister(fmt)
    assert tuple(Format) == before and set(FORMAT_ORDER) <= set(before)
    with pytest.raises(ValueError, match=r"Unknown format 'fp8:toy_e4m3'"):
        Format.parse(TOY)
    with pytest.raises(ValueError, match="built-in"):
        unregister(Format.FP8)


def test_numerics_without_kernels_are_refused():
    row = Gemm(FP8_E5M2, FP8_E5M2, "row", pow2_scales=True)
    bad = Numerics(name="fp8:e5m2_rows", label="fp8:e5m2_rows", fwd=row, dgrad=row, wgrad=row,
                   autocast=torch.bfloat16, output=torch.bfloat16, demotes_to="bf16",
                   recipe="e5m2_rows")
    with pytest.raises(ValueError, match="scaled kernels do not compute fp8:e5m2_rows"):
        register(bad)
    assert "fp8:e5m2_rows" not in [f.value for f in Format]
    with pytest.raises(ValueError, match="need scales"):
        Gemm(FP8_E4M3, FP8_E4M3)


def test_policy_file_and_show(toy, tmp_path, capsys):
    policy = Policy(default="bf16", layers={"transformer.h.*.mlp.*": TOY},
                    fp8_recipe="rowwise")
    path = tmp_path / "toy.yaml"
    policy.save(path)
    assert yaml.safe_load(path.read_text())["layers"] == {"transformer.h.*.mlp.*": TOY}
    back = autoprec.load_policy(path)
    assert back == policy and back.format_for("transformer.h.0.mlp.c_fc") is toy
    # its recipe as the policy's default recipe: a bare `fp8` means it
    own = Policy(default="fp8", fp8_recipe="toy_e4m3")
    assert own.default is toy and yaml.safe_load(own.to_yaml())["default"] == "fp8"
    assert main(["show", str(path)]) == 0
    assert f"transformer.h.*.mlp.*: {TOY}" in capsys.readouterr().out


def test_cost_model_prices_it_as_its_kernels(toy):
    layer = Layer(fqn="mlp", kind="linear", module_type="Linear",
                  matmuls=((1, 8192, 4096, 16384),), calls=("linear",),
                  bytes=4 * (8192 * 4096 + 4096 * 16384 + 8192 * 16384), params=4096 * 16384)
    # the same GEMM rates and the same cast traffic as tensorwise (E4M3 and E5M2 are one byte)
    for target in ("h100", "a100"):
        mine, tensorwise = estimate_layer(layer, toy, target), estimate_layer(layer, "fp8", target)
        assert mine.seconds == tensorwise.seconds and mine.emulated == tensorwise.emulated
    assert DEVICES["h100"].support[toy] is Support.NATIVE
    assert DEVICES["a100"].support[toy] is Support.EMULATED
    assert estimate_layer(layer, toy, "h100").seconds < estimate_layer(layer, "bf16", "h100").seconds
    head = Layer(fqn="head", kind="linear", module_type="Linear", matmuls=((1, 8192, 16384, 256),),
                 calls=("linear",), params=16384 * 256)
    step = estimate_step([layer, head], {"mlp": toy, "head": "fp32"}, "h100",
                         edges=[("mlp", "head")])
    assert step > estimate_layer(layer, toy, "h100", boundary_casts=False).seconds


def test_memory_model_reads_its_kernel(toy):
    layer = Layer(fqn="fc", kind="linear", module_type="Linear", matmuls=((1, 64, 128, 256),),
                  calls=("linear",), params=128 * 256)
    model = MemoryModel((layer,), StepMemory(0, 10**6, 10**5))
    on_autoprec = dict(engine="autoprec")
    # autoprec's kernel keeps the one-byte quantized operands, as for tensorwise
    assert model.layer_change(Policy(default=toy.value, **on_autoprec)) == \
        model.layer_change(Policy(default="fp8", **on_autoprec))
    # torchao has no recipe for it, so engine auto still runs it on autoprec's kernel
    assert model.layer_change(Policy(default=toy.value)) == \
        model.layer_change(Policy(default=toy.value, **on_autoprec))
    assert engine_for(nn.Linear(128, 256), toy, "auto") == "autoprec"


def test_exports_refuse_it_in_one_line(toy):
    policy = Policy(default="bf16", layers={"model.layers.*.mlp.*": TOY})
    with pytest.raises(ExportError, match=r"is fp8:toy_e4m3, which torchao's float8 training "
                                          r"has no recipe for") as info:
        export(policy, "torchao", model=tiny_llama())
    assert "\n" not in str(info.value)
    with pytest.raises(ExportError, match="has no recipe for"):
        export(policy, "torchao")
    with pytest.raises(ExportError, match="none computes fp8:toy_e4m3") as info:
        export(policy, "megatron", model=tiny_llama())
    assert "\n" not in str(info.value)


def test_emulation_trains_a_step_in_it(toy):
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    grads = {}
    for recipe in ("toy_e4m3", "tensorwise"):
        out = fp8_linear(x, w, recipe=recipe)
        (g,) = torch.autograd.grad((out.float() * torch.linspace(1e-3, 1, 48)).sum(), x)
        grads[recipe] = (out, g)
    # the same forward (E4M3 operands, per-tensor scales); the gradient in E4M3, not E5M2
    assert torch.equal(grads["toy_e4m3"][0], grads["tensorwise"][0])
    assert not torch.equal(grads["toy_e4m3"][1], grads["tensorwise"][1])

    model = train_mlps_in(toy)
    copy.deepcopy(model)  # regions holding the format copy


def test_a_new_tensor_scaled_recipe_counts_its_range_per_tensor_as_its_gemms_say(toy):
    """The range statistics read each operand's scaling and element dtype from the format's
    GEMMs: the toy recipe scales per tensor in E4M3 everywhere, so a batch whose rows differ by
    eight orders of magnitude underflows its small rows as tensorwise fp8 does (and its
    gradients too, where the rowwise recipe scales each row to its own range). It used to be
    counted as rowwise: every FP8 format but the tensorwise built-in was."""
    from autoprec.measure.sensitivity import measure_sensitivity

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    rows = torch.tensor([1e3] * 8 + [1e-5] * 8).unsqueeze(1)
    x = torch.randn(16, 32) * rows

    def loss_fn(m, batch):
        return (m(batch) * rows).sum()

    got = measure_sensitivity(model, ["0"], [toy, "fp8", "fp8:rowwise"], batches=[x],
                              loss_fn=loss_fn, mode="exact")["0"]
    tensorwise, rowwise, mine = got[Format.FP8], got[Format.FP8_ROWWISE], got[toy]
    assert mine.act_underflow == tensorwise.act_underflow > rowwise.act_underflow
    assert mine.grad_underflow > rowwise.grad_underflow
