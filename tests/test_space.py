"""The search space (autoprec.tuning.space): same-role groups shrink the space while their
members agree, and a member whose profile contradicts its peers' (non-finite, or far more
sensitive) becomes a unit of its own; the policy of every assignment gives each layer the
format its unit was assigned, split members included."""

from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch
import yaml

from autoprec import Format, Policy
from autoprec.measure.capture import Layer
from autoprec.measure.sensitivity import LayerSensitivity
from autoprec.measure.timing import LayerTime
from autoprec.profiling import LayerProfile, Profile
from autoprec.tuning.space import (
    SPLIT_GRAD_FLOOR,
    SPLIT_LOSS_FLOOR,
    SearchSpace,
    assignment_policy,
    expand,
    group_layers,
    split_outliers,
)

FP16 = Format.FP16
GROUP = "transformer.h.*.mlp.c_proj"
FRAGILE = "transformer.h.1.mlp.c_proj"


def gpt2_fqns(n_layer: int = 4) -> list[str]:
    """The computing layers of an HF GPT-2 as the profile lists them (the attention module
    around its projections is a layer of its own)."""
    out = []
    for i in range(n_layer):
        h = f"transformer.h.{i}"
        out += [f"{h}.attn.c_attn", f"{h}.attn", f"{h}.attn.c_proj", f"{h}.mlp.c_fc",
                f"{h}.mlp.c_proj"]
    return [*out, "lm_head"]


def make_profile(fqns, errors=None, fmts=(Format.FP32, FP16)) -> Profile:
    """A profile by hand: every layer half as fast in each low format as in fp32, with a
    harmless error (loss 1e-6, gradient 1e-4) unless ``errors`` gives (loss, grad) for a
    (fqn, format), None meaning non-finite."""
    errors = errors or {}
    rows = []
    for f in fqns:
        kind = "attention" if f.endswith(".attn") else "linear"
        lp = LayerProfile(Layer(f, kind, "Linear", ((1, 64, 64, 64),), flops=2 * 64 ** 3))
        for fmt in fmts:
            t = 1e-3 if fmt is Format.FP32 else 5e-4
            lp.times[fmt] = LayerTime(f, fmt, t, t, source="model:h100")
            if fmt is Format.FP32:
                continue
            err = errors.get((f, fmt), (1e-6, 1e-4))
            lp.sensitivity[fmt] = LayerSensitivity(
                layer=f, format=fmt, loss_rel_change=err[0] if err else float("nan"),
                grad_rel_error=err[1] if err else float("nan"), layer_grad_rel_error=None,
                output_sqnr_db=40.0, act_overflow=None, act_underflow=None, grad_overflow=None,
                grad_underflow=None, finite=err is not None, n_batches=1)
        rows.append(lp)
    return Profile(task_name="t", model_name="GPT2LMHeadModel", device="sim", target="h100",
                   capture_method="hooks", formats=tuple(fmts), layers=rows)


def every_policy_resolves(space: SearchSpace, prof: Profile) -> int:
    """Check, for every assignment of the space, that the written policy gives each layer
    its unit's format (Policy.format_for on every profiled layer); returns how many."""
    names = list(space.choices)
    n = 0
    for combo in itertools.product(*(space.choices[u] for u in names)):
        choice = dict(zip(names, combo))
        policy = assignment_policy(space.units, choice)
        want = {f: Format(choice[u]) for u, fqns in space.units.items() for f in fqns}
        # the policy survives its YAML form (what tune writes)
        again = Policy.from_dict(yaml.safe_load(policy.to_yaml()))
        for p in (policy, again):
            assert expand(p, prof) == want, (choice, dict(p.layers))
        n += 1
    return n


# ----------------------------------------------------------------------- the split rule
def test_a_non_finite_member_leaves_its_group_and_the_rest_keep_fp16():
    prof = make_profile(gpt2_fqns(), {(FRAGILE, FP16): None})
    space = SearchSpace.build(prof, (Format.FP32, FP16), "role")
    assert space.units[GROUP] == [f"transformer.h.{i}.mlp.c_proj" for i in (0, 2, 3)]
    assert space.units[FRAGILE] == [FRAGILE]
    assert space.choices[GROUP] == ["fp32", "fp16"]
    assert space.choices[FRAGILE] == ["fp32"]
    # every other group is untouched and still one unit: groups still shrink the space
    assert len(space.units) == len(group_layers(gpt2_fqns(), "role")) + 1
    assert space.split_summary() == [
        f"split off its group: {FRAGILE} from {GROUP}: fp16 non-finite, 3 of its 3 peers finite"]
    # the not-offered line counts the split member alone
    assert space.pruned_summary() == ["not offered: fp16 on 1 of 7 units: non-finite (1)"]


