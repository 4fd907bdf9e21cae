"""Exports of a policy to torchao, Megatron-Core and a plain fqn map, on real HF models: the
torchao conversion runs torchao itself; the Megatron file is checked against the schema its
documentation gives and resolved the way Megatron-Core resolves it."""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import yaml
from conftest import tiny_gpt2, tiny_llama
from torch import nn

import autoprec
from autoprec import Policy
from autoprec.cli import main
from autoprec.exporting import ExportError, export, load_name_map

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

# A Llama policy with every recipe: an MLP glob, two single projections, an exception.
MIXED = Policy(default="bf16", layers={
    "model.layers.*.mlp.*": "fp8",
    "model.layers.0.self_attn.k_proj": "fp8:rowwise",
    "model.layers.1.self_attn.q_proj": "fp8:rowwise_with_gw_hp",
    "model.layers.1.mlp.down_proj": "bf16",
})
# ... and the layers it puts in each recipe, written out by hand from the policy
MIXED_FP8 = {
    "model.layers.0.mlp.gate_proj": "tensorwise", "model.layers.0.mlp.up_proj": "tensorwise",
    "model.layers.0.mlp.down_proj": "tensorwise", "model.layers.1.mlp.gate_proj": "tensorwise",
    "model.layers.1.mlp.up_proj": "tensorwise", "model.layers.0.self_attn.k_proj": "rowwise",
    "model.layers.1.self_attn.q_proj": "rowwise_with_gw_hp",
}


@pytest.fixture(autouse=True)
def _no_emulation_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        yield


# ------------------------------------------------------------------ torchao
def _float8_layers(model: nn.Module) -> dict[str, object]:
    from torchao.float8.float8_linear import Float8Linear

    return {fqn: m.config for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}


def _assert_converted_as_the_policy_says(model: nn.Module) -> None:
    from torchao.float8 import Float8LinearConfig

    converted = _float8_layers(model)
    assert set(converted) == set(MIXED_FP8), set(converted) ^ set(MIXED_FP8)
    for fqn, recipe in MIXED_FP8.items():
        want = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        assert converted[fqn] == want, (fqn, recipe)
    # and it trains: one real step on the converted model (emulated FP8 on this CPU)
    from examples.data import byte_batches

    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss = model(**byte_batches(1, 2, 32, seed=1)[0]).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [model.get_submodule(f).weight.grad for f in MIXED_FP8]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    opt.step()


def test_torchao_export_converts_exactly_the_policys_fp8_layers_with_their_recipes():
    pytest.importorskip("torchao")
    from torchao.float8 import convert_to_float8_training

    model = tiny_llama()
    exported = export(MIXED, "torchao", model=model)
    assert {r.recipe for r in exported.recipes} == set(RECIPES)
    assert exported.data == {r: [f for f, x in MIXED_FP8.items() if x == r] for r in RECIPES}
    # torchao's own conversion with the exported configs and filters, one call per recipe
    for r in exported.recipes:
        convert_to_float8_training(model, config=r.config(emulate=True),
                                   module_filter_fn=r.module_filter_fn)
    _assert_converted_as_the_policy_says(model)


def test_the_exported_torchao_script_and_the_patterns_only_export_do_the_same():
    pytest.importorskip("torchao")
    text = export(MIXED, "torchao", model=tiny_llama()).text
    namespace: dict = {}
    exec(compile(text, "exported_torchao.py", "exec"), namespace)  # noqa: S102 - our output
    model = namespace["convert"](tiny_llama(), emulate=True)
    _assert_converted_as_the_policy_says(model)

    # without a model the filters are the policy's own (Policy.module_filter_fn per recipe)
    by_pattern = export(MIXED, "torchao")
    assert by_pattern.text is None and all(r.fqns is None for r in by_pattern.recipes)
    _assert_converted_as_the_policy_says(by_pattern.convert(tiny_llama(), emulate=True))
    # a script exported for another model refuses to half-convert this one
    with pytest.raises(ValueError, match="no module model.layers.1"):
        namespace["convert"](tiny_llama(n_layer=1), emulate=True)


