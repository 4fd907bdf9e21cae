"""The runtime guard on a real HF GPT-2: planted FP16 overflows (outputs, gradients, attention
scores) are found, blamed on the right layer, demoted, and training goes on; what only looks
like a failure (a GradScaler backing off, NaN from an unwatched layer) is not demoted."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from conftest import ComputeProbe, poison_and_train, tiny_gpt2

import autoprec
from autoprec import Format, Policy
from autoprec.runtime.guard import Guard, GuardConfig, get_guard
from examples.data import byte_batches
from examples.train_plain import PLANT_LAYER, train

PLANT_STEP = 3


@pytest.fixture(autouse=True)
def _quiet_fp8_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        yield


def overflow_policy():
    return Policy(default="bf16", layers={PLANT_LAYER: "fp16", "lm_head": "fp32"},
                  loss_scaling={"init_scale": 1024.0, "growth_interval": 1000})


def test_guard_demotes_an_overflowing_fp16_layer_and_training_goes_on(tmp_path):
    batches = byte_batches(4, 4, 32, seed=1)
    steps = 8
    # Without the guard: from the planted step on, every loss is NaN (the GradScaler skips the
    # updates, so the weights survive, but the layer overflows again at every forward).
    plain = train(tiny_gpt2(n_layer=3), overflow_policy(), batches, steps=steps,
                  plant_at=PLANT_STEP)
    assert all(math.isfinite(x) for x in plain["losses"][:PLANT_STEP])
    assert not any(math.isfinite(x) for x in plain["losses"][PLANT_STEP:]), plain["losses"]

    path = tmp_path / "amended.yaml"
    out = train(tiny_gpt2(n_layer=3), overflow_policy(), batches, steps=steps,
                plant_at=PLANT_STEP, guard=GuardConfig(patience=2, save_to=str(path)))
    guard, losses = out["guard"], out["losses"]
    # two failing steps (patience), then the layer is fp32 and every later loss is finite
    assert [e.fqn for e in guard.events] == [PLANT_LAYER], guard.events
    event = guard.events[0]
    assert (event.old, event.new, event.where) == (Format.FP16, Format.FP32, "outputs")
    assert event.step == PLANT_STEP + 2  # guard.step() counts from 1
    assert "overflow fp16 max 65504" in event.reason and "% of outputs" in event.reason
    assert not any(math.isfinite(x) for x in losses[PLANT_STEP:PLANT_STEP + 2])
    assert all(math.isfinite(x) for x in losses[PLANT_STEP + 2:]), losses
    assert autoprec.applied_formats(guard.model)[PLANT_LAYER] is Format.FP32
    # the layers downstream of the overflow saw NaN too, but only the culprit was demoted
    assert "transformer.h.2.mlp.c_fc" in guard.watched
    assert PLANT_LAYER not in guard.watched  # fp32 now: nothing to watch
    # the amended policy file names the layer and loads back as the policy in force
    amended = autoprec.load_policy(path)
    assert amended.layers[PLANT_LAYER] is Format.FP32
    assert amended.format_for("transformer.h.2.mlp.c_fc") is Format.BF16
    assert amended.tuned["guard"][0]["layer"] == PLANT_LAYER
    assert PLANT_LAYER in path.read_text().splitlines()[0]  # the comment line says why
    assert amended.layers == guard.amended_policy().layers


def test_gradient_overflow_is_blamed_on_the_layer_whose_backward_overflows():
    """No GradScaler, loss x 1e7: c_fc's forward and the gradient reaching it are fine, its
    FP16 weight gradient (a sum over all tokens) overflows. Only c_fc is demoted."""
    batch = byte_batches(1, 4, 32, seed=1)[0]

    def run(guard):
        model = tiny_gpt2().train()
        autoprec.apply(model, Policy(default="bf16", layers={"transformer.h.0.mlp.c_fc": "fp16"}),
                       guard=guard)
        finite = []
        for _ in range(4):
            (model(**batch).loss * 1e7).backward()
            finite.append(all(torch.isfinite(p.grad).all().item() for p in model.parameters()))
            model.zero_grad(set_to_none=True)
            if get_guard(model) is not None:
                get_guard(model).step()
        return finite, get_guard(model)

    finite, _ = run(None)
    assert finite == [False] * 4
    finite, guard = run(True)
    assert finite == [False, False, True, True]
    assert [(e.fqn, e.where, e.step) for e in guard.events] == [
        ("transformer.h.0.mlp.c_fc", "weight gradients", 2)]
    assert "weight gradients overflow fp16 max 65504" in guard.events[0].reason


def _fp16_run(min_loss_scale):
    """fp16 MLPs with a GradScaler starting far too high (2**40): its scaled gradients overflow
    until it has backed the scale off, a dozen steps or so."""
    model = tiny_gpt2().train()
    policy = Policy(default="bf16", layers={"transformer.h.0.mlp.c_fc": "fp16"},
                    loss_scaling={"init_scale": 2.0 ** 40, "growth_interval": 1000})
    autoprec.apply(model, policy, guard=GuardConfig(min_loss_scale=min_loss_scale))
    guard = get_guard(model)
    scaler = policy.grad_scaler("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = byte_batches(1, 4, 32, seed=2)[0]
    for _ in range(6):
        scaler.scale(model(**batch).loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        guard.step(scaler=scaler)
    return guard, scaler


def test_a_grad_scaler_backing_off_is_not_a_demotion():
    guard, scaler = _fp16_run(min_loss_scale=1.0)
    assert scaler.get_scale() < 2.0 ** 40  # the scaled gradients did overflow ...
    assert guard.events == []              # ... and that was the scaler's to handle
    # the same run, judging gradients at any scale, demotes c_fc: the test can fail
    guard, _ = _fp16_run(min_loss_scale=math.inf)
    assert [e.fqn for e in guard.events] == ["transformer.h.0.mlp.c_fc"]
    assert "loss scale" in guard.events[0].reason


def test_nan_from_an_unwatched_layer_is_not_blamed_on_the_next_watched_one():
    """An fp32 (unwatched) c_fc emits NaN; the bf16 c_proj after it fails too. Its inputs were
    already NaN, so after a first suspicion it is cleared and never demoted."""
    model = tiny_gpt2().train()
    autoprec.apply(model, Policy(default="fp32", layers={"transformer.h.0.mlp.c_proj": "bf16"}),
                   guard=GuardConfig(patience=2))
    guard = get_guard(model)
    assert guard.watched == {"transformer.h.0.mlp.c_proj": Format.BF16}
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.bias[0] = float("nan")
    batch = byte_batches(1, 4, 32, seed=1)[0]
    for _ in range(4):
        loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        assert guard.step() == []
    assert math.isnan(loss.item())
    assert guard.events == []
    assert guard.recorder.suspects == {"transformer.h.0.mlp.c_proj"}  # watched closely, not demoted


def test_overflowing_attention_scores_demote_the_attention_module_not_its_children():
    """q @ k.T overflows FP16 inside GPT-2's attention (its own matmuls); its child c_proj is
    the first to show NaN, is cleared (its input was NaN), and the blame moves to the
    attention module. Demoting it pins its children to fp16: only the attention's own matmuls
    go to fp32."""
    model = tiny_gpt2().train()
    attn = "transformer.h.0.attn"
    autoprec.apply(model, Policy(default="fp32", layers={attn: "fp16"}), guard=True)
    guard = get_guard(model)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight.mul_(1000.0)  # q, k ~ 1e2: q.k ~ 1e5
    batch = byte_batches(1, 4, 32, seed=1)[0]
    losses = []
    for _ in range(5):
        loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
        guard.step()
    assert [(e.fqn, e.old, e.new) for e in guard.events] == [(attn, Format.FP16, Format.FP32)]
    assert guard.events[0].step == 3  # c_proj suspected (1), cleared (2); attn blamed (2, 3)
    assert not any(math.isfinite(x) for x in losses[:3]) and all(map(math.isfinite, losses[3:]))
    assert guard.policy.format_for(attn) is Format.FP32
    # attn now inherits fp32 from the root (no region of its own); its children keep fp16
    assert autoprec.applied_formats(model) == {
        "": Format.FP32, f"{attn}.c_attn": Format.FP16, f"{attn}.c_proj": Format.FP16}
    with ComputeProbe(model) as probe:
        model(**batch)
    assert probe.matmul_dtypes(attn) == {torch.float32}         # q @ k.T, attn @ v
    assert probe.matmul_dtypes(f"{attn}.c_attn") == {torch.float16}


def test_guard_records_nothing_in_evaluation_and_steps_without_training_are_no_ops(gpt2_batch):
    model = tiny_gpt2()
    autoprec.apply(model, Policy(default="bf16", layers={"transformer.h.0.mlp": "fp16",
                                                         "lm_head": "fp16"}), guard=True)
    guard = get_guard(model)
    # the layers that run matmuls; norms and embeddings compute in FP32 in every format.
    # Layers by class are known at once; the attention cores (no layer class: they compute by
    # running q @ k.T) are found on the first training forward.
    projections = {"lm_head"} | {f"transformer.h.{i}.{m}" for i in range(2)
                                 for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert set(guard.watched) == projections
    with torch.no_grad():
        model(**gpt2_batch)
    assert all(not v for v in guard.recorder.records.values())
    assert guard.step() == []
    assert set(guard.watched) == projections, "an evaluation forward must not count"
    model(**gpt2_batch).loss.backward()
    assert set(guard.watched) == projections | {"transformer.h.0.attn", "transformer.h.1.attn"}
    assert set(guard.recorder.records["out"]) == set(guard.watched)
    assert set(guard.recorder.records["grad"]) == set(guard.watched)
    # weight gradients: fp16 layers' own only (lm_head's weight is tied to the embedding)
    assert set(guard.recorder.records["wgrad"]) == {"transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"}
    assert guard.step() == [] and guard.events == []


def test_apply_without_guard_or_remove_detaches_it(gpt2_batch):
    model = tiny_gpt2()
    policy = Policy(default="bf16")
    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    autoprec.apply(model, policy, guard=True)
    guard = get_guard(model)
    hooked = model.transformer.h[0].mlp.c_fc
    model(**gpt2_batch).loss.backward()  # the first training forward settles what is watched
    guard.step()
    assert len(hooked._forward_hooks) == 1 and hooks() == len(guard.watched)
    autoprec.apply(model, policy, guard=guard)  # re-attaching keeps the same guard
    assert get_guard(model) is guard and len(hooked._forward_hooks) == 1
    autoprec.apply(model, policy)
    assert get_guard(model) is None and hooks() == 0
    assert guard.model is None

    # detached before its first training forward, a guard leaves none of its hooks either
    autoprec.apply(model, policy, guard=True)
    guard = get_guard(model)
    autoprec.remove(model)
    assert hooks() == 0
    model(**gpt2_batch).loss.backward()
    assert guard.step() == [] and get_guard(model) is None and hooks() == 0


def test_deepcopy_of_a_guarded_model_gets_its_own_guard(gpt2_batch):
    model = tiny_gpt2()
    autoprec.apply(model, Policy(default="bf16"), guard=True)
    twin = copy.deepcopy(model)
    assert get_guard(twin) is not get_guard(model) and get_guard(twin).model is twin
    twin(**gpt2_batch).loss.backward()
    assert get_guard(twin).recorder.records["out"] and not get_guard(model).recorder.records["out"]


def test_bad_guard_arguments_are_clear_errors():
    model = tiny_gpt2()
    with pytest.raises(TypeError, match="expected True, a GuardConfig, a Guard"):
        autoprec.apply(model, Policy(), guard="yes")
    with pytest.raises(ValueError, match="patience must be an integer >= 2"):
        GuardConfig(patience=1)
    with pytest.raises(ValueError, match="cannot include fp32"):
        GuardConfig(formats=("fp32",))
    with pytest.raises(ValueError, match="Unknown format 'fp9'"):
        GuardConfig(formats=("fp9",))
    assert GuardConfig(formats=("fp16",)).formats == (Format.FP16,)
    assert get_guard(model) is None
    with pytest.raises(RuntimeError, match="never attached"):
        Guard().amended_policy()


def test_demotion_walks_fp8_to_bf16_to_fp32_and_then_stops(gpt2_batch):
    """A layer that fails in every format (an inf weight) is demoted one step per failing
    stretch and stops at fp32, which is not watched. The NaN it still emits is then not pinned
    on the watched layers after it: their inputs were already NaN."""
    layer = "transformer.h.1.mlp.c_fc"
    model = tiny_gpt2().train()
    autoprec.apply(model, Policy(default="bf16", layers={layer: "fp8"}), guard=True)
    guard = get_guard(model)
    poison_and_train(model, layer, gpt2_batch, guard, 9)
    assert [(e.step, e.fqn, e.old, e.new) for e in guard.events] == [
        (2, layer, Format.FP8, Format.BF16), (4, layer, Format.BF16, Format.FP32)]
    assert all(e.reason.startswith("non-finite outputs") for e in guard.events)
    assert layer not in guard.watched and guard.policy.format_for(layer) is Format.FP32
    assert not math.isfinite(model(**gpt2_batch).loss.item())  # still failing, upstream of all


def test_a_module_that_computes_by_what_it_runs_is_watched_and_demoted():
    # No layer class and no attention-like name: it computes by running x @ x.T itself, as
    # capture sees it (the same rule, runtime.calls.layer_kind). Its FP16 products overflow.
    class Mixer(torch.nn.Module):
        def forward(self, x):
            return x @ x.transpose(-1, -2)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), Mixer(), torch.nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight.mul_(400.0)
    autoprec.apply(model, Policy(default="fp32", layers={"1": "fp16"}), guard=True)
    guard = get_guard(model)
    assert "1" not in guard.watched  # not known before it ran
    x = torch.randn(2, 4, 16)
    events = []
    for _ in range(3):
        model(x).float().sum().backward()
        events += guard.step()
        model.zero_grad()
    assert "1" not in guard.watched  # fp32 now: nothing left to watch
    assert [(e.fqn, e.old, e.new) for e in events] == [("1", Format.FP16, Format.FP32)], events
    assert torch.isfinite(model(x)).all()


@pytest.mark.parametrize("culprit", ["lm_head", "transformer.h.0.attn.c_attn",
                                     "transformer.h.0.mlp.c_fc"])
def test_nan_out_of_an_fp32_layer_demotes_nobody_and_warns_naming_it(culprit, caplog):
    """The last, the first or a middle layer, kept in fp32 by the policy, emits NaN. Its bf16
    neighbours see non-finite inputs or gradients that are not their fault: nothing is
    demoted, and a WARNING names where the NaN starts (nothing will fix itself)."""
    model = tiny_gpt2().train()
    # the layer's output turns NaN (a forward hook: GPT-2's lm_head shares its weight with the
    # embedding, so a NaN weight would start at the embedding)
    model.get_submodule(culprit).register_forward_hook(lambda m, a, out: out * float("nan"))
    autoprec.apply(model, Policy(default="bf16", layers={culprit: "fp32"}), guard=True)
    guard = get_guard(model)
    batch = byte_batches(1, 4, 32, seed=1)[0]
    with caplog.at_level("WARNING", logger="autoprec.runtime.guard"):
        for _ in range(5):
            loss = model(**batch).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            assert guard.step() == []
    assert math.isnan(loss.item()) and guard.events == []
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and f"`{culprit}`" in warned[0] and "fp32" in warned[0], warned


# ----------------------------------------------------------------------------- checkpoints
def _fp8_then_failing(batch, steps: int, guard=True):
    """GPT-2 with one fp8 layer poisoned (an inf weight): demoted fp8 -> bf16 at step 2, blamed
    again at step 3, demoted to fp32 at step 4."""
    model = tiny_gpt2().train()
    autoprec.apply(model, Policy(default="bf16", layers={POISONED: "fp8", "lm_head": "fp32"}),
                   guard=guard)
    poison_and_train(model, POISONED, batch, get_guard(model), steps)
    return model


POISONED = "transformer.h.1.mlp.c_fc"


def test_state_dict_round_trip_puts_the_demotions_back_on_a_fresh_model(gpt2_batch, tmp_path):
    import json

    model = _fp8_then_failing(gpt2_batch, 3)
    guard = get_guard(model)
    state, amended_then = guard.state_dict(), guard.amended_policy()
    assert (state["step"], state["layers"], state["counts"], state["suspects"]) == (
        3, {POISONED: "bf16"}, {POISONED: 1}, [POISONED])
    # plain data: through JSON, and through torch.save / torch.load(weights_only=True)
    assert json.loads(json.dumps(state)) == state
    torch.save(state, tmp_path / "guard.pt")
    loaded = torch.load(tmp_path / "guard.pt", weights_only=True)

    fresh = tiny_gpt2().train()
    fresh.load_state_dict(model.state_dict())   # the poisoned weights too
    policy = Policy(default="bf16", layers={POISONED: "fp8", "lm_head": "fp32"})
    autoprec.apply(fresh, policy, guard=True)
    twin = get_guard(fresh)
    assert autoprec.applied_formats(fresh)[POISONED] is Format.FP8
    twin.load_state_dict(loaded)
    assert autoprec.applied_formats(fresh) == autoprec.applied_formats(model)
    assert twin.policy.format_for(POISONED) is Format.BF16
    assert twin.events == guard.events and twin.policy == guard.policy
    assert twin.state_dict() == state
    assert twin.amended_policy().to_yaml() == guard.amended_policy().to_yaml()
    # and both go on alike: one more failing step (the count carried over) demotes to fp32
    poison_and_train(model, POISONED, gpt2_batch, guard, 1)
    poison_and_train(fresh, POISONED, gpt2_batch, twin, 1)
    assert [(e.step, e.new) for e in twin.events] == [(2, Format.BF16), (4, Format.FP32)]
    assert twin.events == guard.events
    assert autoprec.applied_formats(fresh) == autoprec.applied_formats(model)

    # a state loaded before the guard is attached takes effect when it attaches
    early = Guard()
    early.load_state_dict(loaded)
    other = tiny_gpt2().train()
    autoprec.apply(other, policy, guard=early)
    assert early.policy.format_for(POISONED) is Format.BF16 and early.ledger.step == 3
    assert POISONED not in autoprec.applied_formats(other)  # no fp8 region: bf16 like the root
    # and a guard attached with the amended policy (a run resumed from the amended file)
    # takes the state as it is: nothing more to demote
    amended = tiny_gpt2().train()
    autoprec.apply(amended, amended_then, guard=True)
    get_guard(amended).load_state_dict(loaded)
    assert get_guard(amended).policy.format_for(POISONED) is Format.BF16
    assert get_guard(amended).events == twin.events[:1]


def test_loading_a_guard_state_of_another_policy_is_a_one_line_error(gpt2_batch):
    from autoprec import PolicyError

    state = get_guard(_fp8_then_failing(gpt2_batch, 2)).state_dict()
    model = tiny_gpt2().train()
    autoprec.apply(model, Policy(default="bf16", layers={POISONED: "fp16", "lm_head": "fp32"}),
                   guard=True)
    before = autoprec.applied_formats(model)
    with pytest.raises(PolicyError) as err:
        get_guard(model).load_state_dict(state)
    msg = str(err.value)
    assert "\n" not in msg and f"layer `{POISONED}` is fp8 there, fp16 here" in msg, msg
    assert "saved for another policy" in msg
    assert autoprec.applied_formats(model) == before and get_guard(model).events == []

    autoprec.apply(model, Policy(default="bf16", layers={POISONED: "fp8", "lm_head": "fp32"}),
                   guard=GuardConfig(formats=("fp16",)))
    with pytest.raises(PolicyError, match="watched formats fp16, fp8, .*bf16 but this guard watches "
                                          "fp16; use GuardConfig"):
        get_guard(model).load_state_dict(state)
    with pytest.raises(PolicyError, match="Not an autoprec guard state"):
        get_guard(model).load_state_dict({"step": 3})


# ----------------------------------------------------------------------------- lost causes
def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelname == "WARNING" and r.name == "autoprec.runtime.guard"]


def test_weights_poisoned_by_one_nan_step_demote_nobody_and_say_to_restore_a_checkpoint(caplog):
    """bf16 training has no GradScaler: one step on which HF ResNet's fp32 classifier emits
    NaN sends NaN gradients through AdamW into every weight. From then on every layer's output
    is NaN because its weights are (the first conv's first: it used to be demoted, then the
    next one); demoting cannot help. The guard demotes nobody, says so once (since when,
    where it started, restore a checkpoint), and judges again once the weights are restored."""
    from examples import cnn

    head = "classifier.1"
    model = cnn.make_model(width=8).train()
    bad_step = 2
    now = {"step": 0}
    model.get_submodule(head).register_forward_hook(
        lambda m, a, out: out * float("nan") if now["step"] == bad_step else None)
    autoprec.apply(model, Policy(default="bf16", layers={head: "fp32"}), guard=True)
    guard = get_guard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = cnn.image_batches(1, batch_size=2)[0]
    saved = None
    events, losses = [], []
    with caplog.at_level("WARNING", logger="autoprec.runtime.guard"):
        for step in range(1, 7):
            now["step"] = step
            if step == bad_step:  # the checkpoint to restore: the state before the bad step
                saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            events += guard.step()
            losses.append(loss.item())
    assert all(map(math.isfinite, losses[:bad_step - 1]))
    assert not any(map(math.isfinite, losses[bad_step - 1:])), losses
    first_conv = model.get_submodule("resnet.embedder.embedder.convolution")
    assert not torch.isfinite(first_conv.weight).all()  # the premise: the weights are lost
    assert events == [] and guard.events == []
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    msg = warned[0]
    assert "\n" not in msg and f"since step {bad_step}" in msg and f"`{head}`" in msg, msg
    assert "demoting" in msg and "cannot help" in msg and "restore a checkpoint" in msg, msg
    assert (guard.poisoned_since, guard.first_nonfinite) == (bad_step, head)

    # restored, the run trains again, and the guard with it
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert guard.step() == [] and math.isfinite(loss.item())
    assert guard.poisoned_since is None and guard.first_nonfinite is None


def test_an_fp16_layer_whose_backward_overflows_without_a_grad_scaler_is_demoted(caplog):
    """No GradScaler, loss x 1e9: the forward is finite, but the gradient the fp32 tail sends
    into the last fp16 layer overflows FP16 there (its output, hence the gradient for it, is
    FP16) and so do its weight gradients, on every step. It is the first watched layer in the
    backward, so nothing watched upstream of it can be blamed: it is, after `patience` steps,
    named in the event, and the weight gradients are finite from then on."""
    layer = "transformer.h.1.mlp.c_proj"
    model = tiny_gpt2().train()
    autoprec.apply(model, Policy(default="fp32", layers={layer: "fp16"}), guard=True)
    guard = get_guard(model)
    batch = byte_batches(1, 4, 32, seed=1)[0]
    finite, events = [], []
    with caplog.at_level("WARNING", logger="autoprec.runtime.guard"):
        for _ in range(4):
            loss = model(**batch).loss
            (loss * 1e9).backward()
            finite.append(bool(torch.isfinite(model.get_submodule(layer).weight.grad).all()))
            model.zero_grad(set_to_none=True)
            events += guard.step()
    assert math.isfinite(loss.item())
    assert finite == [False, False, True, True]
    assert [(e.fqn, e.old, e.new, e.step) for e in events] == [(layer, Format.FP16, Format.FP32, 2)]
    assert "overflow fp16 max 65504" in events[0].reason
    assert not any("loss computation" in w for w in _warnings(caplog)), _warnings(caplog)


def test_non_finite_values_in_the_input_batch_are_named_as_such(caplog, cnn_model, cnn_batch):
    """HF ResNet fed a batch with an inf pixel: the first layer's output is non-finite because
    its input is. Nobody is demoted, and the warning says the input batch held non-finite
    values (not that no module's output was non-finite)."""
    first = "resnet.embedder.embedder.convolution"
    model = cnn_model.train()
    autoprec.apply(model, Policy(default="fp32", layers={first: "bf16"}), guard=True)
    guard = get_guard(model)
    batch = dict(cnn_batch, pixel_values=cnn_batch["pixel_values"].clone())
    batch["pixel_values"][0, 0, 0, 0] = float("inf")
    with caplog.at_level("WARNING", logger="autoprec.runtime.guard"):
        for _ in range(4):
            model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)
            assert guard.step() == []
    warned = _warnings(caplog)
    assert len(warned) == 1 and "input batch" in warned[0], warned
    assert "no module's output" not in warned[0] and "\n" not in warned[0]


