"""The run follows the criterion (autoprec.runtime.bias.BiasWatch): measured during training
on a real HF Llama byte LM with a cosine (decaying) LR, the gradient bias brings a phased
policy's final BF16 phase forward. A switch the watch makes computes bit for bit what the same
phase planned at that step computes (the measurement leaves no trace in training); on a real
run it switches when, and only when, a reading reaches the rule; the moved phase survives a
checkpoint; misuse is one line."""

from __future__ import annotations

import os

import pytest
import torch
from tasks import tiny_llama_task

import autoprec
from autoprec import Policy, PolicyError
from autoprec.certification import start_run, train_step, training_stream
from autoprec.formats import Format
from autoprec.integrations import PHASES_STATE_FILE
from autoprec.policy import SCHEMA_VERSION
from autoprec.runtime.bias import DEFAULT_BIAS_BUDGET, RULE_RATIO, BiasWatch, FollowBias
from autoprec.runtime.rewrite import applied_policy
from autoprec.runtime.switcher import PhaseSwitcher

LINEARS = ("model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj", "lm_head")


def rtn_with_tail(start: dict) -> Policy:
    """Round-to-nearest NVFP4 on every Linear, then a BF16 phase (the key scaled maps every
    scaled format) from ``start``."""
    return Policy.from_dict({"autoprec": SCHEMA_VERSION, "default": "bf16", "layers": dict.fromkeys(LINEARS, "nvfp4:plain"),
                             "phases": [{**start, "name": "tail", "formats": {"scaled": "bf16"}}]})


@pytest.fixture(scope="module")
def task(one_thread):
    return tiny_llama_task()


def train(task, policy: Policy, steps: int, watch_kwargs: dict | None = None):
    run = start_run(task, policy, steps, strict=True)
    watch = None
    if watch_kwargs is not None:
        held = training_stream(task, 4, task.seed + 7777)
        watch = BiasWatch(run.model, held, task.loss, **watch_kwargs)
    for step, batch in enumerate(training_stream(task, steps, task.seed + 1000)):
        train_step(task, run, batch, step)  # calls run.phases.at(step) first
        if watch is not None:
            watch.after_step(step + 1)
    return run, watch


