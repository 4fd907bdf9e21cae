"""Training a real HF model with a policy in a plain loop, under Accelerate and under the HF
Trainer (through the examples/ scripts), state dicts that move between policy-applied and
plain models, and the torchao-style module filter on MiniLM's module tree."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import ComputeProbe, tiny_gpt2
from torch import nn

import autoprec
from autoprec import Format, Policy, PolicyError
from autoprec.integrations import training_kit
from autoprec.runtime.guard import get_guard
from examples import train_accelerate, train_hf_trainer, train_plain
from examples.data import byte_batches

POLICY = Policy(default="bf16", layers={
    "lm_head": "fp32",
    "transformer.h.0.mlp.c_fc": "fp16",   # tiny: FP16 matmuls are slow on this CPU
    "transformer.h.1.attn": "fp8",
}, loss_scaling={"init_scale": 512.0, "growth_interval": 1000})


@pytest.fixture(autouse=True)
def _quiet_fp8_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        yield


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state; each Accelerator (or Trainer) here sets its own
    mixed precision, so start and end each test from a clean one."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def check_formats(model, batch, policy, fqns):
    """The matmuls of each of ``fqns`` ran in the policy's format (FP8 as FP8 casts)."""
    with ComputeProbe(model) as probe:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    dtype = {Format.FP32: torch.float32, Format.BF16: torch.bfloat16, Format.FP16: torch.float16}
    for fqn in fqns:
        fmt = policy.format_for(fqn)
        if fmt is Format.FP8:
            assert probe.fp8_casts.get(fqn, 0) >= 2, f"{fqn} is fp8 but cast nothing to FP8"
        else:
            assert probe.matmul_dtypes(fqn) == {dtype[fmt]}, (fqn, probe.matmul_dtypes(fqn))


FQNS = ["lm_head", "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj",
        "transformer.h.1.attn", "transformer.h.1.attn.c_attn"]


# ----------------------------------------------------------------------------- plain loop
def test_plain_loop_trains_with_the_policy_and_its_grad_scaler(gpt2_batch):
    batches = byte_batches(3, 4, 32, seed=5)
    model = tiny_gpt2()
    out = train_plain.train(model, POLICY, batches, steps=6)
    scaler, losses = out["scaler"], out["losses"]
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
    # the policy's loss scaling, used at every step without an overflow
    assert scaler.is_enabled() and scaler.get_scale() == 512.0
    assert scaler.state_dict()["_growth_tracker"] == 6
    check_formats(model, gpt2_batch, POLICY, FQNS)
    # no fp16 layer: the kit's scaler is a pass-through
    _, scaler, guard = training_kit(tiny_gpt2(), Policy(default="bf16"))
    assert not scaler.is_enabled() and guard is None


# ----------------------------------------------------------------------------- Accelerate
def test_accelerate_prepare_after_apply_trains_in_the_policys_formats(fresh_accelerate_state,
                                                                      gpt2_batch):
    batches = byte_batches(3, 4, 32, seed=5)
    out = train_accelerate.train(tiny_gpt2(), POLICY, batches, steps=6, cpu=True, guard=True)
    model, scaler, losses = out["model"], out["scaler"], out["losses"]
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
    assert out["accelerator"].scaler is None  # mixed_precision="no": the policy scales
    assert scaler.is_enabled() and scaler.state_dict()["_growth_tracker"] == 6
    assert get_guard(model) is out["guard"] and out["guard"].events == []
    assert out["guard"].scaler is scaler
    check_formats(model, gpt2_batch, POLICY, FQNS)


