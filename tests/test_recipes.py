"""FP8 recipes: rowwise and rowwise_with_gw_hp compute what torchao's recipes of those names
define (checked against an independent float64 reference), the policy names a recipe per layer
and per glob, schema-1 files load unchanged, and the search offers each recipe it can gain from."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from autoprec import Policy, profile_view
from autoprec.formats import FP8_E4M3, FP8_FORMATS, Format, expand_formats
from autoprec.policy import PolicyError, load_policy
from autoprec.runtime.fp8 import fp8_linear, fp8_matmul


def _rowwise_round_trip(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Independent E4M3 round trip with one power-of-two scale per slice along ``dim``."""
    x = x.double()
    amax = x.abs().amax(dim=dim, keepdim=True).clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    return (x * scale).float().to(FP8_E4M3).double() / scale


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_rowwise_forward_is_product_of_rowwise_quantized_operands():
    a, b = torch.randn(64, 96), torch.randn(96, 48)
    out = fp8_matmul(a, b, native=False, recipe="rowwise")
    assert out.dtype == torch.bfloat16
    ref = _rowwise_round_trip(a, -1) @ _rowwise_round_trip(b, 0)
    rel = ((out.double() - ref).abs() / ref.abs().clamp(min=1e-3)).max().item()
    assert rel <= 2 ** -8 + 1e-6, f"max relative deviation {rel:.3g} exceeds one bf16 ulp"
    # not tensorwise under another name
    assert not torch.equal(out, fp8_matmul(a, b, native=False, recipe="tensorwise"))


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_gradients_requantize_along_each_gemms_contraction(recipe):
    x = torch.randn(2, 16, 64).requires_grad_()
    w = torch.randn(48, 64, requires_grad=True)
    y = fp8_linear(x, w, native=False, recipe=recipe)
    g = torch.randn(y.shape) * 1e-3
    y.backward(g.to(y.dtype))
    g2 = g.to(torch.bfloat16).double().reshape(-1, 48)
    x2 = x.detach().reshape(-1, 64)
    # dgrad g @ W contracts over N: g per row, W (as the K x N operand W^T) per column
    ref_dx = _rowwise_round_trip(g2, -1) @ _rowwise_round_trip(w.detach().t(), -1).t()
    assert _rel(x.grad.reshape(-1, 64), ref_dx) < 1e-5
    if recipe == "rowwise":  # wgrad x^T @ g contracts over M: x^T per row, g per column
        ref_dw = (_rowwise_round_trip(x2.t(), -1) @ _rowwise_round_trip(g2, 0)).t()
        assert _rel(w.grad, ref_dw) < 1e-5, f"{recipe} wgrad"
    else:  # the weight gradient a BF16 GEMM: within its output rounding of the exact product
        ref_dw = (x2.t().to(torch.bfloat16).double() @ g2).t()
        assert _rel(w.grad, ref_dw) < 2 ** -8, f"{recipe} wgrad"
        assert _rel(w.grad, ref_dw) < 0.1 * _rel(_rowwise_round_trip(x2.t(), -1)
                                                  @ _rowwise_round_trip(g2, 0), ref_dw.t())


def test_rowwise_keeps_small_rows_that_tensorwise_rounds_away():
    """The reason the rowwise recipes exist: one outlier row sets a per-tensor scale that
    leaves the other rows in FP8's subnormals; per-row scales do not."""
    a, b = torch.randn(128, 256), torch.randn(256, 64)
    a[0] *= 3e4
    ref = a.double() @ b.double()
    errors = {}
    for recipe in ("tensorwise", "rowwise"):
        out = fp8_matmul(a, b, native=False, recipe=recipe)
        errors[recipe] = _rel(out[1:], ref[1:])
    assert errors["rowwise"] < 0.05 < errors["tensorwise"], errors


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_scaled_mm_kernel_agrees_with_emulation(recipe):
    x1 = torch.randn(32, 64, requires_grad=True)
    w1 = torch.randn(48, 64, requires_grad=True)
    x2, w2 = x1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    g = torch.randn(32, 48).to(torch.bfloat16)
    emu, real = (fp8_linear(x1, w1, native=False, recipe=recipe),
                 fp8_linear(x2, w2, native=True, recipe=recipe))
    emu.backward(g)
    real.backward(g)
    for name, a, b in (("out", emu, real), ("dx", x1.grad, x2.grad), ("dw", w1.grad, w2.grad)):
        assert _rel(a, b) < 4e-3, f"{name}: kernel vs emulation"


# ---------------------------------------------------------------------------- formats, policy
def test_recipe_names_and_expansion():
    assert Format.parse("fp8") is Format.FP8 and Format.FP8.recipe == "tensorwise"
    assert Format.parse("fp8:tensorwise") is Format.FP8
    assert Format.parse("FP8:RowWise") is Format.FP8_ROWWISE
    assert Format.parse("fp8", fp8_recipe="rowwise_with_gw_hp") is Format.FP8_ROWWISE_GW_HP
    assert expand_formats(["bf16", "fp8"]) == (Format.BF16, *FP8_FORMATS)
    assert expand_formats(["fp8:rowwise", "fp32"]) == (Format.FP32, Format.FP8_ROWWISE)
    assert all(f.demoted() is Format.BF16 for f in FP8_FORMATS)
    with pytest.raises(ValueError, match=r"'fp8:colwise'.*fp8:rowwise"):
        Format.parse("fp8:colwise")


