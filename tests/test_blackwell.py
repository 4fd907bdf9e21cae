"""Blackwell's formats (issue 25): MXFP8 and NVFP4 as factory entries, their emulation in the
scaled-GEMM kernel (against the block rules of autoprec.blockscale bit for bit, and
against torchao's own MXFP8Linear where it runs: its emulated kernels), per-GEMM formats, the
b200 cost model, the engines, the exports and the tune."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import yaml
from conftest import tiny_llama
from test_export import validate_megatron
from torch import nn

import autoprec
from autoprec import Policy, blockscale
from autoprec.calibration import BLACKWELL_PUBLISHED, CALIBRATION, LLAMA3_8B_GB200, blackwell_rows
from autoprec.cli import main
from autoprec.costmodel import estimate_layer, gemm_seconds, linear_seconds
from autoprec.devices import DEVICES
from autoprec.exporting import ExportError, export
from autoprec.formats import (
    BLOCK_FORMATS,
    FORMAT_ORDER,
    FP4_E2M1,
    FP8_E4M3,
    FP8_E5M2,
    FP8_FORMATS,
    Format,
    Gemm,
    Numerics,
    Support,
    expand_formats,
    per_gemm,
    register,
    unregister,
)
from autoprec.graph import Layer
from autoprec.runtime import engines
from autoprec.runtime.fp8 import round_operand, scaled_matmul
from autoprec.titan_step import price_training_step
from autoprec.tuning import TuneConfig
from autoprec.tuning.config import per_gemm_candidates

MX, NV = Format.MXFP8, Format.NVFP4


@pytest.fixture(autouse=True)
def _builtins_only_after():
    """The per-GEMM mixes a test registers are taken out after it: the rest of the suite sees
    the built-ins only (tests/test_format_registry.py checks the registry's order)."""
    yield
    for fmt in [f for f in Format if f not in FORMAT_ORDER]:
        unregister(fmt)


def _rule(x: torch.Tensor, gemm: Gemm) -> torch.Tensor:
    """The FP32 values the block rules give ``x`` (contraction last), straight from
    blockscale: what the kernel must multiply."""
    if gemm.scaling == "mx":
        return blockscale.mx_dequantize(*blockscale.mx_quantize(x, gemm.a, rounding=gemm.rounding))
    ts = blockscale.nvfp4_tensor_scale(x)
    return blockscale.nvfp4_dequantize(*blockscale.nvfp4_quantize(x, ts), ts)


def _crafted(rows: int, k: int) -> torch.Tensor:
    """Rows of blocks that hit the rules' edges: all-equal, one outlier, zeros, FP32
    subnormals, E4M3's max and a power of two, tiny and huge magnitudes (E8M0's ends)."""
    torch.manual_seed(0)
    x = torch.randn(rows, k)
    x[0, :32] = 3.0                       # all equal
    x[1, :32] = 0.01
    x[1, 5] = 1000.0                      # one outlier
    x[2, :32] = 0.0                       # zeros
    x[3, :32] = 2.0 ** -140               # FP32 subnormals
    x[4, :32] = 448.0                     # E4M3's largest value
    x[5, :32] = torch.linspace(-2.0 ** 100, 2.0 ** 100, 32)
    x[6, :32] = 2.0 ** -120
    x[7, 16:32] = 6.0                     # E2M1's largest value, one NVFP4 block
    return x


# ------------------------------------------------------------------ the formats
def test_block_formats_are_factory_entries_not_fp8_recipes():
    assert [f.value for f in BLOCK_FORMATS] == ["mxfp8", "mxfp8:gw_hp", "nvfp4", "nvfp4:plain"]
    assert all(f.is_scaled and f.recipe is None for f in BLOCK_FORMATS)  # scaled, not fp8:<recipe>
    assert not set(BLOCK_FORMATS) & set(FP8_FORMATS)
    assert set(expand_formats(["fp8"])) == set(FP8_FORMATS)  # a bare fp8: the FP8 recipes only
    assert NV.demoted() is MX and MX.demoted() is Format.BF16
    assert MX.numerics.block == 32 and NV.numerics.block == 16
    assert MX.numerics.torchao_recipe == "mxfp8_rceil" and MX.numerics.megatron_recipe == "mxfp8"
    wgrad = NV.numerics.wgrad
    assert wgrad.hadamard and wgrad.stochastic and NV.numerics.dgrad.stochastic
    assert not NV.numerics.fwd.stochastic and not Format("nvfp4:plain").numerics.wgrad.hadamard
    assert NV.compute_dtype is FP4_E2M1 and NV.max_value == 6.0
    assert Format.MXFP8_GW_HP.numerics.high_precision == ("wgrad",)
    # bytes a GEMM reads per operand element, scales included
    assert MX.numerics.fwd.operand_bytes == 1 + 1 / 32
    assert NV.numerics.fwd.operand_bytes == 0.5 + 1 / 16
    with pytest.raises(ValueError, match="mx or nvfp4"):
        Gemm(FP4_E2M1, FP4_E2M1, "none")
    with pytest.raises(ValueError, match="takes operands in"):
        Gemm(FP4_E2M1, FP4_E2M1, "mx")
    with pytest.raises(ValueError, match="NVFP4's"):
        Gemm(FP8_E4M3, FP8_E4M3, "mx", hadamard=True)


def test_per_gemm_formats_compose_register_once_and_parse():
    mix = Format.parse("nvfp4/mxfp8/bf16")
    assert mix is per_gemm("nvfp4", "mxfp8", "bf16") and mix in Format
    num = mix.numerics
    assert num.fwd == NV.numerics.fwd and num.dgrad == MX.numerics.dgrad
    assert num.wgrad == Format.BF16.numerics.wgrad and num.demotes_to == "bf16"
    # the three GEMMs of a registered format: that format
    assert per_gemm("mxfp8", "mxfp8", "bf16") is Format.MXFP8_GW_HP
    assert Format.parse("fp8:rowwise/fp8:rowwise/bf16") is Format.FP8_ROWWISE_GW_HP
    with pytest.raises(ValueError, match="at least one GEMM must be scaled") as e:
        Format.parse("bf16/bf16/fp32")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="none fp16"):
        per_gemm("nvfp4", "fp16", "fp16")
    with pytest.raises(ValueError, match="Unknown format 'nvfp5'"):
        Format.parse("nvfp5/bf16/bf16")
    # a policy file carries it as its spelling
    p = Policy(default="bf16", layers={"model.layers.0.mlp.*": mix})
    assert Policy.from_dict(yaml.safe_load(p.to_yaml())).format_for("model.layers.0.mlp.up_proj") is mix


