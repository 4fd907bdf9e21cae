"""Parsing edges of policies, formats, phases, profiles and guard states: a bare `fp8` inside a
per-GEMM mix, refusals of oversized input that come quickly, parsing that leaves no
process-wide state behind, duplicate keys, and errors that quote input bounded. CLI cases run
the real `autoprec` console script."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import tiny_gpt2
from test_hostile_files import cli, one_line_error, tiny_profile
from torch import nn

import autoprec
from autoprec import Format, Policy, PolicyError, load_policy
from autoprec.formats import unregister
from autoprec.integrations import GUARD_STATE_FILE, load_guard_state
from autoprec.runtime.guard import Guard, GuardConfig, get_guard

# What a refusal of oversized input may take. The bounds are set for ~0.6-0.9 s on this 2-core
# machine idle; measured at most 1.4 s with the other core and more busy (load average 2.8).
REFUSAL_S = 2.0
# An error line quoting input: the quote is bounded (120 characters), the rest a sentence.
ERROR_CHARS = 500
HEADER = "autoprec: 3\ndefault: bf16\n"


def write(path, text: str):
    path.write_text(text)
    return path


def refused_in_time(path, *needles) -> str:
    """load_policy refuses ``path`` within REFUSAL_S with a one-line PolicyError naming
    ``needles``; returns the message."""
    t0 = time.perf_counter()
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    took = time.perf_counter() - t0
    msg = str(e.value)
    assert took < REFUSAL_S, f"refused after {took:.2f} s: {msg[:200]}"
    assert "\n" not in msg and len(msg) < ERROR_CHARS, msg[:1000]
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


def _builtins_only(*names: str) -> None:
    """Take the mixes ``names`` out again, so a test sees them made afresh."""
    for name in names:
        fmt = next((f for f in Format if f.value == name), None)
        if fmt is not None:
            unregister(fmt)


# ======================================================================= 1. fp8 inside a mix
def _out(policy: Policy, x: torch.Tensor) -> torch.Tensor:
    """The output of layer 0 of a small real model under ``policy``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))
    autoprec.apply(model, policy)
    with torch.no_grad():
        return model[0](x)


