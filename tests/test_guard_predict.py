"""The predictive guard: on the planted drift (examples/drift.py) it demotes the drifting fp16
layer before its first non-finite step and well before the reactive guard; on the same model
unplanted it demotes nothing in 1000 steps. Also the forecast rule as a table, the forecaster's
checkpoint state, demotions requested from outside (request_demotion) and phase switches
(replace_policy)."""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
import random
import warnings

import pytest
import torch

import autoprec
from autoprec import Format, Policy, PolicyError
from autoprec.integrations import training_kit
from autoprec.runtime.guard import GuardConfig, get_guard
from autoprec.runtime.guard.demote import safer
from autoprec.runtime.guard.forecast import Forecaster, Point, fit, hits
from examples.data import byte_batches
from examples.drift import DRIFT_LAYER, drift_policy, plant_drift
from examples.gpt2_bytes import make_model

FP16_MAX = 65504.0
HORIZON = 50


pytestmark = pytest.mark.filterwarnings("ignore:.*can only emulate.*")


# ----------------------------------------------------------------------------- the rule
def _series(ys, start=100):
    return [Point(start + i, FP16_MAX * math.exp(y)) for i, y in enumerate(ys)]


def _noisy(n, fn, sigma, seed=0):
    rng = random.Random(seed)
    return [fn(i) + rng.gauss(0, sigma) for i in range(n)]


RULE_CASES = {
    # y = ln(amax / 65504) over 32 steps
    "steady 1%/step growth, 40 steps from the range": (
        _noisy(32, lambda i: -0.72 + 0.01 * i, 0.05), True),
    "steady growth, 200 steps from the range": (
        _noisy(32, lambda i: -2.3 + 0.01 * i, 0.05), False),
    "flat and noisy just below the range": (_noisy(32, lambda i: -0.2, 0.1), False),
    "early growth that has levelled off": (
        _noisy(32, lambda i: -1.0 + 0.6 * (1 - math.exp(-i / 3)), 0.03), False),
    "one spike on the last step": ([-1.0] * 31 + [-0.05], False),
    "far from the range (values ~1), growing 5%/step": (
        [math.log(1 / FP16_MAX) + 0.05 * i for i in range(32)], False),
    "values ~1 growing 20%/step: there in ~30 steps": (
        [math.log(1 / FP16_MAX) + 0.18 * i for i in range(32)], True),
    "falling": (_noisy(32, lambda i: -0.1 - 0.01 * i, 0.02), False),
    "too few points": (_noisy(6, lambda i: -0.3 + 0.05 * i, 0.0), False),
}


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_the_forecast_rule(case):
    ys, expected = RULE_CASES[case]
    trend = fit(_series(ys), FP16_MAX, HORIZON, min_points=16)
    assert hits(trend, HORIZON) is expected, (case, trend)
    if expected:
        assert 0 < trend.steps_left <= HORIZON and trend.t >= 4 and trend.slope > 0
        text = trend.describe(Format.FP16)
        assert "growing" in text and "reaches 65504 in ~" in text, text


def test_forecaster_needs_patience_steps_and_forgets_a_changed_format():
    f = Forecaster(window=32, horizon=HORIZON, patience=2)
    formats = {"a": Format.FP16, "b": Format.FP16}
    ys = _noisy(40, lambda i: -1.0 + 0.02 * i, 0.02)
    due_at = None
    for i, y in enumerate(ys):
        # "b" stays flat far below the range
        f.observe(i, {"out": {"a": (FP16_MAX * math.exp(y), 3.0, 0.0),
                              "b": (10.0, 3.0, 0.0)}}, formats)
        if f.due() and due_at is None:
            due_at = i
            first = f.hitting["a"]
    assert due_at is not None and set(f.due()) == {"a"}
    assert f.streaks["a"] >= 2 and due_at >= 16  # half a window, then two steps in a row
    assert first.kind == "out" and first.kurtosis == 3.0
    f.observe(41, {"out": {"a": (1.0, None, None)}}, {"a": Format.BF16, "b": Format.FP16})
    assert len(f.history["a"]["out"]) == 1 and "a" not in f.streaks  # afresh in bf16
    assert len(f.history["b"]["out"]) == 32
    f.observe(42, {"out": {"b": (10.0, None, None)}}, {"b": Format.FP16})  # "a" not watched
    assert "a" not in f.history and "a" not in f.formats


