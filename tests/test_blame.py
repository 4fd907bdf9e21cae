"""Blame as a pure function: a table of recorded checks (what the guard's hooks measured, in the
order the layers ran) and, for each, the layer blamed and where (``autoprec.runtime.guard.blame``).

Levels are what ``Recorder.collect`` reads back: for layers whose values are counted (fp16,
suspects) ``inf`` when any value failed (else 0.0) with the share of failing values beside it;
for the others the plain sum (non-finite exactly when a value is).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from autoprec import Format
from autoprec.runtime.guard.blame import Blame, blame, describe, failing, first_nonfinite
from autoprec.runtime.guard.diagnose import params_poisoned
from autoprec.runtime.guard.record import Checks, Recorder
from autoprec.runtime.guard.terms import BF16_MAX

INF, NAN = math.inf, math.nan
FP16, BF16 = Format.FP16, Format.BF16

# A GPT-2-like block's watched layers and their formats (fp32 layers are not watched).
FORMATS = {
    "h.attn.c_attn": BF16, "h.attn.c_proj": BF16, "h.attn": BF16,
    "h.mlp.c_fc": FP16, "h.mlp.c_proj": FP16, "lm_head": BF16,
}
FORWARD = ["h.attn.c_attn", "h.attn.c_proj", "h.attn", "h.mlp.c_fc", "h.mlp.c_proj", "lm_head"]


def checks(out=None, inp=None, grad=None, ingrad=None, wgrad=None, share=None) -> Checks:
    """Checks with the given levels (dicts keep the order the layers ran); ``out`` defaults to
    every watched layer finite in forward order and ``grad`` to them finite backward."""
    c = Checks()
    c.level["out"] = dict(out) if out is not None else {f: 1.0 for f in FORWARD}
    c.level["grad"] = dict(grad) if grad is not None else {f: 1.0 for f in reversed(FORWARD)}
    c.level["in"], c.level["ingrad"], c.level["wgrad"] = dict(inp or {}), dict(ingrad or {}), \
        dict(wgrad or {})
    for (kind, fqn), v in (share or {}).items():
        c.share[kind][fqn] = v
    return c


def fine(**overrides) -> dict[str, float]:
    """Every watched output finite, in forward order, but ``overrides`` (dots as __)."""
    return {f: overrides.get(f.replace(".", "__"), 1.0) for f in FORWARD}


def fine_back(**overrides) -> dict[str, float]:
    return {f: overrides.get(f.replace(".", "__"), 1.0) for f in reversed(FORWARD)}


# id: (checks, blame kwargs, culprit, where, cleared)
SCENARIOS = {
    "healthy step": (checks(), {}, None, None, set()),
    "fp16 overflow in the forward": (
        checks(out=fine(h__mlp__c_fc=INF, h__mlp__c_proj=INF, lm_head=NAN),
               share={("out", "h.mlp.c_fc"): 0.25}),
        {}, "h.mlp.c_fc", "outputs", set()),
    "downstream contamination: the first bad layer in call order, not its consumers": (
        checks(out=fine(h__attn__c_proj=NAN, h__attn=NAN, h__mlp__c_fc=INF, lm_head=NAN)),
        {}, "h.attn.c_proj", "outputs", set()),
    "a bf16 output beyond BF16's range but finite in FP32": (
        checks(out=fine(lm_head=BF16_MAX * 2)), {}, "lm_head", "outputs", set()),
    "NaN made by an fp32 layer: the watched layer after it had a non-finite input": (
        checks(out=fine(h__mlp__c_fc=INF, h__mlp__c_proj=INF, lm_head=NAN),
               inp={"h.mlp.c_fc": INF}),
        {}, None, None, {"h.mlp.c_fc"}),
    "inf in the input batch: the first layer's input was non-finite": (
        checks(out={f: NAN for f in FORWARD}, inp={"h.attn.c_attn": INF}),
        {}, None, None, {"h.attn.c_attn"}),
    "a cleared child's ancestor is still judged (the attention core feeds its c_proj)": (
        checks(out=fine(h__attn__c_proj=NAN, h__attn=NAN), inp={"h.attn.c_proj": NAN}),
        {}, "h.attn", "outputs", {"h.attn.c_proj"}),
    "a suspect whose unwatched child made the NaN is cleared, the child named": (
        checks(out=fine(h__attn=NAN, h__mlp__c_fc=INF), inp={"h.attn": 1.0}),
        {"subtree_faults": {"h.attn": "h.attn.attn_dropout"}}, None, None, {"h.attn"}),
    "fp16 overflow in the backward: the first overflowing gradient in backward order": (
        checks(grad=fine_back(h__mlp__c_proj=INF, h__mlp__c_fc=INF, h__attn=NAN),
               share={("grad", "h.mlp.c_proj"): 0.5}),
        {}, "h.mlp.c_proj", "gradients", set()),
    "a bf16 gradient beyond BF16's range but finite": (
        checks(grad=fine_back(h__attn=BF16_MAX * 4)), {}, "h.attn", "gradients", set()),
    "a non-finite bf16 gradient arrived that way: the backward before it made it": (
        checks(grad=fine_back(h__attn=NAN, h__attn__c_proj=NAN)),
        {}, "h.mlp.c_fc", "backward", {"h.attn"}),
    "...unless that backward's input gradient was seen finite (a suspect's)": (
        checks(grad=fine_back(h__attn=NAN), ingrad={"h.mlp.c_fc": 1.0}),
        {}, None, None, {"h.attn", "h.mlp.c_fc"}),
    "a non-finite gradient at the first layer of the backward came from the loss": (
        checks(grad=fine_back(lm_head=NAN, h__mlp__c_proj=NAN)), {}, None, None, {"lm_head"}),
    "an fp16 layer first in the backward overflows without a GradScaler": (
        checks(grad={"h.mlp.c_proj": INF, "h.mlp.c_fc": INF}), {}, "h.mlp.c_proj", "gradients",
        set()),
    "...with an enabled GradScaler at its floor it came from the loss": (
        checks(grad={"h.mlp.c_proj": INF, "h.mlp.c_fc": INF}), {"scale": 1.0}, None, None,
        {"h.mlp.c_proj"}),
    "own weight gradient non-finite while its output gradient is finite: certain": (
        checks(grad=fine_back(h__attn=NAN), wgrad={"h.mlp.c_proj": 0.0, "h.mlp.c_fc": NAN}),
        {}, "h.mlp.c_fc", "weight gradients", set()),
    "a weight gradient that fails with its output gradient is not its own overflow": (
        checks(grad=fine_back(h__mlp__c_fc=INF), wgrad={"h.mlp.c_fc": NAN}),
        {}, "h.mlp.c_fc", "gradients", set()),
    "outputs are judged first: a failing forward ignores the gradients": (
        checks(out=fine(lm_head=NAN), grad=fine_back(h__mlp__c_proj=INF)),
        {}, "lm_head", "outputs", set()),
    "a gradient overflow at a GradScaler scale above min_loss_scale is the scaler's": (
        checks(grad=fine_back(h__mlp__c_fc=INF)), {"scale": 65536.0}, None, None, set()),
    "...at or below min_loss_scale it counts": (
        checks(grad=fine_back(h__mlp__c_fc=INF)), {"scale": 0.5}, "h.mlp.c_fc", "gradients",
        set()),
    "an unwatched layer's failing check is nobody's (no format, no limit)": (
        checks(out={**fine(), "h.ln_f": NAN}), {}, None, None, set()),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_blame_names_the_culprit_and_where(name):
    recorded, kwargs, culprit, where, cleared = SCENARIOS[name]
    before = (dict(recorded.level["out"]), dict(recorded.level["grad"]))
    verdict = blame(recorded, FORMATS, **kwargs)
    got = verdict.failure
    assert (got.fqn if got else None, got.where if got else None) == (culprit, where), name
    assert verdict.cleared == cleared, name
    # pure: what it was given is unchanged
    assert (recorded.level["out"], recorded.level["grad"]) == before


def test_blame_reports_the_share_the_origin_and_the_scale():
    v = blame(SCENARIOS["fp16 overflow in the forward"][0], FORMATS)
    assert v.failure.fraction == 0.25 and v.failure.level == INF
    assert describe(v.failure, FP16) == "25% of outputs overflow fp16 max 65504 or are NaN"
    recorded, kwargs = SCENARIOS["a suspect whose unwatched child made the NaN is cleared, "
                                 "the child named"][:2]
    assert blame(recorded, FORMATS, **kwargs).origin == "h.attn.attn_dropout"
    deferred = blame(checks(grad=fine_back(h__mlp__c_fc=INF)), FORMATS, scale=65536.0).deferred
    assert (deferred.fqn, deferred.scale) == ("h.mlp.c_fc", 65536.0)
    counted = blame(checks(grad=fine_back(h__mlp__c_fc=INF)), FORMATS, scale=0.5,
                    min_loss_scale=1.0).failure
    assert counted.scale == 0.5 and describe(counted, FP16).endswith("loss scale 0.5")


def test_the_scale_is_read_only_when_a_gradient_fails():
    """A GPU GradScaler's scale is a device tensor: reading it is a host sync, so blame asks
    for it only when it has a gradient failure to weigh."""
    asked = []

    def scale() -> float:
        asked.append(1)
        return 2.0 ** 16

    assert blame(checks(), FORMATS, scale=scale) == Blame()
    assert blame(checks(out=fine(lm_head=NAN)), FORMATS, scale=scale).failure.fqn == "lm_head"
    assert not asked
    assert blame(checks(grad=fine_back(h__mlp__c_fc=INF)), FORMATS, scale=scale).failure is None
    assert asked == [1]


def test_failing_and_where_the_non_finite_values_began():
    assert not failing(checks(), FORMATS)
    assert failing(checks(out=fine(lm_head=BF16_MAX * 2)), FORMATS)
    assert failing(checks(wgrad={"h.mlp.c_fc": NAN}), FORMATS)
    finish = {f: i for i, f in enumerate(["h.attn.c_attn", "h.attn.c_proj", "h.attn",
                                          "h.mlp.c_fc", "h.mlp.act", "h.mlp.c_proj", "lm_head"])}
    bad = checks(out=fine(h__mlp__c_proj=INF, lm_head=NAN))
    # an unwatched layer ran between the last finite output and the first bad one
    layer, words = first_nonfinite(bad, None, FORMATS, finish, ["h.mlp.act"], lambda f: None)
    assert layer is None and "`h.mlp.act`" in words and "`h.mlp.c_proj`'s" in words
    layer, words = first_nonfinite(bad, None, FORMATS, finish, [], lambda f: None)
    assert layer == "h.mlp.c_proj"
    # outputs finite, an unwatched layer after every watched one: it, or the loss
    layer, words = first_nonfinite(checks(grad=fine_back(lm_head=NAN)), None, FORMATS,
                                   {**finish, "head": 99}, ["head"], lambda f: Format.FP32)
    assert layer == "head" and "fp32 under the policy" in words


def _called_twice_checks(second_input: torch.Tensor) -> Checks:
    """What the recorder records on a tiny model whose fp16 layer ``a`` runs twice per forward
    (a shared layer), its second call fed ``second_input``'s scale."""
    torch.manual_seed(0)

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, y):
            return self.b(self.a(x) + self.a(y))

    model = Shared()
    recorder = Recorder(check_gradients=True)
    recorder.start(model, forget_order=True)
    for fqn, fmt in (("a", FP16), ("b", BF16)):
        recorder.watch(fqn, model.get_submodule(fqn), fmt, torch.device("cpu"), lambda: {})
    x = torch.ones(2, 4, requires_grad=True)
    model(x, second_input).sum().backward()
    return recorder.collect()


def test_a_layer_called_twice_is_checked_over_both_calls():
    fine_twice = _called_twice_checks(torch.ones(2, 4))
    assert list(fine_twice.level["out"]) == ["a", "b"]  # the order they first ran
    assert blame(fine_twice, {"a": FP16, "b": BF16}).failure is None
    # the second call overflows fp16: a is blamed for its outputs, with the share over both
    big = _called_twice_checks(torch.full((2, 4), 1e6))
    verdict = blame(big, {"a": FP16, "b": BF16})
    assert (verdict.failure.fqn, verdict.failure.where) == ("a", "outputs")
    assert 0 < verdict.failure.fraction <= 0.5  # only the second call's values failed


def test_poisoned_means_non_finite_parameters_in_more_than_one_module():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    assert not params_poisoned(model)
    with torch.no_grad():
        model[1].weight[0, 0] = NAN
    assert not params_poisoned(model)  # one module's bad entry: its own failure, judged
    with torch.no_grad():
        model[2].bias[0] = INF
    assert params_poisoned(model)