def test_policy_names_a_recipe_per_layer_and_glob(tmp_path, llama):
    path = tmp_path / "p.yaml"
    path.write_text(
        "autoprec: 2\ndefault: bf16\nlayers:\n"
        "  'model.layers.*.mlp.*': fp8\n"
        "  'model.layers.*.self_attn.*': fp8:rowwise\n"
        "  model.layers.0.self_attn.k_proj: fp8:rowwise_with_gw_hp\n"
        "fp8: {recipe: tensorwise, engine: autoprec}\n")
    policy = load_policy(path)
    assert policy.format_for("model.layers.1.mlp.up_proj") is Format.FP8
    assert policy.format_for("model.layers.1.self_attn.q_proj") is Format.FP8_ROWWISE
    assert policy.format_for("model.layers.0.self_attn.k_proj") is Format.FP8_ROWWISE_GW_HP
    assert policy.engine == "autoprec"
    # torchao's module_filter_fn per recipe selects exactly that recipe's nn.Linear layers
    keep = policy.module_filter_fn("rowwise")
    chosen = {fqn for fqn, m in llama.named_modules() if keep(m, fqn)}
    assert chosen == {f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1)
                      for p in "qkvo"} - {"model.layers.0.self_attn.k_proj"}


def test_a_bare_fp8_means_the_policys_default_recipe_and_round_trips(tmp_path):
    policy = Policy(default="fp8", layers={"a": "fp8:tensorwise", "b": "bf16"},
                    fp8_recipe="rowwise")
    assert policy.default is Format.FP8_ROWWISE and policy.layers["a"] is Format.FP8
    path = tmp_path / "p.yaml"
    policy.save(path)
    text = path.read_text()
    assert "autoprec: 2" in text and "a: fp8:tensorwise" in text and "default: fp8\n" in text
    assert load_policy(path) == policy


def test_schema_1_policies_load_unchanged(tmp_path):
    """A file written by the previous release (schema 1, `fp8` = tensorwise) reads the same."""
    path = tmp_path / "old.yaml"
    path.write_text("autoprec: 1\nmodel: {name: GPT2LMHeadModel}\ndefault: bf16\nlayers:\n"
                    "  lm_head: fp32\n  'transformer.h.*.mlp.*': fp8\nfp8: {recipe: tensorwise}\n"
                    "loss_scaling: {init_scale: 65536, growth_interval: 2000}\n")
    policy = load_policy(path)
    assert policy.format_for("transformer.h.3.mlp.c_fc") is Format.FP8
    assert policy.engine == "auto"
    saved = tmp_path / "new.yaml"
    policy.save(saved)
    assert load_policy(saved).layers == policy.layers