def test_a_bare_fp8_in_a_mix_is_the_policys_recipe(tmp_path):
    """`fp8: {recipe: rowwise}` and a layer in `fp8/bf16/bf16`: its forward is rowwise, as a
    layer in plain `fp8` is, and `show` says so (it printed `fp8/bf16/bf16` while computing a
    tensorwise forward)."""
    path = write(tmp_path / "p.yaml", "autoprec: 2\ndefault: bf16\nlayers:\n  '0': fp8/bf16/bf16\n"
                                      "  '2': fp8\nfp8: {recipe: rowwise}\n")
    policy = load_policy(path)
    assert policy.layers["0"].label == "fp8:rowwise/bf16/bf16"
    assert policy.layers["0"] is Format.parse("fp8:rowwise/bf16/bf16")
    # rows six orders of magnitude apart: one scale per tensor flushes the small ones that
    # one scale per row keeps (32 rows: the FP8 kernel takes multiples of 16)
    x = torch.randn(32, 64) * torch.logspace(-3, 3, 32)[:, None]
    rowwise = Policy(default="bf16", layers={"0": "fp8:rowwise/bf16/bf16", "2": "fp8:rowwise"})
    tensorwise = Policy(default="bf16", layers={"0": "fp8:tensorwise/bf16/bf16",
                                                "2": "fp8:rowwise"})
    got, want = _out(policy, x), _out(rowwise, x)
    assert torch.equal(got, want), (got - want).abs().max()
    assert not torch.equal(_out(tensorwise, x), want)  # the two recipes differ on these inputs
    r = cli("show", path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "0: fp8:rowwise/bf16/bf16" in r.stdout and "2: fp8:rowwise" in r.stdout, r.stdout
    assert "fp8/bf16/bf16" not in r.stdout.replace("fp8:rowwise/bf16/bf16", ""), r.stdout


def test_a_mix_written_under_another_recipe_reads_back_the_same(tmp_path):
    """A tensorwise mix in a rowwise policy is written `fp8:tensorwise/...` (a bare `fp8` in
    the file would read back rowwise), the rowwise one `fp8/...`."""
    mixes = {"a": "fp8:tensorwise/bf16/bf16", "b": "fp8:rowwise/bf16/bf16"}
    policy = Policy(default="bf16", layers=mixes, fp8_recipe="rowwise")
    policy.save(tmp_path / "p.yaml")
    back = load_policy(tmp_path / "p.yaml")
    assert {k: f.label for k, f in back.layers.items()} == mixes
    assert "a: fp8:tensorwise/bf16/bf16" in (tmp_path / "p.yaml").read_text()


def test_a_mix_is_named_by_what_it_computes():
    """Two spellings of one computation are one format, named by the first registered format
    of each GEMM, whichever spelling came first (nvfp4:plain's forward is nvfp4's)."""
    _builtins_only("nvfp4/bf16/bf16")
    plain = Format.parse("nvfp4:plain/bf16/bf16")
    assert plain.value == "nvfp4/bf16/bf16" and plain is Format.parse("nvfp4/bf16/bf16")
    assert plain.parts == (Format.NVFP4, Format.BF16, Format.BF16)
    assert Format("nvfp4/bf16/bf16") is plain


# ======================================================================= 2. slow refusals
def test_a_4mib_policy_of_flow_style_phases_is_refused_quickly(tmp_path):
    """Just under the old bound of 4 MiB: it took 61 s to compose before `at most 64 phases`."""
    phases = ", ".join(f"{{from_step: {i + 1}, formats: {{fp8: bf16}}}}" for i in range(98_000))
    path = write(tmp_path / "p.yaml", HEADER + f"phases: [{phases}]\n")
    assert 3.9 * 2 ** 20 < os.path.getsize(path) < 4 * 2 ** 20
    refused_in_time(path, "p.yaml", "at most 1 MiB", "1000-block model")


def test_phases_are_counted_while_composing(tmp_path):
    """Under the byte bound, a list of 20,000 phases (0.8 MiB) stops at the 65th."""
    phases = ", ".join(f"{{from_step: {i + 1}, formats: {{fp8: bf16}}}}" for i in range(20_000))
    path = write(tmp_path / "p.yaml", HEADER + f"phases: [{phases}]\n")
    assert os.path.getsize(path) < 2 ** 20
    refused_in_time(path, "p.yaml line 3", "more than 64 phases", "at most 64")
    one_line_error(cli("show", path), "more than 64 phases")


def test_a_flat_layers_file_is_refused_quickly(tmp_path):
    # just under the old bound of 4 MiB: it took 46 s to load
    entries = "".join(f"  model.layers.{i // 7}.mlp.proj_{i % 7}: fp8\n" for i in range(114_000))
    big = write(tmp_path / "big.yaml", HEADER + "layers:\n" + entries)
    assert 3.9 * 2 ** 20 < os.path.getsize(big) < 4 * 2 ** 20
    refused_in_time(big, "big.yaml", "at most 1 MiB")
    # under the byte bound: 12,500 entries of long names (1 MiB) stop at the value bound
    long = "".join(f"  model.layers.{i // 7}.mlp.{'x' * 50}_{i % 7}: fp8\n" for i in range(12_500))
    path = write(tmp_path / "p.yaml", HEADER + "layers:\n" + long)
    assert os.path.getsize(path) < 2 ** 20
    refused_in_time(path, "p.yaml line 12000", "more than 24000 values", "1000-block model")


@pytest.mark.parametrize("body", [
    "tuned: {x: [" + "1," * 500_000 + "1]}\n",                       # tiny values
    "tuned: {x: [" + "{a: 1}," * 140_000 + "1]}\n",                  # tiny mappings
    "\n" * 1_000_000,                                                 # blank lines
    "tuned:\n  note: |\n    x\n" + "\n" * 500_000,                    # a block scalar's lines
])
def test_a_file_of_tiny_values_or_lines_is_refused_quickly(tmp_path, body):
    path = write(tmp_path / "p.yaml", HEADER + body)
    assert os.path.getsize(path) < 2 ** 20
    refused_in_time(path, "p.yaml")


def test_a_1000_block_models_explicit_policy_loads(tmp_path):
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    entries = "".join(f"  model.layers.{b}.{'self_attn' if i < 4 else 'mlp'}.{n}: fp8:rowwise\n"
                      for b in range(1000) for i, n in enumerate(names))
    path = write(tmp_path / "p.yaml", HEADER + "layers:\n" + entries + "  lm_head: fp32\n")
    policy = load_policy(path)
    assert len(policy.layers) == 7001
    assert policy.format_for("model.layers.999.mlp.down_proj") is Format.FP8_ROWWISE


def _guard_state() -> dict:
    model = tiny_gpt2().train()
    autoprec.apply(model, Policy(default="bf16", layers={"lm_head": "fp32"}), guard=True)
    return get_guard(model).state_dict()


def test_a_guard_states_policy_is_bounded_before_anything_is_compiled(tmp_path):
    """The policy a guard state embeds is held to a policy file's bounds when the state is
    loaded, before a model is attached (it was compiled at attach, then refused: 72 s for
    29 MiB)."""
    state = _guard_state()
    huge = copy.deepcopy(state)
    huge["policy"]["layers"] = {f"model.layers.{i // 7}.mlp.proj_{i % 7}": "fp8"
                                for i in range(100_000)}
    with pytest.raises(PolicyError, match=r"Guard state `policy` holds more than 24000 values"):
        Guard().load_state_dict(huge)
    (tmp_path / GUARD_STATE_FILE).write_text(json.dumps(huge))
    t0 = time.perf_counter()
    with pytest.raises(PolicyError, match=rf"{GUARD_STATE_FILE}: Guard state `policy` holds"):
        load_guard_state(Guard(), tmp_path)
    took = time.perf_counter() - t0
    assert took < REFUSAL_S, f"refused after {took:.2f} s"
    deep, nested = copy.deepcopy(state), {}
    deep["policy"]["tuned"] = nested
    for _ in range(30):
        nested["a"] = nested = {}
    with pytest.raises(PolicyError, match="`policy`: lists or mappings nest deeper than 24"):
        Guard().load_state_dict(deep)
    many = copy.deepcopy(state)
    many["phase"] = dict(many["policy"], autoprec=3,
                         phases=[{"from_step": i + 1, "default": "fp32"} for i in range(65)])
    with pytest.raises(PolicyError, match="`phase`: `phases` lists 65 phases; .* at most 64"):
        Guard().load_state_dict(many)
    Guard().load_state_dict(state)  # the state as written still loads


# ======================================================================= 3. no global state
def test_parsing_a_mix_before_the_cost_model_is_imported(tmp_path):
    """A mix parsed before the cost model's devices (`autoprec.devices`) were first imported
    made that import fail (they were built over every format known then)."""
    write(tmp_path / "p.yaml", "autoprec: 2\ndefault: bf16\nlayers:\n  a: nvfp4/mxfp8/mxfp8\n")
    code = ("from autoprec import load_policy; load_policy('p.yaml'); import autoprec.devices "
            "as c; from autoprec import Format; m = Format.parse('nvfp4/mxfp8/mxfp8'); "
            "print(c.DEVICES['h100'].support[m].value, c.DEVICES['b200'].support[m].value)")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    # priced from its GEMMs: NVFP4's forward is emulated on a Hopper, native on a Blackwell
    assert r.stdout.split() == ["emulated", "native"], r.stdout


def test_a_mix_in_a_hostile_guard_state_changes_no_later_guard():
    """A mix named in a guard state (parsed while checking it) entered every later guard's
    watched formats: a later run's state then listed it, and resuming that in a fresh process
    failed."""
    mix = "nvfp4/mxfp8:gw_hp/mxfp8"  # spelled oddly: one computation, named nvfp4/mxfp8/mxfp8
    _builtins_only("nvfp4/mxfp8/mxfp8")
    before = GuardConfig().formats
    state = _guard_state()
    hostile = dict(state, formats=[*state["formats"], mix])
    Guard().load_state_dict(hostile)  # its layout checks out; the formats differ at attach
    assert GuardConfig().formats == before
    assert _guard_state()["formats"] == state["formats"]


def test_a_mix_layer_is_watched_by_a_config_made_before_the_mix():
    _builtins_only("nvfp4/bf16/bf16")
    config = GuardConfig()  # "fp8": every scaled format, mixes of them included
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).train()
    autoprec.apply(model, Policy(default="bf16", layers={"0": "nvfp4/bf16/bf16"}), guard=config)
    assert get_guard(model).watched["0"] is Format("nvfp4/bf16/bf16")
    assert get_guard(model).watched["2"] is Format.BF16