def test_a_new_block_format_is_one_factory_entry():
    """MX with E5M2 elements and OCP floor scales, registered here alone: the emulation, the
    policy file and the cost model take it with no edit elsewhere."""
    g = Gemm(FP8_E5M2, FP8_E5M2, "mx", rounding="floor")
    fmt = register(Numerics(name="mxfp8:e5m2_floor", label="mxfp8:e5m2_floor", fwd=g, dgrad=g,
                            wgrad=g, autocast=torch.bfloat16, output=torch.bfloat16,
                            demotes_to="bf16"))
    try:
        a, w = _crafted(32, 64), torch.randn(64, 96)
        out = scaled_matmul(a, w, fmt=fmt)
        ref = _rule(a, g) @ _rule(w.t(), g).t()
        assert torch.equal(out, ref.to(torch.bfloat16))
        assert Policy.from_dict(yaml.safe_load(Policy(default=fmt).to_yaml())).default is fmt
        layer = Layer(fqn="l", kind="linear", module_type="Linear",
                      matmuls=((1, 8192, 4096, 4096),), calls=("linear",))
        # rated and cast as MXFP8 (the same kernels: one byte, a scale per 32)
        assert estimate_layer(layer, fmt, "b200").seconds == \
            estimate_layer(layer, MX, "b200").seconds
        assert DEVICES["h100"].support[fmt] is Support.EMULATED
    finally:
        unregister(fmt)


