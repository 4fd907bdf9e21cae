"""Policy: schema 1 YAML round trip, matching, and every kind of bad input."""

from __future__ import annotations

import textwrap
import warnings

import pytest
import torch
from torch import nn

import autoprec
from autoprec import Format, Policy, PolicyError, load_policy, model_fingerprint


def write(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_round_trip_exact(tmp_path, gpt2):
    p = Policy(default="bf16",
               layers={"lm_head": "fp32", "transformer.h.*.mlp.*": "fp8",
                       "transformer.h.0.attn": Format.FP16},
               model_name="GPT2LMHeadModel", fingerprint=model_fingerprint(gpt2),
               loss_scaling={"init_scale": 1024.0, "growth_interval": 100},
               tuned={"device": "cpu", "torch": torch.__version__,
                      "metrics": {"speedup_vs_fp32": 1.44, "loss_increase": 0.003}})
    path = tmp_path / "sub" / "gpt2.yaml"
    p.save(path)
    q = load_policy(path)
    assert q == p
    assert list(q.layers) == list(p.layers)  # file order kept
    assert q.source == str(path)
    # and saving the loaded policy gives the same bytes
    q.save(tmp_path / "again.yaml")
    assert (tmp_path / "again.yaml").read_text() == path.read_text()


def test_format_for_most_specific_and_nesting():
    p = Policy(default="bf16", layers={
        "transformer.h.*.mlp.*": "fp8",
        "transformer.h.1.mlp.c_proj": "fp32",   # exact beats glob
        "transformer.h.*.mlp.c_*": "fp16",       # more literal characters than mlp.*
        "transformer.h.2": "fp32",               # an ancestor: its children inherit
        "**.ln_?": "fp32",
    })
    assert p.format_for("transformer.h.0.mlp.act") is Format.FP8
    assert p.format_for("transformer.h.0.mlp.c_fc") is Format.FP16
    assert p.format_for("transformer.h.1.mlp.c_proj") is Format.FP32
    assert p.format_for("transformer.h.2.attn.c_attn") is Format.FP32
    assert p.format_for("transformer.h.2.mlp.c_fc") is Format.FP16  # own match beats ancestor
    assert p.format_for("transformer.h.3.ln_1") is Format.FP32
    assert p.format_for("transformer.h.0.mlp") is Format.BF16  # `*` needs a component
    assert p.format_for("lm_head") is Format.BF16
    assert p.format_for("") is Format.BF16
    assert p.format_for("transformer.h.10.mlp.dropout") is Format.FP8  # `*` spans one component


def test_layer_map_with_quoted_globs_loads(tmp_path):
    path = write(tmp_path, """
        autoprec: 1
        default: fp32
        layers:
          "transformer.h.*.mlp.c_fc": bf16
          lm_head: fp32
        """)
    p = load_policy(path)
    assert p.layers == {"transformer.h.*.mlp.c_fc": Format.BF16, "lm_head": Format.FP32}
    assert p.fp8_recipe == "tensorwise" and p.loss_scaling.init_scale == 65536


# ----------------------------------------------------------------------------- bad input
def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, """
        autoprec: 1
        default: bf16
        layers:
          lm_head: fp32
         bad_indent: [fp8
        """)
    with pytest.raises(PolicyError, match=rf"Malformed YAML in {path} line \d+"):
        load_policy(path)


def test_unknown_schema_version(tmp_path):
    path = write(tmp_path, "autoprec: 6\ndefault: bf16\n")
    with pytest.raises(PolicyError, match=rf"schema version 6 in {path} line 1.*reads versions "
                                          r"1, 2, 3, 4, 5"):
        load_policy(path)
    with pytest.raises(PolicyError, match="Missing schema key"):
        load_policy(write(tmp_path, "default: bf16\n", "nover.yaml"))


def test_unknown_format_names_layer_line_and_choices(tmp_path):
    path = write(tmp_path, """
        autoprec: 1
        default: bf16
        layers:
          transformer.wte: fp32
          lm_head: fp9
        """)
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    msg = str(e.value)
    assert "'fp9'" in msg and "`lm_head`" in msg and f"{path} line 5" in msg
    assert "expected one of fp32, bf16, fp16, fp8" in msg
    with pytest.raises(PolicyError, match=r"`default` in .* line 2"):
        load_policy(write(tmp_path, "autoprec: 1\ndefault: half\n", "d.yaml"))