def test_what_torchao_cannot_express_is_a_clear_error_or_a_note():
    fp16 = MIXED.with_layers({"model.layers.0.self_attn.o_proj": "fp16"})
    with pytest.raises(ExportError) as e:
        export(fp16, "torchao", model=tiny_llama())
    msg = str(e.value)
    assert "`model.layers.0.self_attn.o_proj` (Linear) is fp16" in msg and "\n" not in msg
    assert "--no-strict" in msg and "--formats bf16 fp8" in msg
    # the same from the patterns alone
    with pytest.raises(ExportError, match="`model.layers.0.self_attn.o_proj` is fp16"):
        export(fp16, "torchao")
    # strict=False: exported anyway, the layer named in a note, the fp8 layers unchanged
    loose = export(fp16, "torchao", model=tiny_llama(), strict=False)
    assert any("o_proj" in n and "would run in bf16" in n for n in loose.notes)
    assert loose.data == export(MIXED, "torchao", model=tiny_llama()).data

    # GPT-2's projections are HF Conv1D: torchao converts nn.Linear only
    with pytest.raises(ExportError, match=r"`transformer.h.0.mlp.c_fc` \(Conv1D\) is "
                                          r"fp8:tensorwise, but torchao's float8 training "
                                          r"converts nn.Linear only.*autoprec.apply runs such "
                                          "layers in FP8"):
        export(Policy(default="bf16", layers={"transformer.h.*.mlp.*": "fp8"}), "torchao",
               model=tiny_gpt2())


# ------------------------------------------------------------------ Megatron-Core
# The schema, as megatron/core/extensions/TransformerEngineMixedPrecision.md documents it:
#
#   Recipe configurations are named entries in a "configs" dictionary.
#   configs:
#     mxfp8:
#       transformer_engine_config_type: "TEQuantizationParams"
#       training_recipe:
#         fp8_quantization_recipe: "mxfp8"
#     bf16:
#       transformer_engine_config_type: "TEQuantizationParams"
#       training_recipe: {}
#     mxfp8_evaluate_bf16:
#       transformer_engine_config_type: "TEQuantizationParams"
#       training_recipe:
#         fp8_quantization_recipe: "mxfp8"
#       evaluation_recipe: {}
#
#   Recipes are selected by matchers. Currently implemented are glob style expressions.
#   Matchers are ordered, and the first enabled matcher to match against a module name
#   chooses the config from the configs list.
#   matchers:
#     attn_qkv_bf16:
#       config: "bf16"
#       type: "glob"
#       pattern: "*.linear_qkv"
#       enabled: true
#
# and the fields a recipe may carry, from the dataclass that parses it
# (megatron/core/extensions/transformer_engine.py TEQuantizationRecipe; unknown fields are a
# ValueError there, `delayed` is refused, fp8 and fp4 exclude each other), with the values of
# megatron/core/enums.py Fp8Recipe and the fp8_format values the autocast accepts.
RECIPE_FIELDS = {"fp8_quantization_recipe", "fp4_quantization_recipe", "custom_recipe_factory",
                 "fp8_format", "override_quantized_autocast", "override_nonquantized_autocast",
                 "tp_only_amax_red"}
FP8_RECIPES = {"tensorwise", "blockwise", "mxfp8", "custom"}  # Fp8Recipe less `delayed`
FP8_FORMATS = {"e4m3", "hybrid"}


def validate_megatron(doc) -> None:
    """Raise AssertionError where ``doc`` breaks the documented schema."""
    assert isinstance(doc, dict) and set(doc) == {"configs", "matchers"}, doc
    configs, matchers = doc["configs"], doc["matchers"]
    assert isinstance(configs, dict) and configs and isinstance(matchers, dict) and matchers
    for name, config in configs.items():
        assert isinstance(name, str) and isinstance(config, dict), name
        assert config.get("transformer_engine_config_type") == "TEQuantizationParams", name
        assert set(config) <= {"transformer_engine_config_type", "training_recipe",
                               "evaluation_recipe"} and "training_recipe" in config, name
        for key in ("training_recipe", "evaluation_recipe"):
            recipe = config.get(key, {})
            assert isinstance(recipe, dict) and set(recipe) <= RECIPE_FIELDS, (name, recipe)
            if "fp8_quantization_recipe" in recipe:
                assert recipe["fp8_quantization_recipe"] in FP8_RECIPES, (name, recipe)
                assert "fp4_quantization_recipe" not in recipe, name
            assert recipe.get("fp8_format", "e4m3") in FP8_FORMATS, (name, recipe)
            for flag in ("override_quantized_autocast", "override_nonquantized_autocast"):
                assert isinstance(recipe.get(flag, True), bool), (name, flag)
    for name, m in matchers.items():
        assert isinstance(name, str) and isinstance(m, dict), name
        assert set(m) == {"config", "type", "pattern", "enabled"}, (name, m)
        # Megatron-Core skips a matcher without `enabled: true`
        assert m["type"] == "glob" and m["enabled"] is True, (name, m)
        assert isinstance(m["pattern"], str) and m["config"] in configs, (name, m)


