"""The policies in policies/ are what users commit and train with: each must load, match the
example model it was tuned for, apply and remove cleanly, and `autoprec show` must explain the
GPU-target policy's FP8 choices (a recipe per fp8 layer, with the measured reason)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import autoprec
from autoprec.policy import load_policy
from autoprec.profiling import Profile
from autoprec.runtime import rewrite
from examples import cnn, gpt2_bytes, minilm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = os.path.join(ROOT, "policies")

SHIPPED = {
    "gpt2_bytes.yaml": lambda: gpt2_bytes.make_model(),
    "gpt2_bytes.bf16.yaml": lambda: gpt2_bytes.make_model(),
    "gpt2_bytes.bf16_fp32_head.yaml": lambda: gpt2_bytes.make_model(),
    # hand-written: phases (examples/train_plain.py; tests/test_phases.py trains through them)
    "gpt2_bytes.phased.yaml": lambda: gpt2_bytes.make_model(),
    "gpt2_bytes_h100.yaml": lambda: gpt2_bytes.make_model(n_embd=1024, n_head=16, seq_len=1024),
    "minilm.yaml": lambda: minilm.make_model(),
    "cnn.yaml": lambda: cnn.make_model(),
}


def test_every_shipped_policy_is_checked_here():
    on_disk = {f for f in os.listdir(POLICIES) if f.endswith(".yaml")}
    assert on_disk == set(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_policy_matches_its_model_and_applies(name):
    policy = load_policy(os.path.join(POLICIES, name))
    model = SHIPPED[name]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    policy.check_model(model)  # fingerprint and every pattern: PolicyError if not
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        autoprec.apply(model, policy)
    applied = rewrite.applied_formats(model)
    assert applied and all(applied[f] is policy.format_for(f) for f in applied if f)
    autoprec.remove(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_show_lists_a_recipe_and_a_measured_reason_per_fp8_layer_of_the_h100_policy():
    path = os.path.join(POLICIES, "gpt2_bytes_h100.yaml")
    policy, prof = load_policy(path), Profile.load(path.replace(".yaml", ".profile.json"))
    fp8 = {lp.fqn: policy.format_for(lp.fqn) for lp in prof.layers
           if policy.format_for(lp.fqn).is_scaled}
    assert fp8, "the h100 policy puts no layer in fp8"
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "autoprec.cli", "show", path], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {line.split()[0]: line for line in r.stdout.splitlines()
            if line.startswith("  ") and line.split() and line.split()[0] in fp8}
    assert set(rows) == set(fp8)
    for fqn, fmt in fp8.items():
        # e.g. "chosen: tensorwise 1.31x bf16, loss +0.01%; rowwise skipped (...)"
        assert f"chosen: {fmt.recipe} " in rows[fqn], rows[fqn]
        assert "x bf16" in rows[fqn] and "loss" in rows[fqn], rows[fqn]
    assert "matmul FLOPs by format:" in r.stdout
    # a priced figure says which measurements its model was checked against, and how far off
    assert "priced by the h100 cost model, checked against torchtitan Llama-3-8B" in r.stdout
    assert "step speed-ups within" in r.stdout, r.stdout
