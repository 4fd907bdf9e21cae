"""The runtime guard under torch.compile: it adds no graph break (its checks travel through
autograd, see ``autoprec.runtime.guard.record.SinkReport``), with and without HF activation checkpointing,
and a compiled guarded run finds, blames and demotes exactly what the eager one does."""

from __future__ import annotations

import functools
import logging
import math
import warnings

import pytest
import torch
from conftest import tiny_gpt2, tiny_llama

import autoprec
from autoprec import Policy
from autoprec.runtime.guard import GuardConfig, get_guard
from examples.data import byte_batches
from examples.train_plain import PLANT_LAYER, plant_overflow

MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}

CASES = {
    "gpt2 bf16/fp32": ("gpt2", Policy(default="bf16", layers={
        "transformer.h.0.mlp": "fp32", "lm_head": "fp32"})),
    # fp16 layers: values counted (record.stat) and their own weight gradients hooked
    "gpt2 fp16 mlp": ("gpt2", Policy(default="bf16", layers={
        "transformer.h.0.mlp": "fp16", "lm_head": "fp32"})),
    "gpt2 fp8 + rowwise attn": ("gpt2", Policy(default="bf16", layers={
        "transformer.h.*.mlp": "fp8", "transformer.h.1.attn": "fp8:rowwise",
        "transformer.h.0.mlp.c_proj": "fp32", "lm_head": "fp32"})),
    "llama fp8 torchao": ("llama", Policy(default="bf16", engine="torchao", layers={
        "model.layers.*.mlp.*": "fp8", "lm_head": "fp32"})),
}


@pytest.fixture(autouse=True)
def _quiet_fp8_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        yield


def _model(name: str, policy: Policy | None, *, checkpointing: bool):
    model = MODELS[name]().train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if policy is not None:
        autoprec.apply(model, policy, guard=True)
    return model


def _explain(model, batch) -> tuple[int, int]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda b: model(**b).loss)(batch)
    torch._dynamo.reset()
    return explained.graph_count, explained.graph_break_count


@functools.cache
def _baseline(name: str, checkpointing: bool) -> tuple[int, int]:
    return _explain(_model(name, None, checkpointing=checkpointing), byte_batches(1, 4, 32)[0])


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("case", list(CASES))
def test_guard_adds_no_graph_breaks(case, checkpointing):
    name, policy = CASES[case]
    if "torchao" in case:
        pytest.importorskip("torchao", reason="the torchao extra: pip install -e '.[torchao]'")
    batch = byte_batches(1, 4, 32)[0]
    model = _model(name, policy, checkpointing=checkpointing)
    base = _baseline(name, checkpointing)
    assert base == (1, 0), f"{name} without a policy no longer compiles whole: {base}"
    guard = get_guard(model)
    watched = set(guard.watched)
    # the first training forward also finds the modules that compute by what they run
    # (attention cores); traced, it hooks them at the next step(). Inside checkpointed blocks
    # that search still splits the first call (6-7 graphs; benchmarks/bench_compile.py).
    first = _explain(model, batch)
    if not checkpointing:
        assert first == base, f"{case}: first call {first} with the guard, {base} without"
    model(**batch).loss.backward()
    guard.step()
    if name == "gpt2":
        assert {"transformer.h.0.attn", "transformer.h.1.attn"} <= set(guard.watched) - watched
    got = _explain(model, batch)
    assert got == base, f"{case}: (graphs, breaks) {got} with the guard, {base} without a policy"