def megatron_precision(doc, path: str) -> str | None:
    """What Megatron-Core runs module ``path`` in (RecipeConfig.match_to_config_key: the first
    enabled glob, fnmatch, in file order): "bf16", "fp8:<recipe>", or None (no match)."""
    for m in doc["matchers"].values():
        if m["enabled"] and fnmatch.fnmatchcase(path, m["pattern"]):
            recipe = doc["configs"][m["config"]]["training_recipe"]
            fp8 = recipe.get("fp8_quantization_recipe")
            return "bf16" if fp8 is None else f"fp8:{fp8}"
    return None


def _megatron_paths(n_layer: int) -> list[str]:
    return [f"decoder.layers.{i}.{role}" for i in range(n_layer)
            for role in ("self_attention.linear_qkv", "self_attention.linear_proj",
                         "mlp.linear_fc1", "mlp.linear_fc2")]


def test_the_megatron_file_parses_validates_and_resolves_as_the_policy_says():
    policy = Policy(default="bf16", layers={"model.layers.*.mlp.*": "fp8",
                                            "model.layers.1.self_attn.*_proj": "fp8",
                                            "lm_head": "bf16"})
    exported = export(policy, "megatron", model=tiny_llama(n_layer=3))
    doc = yaml.safe_load(exported.text)
    assert doc == exported.data
    validate_megatron(doc)
    want = {p: "fp8:tensorwise" if ".mlp." in p or ".layers.1." in p else "bf16"
            for p in _megatron_paths(3)}
    assert {p: megatron_precision(doc, p) for p in want} == want
    tensorwise = next(c for c in doc["configs"].values() if c["training_recipe"])
    # tensorwise with E5M2 gradients (hybrid), on whether or not the run has --fp8
    assert tensorwise["training_recipe"] == {"fp8_quantization_recipe": "tensorwise",
                                             "fp8_format": "hybrid",
                                             "override_nonquantized_autocast": True}
    # the MLP is the same in every layer: one glob per role; attention differs per layer
    patterns = [m["pattern"] for m in doc["matchers"].values()]
    assert "decoder.layers.*.mlp.linear_fc1" in patterns
    assert "decoder.layers.1.self_attention.linear_qkv" in patterns
    assert patterns[-1] == "*" and not exported.notes

    # GPT-2 names map too (c_attn is Megatron's fused linear_qkv already)
    gpt2 = export(Policy(default="fp8", layers={"transformer.h.*.attn": "bf16",
                                                "transformer.h.*.attn.c_attn": "fp8",
                                                "transformer.h.1.mlp.c_proj": "bf16",
                                                "lm_head": "bf16"}), "megatron",
                  model=tiny_gpt2())
    validate_megatron(gpt2.data)
    assert megatron_precision(gpt2.data, "decoder.layers.1.mlp.linear_fc2") == "bf16"
    assert megatron_precision(gpt2.data, "decoder.layers.0.mlp.linear_fc2") == "fp8:tensorwise"
    assert megatron_precision(gpt2.data, "decoder.layers.0.self_attention.linear_qkv") == \
        "fp8:tensorwise"
    # c_proj inherits its attention block's bf16
    assert megatron_precision(gpt2.data, "decoder.layers.0.self_attention.linear_proj") == "bf16"


def test_the_validator_rejects_what_megatron_would_reject():
    good = export(Policy(default="bf16", layers={"model.layers.*.mlp.*": "fp8"}), "megatron",
                  model=tiny_llama()).data
    validate_megatron(good)
    for breaks in (
        lambda d: d["matchers"]["default"].pop("enabled"),
        lambda d: d["matchers"]["default"].update(config="fp8_rowwise"),
        lambda d: d["configs"]["bf16"]["training_recipe"].update(fp8_quantization_recipe="delayed"),
        lambda d: d["configs"]["bf16"]["training_recipe"].update(scaling="rowwise"),
        lambda d: d["configs"]["bf16"].pop("transformer_engine_config_type"),
    ):
        bad = json.loads(json.dumps(good))
        breaks(bad)
        with pytest.raises(AssertionError):
            validate_megatron(bad)