def test_accelerate_bf16_autocast_does_not_override_the_policy(fresh_accelerate_state):
    """With the policy applied before prepare, Accelerate's bf16 autocast wraps the policy's
    regions and changes nothing: the losses are bit-identical to mixed_precision="no", and
    the policy's fp32 layers stay FP32. Only the outputs are cast to FP32."""
    policy = Policy(default="fp32", layers={"transformer.h.*.mlp.c_fc": "bf16"})
    batches = byte_batches(2, 4, 32, seed=6)
    runs = {}
    for mp in ("no", "bf16"):
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(True)
        runs[mp] = train_accelerate.train(tiny_gpt2(), policy, batches, steps=3, cpu=True,
                                          mixed_precision=mp)
    assert runs["no"]["losses"] == runs["bf16"]["losses"]
    model = runs["bf16"]["model"]
    assert "_original_forward" in model.__dict__  # Accelerate did wrap the forward
    check_formats(model, batches[0], policy, ["transformer.h.0.attn.c_attn", "lm_head",
                                              "transformer.h.0.mlp.c_fc"])
    # and the control: plain bf16 autocast on the same model does change the losses
    plain = tiny_gpt2().train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = plain(**batches[0]).loss.item()
    assert first != runs["no"]["losses"][0]


def test_guard_demotion_keeps_accelerates_autocast_wrapper(fresh_accelerate_state):
    """A demotion re-applies the policy; Accelerate's wrapper around the root region (here its
    FP32 output cast) must survive it."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = tiny_gpt2(n_layer=3).train()
    policy = Policy(default="bf16", layers={train_plain.PLANT_LAYER: "fp16"})
    model, scaler, guard = training_kit(model, policy, accelerator=acc, guard=True)
    model = acc.prepare(model)
    wrapper = model.__dict__["forward"]
    batch = byte_batches(1, 4, 32, seed=1)[0]
    train_plain.plant_overflow(model)
    for _ in range(3):
        out = model(**batch)
        scaler.scale(out.loss).backward()
        model.zero_grad(set_to_none=True)
        guard.step()
    assert [e.fqn for e in guard.events] == [train_plain.PLANT_LAYER]
    assert model.__dict__["forward"] is wrapper
    assert out.logits.dtype == torch.float32 and math.isfinite(out.loss.item())


def test_accelerate_settings_that_would_fight_the_policy_are_refused(fresh_accelerate_state):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = acc.prepare(tiny_gpt2())
    with pytest.raises(PolicyError, match="before accelerator.prepare"):
        training_kit(model, POLICY, accelerator=acc)

    class FakeFP8:  # Accelerate's fp8 needs Transformer Engine or torchao: just the setting
        mixed_precision = "fp8"
        device = torch.device("cpu")
        scaler = None

    with pytest.raises(PolicyError, match="mixed_precision='no'"):
        training_kit(tiny_gpt2(), POLICY, accelerator=FakeFP8())


def test_accelerate_fp16_on_cpu_has_no_scaler_so_the_policys_is_used(fresh_accelerate_state):
    """Accelerate's own fp16 mode does nothing on a CPU: no autocast, no GradScaler. The kit
    then hands back the policy's scaler (on a GPU it would defer to Accelerate's)."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, mixed_precision="fp16")
    assert acc.scaler is None and not acc.native_amp
    _, scaler, _ = training_kit(tiny_gpt2(), POLICY, accelerator=acc)
    assert scaler.is_enabled() and scaler.get_scale() == 512.0

    class FakeGPUFP16:  # what training_kit sees on a GPU with mixed_precision="fp16"
        mixed_precision = "fp16"
        device = torch.device("cpu")
        scaler = torch.amp.GradScaler("cpu")

    fake = FakeGPUFP16()
    _, scaler, guard = training_kit(tiny_gpt2(), POLICY, accelerator=fake, guard=True)
    assert not scaler.is_enabled()  # no second scaling of the loss
    assert guard.scaler is fake.scaler


# ----------------------------------------------------------------------------- HF Trainer
def test_trainer_with_policy_callback_trains_and_saves_a_plain_checkpoint(
        fresh_accelerate_state, tmp_path, gpt2_batch):
    from transformers import GPT2LMHeadModel

    dataset = train_hf_trainer.as_dataset(byte_batches(3, 4, 32, seed=7))
    model = tiny_gpt2()
    with pytest.warns(UserWarning, match="fp16 but this Trainer scales no loss"):
        trainer, callback = train_hf_trainer.train(model, POLICY, dataset, steps=3,
                                                   output_dir=str(tmp_path / "run"),
                                                   guard=True, use_cpu=True)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(map(math.isfinite, losses)) and losses[-1] < losses[0]
    assert autoprec.applied_formats(model)["transformer.h.1.attn"] is Format.FP8
    assert callback.guard is get_guard(model) and callback.guard.ledger.step == 3
    check_formats(model, gpt2_batch, POLICY, FQNS)
    # a checkpoint of the policy-applied model is a plain HF checkpoint
    trainer.save_model(str(tmp_path / "ckpt"))
    plain = GPT2LMHeadModel.from_pretrained(str(tmp_path / "ckpt"))
    assert autoprec.applied_formats(plain) == {}
    for (n, a), (_, b) in zip(model.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), n