def test_members_that_agree_stay_grouped_noise_never_splits():
    # 100x apart, but all below the floors: measurement noise, one unit per role as before
    quiet = {(f"transformer.h.{i}.mlp.c_proj", FP16): (10.0 ** -(i + 4), 10.0 ** -(i + 3))
             for i in range(4)}
    prof = make_profile(gpt2_fqns(), quiet)
    space = SearchSpace.build(prof, (Format.FP32, FP16), "role")
    assert space.units == group_layers(gpt2_fqns(), "role")
    assert space.split == [] and space.split_summary() == []


@pytest.mark.parametrize("loss, grad, split", [
    (0.05, 1e-4, "|loss change| 0.05 > 10x its peers' median 1e-05"),  # far more sensitive
    (1e-6, 0.5, "gradient error 0.5 > 10x its peers' median 0.001"),
    (5e-5, 1e-4, ""),                                                  # 5x: agrees
    (9 * SPLIT_LOSS_FLOOR / 10, 1e-4, ""),                 # 90x its peers, under the floor
    (1e-6, 9 * SPLIT_GRAD_FLOOR / 10, ""),
    (-0.05, 1e-4, "|loss change| 0.05"),                   # a loss that fell as far counts
])
def test_far_more_sensitive_means_ten_times_the_peers_median_and_above_a_floor(loss, grad, split):
    peers = {(f"transformer.h.{i}.mlp.c_proj", FP16): (1e-5, 1e-3) for i in (0, 2, 3)}
    prof = make_profile(gpt2_fqns(), {**peers, (FRAGILE, FP16): (loss, grad)})
    units, notes = split_outliers(prof, group_layers(gpt2_fqns(), "role"), prof.formats)
    if split:
        assert units[FRAGILE] == [FRAGILE] and FRAGILE not in units[GROUP]
        assert len(notes) == 1 and notes[0].startswith(f"{FRAGILE} from {GROUP}: fp16 {split}")
    else:
        assert units == group_layers(gpt2_fqns(), "role") and notes == []


def test_a_finite_minority_is_split_not_the_non_finite_majority():
    bad = {(f"transformer.h.{i}.mlp.c_proj", FP16): None for i in (0, 1, 3)}
    prof = make_profile(gpt2_fqns(), bad)
    space = SearchSpace.build(prof, (Format.FP32, FP16), "role")
    good = "transformer.h.2.mlp.c_proj"
    assert space.units[good] == [good] and space.choices[good] == ["fp32", "fp16"]
    assert space.choices[GROUP] == ["fp32"] and len(space.units[GROUP]) == 3
    assert space.split == [f"{good} from {GROUP}: fp16 finite, 3 of its 3 peers non-finite"]


def test_a_two_member_group_splits_the_fragile_one_only():
    fqns = ["blocks.0.proj", "blocks.1.proj"]
    prof = make_profile(fqns, {("blocks.1.proj", FP16): (0.2, 0.3)})
    units, notes = split_outliers(prof, group_layers(fqns, "role"), prof.formats)
    assert units == {"blocks.*.proj": ["blocks.0.proj"], "blocks.1.proj": ["blocks.1.proj"]}
    assert len(notes) == 1


def test_the_experts_of_one_moe_layer_leave_together():
    fqns = [f"model.layers.{i}.mlp.experts.{e}.w1" for i in range(3) for e in range(4)]
    prof = make_profile(fqns, {("model.layers.1.mlp.experts.2.w1", FP16): None})
    space = SearchSpace.build(prof, (Format.FP32, FP16), "role")
    member = "model.layers.1.mlp.experts.*.w1"
    assert space.units[member] == [f"model.layers.1.mlp.experts.{e}.w1" for e in range(4)]
    assert space.choices[member] == ["fp32"]
    assert space.choices["model.layers.*.mlp.experts.*.w1"] == ["fp32", "fp16"]
    assert every_policy_resolves(space, prof) == 2


def test_an_explicit_mapping_is_kept_as_given_and_single_layers_never_split():
    prof = make_profile(gpt2_fqns(), {(FRAGILE, FP16): None})
    mapping = {"mine": [f"transformer.h.{i}.mlp.c_proj" for i in range(4)],
               **{f: [f] for f in gpt2_fqns() if not f.endswith("mlp.c_proj")}}
    space = SearchSpace.build(prof, (Format.FP32, FP16), mapping)
    assert space.units == mapping and space.split == []
    assert space.choices["mine"] == ["fp32"]
    per_layer = SearchSpace.build(prof, (Format.FP32, FP16), "layer")
    assert per_layer.split == [] and per_layer.units == group_layers(gpt2_fqns(), "layer")