def test_formats_list_mixes_in_one_order_whichever_was_parsed_first():
    names = ["mxfp8/bf16/bf16", "nvfp4/bf16/bf16", "nvfp4/mxfp8/mxfp8"]
    orders = []
    for spelled in (names, names[::-1]):
        _builtins_only(*names)
        for name in spelled:
            Format.parse(name)
        orders.append([f.value for f in Format if f.value in names])
    assert orders[0] == orders[1] == names


# ======================================================================= 4. duplicates
def test_phase_formats_keys_that_normalise_alike_are_refused(tmp_path):
    path = write(tmp_path / "p.yaml", textwrap.dedent("""\
        autoprec: 3
        default: fp8
        phases:
          - from_step: 10
            formats: {fp8: bf16, " FP8 ": fp32}
        """))
    with pytest.raises(PolicyError, match=r"names fp8 twice \(as 'fp8' and ' FP8 '\)"):
        load_policy(path)
    one_line_error(cli("show", path), "p.yaml", "twice")


def test_duplicate_keys_in_a_profile_are_refused(tmp_path):
    (tmp_path / "p.yaml").write_text("autoprec: 2\ndefault: bf16\nlayers:\n  lm_head: fp32\n")
    text = json.dumps(tiny_profile())
    (tmp_path / "p.profile.json").write_text(text[:-1] + ', "task_name": "other"}')
    one_line_error(cli("show", tmp_path / "p.yaml"), "p.profile.json", "'task_name' twice")