def test_trainer_bf16_flag_does_not_override_a_policy_applied_at_init(fresh_accelerate_state,
                                                                      tmp_path):
    from accelerate.state import AcceleratorState

    policy = Policy(default="fp32", layers={"transformer.h.*.mlp.c_fc": "bf16"})
    dataset = train_hf_trainer.as_dataset(byte_batches(2, 4, 32, seed=8))
    losses = {}
    for bf16 in (False, True):
        AcceleratorState._reset_state(True)
        trainer, _ = train_hf_trainer.train(tiny_gpt2(), policy, dataset, steps=2,
                                            output_dir=str(tmp_path), bf16=bf16, use_cpu=True)
        losses[bf16] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if bf16:
            assert "_original_forward" in trainer.model.__dict__  # Accelerate wrapped it
    assert losses[True] == losses[False]


def test_policy_callback_added_after_prepare_under_bf16_is_refused(fresh_accelerate_state,
                                                                  tmp_path):
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from autoprec.integrations import PolicyCallback, use_policy

    dataset = train_hf_trainer.as_dataset(byte_batches(1, 4, 32, seed=8))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True, bf16=True,
                             report_to=[], save_strategy="no", per_device_train_batch_size=4,
                             disable_tqdm=True)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset)
    trainer.add_callback(PolicyCallback(POLICY))
    with pytest.raises(PolicyError, match="after the Trainer's Accelerator prepared"):
        trainer.train()
    # use_policy applies right away, before train() prepares the model: accepted
    AcceleratorState._reset_state(True)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset)
    callback = use_policy(trainer, Policy(default="bf16"), guard=True)
    assert autoprec.applied_formats(trainer.model) == {"": Format.BF16}
    trainer.train()
    assert callback.guard.ledger.step == 1 and callback.guard.events == []