def test_a_switch_the_watch_makes_computes_as_the_phase_planned_at_that_step(task):
    # threshold ~0: the first reading (step 10) brings the tail forward from step 38 to 10
    run, watch = train(task, rtn_with_tail({"from_fraction": 0.95}), 24,
                       {"every": 10, "threshold": 1e-12})
    planned, _ = train(task, rtn_with_tail({"from_step": 10}), 24)
    assert watch.switched_at == 10 and len(watch.readings) == 1, watch.readings
    assert run.phases.current == 1 and run.phases.starts == [0, 10]
    for (name, a), b in zip(run.model.state_dict().items(), planned.model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs from the run whose tail was planned at 10"


@pytest.mark.slow
def test_on_a_decaying_run_the_switch_follows_the_readings(task):
    # This 64-wide model's round-to-nearest run reads 0.18 at step 15, 0.20-0.21 to step 60
    # and 0.28-0.32 from step 75 (measured): a budget of 0.25, clear of the early readings,
    # is reached three quarters through the cosine decay (the default 0.21 is too near them
    # to make a test that every CPU's rounding passes alike)
    steps, threshold = 120, 0.25
    run, watch = train(task, rtn_with_tail({"from_fraction": 0.95}), steps,
                       {"every": 15, "threshold": threshold})
    readings = watch.readings
    assert readings and all(r.threshold == threshold for r in readings)
    assert all(r.bias < RULE_RATIO for r in readings)  # the theory's figure: never reached
    assert watch.switched_at is not None, [r.describe() for r in readings]
    *before, at = readings
    assert all(r.admits for r in before) and not at.admits, [r.describe() for r in readings]
    assert at.step == watch.switched_at < round(0.95 * steps) == 114
    assert run.phases.current == 1 and run.phases.starts == [0, at.step]
    # the bias grew as the LR decayed and the gradient shrank
    assert at.bias > 1.4 * readings[0].bias, [r.describe() for r in readings]
    assert applied_policy(run.model).format_for("lm_head") is Format.BF16


def test_the_measured_budget_is_the_default_and_the_final_phase_ends_the_watch(task):
    run, watch = train(task, rtn_with_tail({"from_step": 8}), 16, {"every": 4})
    assert [r.step for r in watch.readings] == [4, 8]  # none once the tail is in force
    # early in the run round-to-nearest NVFP4 reads ~0.18, inside the budget
    assert all(r.threshold == DEFAULT_BIAS_BUDGET and r.admits for r in watch.readings)
    assert watch.switched_at is None and run.phases.starts == [0, 8]


def test_a_moved_phase_survives_a_checkpoint_and_a_bad_state_is_one_line(task):
    run, watch = train(task, rtn_with_tail({"from_fraction": 0.95}), 12,
                       {"every": 6, "threshold": 1e-12})
    assert watch.switched_at == 6
    state, watch_state = run.phases.state_dict(), watch.state_dict()
    fresh = start_run(task, rtn_with_tail({"from_fraction": 0.95}), 12, strict=True)
    resumed = fresh.phases
    resumed.load_state_dict(state)
    assert resumed.at(12) == 1 and resumed.starts == [0, 6]
    again = BiasWatch(fresh.model, training_stream(task, 2, 1), task.loss, every=6)
    again.load_state_dict(watch_state)
    assert again.switched_at == 6 and again.after_step(12) is None  # no second switch
    for bad in ({"version": 1, "switched_at": "soon"},
                {"version": 1, "switched_at": None, "readings": [[6, "high"]]}):
        with pytest.raises(PolicyError) as e:
            again.load_state_dict(bad)
        assert "\n" not in str(e.value)


def test_misuse_is_one_line(task):
    model = task.build_model()
    held = training_stream(task, 2, 1)
    with pytest.raises(PolicyError, match="no policy applied"):
        BiasWatch(model, held, task.loss)
    autoprec.apply(model, Policy(default="bf16"), guard=True)
    with pytest.raises(PolicyError, match="runtime guard"):
        BiasWatch(model, held, task.loss)
    autoprec.remove(model)
    autoprec.apply(model, Policy(default="bf16"))
    for kwargs in ({"every": 0}, {"threshold": 0.0}):
        with pytest.raises(ValueError) as e:
            BiasWatch(model, held, task.loss, **kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(PolicyError, match="no later phase"):
        PhaseSwitcher(model, Policy(default="bf16")).bring_final_forward(3)


# ------------------------------------------------------------------ the HF Trainer
def _hf_run(task, out_dir: str, *, steps: int, resume_at: int | None = None,
            save_steps: int = 0, **callback_kwargs):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from autoprec.integrations import PolicyCallback
    from examples.train_hf_trainer import as_dataset

    torch.manual_seed(0)
    model = task.build_model()
    seen: dict[int, str] = {}

    class Record(TrainerCallback):  # after the policy's callback: the format each step runs
        def on_step_begin(self, args, state, control, **kwargs):
            seen[state.global_step] = applied_policy(model).format_for("lm_head").label

    callback = PolicyCallback(rtn_with_tail({"from_fraction": 0.95}), **callback_kwargs)
    args = TrainingArguments(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=8,
                             learning_rate=1e-3, report_to=[], disable_tqdm=True, use_cpu=True,
                             save_strategy="steps" if save_steps else "no",
                             save_steps=save_steps or 500)
    trainer = Trainer(model=model, args=args, callbacks=[callback, Record()],
                      train_dataset=as_dataset(training_stream(task, steps, 3)))
    trainer.train(resume_from_checkpoint=f"{out_dir}/checkpoint-{resume_at}"
                  if resume_at else None)
    return seen, callback


@pytest.mark.slow
def test_the_hf_trainer_follows_the_bias_and_a_resume_keeps_the_moved_phase(task, tmp_path):
    out = str(tmp_path / "run")
    # readings from step 6 on (the first 4 batches are the held set); ~0: the first one moves
    # the tail (planned at 19 of 20) to step 6
    seen, callback = _hf_run(task, out, steps=20, save_steps=10,
                             follow_bias=FollowBias(every=6, threshold=1e-12))
    assert [r.step for r in callback.bias_watch.readings] == [6]
    assert seen == {s: "nvfp4:plain" if s < 6 else "bf16" for s in range(20)}, seen
    assert os.path.isfile(os.path.join(out, "checkpoint-10", PHASES_STATE_FILE))
    # resumed at 10 without the watch: the tail is still in force, not back to nvfp4 until 19
    resumed, _ = _hf_run(task, out, steps=20, resume_at=10)
    assert resumed == {s: "bf16" for s in range(10, 20)}, resumed
    with pytest.raises(PolicyError, match="phases"):
        from autoprec.integrations import PolicyCallback

        PolicyCallback(Policy(default="bf16"), follow_bias=5)


@pytest.mark.slow
def test_lightning_follows_the_bias_and_a_resume_keeps_the_moved_phase(task, tmp_path):
    L = pytest.importorskip("lightning")
    from examples import train_lightning

    batches = training_stream(task, 20, 3)

    def run(steps, **kw):
        torch.manual_seed(0)
        model = task.build_model()
        seen: dict[int, str] = {}

        class Record(L.Callback):  # after autoprec's callback: the format each step runs
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                seen[trainer.global_step] = applied_policy(model).format_for("lm_head").label
        trainer, _, cb = train_lightning.train(
            model, rtn_with_tail({"from_fraction": 0.95}), batches, steps=steps,
            root_dir=str(tmp_path), callbacks=[Record()], **kw)
        return seen, trainer, cb

    seen, trainer, cb = run(12, follow_bias=FollowBias(every=6, threshold=1e-12))
    assert [r.step for r in cb.bias_watch.readings] == [6] and cb.phases.starts == [0, 6]
    assert seen == {s: "nvfp4:plain" if s < 6 else "bf16" for s in range(12)}, seen
    ckpt = str(tmp_path / "at12.ckpt")
    trainer.save_checkpoint(ckpt)
    # resumed at 12 of a 20-step run without the watch: the tail stays, not back to nvfp4
    seen, _, cb = run(20, ckpt_path=ckpt)
    assert cb.phases.starts == [0, 6]
    assert seen == {s: "bf16" for s in range(12, 20)}, seen