def test_duplicate_keys_in_a_guard_state_are_refused(tmp_path):
    text = json.dumps(_guard_state())
    key = "k" * 1_000_000
    for dup, named in (('"step": 0, ', "the key 'step' twice"),
                       (f'"{key}": 1, "{key}": 2, ', "more characters)' twice")):
        (tmp_path / GUARD_STATE_FILE).write_text("{" + dup + text[1:])
        with pytest.raises(PolicyError) as e:
            load_guard_state(Guard(), tmp_path)
        msg = str(e.value)
        assert GUARD_STATE_FILE in msg and named in msg and len(msg) < ERROR_CHARS, msg[:1000]


# ======================================================================= 5. bounded quotes
@pytest.mark.parametrize("body, chars", [
    ("default: bf16\nlayers:\n  lm_head: {}\n", 1_000_000),
    ("default: {}\n", 1_000_000),
    ("default: bf16\nphases:\n  - {{from_step: 2, formats: {{fp8: {}}}}}\n", 1_000_000),
    ("default: bf16\nphases:\n  - {{from_step: 2, layers: {{a: {}}}}}\n", 1_000_000),
    ("default: bf16\nlayers:\n  lm_head: nvfp4/bf16/{}\n", 1_000_000),
    # a key YAML reads as text is at most 1024 characters
    ("default: bf16\nphases:\n  - {{from_step: 2, formats: {{{}: bf16}}}}\n", 1000),
])
def test_a_1mb_format_string_is_quoted_bounded(tmp_path, body, chars):
    path = write(tmp_path / "p.yaml", "autoprec: 3\n" + body.format("x" * chars))
    with pytest.raises(PolicyError, match="more characters"):
        load_policy(path)
    line = one_line_error(cli("show", path), "p.yaml", "Unknown format 'xxx", "more characters")
    assert len(line) < ERROR_CHARS, line[:1000]


def test_a_long_format_on_the_command_line_is_quoted_bounded():
    # one argument may be at most 128 KiB (Linux's MAX_ARG_STRLEN)
    r = cli("tune", "examples/gpt2_bytes.py:task", "--formats", "bf16", "y" * 100_000)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert "Unknown format 'yyy" in line and len(line) < ERROR_CHARS, line[:1000]


def test_guard_state_values_are_quoted_bounded(tmp_path):
    state = _guard_state()
    for bad in (dict(state, step="9" * 1_000_000), dict(state, formats=["f" * 1_000_000]),
                dict(state, layers={"\x1b[2J" + "m" * 1_000_000: "bf16"})):
        (tmp_path / GUARD_STATE_FILE).write_text(json.dumps(bad))
        model = tiny_gpt2().train()
        autoprec.apply(model, Policy(default="bf16", layers={"lm_head": "fp32"}), guard=True)
        with pytest.raises(PolicyError) as e:
            load_guard_state(get_guard(model), tmp_path)
        msg = str(e.value)
        assert len(msg) < ERROR_CHARS and "\x1b" not in msg, msg[:1000]


def test_unknown_keys_are_listed_bounded(tmp_path):
    keys = "".join(f"  k{i}{'z' * 1000}: 1\n" for i in range(200))
    path = write(tmp_path / "p.yaml", "autoprec: 2\ndefault: bf16\n" + keys.replace("  ", ""))
    line = one_line_error(cli("show", path), "Unknown key(s)", "and 197 more")
    assert len(line) < ERROR_CHARS, line[:1000]