# ----------------------------------------------------------------------------- state dicts
def test_state_dict_moves_between_policy_applied_and_plain_models(tmp_path, gpt2_batch):
    batches = byte_batches(2, 4, 32, seed=9)
    model = tiny_gpt2()
    train_plain.train(model, POLICY, batches, steps=2, guard=True)
    assert get_guard(model) is not None
    path = tmp_path / "sd.pt"
    torch.save(model.state_dict(), path)
    saved = torch.load(path)

    plain = tiny_gpt2(n_layer=2)
    assert list(plain.state_dict()) == list(saved)  # same names, nothing added by the policy
    plain.load_state_dict(saved)
    for k, v in plain.state_dict().items():
        assert v.dtype == saved[k].dtype and torch.equal(v, saved[k]), k
    with torch.no_grad():  # the plain model computes what the trained weights say
        assert torch.isfinite(plain(**gpt2_batch).loss)

    # and back: a plain model's weights into a policy-applied model, policy and guard intact
    other = tiny_gpt2()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01)
    model.load_state_dict(other.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(v, other.state_dict()[k]), k
    assert autoprec.applied_formats(model)["transformer.h.0.mlp.c_fc"] is Format.FP16
    assert get_guard(model) is not None
    check_formats(model, gpt2_batch, POLICY, FQNS)


# ----------------------------------------------------------------------------- interop
def test_module_filter_fn_selects_exactly_the_policys_fp8_linears(minilm_model, minilm_batch):
    policy = Policy(default="bf16", layers={
        "bert.encoder.layer.*.intermediate.dense": "fp8",
        "bert.encoder.layer.1": "fp8",                        # every Linear inside it ...
        "bert.encoder.layer.1.attention.self.key": "bf16",    # ... but this one
        "bert.encoder.layer.2.attention.output": "fp32",
        "classifier": "fp8",
    })
    keep = policy.module_filter_fn()
    # torchao's convert_to_float8_training walks named_modules() calling filter(module, fqn)
    selected = {fqn for fqn, m in minilm_model.named_modules() if keep(m, fqn)}
    expected = ({f"bert.encoder.layer.{i}.intermediate.dense" for i in range(6)}
                | {f"bert.encoder.layer.1.{n}" for n in (
                    "attention.self.query", "attention.self.value", "attention.output.dense",
                    "output.dense")})
    assert selected == expected
    # and these are the Linears the policy resolves to fp8, by the policy's own rules, less
    # the classifier: its N=4 output is a shape the FP8 kernel cannot take (bf16 instead)
    linears = {fqn for fqn, m in minilm_model.named_modules() if isinstance(m, nn.Linear)}
    assert selected == {f for f in linears if policy.format_for(f) is Format.FP8} - {"classifier"}
    assert not any(keep(m, f) for f, m in minilm_model.named_modules()
                   if not isinstance(m, nn.Linear))  # fp8 parents are not Linears
    # applied (on either engine), exactly the selected layers cast to FP8
    for engine in ("autoprec", "torchao"):
        model = autoprec.apply(minilm_model, dataclasses.replace(policy, engine=engine))
        with ComputeProbe(model) as probe:
            model(**minilm_batch)
        cast = {f for f in probe.fp8_casts if f in linears}
        assert cast == selected, engine
        swapped = {f for f, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
        assert swapped == (selected if engine == "torchao" else set())
        autoprec.remove(model)


# ----------------------------------------------------------------------------- resume
# A layer's fp16 outputs overflow from step 4 on (planted before it), the guard demotes it at
# step 5, a checkpoint is made at step 8, and a FRESH process resumes from it to step 12: it
# must run the same formats and get the same losses as the uninterrupted run.
RESUME_POLICY = Policy(default="bf16", layers={train_plain.PLANT_LAYER: "fp16", "lm_head": "fp32"},
                       loss_scaling={"init_scale": 1024.0, "growth_interval": 1000})
PLANT_AFTER, CKPT_STEP, LAST_STEP = 3, 8, 12


def _outcome(model, guard, losses: dict) -> dict:
    return {"losses": {str(k): v for k, v in losses.items()},
            "formats": {k: str(v) for k, v in autoprec.applied_formats(model).items()},
            "events": [str(e) for e in guard.events],
            "amended": guard.amended_policy().to_yaml()}


def _plain_run(ckpt: str, resume: bool = False) -> dict:
    """The plain loop: a hand-written checkpoint holding guard.state_dict()."""
    from autoprec.runtime.guard import GuardConfig

    model, scaler, guard = training_kit(tiny_gpt2(n_layer=3).train(), RESUME_POLICY,
                                        guard=GuardConfig(patience=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = byte_batches(4, 4, 32, seed=1)
    start, losses = 0, {}
    if resume:
        ck = torch.load(ckpt, weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        guard.load_state_dict(ck["guard"])
        torch.set_rng_state(ck["rng"])
        start = ck["step"]
    for step in range(start + 1, LAST_STEP + 1):
        if step == PLANT_AFTER + 1:
            train_plain.plant_overflow(model)
        loss = model(**batches[step % len(batches)]).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        guard.step()
        losses[step] = loss.item()
        if step == CKPT_STEP and not resume:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "scaler": scaler.state_dict(), "guard": guard.state_dict(),
                        "rng": torch.get_rng_state(), "step": step}, ckpt)
    return _outcome(model, guard, losses)


def _trainer_run(out_dir: str, resume: bool = False) -> dict:
    """The HF Trainer with PolicyCallback; checkpoint-8 by save_steps, resumed with
    train(resume_from_checkpoint=...)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from autoprec.integrations import PolicyCallback
    from autoprec.runtime.guard import GuardConfig

    model = tiny_gpt2(n_layer=3)
    losses, last = {}, []
    model.register_forward_hook(
        lambda m, a, out: last.append(out.loss.item()) if torch.is_grad_enabled() else None)

    class PlantAndSkip(TrainerCallback):
        """Plants the overflow, records each step's exact loss, and skips an update whose
        gradients are non-finite (what a GradScaler does; the Trainer has none on a CPU)."""

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == PLANT_AFTER:
                train_plain.plant_overflow(model)

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if not all(torch.isfinite(p.grad).all() for p in model.parameters()
                       if p.grad is not None):
                model.zero_grad(set_to_none=True)

        def on_step_end(self, args, state, control, **kwargs):
            losses[state.global_step] = last[-1]

    args = TrainingArguments(output_dir=out_dir, max_steps=LAST_STEP, save_strategy="steps",
                             save_steps=CKPT_STEP, per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=1, report_to=[],
                             disable_tqdm=True, use_cpu=True)
    callback = PolicyCallback(RESUME_POLICY, guard=GuardConfig(patience=2))
    trainer = Trainer(model=model, args=args, callbacks=[callback, PlantAndSkip()],
                      train_dataset=train_hf_trainer.as_dataset(byte_batches(12, 4, 32, seed=1)))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*scales no loss.*")
        trainer.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{CKPT_STEP}")
                      if resume else None)
    return _outcome(model, callback.guard, losses)


def _resume_in_fresh_process(run: str, path: str) -> dict:
    """``run`` (a function of this module) with resume=True in a new Python process, at this
    process's thread count (the same kernels, so the same rounding)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    code = (f"import json, warnings, torch; torch.set_num_threads({torch.get_num_threads()}); "
            "warnings.simplefilter('ignore'); import test_integrations as t; "
            f"print('RESULT', json.dumps(t.{run}({path!r}, resume=True)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tests, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _check_resumed(full: dict, resumed: dict) -> None:
    fmt = train_plain.PLANT_LAYER
    assert [e.split(":")[0] for e in full["events"]] == ["step 5"], full["events"]
    assert full["formats"][fmt] == "fp32"
    later = [str(s) for s in range(CKPT_STEP + 1, LAST_STEP + 1)]
    assert all(math.isfinite(full["losses"][s]) for s in later), full["losses"]
    # equal up to float32 rounding: a fresh process may reduce in another order under load
    # (seen once in CI: 4.6457853 against 4.6457868)
    assert resumed["losses"] == pytest.approx({s: full["losses"][s] for s in later}, rel=1e-5)
    assert resumed["formats"] == full["formats"]
    assert resumed["events"] == full["events"] and resumed["amended"] == full["amended"]


@pytest.mark.slow
def test_plain_loop_resumed_in_a_fresh_process_keeps_the_guards_demotions(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")
    full = _plain_run(ckpt)
    _check_resumed(full, _resume_in_fresh_process("_plain_run", ckpt))
    # the control: the same checkpoint resumed without the guard's state runs the planted
    # layer in fp16 again, and its loss is not finite
    model = tiny_gpt2(n_layer=3).train()
    model.load_state_dict(torch.load(ckpt, weights_only=True)["model"])
    autoprec.apply(model, RESUME_POLICY)
    assert not math.isfinite(model(**byte_batches(4, 4, 32, seed=1)[1]).loss.item())


@pytest.mark.slow
def test_trainer_resumed_in_a_fresh_process_keeps_the_guards_demotions(fresh_accelerate_state,
                                                                       tmp_path):
    out = str(tmp_path / "run")
    full = _trainer_run(out)
    saved = json.loads((tmp_path / "run" / f"checkpoint-{CKPT_STEP}" /
                        "autoprec_guard.json").read_text())
    assert saved["step"] == CKPT_STEP and saved["layers"] == {train_plain.PLANT_LAYER: "fp32"}
    _check_resumed(full, _resume_in_fresh_process("_trainer_run", out))


def test_accelerate_save_state_carries_the_guard_and_the_policys_scaler(fresh_accelerate_state,
                                                                         tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    def kit():
        AcceleratorState._reset_state(True)
        acc = Accelerator(cpu=True, mixed_precision="no")
        model, scaler, guard = training_kit(tiny_gpt2(n_layer=3).train(), RESUME_POLICY,
                                            accelerator=acc, guard=True)
        return acc, acc.prepare(model), scaler, guard

    acc, model, scaler, guard = kit()
    assert acc._custom_objects == [guard, scaler]
    train_plain.plant_overflow(model)
    batch = byte_batches(1, 4, 32, seed=1)[0]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(2):
        scaler.scale(model(**batch).loss).backward()
        scaler.step(opt)
        scaler.update()  # an overflow: the step is skipped, the scale backs off
        model.zero_grad(set_to_none=True)
        guard.step()
    assert [e.fqn for e in guard.events] == [train_plain.PLANT_LAYER]
    acc.save_state(str(tmp_path / "state"))

    acc, model2, scaler2, guard2 = kit()
    assert guard2.policy.format_for(train_plain.PLANT_LAYER) is Format.FP16
    acc.load_state(str(tmp_path / "state"))
    assert guard2.events == guard.events and guard2.policy == guard.policy
    assert autoprec.applied_formats(model2) == autoprec.applied_formats(model)
    assert scaler2.get_scale() == scaler.get_scale() < 1024.0


def _accelerate_kit(*, guard: bool | None = True, register: bool = True):
    """A fresh Accelerator and a GPT-2 prepared with it under RESUME_POLICY (fp16 layers: the
    policy's GradScaler); ``register=False`` is what training_kit registered before it carried
    the guard and scaler in Accelerate checkpoints: nothing."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True, mixed_precision="no")
    model, scaler, g = training_kit(tiny_gpt2().train(), RESUME_POLICY, guard=guard,
                                    accelerator=acc if register else None)
    return acc, acc.prepare(model), scaler, g


def _nudged(model) -> dict:
    """Move every weight (so that a load is visible) and return the new values."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_accelerate_loads_a_checkpoint_saved_before_the_guard_was_registered(
        fresh_accelerate_state, tmp_path):
    """Accelerate refuses a folder whose count of custom states differs from the registered
    objects; one saved before training_kit registered the guard and scaler has none, and loads
    with them fresh (as resumed runs had them then), said in a warning."""
    old_acc, old_model, _, _ = _accelerate_kit(register=False)
    assert old_acc._custom_objects == []
    weights = _nudged(old_model)
    old_acc.save_state(str(tmp_path / "old"))

    acc, model, scaler, guard = _accelerate_kit()
    with pytest.warns(UserWarning, match="holds no autoprec state") as caught:
        acc.load_state(str(tmp_path / "old"))
    message = [str(w.message) for w in caught if "autoprec state" in str(w.message)][0]
    assert "guard and GradScaler" in message and "\n" not in message
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    assert guard.events == [] and scaler.get_scale() == 1024.0  # fresh
    # the next save carries them again, and loads without a word
    acc.save_state(str(tmp_path / "new"))
    assert acc._custom_objects == [guard, scaler]
    assert {"custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl"} <= set(
        os.listdir(tmp_path / "new"))
    acc2, _, _, _ = _accelerate_kit()
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        acc2.load_state(str(tmp_path / "new"))
    assert not [w for w in again if "autoprec state" in str(w.message)]


def test_accelerate_checkpoint_with_other_autoprec_state_is_refused_before_loading(
        fresh_accelerate_state, tmp_path):
    """A checkpoint saved with the guard, resumed without one: one line that says what
    differs, raised before Accelerate has loaded anything (its own error comes after the
    model and optimizer were overwritten)."""
    acc, model, _, _ = _accelerate_kit()
    _nudged(model)
    acc.save_state(str(tmp_path / "guarded"))

    acc2, model2, _, guard2 = _accelerate_kit(guard=None)
    assert guard2 is None
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(PolicyError, match="holds 2 custom states .* registers 1") as e:
        acc2.load_state(str(tmp_path / "guarded"))
    assert "\n" not in str(e.value) and "GradScaler" in str(e.value)
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in before.items())