# ------------------------------------------------------------------ emulation
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4:plain"])
def test_the_kernel_multiplies_what_the_block_rules_give_bit_for_bit(name):
    """Forward, input gradient and weight gradient: each GEMM's operands rounded along its
    own contraction by blockscale's rules, multiplied in FP32 (nvfp4:plain: round to nearest
    everywhere, so the rounding is deterministic)."""
    num = Format(name).numerics
    a = _crafted(64, 128).requires_grad_(True)
    w = _crafted(96, 128).t().contiguous().requires_grad_(True)  # (K, N): crafted along K
    g = _crafted(64, 96).to(torch.bfloat16)
    out = scaled_matmul(a, w, fmt=Format(name))
    assert out.dtype is torch.bfloat16
    assert torch.equal(out, (_rule(a, num.fwd) @ _rule(w.t(), num.fwd).t()).to(torch.bfloat16))
    out.backward(g)
    g32 = g.float()
    dgrad = _rule(g32, num.dgrad) @ _rule(w.detach(), num.dgrad).t()   # contracted over N
    wgrad = _rule(a.detach().t(), num.wgrad) @ _rule(g32.t(), num.wgrad).t()  # over M
    assert torch.equal(a.grad, dgrad) and torch.equal(w.grad, wgrad)


def test_shapes_off_the_block_run_in_bf16():
    a, w = torch.randn(48, 64), torch.randn(64, 96)  # M = 48: not a multiple of MX's 32
    bf16 = torch.matmul(a.bfloat16(), w.bfloat16())
    assert torch.equal(scaled_matmul(a, w, fmt=MX), bf16)
    assert not torch.equal(scaled_matmul(a, w, fmt=NV), bf16)  # 48 is a multiple of 16


def test_round_operand_is_the_rule_and_hadamard_cancels_in_the_product():
    x = _crafted(8, 64)
    assert torch.equal(round_operand(x, MX.numerics.fwd, 0), _rule(x, MX.numerics.fwd))
    h = blockscale._hadamard_matrix(torch.device("cpu"))
    assert torch.allclose(h @ h.t(), torch.eye(16), atol=1e-6)
    a, b = torch.randn(32, 64), torch.randn(48, 64)
    ha, hb = blockscale.hadamard_transform(a), blockscale.hadamard_transform(b)
    assert torch.allclose(ha @ hb.t(), a @ b.t(), atol=1e-4)
    # it spreads a block's outlier: the transformed block's amax is far below the outlier's
    spike = torch.zeros(1, 16)
    spike[0, 3] = 16.0
    assert blockscale.hadamard_transform(spike).abs().max() == pytest.approx(4.0)