def test_what_megatron_cannot_express_is_a_clear_error_or_a_note():
    llama = tiny_llama()
    rowwise = Policy(default="bf16", layers={"model.layers.*.mlp.*": "fp8:rowwise"})
    with pytest.raises(ExportError, match=r"`model.layers.0.mlp.gate_proj` \(Linear\) is "
                                          "fp8:rowwise: Megatron-Core's FP8 recipes are "
                                          "tensorwise, blockwise and mxfp8"):
        export(rowwise, "megatron", model=llama)
    split = Policy(default="bf16", layers={"model.layers.0.self_attn.k_proj": "fp8"})
    with pytest.raises(ExportError, match=r"decoder.layers.0.self_attention.linear_qkv as one "
                                          r"fused GEMM.*--couple q_proj,k_proj,v_proj"):
        export(split, "megatron", model=llama)
    with pytest.raises(ExportError, match="not a Transformer Engine linear"):
        export(Policy(default="bf16", layers={"lm_head": "fp8"}), "megatron", model=llama)

    head = Policy(default="bf16", layers={"model.layers.*.mlp.*": "fp8", "lm_head": "fp32"})
    with pytest.raises(ExportError, match=r"`lm_head` \(Linear\) is fp32.*--no-strict"):
        export(head, "megatron", model=llama)
    loose = export(head, "megatron", model=llama, strict=False)
    validate_megatron(loose.data)
    assert any("lm_head" in n for n in loose.notes)
    assert "# note: `lm_head` (Linear) is fp32" in loose.text
    assert megatron_precision(loose.data, "decoder.layers.1.mlp.linear_fc2") == "fp8:tensorwise"


def test_a_name_map_names_the_layers_of_any_model(tmp_path):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 16))
    policy = Policy(default="bf16", layers={"0": "fp8", "2": "fp8"})
    with pytest.raises(ExportError, match=r"`0` \(Linear\) has no Megatron-Core module name"):
        export(policy, "megatron", model=model)
    path = tmp_path / "names.yaml"
    path.write_text("'(\\d+)': 'decoder.layers.\\1.mlp.linear_fc1'\n")
    doc = export(policy, "megatron", model=model, names=load_name_map(path)).data
    validate_megatron(doc)
    assert [megatron_precision(doc, f"decoder.layers.{i}.mlp.linear_fc1") for i in (0, 2, 3)] \
        == ["fp8:tensorwise", "fp8:tensorwise", "bf16"]
    path.write_text("'model.(': x\n")
    with pytest.raises(ExportError, match=r"Name map key 'model.\(' is not a regular expression"):
        load_name_map(path)