def test_a_guard_state_naming_what_the_model_lacks_is_refused_and_changes_nothing(gpt2_batch):
    """A checkpointed state edited by hand (or of another model): a demotion moved to a layer
    that does not exist would silently run the demoted layer in fp8 again; a demotion
    turned into a promotion, a bad format, a wrong type are refused too. Each is a one-line
    error naming the key and the value, and the guard and model are left as they were."""
    from autoprec import PolicyError

    state = get_guard(_fp8_then_failing(gpt2_batch, 3)).state_dict()
    policy = Policy(default="bf16", layers={POISONED: "fp8", "lm_head": "fp32"})
    unknown = "transformer.h.9.mlp.c_fc"

    def edited(**changes):
        return dict(copy.deepcopy(state), **changes)

    cases = {
        "layers": (edited(layers={unknown: "bf16"}), unknown),
        "events": (edited(events=[dict(state["events"][0], layer=unknown)]), unknown),
        "counts": (edited(counts={unknown: 1}), unknown),
        "suspects": (edited(suspects=[unknown]), unknown),
        "warned": (edited(warned=[unknown]), unknown),
        "promotion": (edited(layers={POISONED: "fp16"}), "fp16"),
        "format": (edited(layers={POISONED: "bf17"}), "bf17"),
        "step": (edited(step="3"), "'3'"),
        "counts type": (edited(counts={POISONED: "one"}), "'one'"),
    }
    for name, (bad, named) in cases.items():
        model = tiny_gpt2().train()
        autoprec.apply(model, policy, guard=True)
        guard = get_guard(model)
        before = autoprec.applied_formats(model)
        with pytest.raises(PolicyError) as err:
            guard.load_state_dict(bad)
        msg = str(err.value)
        assert "\n" not in msg and named in msg, (name, msg)
        assert autoprec.applied_formats(model) == before, name
        assert (guard.events, guard.ledger.step, guard.ledger.streaks, guard.recorder.suspects) == \
            ([], 0, {}, set())
    # the state as saved loads (the test can pass)
    get_guard(model).load_state_dict(state)
    assert get_guard(model).policy.format_for(POISONED) is Format.BF16


def test_calls_are_attributed_to_the_innermost_running_module(gpt2_batch):
    """The one attribution capture's hook tracer and the guard's discovery share: a call
    belongs to the innermost module running it (GPT-2's attention core runs q @ k.T itself,
    its c_attn and c_proj run their own addmm)."""
    from autoprec.runtime.attribution import CallAttribution

    class Log(CallAttribution):
        def __init__(self):
            super().__init__()
            self.seen: list[tuple[str, str]] = []

        def attribute(self, call, func, args, kwargs):
            self.seen.append((self.owner(), call.name))
            return func(*args, **kwargs)

    model = tiny_gpt2()
    log = Log()
    handles = log.track(model.named_modules())
    try:
        with log:
            model(**gpt2_batch)
    finally:
        for h in handles:
            h.remove()
    owners = {owner for owner, _ in log.seen}
    assert ("transformer.h.0.attn.c_attn", "addmm") in log.seen
    assert "transformer.h.0.attn" in owners  # the core's own matmul, not a child's
    assert "transformer.h.0" not in owners and "" not in owners  # nothing left at a parent
    assert log.running == []  # every module that entered left