def test_stochastic_rounding_is_unbiased_and_only_on_gradients():
    x = torch.full((200_000,), 2.4)  # between E2M1's 2 and 3: nearest gives 2 every time
    assert blockscale.to_e2m1(x).unique().tolist() == [2.0]
    sr = blockscale.to_e2m1(x, stochastic=True)
    assert set(sr.unique().tolist()) == {2.0, 3.0}
    assert sr.mean().item() == pytest.approx(2.4, abs=0.01)  # 0.4 of the draws go up
    # the forward of nvfp4 is deterministic (no SR); its backward is not
    a = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(64, 48, requires_grad=True)
    outs = [scaled_matmul(a, w, fmt=NV) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    grads, weights = [], torch.randn(32, 48)  # a gradient off E2M1's grid
    for out in outs:
        (ga,) = torch.autograd.grad((out.float() * weights).sum(), a)
        grads.append(ga)
    assert not torch.equal(grads[0], grads[1])


def test_nvfp4_and_mxfp8_train_a_real_llama_step():
    for fmt in (MX, NV, per_gemm("nvfp4", "mxfp8", "mxfp8")):
        model = tiny_llama().train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            autoprec.apply(model, Policy(default="bf16", layers={"model.layers.*.mlp.*": fmt}))
        assert autoprec.applied_formats(model)["model.layers.0.mlp.up_proj"] is fmt
        ids = torch.randint(0, 256, (2, 64))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grad = model.model.layers[0].mlp.up_proj.weight.grad
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad.abs().sum() > 0


# ------------------------------------------------------------------ torchao
def test_autoprec_mxfp8_matches_torchaos_mxfp8linear_bit_for_bit():
    """torchao's MXFP8Linear with its emulated kernels (the AUTO ones need sm_100): the same
    forward, input gradient and weight gradient as autoprec's kernel, bit for bit; the
    weight-gradient-in-BF16 recipe with BF16 inputs as training feeds it."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    for fmt, dtype in ((MX, torch.float32), (Format.MXFP8_GW_HP, torch.bfloat16)):
        linear = nn.Linear(128, 64, bias=False).to(dtype)
        theirs = engines.mxfp8_linear(linear, fmt, emulate=True)
        assert theirs.weight is linear.weight and type(theirs).__name__ == "MXFP8Linear"
        x = _crafted(32, 128).to(dtype).requires_grad_(True)
        g = torch.randn(32, 64).bfloat16()
        out_t = theirs(x)
        out_t.backward(g.to(out_t.dtype))
        got_t = (out_t.float(), x.grad.clone(), linear.weight.grad.clone())
        x.grad = linear.weight.grad = None
        out_a = scaled_matmul(x, linear.weight.t(), fmt=fmt)
        out_a.backward(g)
        assert torch.equal(out_t.to(torch.bfloat16), out_a)
        assert torch.equal(got_t[1], x.grad) and torch.equal(got_t[2], linear.weight.grad)


def test_torchao_engine_refuses_mxfp8_off_blackwell_in_one_line(monkeypatch):
    pytest.importorskip("torchao")
    linear = nn.Linear(64, 64)
    assert engines.engine_for(linear, MX, "auto") == "autoprec"  # emulated here
    with pytest.raises(RuntimeError, match="compute capability 10.0 .*engine to auto or "
                                           "autoprec") as e:
        engines.engine_for(linear, MX, "torchao")
    assert "\n" not in str(e.value)
    assert engines.engine_for(linear, NV, "torchao") == "autoprec"  # torchao has no recipe
    # on a Blackwell GPU the layer is torchao's MXFP8Linear, with the recipe's settings
    monkeypatch.setattr(engines, "blackwell", lambda device: True)
    assert engines.engine_for(linear, Format.MXFP8_GW_HP, "auto") == "torchao"
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    swaps = engines.swap_to_torchao(model, {"0": Format.MXFP8_GW_HP})
    assert type(model[0]).__name__ == "MXFP8Linear" and model[0].wgrad_with_hp
    assert engines.computes_own(model[0], Format.MXFP8_GW_HP)
    assert not engines.computes_own(model[0], Format.FP8)
    engines.restore(swaps)
    assert type(model[0]) is nn.Linear


# ------------------------------------------------------------------ cost model
_BIG = Layer(fqn="w1", kind="linear", module_type="Linear", matmuls=((1, 65536, 4096, 14336),),
             calls=("linear",))


def test_b200_runs_block_formats_natively_hopper_emulates_them():
    for fmt in BLOCK_FORMATS:
        assert DEVICES["b200"].support[fmt] is Support.NATIVE
        assert DEVICES["h100"].support[fmt] is Support.EMULATED
        assert DEVICES["a100"].support[fmt] is Support.EMULATED
    bf16 = estimate_layer(_BIG, "bf16", "b200").seconds
    speed = {f: bf16 / estimate_layer(_BIG, f, "b200").seconds for f in ("fp8", MX, NV)}
    assert speed[NV] > speed[MX] > 1 and speed["fp8"] > 1
    h100 = estimate_layer(_BIG, MX, "h100")
    assert h100.emulated and h100.seconds >= estimate_layer(_BIG, "bf16", "h100").seconds


def test_each_gemm_is_priced_at_its_own_rate():
    m, k, n = 65536, 4096, 14336
    parts = {f: gemm_seconds(m, k, n, f, "b200") for f in ("nvfp4", "mxfp8")}
    mix = gemm_seconds(m, k, n, "nvfp4/mxfp8/mxfp8", "b200")
    # forward at NVFP4's rate, both backward GEMMs at MXFP8's
    assert mix == pytest.approx(parts["nvfp4"] / 3 + 2 * parts["mxfp8"] / 3, rel=1e-9)
    assert linear_seconds(m, k, n, "nvfp4", "b200") < linear_seconds(m, k, n, "nvfp4/mxfp8/mxfp8",
                                                                      "b200") \
        < linear_seconds(m, k, n, "mxfp8", "b200")
    # a high-precision weight gradient costs a BF16 GEMM and saves two casts
    gw = gemm_seconds(m, k, n, "mxfp8:gw_hp", "b200")
    assert gw == pytest.approx(2 * parts["mxfp8"] / 3 + gemm_seconds(m, k, n, "bf16", "b200") / 3)


def test_b200_calibration_states_what_the_published_figures_find():
    rows = blackwell_rows()
    assert len(rows) == len(BLACKWELL_PUBLISHED)
    fitted = [r for r in rows if r.fitted]
    assert all(abs(r.error) < 0.012 for r in fitted)  # each fit reproduces its figure
    held = [abs(r.error) for r in rows if not r.fitted and "speed-up" in r.figure]
    cal = CALIBRATION["b200"]
    steps = [abs(r.error) for r in rows if not r.fitted and r.kind == "step"
             and "speed-up" in r.figure]
    gemms = [abs(r.error) for r in rows if not r.fitted and r.kind == "linear"]
    assert len(held) == len(steps) + len(gemms) == 5
    assert max(steps) <= cal.speedup_error < max(steps) + 0.005
    assert max(gemms) <= cal.linear_error < max(gemms) + 0.005
    # torchtitan's rule priced as it ran: the last 5 blocks in bf16 cost speed
    tail = price_training_step(LLAMA3_8B_GB200, "nvfp4", "b200", bf16_tail=5)
    full = price_training_step(LLAMA3_8B_GB200, "nvfp4", "b200")
    assert sum(tail.values()) > sum(full.values())
    with pytest.raises(ValueError, match="bf16_tail=40"):
        price_training_step(LLAMA3_8B_GB200, "nvfp4", "b200", bf16_tail=40)
    with pytest.raises(ValueError, match="FP8 all-gather needs per-tensor scales"):
        price_training_step(LLAMA3_8B_GB200, "mxfp8", "b200", fp8_all_gather=True)


def test_per_gemm_candidates_are_the_mixes_that_can_pay_on_the_target():
    fmts = expand_formats(["bf16", "mxfp8", "nvfp4"])
    mixes = {f.value for f in per_gemm_candidates(fmts, "b200")}
    assert mixes == {"nvfp4/mxfp8/mxfp8", "nvfp4/bf16/bf16", "mxfp8/bf16/bf16"}
    assert per_gemm_candidates(fmts, "h100") == ()  # emulated there: nothing can pay
    cfg = TuneConfig(formats=("bf16", "mxfp8", "nvfp4"), target="b200", per_gemm=True)
    assert {f.value for f in cfg.search.formats} >= mixes
    with pytest.raises(ValueError, match="needs a cost-model target"):
        TuneConfig(formats=("bf16", "mxfp8"), per_gemm=True)


# ------------------------------------------------------------------ exports
def test_torchao_export_gives_mxfp8_layers_torchaos_mxfp8_training_config():
    pytest.importorskip("torchao")
    policy = Policy(default="bf16", layers={"model.layers.*.mlp.*": "mxfp8",
                                            "model.layers.*.self_attn.q_proj": "fp8"})
    exported = export(policy, "torchao", model=tiny_llama())
    assert set(exported.data) == {"mxfp8_rceil", "tensorwise"}
    assert "model.layers.0.mlp.up_proj" in exported.data["mxfp8_rceil"]
    namespace: dict = {}
    exec(compile(exported.text, "exported.py", "exec"), namespace)  # noqa: S102
    for convert in (lambda m: exported.convert(m), lambda m: namespace["convert"](m, emulate=True)):
        model = tiny_llama().train()
        convert(model)
        up = model.model.layers[0].mlp.up_proj
        assert type(up.weight.data).__name__ == "MXFP8TrainingWeightWrapperTensor"
        assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Float8Linear"
        ids = torch.randint(0, 256, (2, 64))
        model(input_ids=ids, labels=ids).loss.backward()
        assert torch.isfinite(up.weight.grad).all()
    with pytest.raises(ExportError, match="is nvfp4, which torchao's float8 training has no "
                                          "recipe for") as e:
        export(Policy(default="bf16", layers={"model.layers.*.mlp.*": "nvfp4"}), "torchao",
               model=tiny_llama())
    assert "\n" not in str(e.value)


def test_megatron_export_speaks_mxfp8_and_nvfp4_and_refuses_what_te_cannot_say():
    policy = Policy(default="bf16", layers={"model.layers.*.mlp.*": "nvfp4",
                                            "model.layers.*.self_attn.*": "mxfp8"})
    doc = export(policy, "megatron", model=tiny_llama()).data
    validate_megatron(doc)
    recipes = {name: c["training_recipe"] for name, c in doc["configs"].items()}
    assert recipes["fp8_mxfp8"] == {"fp8_quantization_recipe": "mxfp8", "fp8_format": "e4m3",
                                    "override_nonquantized_autocast": True}
    assert recipes["fp4_nvfp4"] == {"fp4_quantization_recipe": "nvfp4",
                                    "override_nonquantized_autocast": True}
    for fmt in ("nvfp4:plain", "mxfp8:gw_hp"):
        with pytest.raises(ExportError, match=f"none computes {fmt}") as e:
            export(Policy(default="bf16", layers={"model.layers.*.mlp.*": fmt}), "megatron",
                   model=tiny_llama())
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------ CLI
def test_show_diff_and_formats_speak_the_new_formats(tmp_path, capsys):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    Policy(default="bf16", layers={"model.layers.*.mlp.*": "nvfp4"}).save(a)
    Policy(default="bf16", layers={"model.layers.*.mlp.*": "nvfp4/mxfp8/mxfp8"}).save(b)
    assert yaml.safe_load(b.read_text())["layers"] == {"model.layers.*.mlp.*": "nvfp4/mxfp8/mxfp8"}
    assert main(["show", str(a)]) == 0
    assert "model.layers.*.mlp.*: nvfp4" in capsys.readouterr().out
    main(["diff", str(a), str(b)])
    out = capsys.readouterr().out
    assert "nvfp4" in out and "nvfp4/mxfp8/mxfp8" in out
    with pytest.raises(SystemExit):
        main(["tune", "examples/gpt2_bytes.py:task", "--formats", "bf16", "nvfp9"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "Unknown format 'nvfp9'" in err[-1] and err[-1].startswith("autoprec tune: error")


@pytest.mark.slow
def test_a_tune_for_b200_chooses_among_the_block_formats(tmp_path):
    """A real tune of a HF Llama priced for a B200 over bf16, mxfp8, nvfp4 and their per-GEMM
    mixes: every chosen format is one offered, the policy file round-trips, and it trains."""
    from autoprec.task import Task
    from autoprec.tuning import tune
    from examples.data import byte_batches

    batches = byte_batches(4, 4, 64, seed=0)
    task = Task(model=tiny_llama, batches=batches)
    res = tune(task, TuneConfig(formats=("bf16", "mxfp8", "nvfp4"), target="b200",
                                per_gemm=True, n_trials=8, output=str(tmp_path / "p.yaml")))
    offered = set(res.profile.formats)
    assert {MX, NV, per_gemm("nvfp4", "mxfp8", "mxfp8")} <= offered
    used = res.policy.formats_used()
    assert used <= offered and math.isfinite(res.profile.estimate_step(
        {lp.fqn: res.policy.format_for(lp.fqn) for lp in res.profile.layers}, "b200"))
    res.policy.save(tmp_path / "p.yaml")
    back = autoprec.load_policy(tmp_path / "p.yaml")
    assert back.formats_used() == used


def test_replace_keeps_the_formats_it_was_given():
    """``fp8:tensorwise`` is stored as Format.FP8, which is also the string "fp8": replace()
    rebuilt the config from it and widened it to every FP8 recipe (and their per-GEMM mixes),
    so bench_peers --max-grad-error searched formats it was not given."""
    config = TuneConfig(formats=("fp32", "bf16", "fp8:tensorwise", "mxfp8", "nvfp4"),
                        target="b200", per_gemm=True)
    assert Format.FP8_ROWWISE not in config.formats
    changed = config.replace(max_grad_error=1.0)
    assert changed.formats == config.formats
    assert changed.budget.max_grad_error == 1.0
    # the bare name still means every recipe
    assert Format.FP8_ROWWISE in TuneConfig(formats=("bf16", "fp8")).formats