def _guarded_run(policy: Policy, *, compiled: bool, plant, update: bool = True,
                 steps: int = 5) -> tuple[list, list[float]]:
    """``steps`` steps of a 3-block GPT-2 under ``policy`` and the guard (patience 2),
    compiled from the first step or not; ``plant(model)`` before the second step (guard step
    2); ``update``: step the optimizer. Returns (events, losses)."""
    torch.manual_seed(0)
    model = tiny_gpt2(n_layer=3).train()
    autoprec.apply(model, policy, guard=GuardConfig(patience=2))
    guard = get_guard(model)
    forward = torch.compile(model, backend="aot_eager") if compiled else model
    scaler = policy.grad_scaler("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = byte_batches(1, 4, 32, seed=0)[0]
    losses = []
    for step in range(steps):
        if step == 1:
            plant(model)
        loss = forward(**batch).loss
        scaler.scale(loss).backward()
        if update:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        guard.step()
        losses.append(loss.item())
    torch._dynamo.reset()
    return [(e.fqn, e.old, e.new, e.step, e.where, e.reason) for e in guard.events], losses


def _inf_weight(fqn: str):
    def plant(model):
        with torch.no_grad():
            model.get_submodule(fqn).weight[0, 0] = float("inf")
    return plant


@pytest.mark.slow  # aot_eager recompiles after each change of what is watched
def test_compiled_guard_demotes_what_the_eager_one_does():
    """An fp16 layer whose outputs overflow from step 2: demoted at step 3 (patience 2), with
    the same measured share of failing outputs, in both runs; every later loss finite."""
    policy = Policy(default="bf16", layers={PLANT_LAYER: "fp16", "lm_head": "fp32"},
                    loss_scaling={"init_scale": 1024.0, "growth_interval": 1000})
    eager_events, eager_losses = _guarded_run(policy, compiled=False, plant=plant_overflow)
    events, losses = _guarded_run(policy, compiled=True, plant=plant_overflow)
    assert [e[:5] for e in events] == [(PLANT_LAYER, autoprec.Format.FP16, autoprec.Format.FP32,
                                        3, "outputs")]
    assert events == eager_events  # the reason carries the measured share of failing outputs
    assert all(math.isfinite(x) for x in losses[3:]) and not math.isfinite(losses[1])
    assert losses == pytest.approx(eager_losses, rel=1e-3, nan_ok=True)


@pytest.mark.slow
def test_compiled_guard_blames_no_layer_for_nan_from_an_fp32_layer(caplog):
    """NaN made by a layer the policy keeps in fp32 reaches every watched layer after it:
    compiled as eagerly, nobody is demoted and the warning names the fp32 layer (no optimizer
    step: it would spread the NaN into every weight)."""
    fp32 = "transformer.h.1.mlp.c_fc"
    policy = Policy(default="bf16", layers={fp32: "fp32"})
    with caplog.at_level(logging.WARNING, logger="autoprec.runtime.guard"):
        events, _ = _guarded_run(policy, compiled=True, plant=_inf_weight(fp32), update=False,
                                 steps=4)
    assert events == []
    assert f"come out of `{fp32}`" in caplog.text, caplog.text


def test_compiled_checks_equal_eager_ones_for_watched_layers_and_suspects():
    """The numbers step() judges, per layer and kind: the probes' (compiled) and the hooks'
    (eager) agree, including a suspect's input and input-gradient checks and its share of
    failing values, with a planted overflow in one fp16 layer; and so do the predictive
    check's summaries (amax, kurtosis, underflow share) of outputs and gradients."""
    policy = Policy(default="bf16", layers={PLANT_LAYER: "fp16", "lm_head": "fp32"})
    batch = byte_batches(1, 4, 32, seed=0)[0]
    suspect = PLANT_LAYER

    def checks(compiled: bool):
        torch.manual_seed(0)
        model = tiny_gpt2(n_layer=3).train()
        autoprec.apply(model, policy, guard=True)
        guard = get_guard(model)
        model(**batch).loss.backward()  # the first forward: finds the attention cores
        guard.step()
        model.zero_grad(set_to_none=True)
        plant_overflow(model)
        guard.recorder.set_suspects({suspect}, model)
        forward = torch.compile(model, backend="aot_eager") if compiled else model
        forward(**batch).loss.backward()
        torch._dynamo.reset()
        checks = guard.recorder.collect()
        return checks.level, checks.share, checks.forecast

    (level, frac, ahead), (level_c, frac_c, ahead_c) = checks(False), checks(True)
    for kind in ("out", "grad", "in", "ingrad"):
        assert suspect in level_c[kind], (kind, level_c[kind])
    assert level_c["out"][suspect] == math.inf and 0 < frac_c["out"][suspect] < 1
    for kind in level:
        assert set(level_c[kind]) == set(level[kind]), kind
        for fqn, v in level[kind].items():
            assert level_c[kind][fqn] == pytest.approx(v, rel=1e-3, nan_ok=True), (kind, fqn)
        assert frac_c[kind] == pytest.approx(frac[kind], rel=1e-6), kind
    # eagerly the checks come in the order the layers ran; compiled, in the order learned
    assert list(level_c["out"]) == list(level["out"])
    assert set(ahead) == {"out", "grad"} and set(ahead["out"]) == set(level["out"])
    assert set(ahead["grad"]) == set(level["grad"])
    for kind, found in ahead.items():
        assert set(ahead_c[kind]) == set(found), kind
        for fqn, (amax, kurtosis, under) in found.items():
            got = ahead_c[kind][fqn]
            assert got[0] == pytest.approx(amax, rel=1e-3, nan_ok=True), (kind, fqn)
            assert got[1] == pytest.approx(kurtosis, rel=1e-3, nan_ok=True), (kind, fqn)
            assert (got[2] is None) == (under is None), (kind, fqn)
    assert ahead["out"][suspect][2] is not None  # fp16: its underflow share is measured