def test_unknown_keys_are_rejected(tmp_path):
    path = write(tmp_path, """
        autoprec: 1
        default: bf16
        layer:
          lm_head: fp32
        """)
    with pytest.raises(PolicyError, match=r"Unknown key\(s\) 'layer' at top level .* line 3.*valid keys are"):
        load_policy(path)
    path = write(tmp_path, "autoprec: 1\ndefault: bf16\nfp8: {recipe: tensorwise, amax: 16}\n", "k2.yaml")
    with pytest.raises(PolicyError, match=r"'amax' at `fp8`.* line 3"):
        load_policy(path)
    path = write(tmp_path, "autoprec: 1\ndefault: bf16\nfp8: {recipe: blockwise}\n", "k3.yaml")
    with pytest.raises(PolicyError, match=r"Unknown fp8 recipe 'blockwise'.*tensorwise"):
        load_policy(path)


def test_bad_values(tmp_path):
    with pytest.raises(PolicyError, match="growth_interval must be a positive integer"):
        load_policy(write(tmp_path, "autoprec: 1\ndefault: bf16\nloss_scaling: {growth_interval: 0}\n"))
    with pytest.raises(PolicyError, match="`layers`.* must be a mapping"):
        load_policy(write(tmp_path, "autoprec: 1\ndefault: bf16\nlayers: [lm_head]\n", "l.yaml"))
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy(tmp_path / "missing.yaml")
    with pytest.raises(PolicyError, match="must be a YAML mapping"):
        load_policy(write(tmp_path, "- 1\n- 2\n", "list.yaml"))


def test_yaml_is_read_safely(tmp_path):
    path = write(tmp_path, "autoprec: 1\ndefault: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(PolicyError, match="Malformed YAML"):
        load_policy(path)


def test_glob_matching_no_layer(tmp_path, gpt2):
    path = write(tmp_path, """
        autoprec: 1
        default: bf16
        layers:
          "transformer.blocks.*.mlp": fp8
        """)
    policy = load_policy(path)
    with pytest.raises(PolicyError, match=rf"`transformer.blocks.\*.mlp` in {path} line 4 matches no module"):
        autoprec.apply(gpt2, policy)
    assert autoprec.applied_formats(gpt2) == {}  # nothing half-applied
    with pytest.warns(UserWarning, match="matches no module"):
        autoprec.apply(gpt2, policy, strict=False)
    assert autoprec.applied_formats(gpt2) == {"": Format.BF16}


def test_fingerprint_of_another_model(tmp_path, gpt2):
    other = nn.Sequential(nn.Linear(4, 4))
    p = Policy(default="bf16", model_name="Sequential", fingerprint=model_fingerprint(other))
    p.save(tmp_path / "other.yaml")
    policy = load_policy(tmp_path / "other.yaml")
    with pytest.raises(PolicyError, match=r"made for Sequential\) has fingerprint sha256:.*GPT2LMHeadModel"):
        autoprec.apply(gpt2, policy)
    with pytest.warns(UserWarning, match="fingerprint"):
        autoprec.apply(gpt2, policy, strict=False)
    # the right model passes silently
    ok = Policy(default="bf16", fingerprint=model_fingerprint(gpt2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autoprec.apply(gpt2, ok)


def test_fingerprint_ignores_weights_but_not_shapes(gpt2):
    from conftest import tiny_gpt2

    fp = model_fingerprint(gpt2)
    with torch.no_grad():
        gpt2.lm_head.weight.mul_(2)
    assert model_fingerprint(gpt2) == fp
    assert model_fingerprint(tiny_gpt2(n_embd=128)) != fp


def test_fp8_on_an_emulating_device_warns_once(gpt2, gpt2_batch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autoprec.apply(gpt2, Policy(default="bf16", layers={"transformer.h.*.mlp.*": "fp8"}))
        for _ in range(3):
            gpt2(**gpt2_batch).loss.backward()
    msgs = [str(w.message) for w in caught if "emulate" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert "not faster" in msgs[0] or "slower" in msgs[0]


def test_grad_scaler_and_module_filter(gpt2):
    assert not Policy(default="bf16").grad_scaler("cpu").is_enabled()
    scaler = Policy(default="bf16", layers={"lm_head": "fp16"},
                    loss_scaling={"init_scale": 128.0, "growth_interval": 10}).grad_scaler("cpu")
    assert scaler.is_enabled() and scaler.get_scale() == 128.0
    keep = Policy(default="bf16", layers={"transformer.h.*.mlp.*": "fp8"}).module_filter_fn()
    chosen = [fqn for fqn, m in gpt2.named_modules() if keep(m, fqn)]
    # GPT-2's MLP layers are HF Conv1D, not nn.Linear: torchao would not convert them
    assert chosen == []
    seq = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 8))
    keep = Policy(default="fp32", layers={"2": "fp8", "3": "fp8"}).module_filter_fn()
    # "3" has N = 8, a shape the FP8 kernel cannot take: it runs in bf16, never in torchao
    assert [f for f, m in seq.named_modules() if keep(m, f)] == ["2"]