# ------------------------------------------------------- the policy of a split assignment
def test_every_assignment_with_a_split_member_resolves_for_every_layer():
    """A group's glob (`transformer.h.*.mlp.c_proj`) also matches the member split off it:
    the member's exact name must win whichever of the two is the default, and nested units
    (the attention module around its projections, split too) must keep their own formats."""
    prof = make_profile(gpt2_fqns(), {(FRAGILE, FP16): (0.3, 0.3),
                                      ("transformer.h.2.attn", FP16): (0.2, 0.2)})
    space = SearchSpace.build(prof, (Format.FP32, FP16), "role")
    assert {FRAGILE, "transformer.h.2.attn"} <= set(space.units)
    # finite: offered, each its own choice (8 binary units)
    assert space.choices[FRAGILE] == space.choices["transformer.h.2.attn"] == ["fp32", "fp16"]
    assert every_policy_resolves(space, prof) == 2 ** 8
    # the planted assignment: the group in fp16 (the default), its fragile member fp32
    choice = {u: "fp16" for u in space.units} | {FRAGILE: "fp32", "transformer.h.2.attn": "fp32"}
    policy = assignment_policy(space.units, choice)
    assert policy.default is FP16 and policy.layers[FRAGILE] is Format.FP32
    assert policy.match(FRAGILE) == FRAGILE and policy.match("transformer.h.0.mlp.c_proj") is None
    # and the reverse: the group listed, its member at the default
    flip = {u: "fp32" for u in space.units} | {GROUP: "fp16", FRAGILE: "fp32"}
    policy = assignment_policy(space.units, flip)
    assert policy.format_for(FRAGILE) is Format.FP32
    assert policy.format_for("transformer.h.3.mlp.c_proj") is FP16


def test_coupled_units_are_written_as_patterns_that_match_and_split_together():
    """`--couple q_proj,k_proj,v_proj`: the unit `...self_attn.{q_proj,k_proj,v_proj}` is
    written as one pattern per projection (a brace name would match no module), and a
    fragile k_proj takes its own layer's q and v with it, never another layer's."""
    fqns = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(3) for p in "qkvo"]
    prof = make_profile(fqns, {("model.layers.1.self_attn.k_proj", FP16): None})
    space = SearchSpace.build(prof, (Format.FP32, FP16), "role",
                              couple=[("q_proj", "k_proj", "v_proj")])
    member = "model.layers.1.self_attn.{q_proj,k_proj,v_proj}"
    assert space.units[member] == [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    assert space.choices[member] == ["fp32"]
    assert every_policy_resolves(space, prof) == 4
    policy = assignment_policy(space.units, {u: "fp16" for u in space.units} | {member: "fp32"})
    assert "model.layers.1.self_attn.k_proj" in policy.layers
    assert not any("{" in p for p in policy.layers)


# ----------------------------------------------------------------- the planted GPT-2 case
N_LAYER = 4


def planted_task():
    """A 4-block HF GPT-2 (64 wide) whose `transformer.h.1.mlp.c_proj` overflows FP16 (its
    weight x1e7: outputs far above 65504; FP32 stays finite, the next LayerNorms rescale),
    priced for an H100 at 8x1024 tokens, numerics on 4x32-token calibration batches."""
    import autoprec

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from examples.data import byte_batches
    from examples.gpt2_bytes import make_model

    def model():
        m = make_model(n_layer=N_LAYER, n_embd=64, n_head=2, seq_len=1024)
        with torch.no_grad():
            m.transformer.h[1].mlp.c_proj.weight.mul_(1e7)
        return m

    return autoprec.Task(model=model, batches=byte_batches(3, 4, 32, seed=5),
                         shape_batch=byte_batches(1, 8, 1024, seed=2)[0],
                         name="planted-gpt2", device="cpu",
                         train_batches=lambda n, seed: byte_batches(n, 4, 32, seed=seed),
                         eval_batches=byte_batches(2, 4, 32, seed=99, skip=3_000_000))


@pytest.mark.slow
def test_the_planted_fragile_member_keeps_fp32_and_its_group_gets_fp16(tmp_path):
    from autoprec.policy import load_policy
    from autoprec.tuning import tune

    out = tmp_path / "planted.yaml"
    res = tune(planted_task(), formats=("fp32", "fp16"), target="h100", grouping="role",
               n_trials=6, n_holdout=1, output=str(out), progress=False)
    prof = res.profile
    others = [f"transformer.h.{i}.mlp.c_proj" for i in range(N_LAYER) if i != 1]
    # the plant works: the profile says FP16 overflows in it alone, and only there
    assert prof.layer(FRAGILE).sensitivity[FP16].finite is False
    for f in others:
        assert prof.allows(f, FP16), prof.layer(f).sensitivity
        assert prof.seconds(f, FP16) < prof.seconds(f, Format.FP32)
    assert res.units[GROUP] == others and res.units[FRAGILE] == [FRAGILE]
    res.save(str(out))  # what `autoprec tune -o` writes
    written = load_policy(str(out))
    for policy in (res.policy, written):
        assert policy.format_for(FRAGILE) is Format.FP32, dict(policy.layers)
        for f in others:
            assert policy.format_for(f) is FP16, dict(policy.layers)