@pytest.mark.parametrize("text, match", [
    ("fp8: {recipe: colwise}", r"Unknown fp8 recipe 'colwise'.*line 3.*tensorwise, rowwise"),
    ("fp8: {engine: te}", r"Unknown engine 'te' in .*line 3; .*auto, torchao, autoprec"),
])
def test_bad_recipe_or_engine_is_one_line(tmp_path, text, match):
    path = tmp_path / "p.yaml"
    path.write_text(f"autoprec: 2\ndefault: fp8\n{text}\n")
    with pytest.raises(PolicyError, match=match) as e:
        load_policy(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("engine, phased, version", [
    ("auto", False, 2), ("auto", True, 4), ("torchao", False, 5), ("autoprec", True, 5)])
def test_the_engine_is_written_scaled_engine_in_the_lowest_schema_that_says_it(
        tmp_path, engine, phased, version):
    phases = ({"from_fraction": 0.5, "formats": {"scaled": "bf16"}},) if phased else ()
    policy = Policy(default="bf16", layers={"mlp": "mxfp8"}, engine=engine, phases=phases)
    path = tmp_path / "p.yaml"
    policy.save(path)
    text = path.read_text()
    assert f"\nautoprec: {version}\n" in text
    # the engine runs every scaled format, so it is not under `fp8:` any more
    assert ("scaled:\n  engine: " + engine in text) is (engine != "auto")
    assert "engine" not in text.split("fp8:")[1].split("\n")[1]
    assert load_policy(path) == policy


def test_an_older_schemas_fp8_engine_reads_as_the_engine_and_is_written_anew(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("autoprec: 2\ndefault: bf16\nlayers: {mlp: fp8}\n"
                   "fp8: {recipe: rowwise, engine: torchao}\n")
    policy = load_policy(old)
    assert policy.engine == "torchao" and policy.fp8_recipe == "rowwise"
    new = tmp_path / "new.yaml"
    policy.save(new)
    assert "autoprec: 5" in new.read_text() and load_policy(new) == policy


def test_the_digest_is_of_what_a_policy_computes_not_of_how_its_schema_spells_the_engine(
        tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("autoprec: 2\ndefault: bf16\nlayers: {mlp: fp8}\n"
                   "fp8: {recipe: tensorwise, engine: torchao}\n")
    policy = load_policy(old)
    new = tmp_path / "new.yaml"
    policy.save(new)
    assert "scaled:" in new.read_text() and load_policy(new).digest() == policy.digest()
    assert dataclasses.replace(policy, engine="autoprec").digest() != policy.digest()
    # a certificate made before schema 5 still covers the policy it certified
    shipped = Path(__file__).parent.parent / "policies" / "gpt2_bytes_h100.yaml"
    cert, covers = load_policy(shipped).certified()
    assert cert is not None and covers


@pytest.mark.parametrize("text, match", [
    ("autoprec: 5\ndefault: fp8\nfp8: {engine: torchao}",
     r"`fp8: \{engine: ...\}` in .*p\.yaml line 3 is written `scaled: \{engine: ...\}` in schema 5"),
    ("autoprec: 4\ndefault: fp8\nscaled: {engine: torchao}",
     r"`scaled: \{engine: ...\}` in .*p\.yaml line 3 needs schema 5.*write `autoprec: 5`"),
    ("autoprec: 5\ndefault: fp8\nscaled: {engine: te}", r"Unknown engine 'te' in .*line 3"),
    ("autoprec: 5\ndefault: fp8\nscaled: {recipe: rowwise}",
     r"Unknown key\(s\) 'recipe' at `scaled`.*valid keys are engine"),
    ("autoprec: 5\ndefault: fp8\nscaled: [torchao]", r"`scaled` in .*line 3 must be a mapping"),
])
def test_each_schema_reads_the_engine_where_it_writes_it_and_says_where_it_moved(
        tmp_path, text, match):
    path = tmp_path / "p.yaml"
    path.write_text(text + "\n")
    with pytest.raises(PolicyError, match=match) as e:
        load_policy(path)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- profile, search
def _llama_task():
    """A Llama at 1/4 of Llama-3-8B's width (2 layers, GQA 16 heads / 4 KV heads of 64), its
    numerics measured on 2x32 tokens and its speed priced on an H100 at 8x2048 tokens."""
    from examples.llama_bytes import gpu_task

    return gpu_task(n_layer=2, seq_len=2048, calib_len=32, hidden=1024, intermediate=4096,
                    heads=16, kv_heads=4)


@pytest.fixture(scope="module")
def llama_profile():
    from autoprec.profiling import profile

    return profile(_llama_task(), ["bf16", "fp8"], target="h100", progress=False,
                   only_winnable=True)  # the tune's profile


def test_profile_measures_and_prices_each_recipe(llama_profile):
    prof = llama_profile
    assert prof.formats == (Format.FP32, Format.BF16, *FP8_FORMATS)
    up = "model.layers.0.mlp.up_proj"  # 16384 x 1024 x 4096 on the H100
    speed = {f.recipe: prof.seconds(up, Format.BF16) / prof.seconds(up, f) for f in FP8_FORMATS}
    # the priced order of torchao's roofline at this shape: gw_hp > tensorwise > 1 > rowwise
    assert speed["rowwise_with_gw_hp"] > speed["tensorwise"] > 1.0 > speed["rowwise"], speed
    lp = prof.layer(up)
    assert Format.FP8_ROWWISE in lp.skipped and "not faster than bf16" in \
        lp.skipped[Format.FP8_ROWWISE]
    for f in (Format.FP8, Format.FP8_ROWWISE_GW_HP):  # measured, each with its own numerics
        assert lp.sensitivity[f].finite and lp.sensitivity[f].output_sqnr_db < 40
    assert lp.sensitivity[Format.FP8].output_sqnr_db != \
        lp.sensitivity[Format.FP8_ROWWISE_GW_HP].output_sqnr_db
    # a GQA k projection (N = 4 x 64 = 256) loses in every recipe: nothing measured
    k = prof.layer("model.layers.0.self_attn.k_proj")
    assert all(f in k.skipped for f in FP8_FORMATS), k.skipped
    why = profile_view.fp8_reason(prof, up, Format.FP8_ROWWISE_GW_HP)
    assert why.startswith("chosen: rowwise_with_gw_hp") and "tensorwise" in why, why


def test_search_offers_the_recipes_a_layer_gains_from_and_couples_qkv(llama_profile):
    from autoprec.tuning.config import Grouping
    from autoprec.tuning.space import SearchSpace

    space = SearchSpace.build(llama_profile, llama_profile.formats, Grouping.LAYER,
                              couple=[("q_proj", "k_proj", "v_proj")])
    assert space.choices["model.layers.0.mlp.up_proj"] == [
        "fp32", "bf16", "fp8", "fp8:rowwise_with_gw_hp"]
    qkv = "model.layers.1.self_attn.{q_proj,k_proj,v_proj}"
    assert space.units[qkv] == [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    assert "model.layers.1.self_attn.k_proj" not in space.units
    assert not any(c.startswith("fp8") for c in space.choices[qkv])  # k and v lose in fp8