def test_a_hostile_name_map_is_refused_in_bounded_time(tmp_path):
    # name maps are files people pass around: a backtracking regex, a nested or aliased YAML
    # document, an oversized file, a template naming a missing group, each one line
    import signal
    import time

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    model.add_module("a" * 40 + "b", nn.Linear(32, 32))  # (a|aa)+ backtracks on it
    policy = Policy(default="bf16", layers={"0": "fp8"})
    path = tmp_path / "names.yaml"
    path.write_text("'(a|aa)+$': 'decoder.layers.0.mlp.linear_fc1'\n")
    names = load_name_map(path)

    def _hang(*_):
        raise AssertionError("a backtracking name-map regex still hangs the export")

    old = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(20)
    try:
        t0 = time.perf_counter()
        with pytest.raises(ExportError, match=r"took over .* it backtracks"):
            export(policy, "megatron", model=model, names=names)
        assert time.perf_counter() - t0 < 5
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    for text, match in [
            ("a: {b: {c: d}}\n", "nests a list or mapping"),
            ("[" * 100000 + "]" * 100000 + "\n", "nests a list or mapping"),
            ("a: &x decoder.layers.0\nb: *x\n", "anchor or alias"),
            ("'(\\d+)': 'decoder.layers.\\2.mlp.linear_fc1'\n", "refers to a group"),
            (f"'{'x' * 600}': y\n", "longer than 512 characters")]:
        path.write_text(text)
        with pytest.raises(ExportError, match=match) as info:
            export(policy, "megatron", model=nn.Sequential(nn.Linear(32, 64)),
                   names=load_name_map(path))
        assert "\n" not in str(info.value)
    path.write_bytes(b"a: b\n" * (2 ** 20 // 5 + 1))
    with pytest.raises(ExportError, match="at most 1 MiB"):
        load_name_map(path)


# ------------------------------------------------------------------ fqn and the command
def test_the_fqn_map_lists_every_layer_with_its_format():
    doc = json.loads(export(MIXED, "fqn", model=tiny_llama()).text)
    linears = [f for f, m in tiny_llama().named_modules() if isinstance(m, nn.Linear)]
    assert set(linears) < set(doc["layers"])
    for fqn in linears:
        recipe = MIXED_FP8.get(fqn)
        assert doc["layers"][fqn] == (f"fp8:{recipe}" if recipe else "bf16"), fqn
    assert doc["layers"]["model.layers.0.self_attn"] == "bf16"  # the attention core
    assert doc["default"] == "bf16" and doc["model"] == "LlamaForCausalLM"
    # a Linear the FP8 kernels cannot take (N = 8) is listed as what autoprec runs: bf16
    small = nn.Sequential(nn.Linear(32, 8))
    out = export(Policy(default="fp8"), "fqn", model=small)
    assert out.data["layers"] == {"0": "bf16"} and "cannot take" in out.notes[0]
    assert out.data["notes"] == list(out.notes)


def test_the_export_command(tmp_path, capsys):
    policy = tmp_path / "llama.yaml"
    Policy(default="bf16", layers={"model.layers.*.mlp.*": "fp8"}).save(policy)
    out = tmp_path / "te_precision.yaml"
    # Llama-3-8B's layer shapes, built on the meta device: no memory, no time
    assert main(["export", str(policy), "--to", "megatron", "--model",
                 "examples/llama_bytes.py:gpu_task", "-o", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    validate_megatron(doc)
    assert megatron_precision(doc, "decoder.layers.3.mlp.linear_fc1") == "fp8:tensorwise"
    assert megatron_precision(doc, "decoder.layers.3.self_attention.linear_qkv") == "bf16"

    capsys.readouterr()
    assert main(["export", str(policy), "--to", "fqn"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoprec: error:") and "--model TASK_SPEC" in err
    assert err.count("\n") == 1
    fp16 = tmp_path / "fp16.yaml"
    Policy(default="bf16", layers={"model.layers.*.mlp.*": "fp8", "lm_head": "fp16"}).save(fp16)
    assert main(["export", str(fp16), "--to", "torchao", "--model",
                 "examples/llama_bytes.py:gpu_task"]) == 2
    err = capsys.readouterr().err
    assert "`lm_head` (Linear) is fp16" in err and err.count("\n") == 1


# ------------------------------------------------------------------ hostile text
# File names and the model's module names are user text: every export carries them only as
# escaped literals. Each of these, pasted into the output, would run code when the torchao
# script is imported (a file PWNED appears in the working directory) or add a YAML key.
HOSTILE_FILES = (
    'p""";open("PWNED", "w");"""q.yaml',  # ends the torchao script's docstring
    "n\nevil: 1\n#.yaml",  # a newline ends a comment line: a YAML key follows
    "r\revil: 2\r#.yaml",  # a lone CR ends a line in Python and in YAML
    "u\u2028evil: 3\u2029#\x85.yaml",  # YAML's unicode line breaks
    "b\\'''\\\"#\t\\x{}.yaml",  # backslashes, quotes, a tab, braces
)
HOSTILE_LAYERS = (
    'x\nopen("PWNED", "w")\n#',  # a note's comment line broken into a line of code
    'r\ropen("PWNED", "w")\r#',
    "z\nevil: 1\n#",
    "\u2028evil: 2\u2028#",
    "q\"\"\"'''\\{}",
)
MLP = Policy(default="bf16", layers={"model.layers.*.mlp.*": "fp8"})


def _import_script(path, monkeypatch):
    """Import the exported torchao script from its file, in its directory (where the hostile
    names would leave PWNED), as a user's training code would."""
    monkeypatch.chdir(path.parent)
    spec = importlib.util.spec_from_file_location("autoprec_exported_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not (path.parent / "PWNED").exists(), "the exported script ran the name's code"
    return module


def _hostile_model(names=HOSTILE_LAYERS, first: str = "fc") -> nn.Module:
    model = nn.Module()
    model.add_module(first, nn.Linear(32, 32))
    for name in names:
        model.add_module(name, nn.Linear(32, 32))
    return model


@pytest.mark.parametrize("name", HOSTILE_FILES, ids=range(len(HOSTILE_FILES)))
def test_a_hostile_policy_file_name_is_only_ever_a_literal(tmp_path, monkeypatch, name):
    pytest.importorskip("torchao")
    path = tmp_path / name
    MLP.save(path)
    mlp = {f for f, m in tiny_llama().named_modules() if ".mlp." in f and isinstance(m, nn.Linear)}

    megatron = export(str(path), "megatron", model=tiny_llama())
    doc = yaml.safe_load(megatron.text)
    assert set(doc) == {"configs", "matchers"} and doc == megatron.data
    validate_megatron(doc)

    fqn = export(str(path), "fqn", model=tiny_llama())
    assert json.loads(fqn.text) == fqn.data and fqn.data["policy"] == str(path)

    torchao = export(str(path), "torchao", model=tiny_llama())
    script = tmp_path / "exported_torchao.py"
    torchao.save(script)
    module = _import_script(script, monkeypatch)
    assert module.FP8_LAYERS == torchao.data and module.POLICY == str(path)
    assert set(_float8_layers(module.convert(tiny_llama(), emulate=True))) == mlp


def test_hostile_module_names_are_only_ever_literals(tmp_path, monkeypatch):
    pytest.importorskip("torchao")
    h = HOSTILE_LAYERS
    # fp16/fp32 layers torchao cannot express become notes (comments) naming them
    policy = Policy(default="bf16", layers={"fc": "fp8", h[0]: "fp16", h[1]: "fp32",
                                            h[2]: "fp8", h[3]: "fp16", h[4]: "fp8"})
    torchao = export(policy, "torchao", model=_hostile_model(), strict=False)
    assert any(h[0] in n for n in torchao.notes)
    script = tmp_path / "exported_torchao.py"
    torchao.save(script)
    module = _import_script(script, monkeypatch)
    assert module.FP8_LAYERS == torchao.data == {"tensorwise": ["fc", h[2], h[4]]}
    assert set(_float8_layers(module.convert(_hostile_model(), emulate=True))) == {"fc", h[2], h[4]}

    # Megatron: the unmapped layers are notes; a hostile name-map value is a module path
    path = "decoder.layers.0.mlp.linear_fc1\nevil: 1\u2028#"
    megatron = export(Policy(default="bf16", layers={"fc": "fp8"}), "megatron",
                      model=_hostile_model(), strict=False, names={"fc": path})
    assert len(megatron.notes) == len(h)
    doc = yaml.safe_load(megatron.text)
    assert set(doc) == {"configs", "matchers"} and doc == megatron.data
    validate_megatron(doc)
    assert megatron_precision(doc, path) == "fp8:tensorwise"

    fqn = export(policy, "fqn", model=_hostile_model())
    doc = json.loads(fqn.text)
    assert doc == fqn.data and set(doc["layers"]) == {"fc", *h}


HOSTILE_TASK = """\
import torch
from torch import nn
import autoprec


def model():
    m = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
    m.add_module({name!r}, nn.Linear(32, 32))
    return m


def task():
    return autoprec.Task(model=model, batches=[torch.randn(4, 32)], device="cpu")
"""


@pytest.mark.slow  # a subprocess that imports torch, transformers and torchao
def test_the_export_command_writes_hostile_names_as_literals(tmp_path, monkeypatch):
    pytest.importorskip("torchao")
    hostile = HOSTILE_LAYERS[0]
    (tmp_path / "hostile_task.py").write_text(HOSTILE_TASK.format(name=hostile))
    policy = tmp_path / HOSTILE_FILES[0]
    Policy(default="bf16", layers={"0": "fp8", hostile: "fp16"}).save(policy)
    out = tmp_path / "exported_torchao.py"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "autoprec"), "export",
                        str(policy), "--to", "torchao", "--model", "hostile_task.py:task",
                        "--no-strict", "-o", str(out)], capture_output=True, text=True,
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=root), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert hostile in out.read_text() or repr(hostile)[1:-1] in out.read_text()
    # the notes on the terminal quote the name escaped, on one line each
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
    assert notes and not any(line.startswith('open("PWNED"') for line in r.stderr.splitlines())

    module = _import_script(out, monkeypatch)
    assert module.FP8_LAYERS == {"tensorwise": ["0"]} and module.POLICY == str(policy)
    model = _hostile_model([hostile], first="0")
    assert set(_float8_layers(module.convert(model, emulate=True))) == {"0"}


def test_export_is_public():
    assert "export" in autoprec.__all__ and autoprec.export is export
    # the module is named apart from the function: importing it cannot shadow autoprec.export
    importlib.import_module("autoprec.exporting")
    assert autoprec.export is export