def test_safer_of_two_formats():
    assert safer(Format.FP16, Format.FP32) is Format.FP32
    assert safer(Format.FP8, Format.BF16) is Format.BF16
    assert safer(Format.FP16, Format.BF16) is Format.FP16  # a tie: the new policy's
    assert safer(Format.FP32, Format.BF16) is Format.FP32


# ----------------------------------------------------------------------------- the drift
def _drift_run(predict: bool, steps: int = 400, *, compiled: bool = False, overflow_at=300,
               rate: float = 0.01):
    """The planted drift under the guard: (the first demotion's event, the step of the
    drifting layer's first output above FP16's range or non-finite, as guard.step() counts,
    None: none before the demotion)."""
    torch.manual_seed(0)
    model = make_model(2, 64, 1, 64)
    batches = byte_batches(8, 4, 64, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    drift = plant_drift(model, opt, batches[0], overflow_at=overflow_at, rate=rate)
    model, scaler, guard = training_kit(model, drift_policy(), guard=GuardConfig(predict=predict))
    seen = []
    model.get_submodule(DRIFT_LAYER).register_forward_hook(
        lambda m, a, out: seen.append(float(out.detach().abs().max())) if m.training else None)
    forward = torch.compile(model, backend="aot_eager") if compiled else model
    bad = None
    for s in range(steps):
        loss = forward(**batches[s % len(batches)]).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if bad is None and seen and not seen[-1] <= FP16_MAX:
            bad = guard.ledger.step + 1
        events = guard.step()
        if events:
            break
    drift.remove()
    torch._dynamo.reset()
    return (events[0] if events else None), bad


@functools.cache
def _reactive():
    return _drift_run(predict=False)


@functools.cache
def _predictive():
    return _drift_run(predict=True)


def test_predictive_guard_demotes_the_drifting_layer_before_it_overflows():
    reactive, first_bad = _reactive()
    event, bad_before = _predictive()
    assert reactive is not None and reactive.fqn == DRIFT_LAYER and reactive.where == "outputs"
    assert first_bad is not None and first_bad <= reactive.step
    assert event is not None, "the predictive guard never demoted the drifting layer"
    assert (event.fqn, event.old, event.new, event.where) == (
        DRIFT_LAYER, Format.FP16, Format.FP32, "forecast")
    assert bad_before is None, f"an output overflowed at step {bad_before}, before the demotion"
    assert event.step < first_bad
    assert event.step <= reactive.step - 20, (event.step, reactive.step)
    assert "growing" in event.reason and "reaches 65504" in event.reason, event.reason
    assert "kurtosis" in event.reason, event.reason


@pytest.mark.slow  # 2 x 1000 steps, fp8 emulated
def test_no_false_alarm_in_1000_steps_of_the_unplanted_model():
    """GPT-2 2x64 with fp8, bf16 and fp16 layers (a GradScaler: outputs forecast) trained
    1000 steps, and the same in bf16/fp8 without a scaler (outputs and gradients)."""
    for policy in (Policy(default="fp32", layers={
                       "transformer.h.*.attn.c_attn": "fp8",
                       "transformer.h.*.attn.c_proj": "bf16",
                       "transformer.h.*.mlp.c_fc": "fp16",
                       DRIFT_LAYER: "fp16", "lm_head": "fp32"}),
                   drift_policy(others="bf16").with_layers({DRIFT_LAYER: Format.FP8})):
        torch.manual_seed(0)
        model = make_model(2, 64, 1, 64)
        batches = byte_batches(8, 4, 64, seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, scaler, guard = training_kit(model, policy, guard=True)
        kurtosis = []
        for s in range(1000):
            loss = model(**batches[s % len(batches)]).loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            assert guard.step() == [], f"step {s + 1}: {guard.events}"
            kurtosis += [p.kurtosis for k in guard.forecaster.history.get(DRIFT_LAYER, {}).values()
                         for p in list(k)[-1:] if p.kurtosis is not None]
        assert math.isfinite(loss.item())
        history = guard.forecaster.history[DRIFT_LAYER]
        kinds = {"out"} if scaler.is_enabled() else {"out", "grad"}
        assert set(history) == kinds and all(len(v) == 32 for v in history.values())
        assert kurtosis and all(math.isfinite(k) and k > 1 for k in kurtosis)


@pytest.mark.slow  # aot_eager over ~100 steps
def test_compiled_predictive_guard_demotes_as_the_eager_one():
    eager, _ = _drift_run(True, 160, overflow_at=120, rate=0.02)
    compiled, bad = _drift_run(True, 160, compiled=True, overflow_at=120, rate=0.02)
    assert eager is not None and eager.where == "forecast" and bad is None
    assert (compiled.fqn, compiled.step, compiled.where) == (eager.fqn, eager.step, eager.where)


# ----------------------------------------------------------------------------- checkpoints
def _trained(policy, steps=20, guard=True):
    torch.manual_seed(0)
    model = make_model(2, 64, 1, 64)
    batches = byte_batches(4, 4, 64, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, scaler, g = training_kit(model, policy, guard=guard)
    step = _stepper(model, scaler, opt, g, batches)
    for _ in range(steps):
        step()
    return model, g, step


def _stepper(model, scaler, opt, guard, batches):
    count = [0]

    def step():
        loss = model(**batches[count[0] % len(batches)]).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        count[0] += 1
        return guard.step()

    return step


def test_forecast_history_goes_through_a_checkpoint():
    model, guard, _ = _trained(drift_policy(), steps=12)
    state = guard.state_dict()
    assert len(state["forecast"][DRIFT_LAYER]["out"]) == 12
    torch.save(state, "/dev/null")  # plain data
    twin_model = make_model(2, 64, 1, 64)
    autoprec.apply(twin_model, drift_policy(), guard=True)
    twin = get_guard(twin_model)
    twin.load_state_dict(copy.deepcopy(state))
    assert twin.forecaster.state_dict() == state["forecast"]
    # untrusted: every bad entry is a one-line error naming the key; nothing changes
    bad = {"amax": [[1, -5.0, None, None]], "points": [[1, 2.0]] * 5000,
           "format": "fp9", "kind": "nan", "step": [["x", 2.0, None, None]]}
    for name, value in bad.items():
        edited = copy.deepcopy(state)
        entry = edited["forecast"][DRIFT_LAYER]
        if name == "format":
            entry["format"] = value
        elif name == "kind":
            entry["weird"] = []
        else:
            entry["out"] = value
        fresh = make_model(2, 64, 1, 64)
        autoprec.apply(fresh, drift_policy(), guard=True)
        with pytest.raises(PolicyError) as err:
            get_guard(fresh).load_state_dict(edited)
        assert "\n" not in str(err.value) and "forecast" in str(err.value), (name, err.value)
        assert get_guard(fresh).forecaster.history == {}


# ----------------------------------------------------------------------------- requests
def test_request_demotion_is_applied_at_the_next_step(caplog, tmp_path):
    layer = "transformer.h.0.mlp.c_fc"
    model, guard, step = _trained(drift_policy(), steps=2)
    guard.request_demotion(layer, "re-check: loss 3% above fp32 on held-out batches")
    assert guard.events == []  # not before the step boundary
    events = step()
    assert [(e.fqn, e.old, e.new, e.where, e.step) for e in events] == [
        (layer, Format.FP16, Format.FP32, "recheck", 3)]
    assert events[0].reason == "re-check: loss 3% above fp32 on held-out batches"
    assert guard.amended_policy().format_for(layer) is Format.FP32
    assert _fmt(model, layer) is Format.FP32
    state = guard.state_dict()
    assert state["layers"][layer] == "fp32" and state["events"][0]["where"] == "recheck"
    # a resumed run takes the requested demotion up like any other
    again = make_model(2, 64, 1, 64)
    autoprec.apply(again, drift_policy(), guard=True)
    get_guard(again).load_state_dict(state)
    assert _fmt(again, layer) is Format.FP32
    # not watched: fp32 under the policy, or no such module: an INFO line, nothing else
    with caplog.at_level(logging.INFO, logger="autoprec.runtime.guard"):
        guard.request_demotion("lm_head", "why not")
        guard.request_demotion("transformer.h.7.mlp", "gone")
        guard.request_demotion(layer, "again")  # fp32 now
    assert step() == [] and len(guard.events) == 1
    logged = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(logged) == 3 and "fp32" in logged[0] and "no module" in logged[1], logged
    with pytest.raises(ValueError, match="not one of outputs"):
        guard.request_demotion(DRIFT_LAYER, "x", where="Bad\nlabel")
    guard.request_demotion(DRIFT_LAYER, "phase check", where="phase-check")
    assert [e.where for e in step()] == ["phase-check"]


def _request_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*can only emulate.*")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = make_model(2, 64, 1, 64)
        model, scaler, guard = training_kit(model, drift_policy(), guard=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = _stepper(model, scaler, opt, guard, byte_batches(2, 4, 64, seed=5 + rank))
        for s in range(1, 5):
            if s == 3 and rank == 1:
                guard.request_demotion("transformer.h.0.attn.c_attn", "rank 1's re-check")
            step()
        torch.save({"events": [(e.step, e.fqn, e.where, e.reason) for e in guard.events],
                    "formats": _fmt(model, "transformer.h.0.attn.c_attn").value},
                   os.path.join(out_dir, f"r{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_demotion_one_rank_requests_is_made_on_every_rank(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_request_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["events"] == r1["events"] == [
        (3, "transformer.h.0.attn.c_attn", "recheck", "rank 1's re-check (seen on rank 1 of 2)")]
    assert r0["formats"] == r1["formats"]
    assert r0["formats"] == "fp32"


# ----------------------------------------------------------------------------- phases
PHASE1 = Policy(default="fp32", layers={"transformer.h.*.mlp.c_fc": "fp16",
                                        "transformer.h.0.attn.c_attn": "bf16"})
PHASE2 = Policy(default="fp32", layers={"transformer.h.*.mlp.c_fc": "fp16",
                                        "transformer.h.0.attn.c_attn": "fp16",
                                        "transformer.h.1.attn.c_attn": "fp8",
                                        "transformer.h.*.mlp.c_proj": "bf16"})


def _phased_run():
    """Phase 1, a demotion of h.0's c_fc; phase 2 (h.1's c_attn fp8), a demotion of it."""
    model, guard, step = _trained(PHASE1, steps=2)
    guard.request_demotion("transformer.h.0.mlp.c_fc", "phase 1 check")
    step()
    guard.replace_policy(PHASE2)
    guard.request_demotion("transformer.h.1.attn.c_attn", "phase 2 check")
    step()
    return model, guard, step


def test_replace_policy_keeps_the_guards_demotions():
    model, guard, step = _phased_run()
    assert _fmt(model, "transformer.h.0.mlp.c_fc") is Format.FP32      # demoted in phase 1
    assert _fmt(model, "transformer.h.1.mlp.c_fc") is Format.FP16
    assert _fmt(model, "transformer.h.0.attn.c_attn") is Format.FP16   # phase 2's own
    assert _fmt(model, "transformer.h.1.attn.c_attn") is Format.BF16   # fp8 -> bf16 in phase 2
    assert _fmt(model, "transformer.h.1.mlp.c_proj") is Format.BF16
    assert guard.watched["transformer.h.0.attn.c_attn"] is Format.FP16
    assert "transformer.h.0.mlp.c_fc" not in guard.watched
    # a layer whose format changed starts its forecast history afresh; the others keep theirs
    assert "transformer.h.0.attn.c_attn" in guard.forecaster.history
    assert len(guard.forecaster.history["transformer.h.0.attn.c_attn"]["out"]) == 1
    assert len(guard.forecaster.history["transformer.h.1.mlp.c_fc"]["out"]) == 4
    # a switch back to phase 1 keeps both demotions where they are safer
    guard.replace_policy(PHASE1)
    assert _fmt(model, "transformer.h.0.mlp.c_fc") is Format.FP32
    assert _fmt(model, "transformer.h.1.attn.c_attn") is Format.FP32  # phase 1's: safer


@pytest.mark.parametrize("attach", ["first policy, then replace_policy", "current phase"])
def test_a_phased_run_resumes(attach):
    model, guard, _ = _phased_run()
    state = guard.state_dict()
    assert state["policy"] == _identity(PHASE1) and state["phase"] == _identity(PHASE2)
    fresh = make_model(2, 64, 1, 64)
    fresh.load_state_dict(model.state_dict())
    first = PHASE1 if attach.startswith("first") else PHASE2
    autoprec.apply(fresh, first, guard=True)
    twin = get_guard(fresh)
    twin.load_state_dict(copy.deepcopy(state))
    if first is PHASE1:
        twin.replace_policy(PHASE2)
    assert autoprec.applied_formats(fresh) == autoprec.applied_formats(model)
    assert twin.events == guard.events and twin.state_dict()["layers"] == state["layers"]
    assert twin.state_dict()["policy"] == state["policy"]


def _fmt(model, fqn: str) -> Format:
    """The format ``fqn`` computes in: its own region's, else the root's (default fp32)."""
    formats = autoprec.applied_formats(model)
    return formats.get(fqn, formats[""])


def _identity(policy):
    from autoprec.runtime.guard.state import identity

    return identity(policy)
