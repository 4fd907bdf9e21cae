"""autoprec.recheck with a policy that has phases: every phase's formats measured (each row says
its phases), and the amended policy keeping each demotion in every phase, in the file and in a
run that switches phases (HF GPT-2, the tiny one of examples/gpt2_bytes.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import autoprec
from autoprec.formats import Format
from autoprec.integrations import training_kit
from autoprec.policy import Budget, Policy, load_policy
from autoprec.recheck import Rechecker, RecheckResult, RecheckRow, recheck
from examples.data import byte_batches
from examples.gpt2_bytes import make_model

FC0 = "transformer.h.0.mlp.c_fc"
FC1 = "transformer.h.1.mlp.c_fc"
# FC0 is fp8 in every phase; FC1 only in phase 1. A demotion of FC0 to bf16 written into the
# first phase alone is undone twice: phase 1's `layers` names it fp8 again, and phase 2's
# `formats: {bf16: fp8}` maps its bf16 entry back to fp8. A gradient-error budget of 0 makes
# every low-precision layer's own (non-zero) error break it.
PHASED = Policy(default="fp32", layers={FC0: "fp8"},
                phases=[{"from_step": 2, "layers": {FC0: "fp8", FC1: "fp8"}},
                        {"from_step": 4, "name": "up", "formats": {"bf16": "fp8"}}],
                tuned={"budget": {"max_loss_increase": 0.05, "max_grad_error": 0.0}})


# two noisy shared cores: one thread each is 10x faster than two threads fighting others
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def batches():
    return byte_batches(4, 4, 64, seed=1)


def _model():
    torch.manual_seed(0)
    return make_model(2, 64, 1, 64)


@pytest.fixture(scope="module")
def result(batches):
    return recheck(_model(), PHASED, batches[:1])


def test_recheck_measures_every_phase_and_says_which(result):
    rows = {(r.fqn, r.format, r.measured): (r.phases, r.verdict) for r in result.rows}
    assert rows[(FC0, Format.FP8, Format.FP8)] == ((0, 1, 2), "demote")
    # FC1 computes fp8 in phase 1 only: measured in it, and judged as its own format there
    assert rows[(FC1, Format.FP8, Format.FP8)] == ((1,), "demote")
    assert rows[(FC1, Format.FP32, Format.FP8)] == ((0, 2), "stay")
    assert result.demote == {FC0: Format.BF16, FC1: Format.BF16}, result.format()
    # each (layer, measured format) is one measurement, whatever the phases it serves
    fc1 = [r for r in result.rows if r.fqn == FC1]
    assert fc1[0].loss_change == fc1[1].loss_change
    text = result.format()
    assert "phase" in text.splitlines()[0]
    assert "3 phases, each checked: 0 from step 0; 1 from step 2; 2 from step 4 (up)" in text
    assert f"demote {FC1}: fp8 -> bf16 (" in text and "found in phase 1, kept in every" in text
    assert result.to_dict()["rows"][0]["phases"] == [0, 1, 2]


def test_amended_policy_keeps_each_demotion_in_every_phase(result, tmp_path):
    amended = result.amended_policy()
    path = tmp_path / "amended.yaml"
    amended.save(path)
    for policy in (amended, load_policy(path)):
        assert len(policy.phases) == 2
        assert [policy.phase(i).format_for(FC0) for i in range(3)] == [Format.BF16] * 3
        # FC1, demoted where it was fp8 (phase 1), stays fp32 where the policy has it so
        assert [policy.phase(i).format_for(FC1) for i in range(3)] == \
            [Format.FP32, Format.BF16, Format.FP32]
        # every other computing layer computes in every phase as before
        for fqn in result.layers:
            if fqn not in (FC0, FC1):
                for i in range(3):
                    assert policy.phase(i).format_for(fqn) is PHASED.phase(i).format_for(fqn), \
                        (fqn, i)


def test_a_run_switching_phases_computes_the_demoted_format(result, batches):
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kit = training_kit(model, result.amended_policy(), guard=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = {}
    for step in range(6):
        kit.phases.at(step)
        seen[kit.phases.current] = (autoprec.applied_formats(model)[FC0],
                                    autoprec.applied_formats(model).get(FC1))
        model(**batches[step % len(batches)]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        kit.guard.step()
    assert seen == {0: (Format.BF16, None), 1: (Format.BF16, Format.BF16),
                    2: (Format.BF16, None)}, seen


def test_a_demotion_off_nvfp4_is_not_undone_by_a_later_phase():
    # nvfp4 demotes to mxfp8; a phase that maps mxfp8 to nvfp4 must not put it back (both are
    # scaled formats, but mxfp8 is the more precise)
    policy = Policy(default="fp32", layers={"a": "nvfp4", "b": "mxfp8"},
                    phases=[{"from_step": 5, "formats": {"mxfp8": "nvfp4"}}])
    row = RecheckRow(fqn="a", format=Format.NVFP4, measured=Format.NVFP4, loss_change=0.5,
                     grad_error=0.1, sqnr_db=10.0, overflow=0.0, finite=True, verdict="demote",
                     reason="loss change", phases=(0, 1))
    result = RecheckResult(policy=policy, budget=Budget(), rows=(row,), layers=("a", "b"),
                           n_batches=1, seconds=0.0)
    amended = result.amended_policy()
    assert [amended.phase(i).format_for("a") for i in range(2)] == [Format.MXFP8] * 2
    assert [amended.phase(i).format_for("b") for i in range(2)] == [Format.MXFP8, Format.NVFP4]


def test_promotions_apply_in_the_phases_they_were_found(batches):
    # phase 1 maps fp8 to bf16: a layer promoted in phase 0 to fp8 may be promoted to bf16
    # only there, and a layer kept fp32 by phase 1's own entry is promoted only in phase 0
    policy = Policy(default="fp32", layers={"transformer.h.*.attn.c_attn": "fp8"},
                    phases=[{"from_step": 3, "formats": {"fp8": "bf16"},
                             "layers": {"lm_head": "bf16"}}])
    result = recheck(_model(), policy, batches[:1], budget=Budget(1.0, None))
    amended = result.amended_policy(promote=True)
    promoted = 0
    for i in range(2):
        found = {}
        for r in result.rows:
            if r.verdict == "may promote" and i in r.phases and (
                    r.fqn not in found or r.measured.numerics.precision_rank
                    > found[r.fqn].numerics.precision_rank):
                found[r.fqn] = r.measured
        for fqn in result.layers:
            want = found.get(fqn, policy.phase(i).format_for(fqn))
            assert amended.phase(i).format_for(fqn) is want, (fqn, i)
        promoted += len(found)
    assert promoted, result.format()
    # lm_head: fp32 in phase 0 (a candidate there), bf16 (its own) in phase 1
    assert amended.phase(1).format_for("lm_head") is Format.BF16


def test_rechecker_in_training_checks_the_phase_in_force(batches):
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kit = training_kit(model, PHASED, guard=True)
    result = Rechecker(PHASED, every=1).check(model, batches[0], 1)
    assert not result.policy.phases and {r.phases for r in result.rows} == {(0,)}
    # only phase 0's fp8 layer is its own format; FC1's fp8 in phase 1 is not asked for yet
    assert result.demote == {FC0: Format.BF16}, result.format()
    assert kit.guard is not None


def test_names_from_files_are_shown_escaped():
    model = nn.Sequential()
    model.add_module("evil\x1b[2J", nn.Linear(16, 16))
    model.add_module("out", nn.Linear(16, 16))
    policy = Policy(default="fp32", layers={"evil\x1b[2J": "bf16"},
                    phases=[{"from_step": 2, "name": "decay\x1b]0;x\x07",
                             "formats": {"bf16": "fp32"}}],
                    source="pol\x1b[31m.yaml")
    torch.manual_seed(0)
    batch = torch.randn(8, 16)
    result = recheck(model, policy, [batch], loss_fn=lambda m, b: m(b).square().mean(),
                     budget=Budget(0.0, 0.0))
    text = result.format()
    assert "evil" in text and "decay" in text and "pol" in text, text
    assert "\x1b" not in text and "\x07" not in text, text


def test_the_guards_amended_policy_keeps_a_demotion_a_phase_map_would_swap_back():
    from autoprec.runtime.guard.demote import merge_phases

    # phase 1 swaps fp8 and bf16: the demoted layer's bf16 entry would map to fp8 there
    policy = Policy(default="fp32", layers={"a": "fp8", "b": "bf16"},
                    phases=[{"from_step": 3, "formats": {"fp8": "bf16", "bf16": "fp8"}}])
    kept = merge_phases(policy, {"a": Format.BF16}, ["a", "b"])
    assert [kept.phase(i).format_for("a") for i in range(2)] == [Format.BF16] * 2
    assert [kept.phase(i).format_for("b") for i in range(2)] == [Format.BF16, Format.FP8]
