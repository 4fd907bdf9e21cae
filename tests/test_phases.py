"""Phases in a policy: the file, and switching at the step in a plain loop, across a resume,
under torch.compile (one recompile) and on torchao's engine, bit for bit what applying the next
phase's policy at that step computes."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch

import autoprec
from autoprec import Format, Policy, PolicyError, load_policy
from autoprec.integrations import training_kit
from autoprec.runtime.switcher import PhaseSwitcher, get_phases
from examples.data import byte_batches

SWITCH = 3
STEPS = 6
GPT2_POLICY = dict(default="fp32", layers={"transformer.h.*.mlp.*": "fp8",
                                           "transformer.h.*.attn.c_attn": "fp8:rowwise",
                                           "lm_head": "fp32"},
                   phases=[{"from_step": SWITCH, "formats": {"fp8": "bf16"}, "name": "decay"}])
LLAMA_POLICY = dict(default="fp32", layers={"model.layers.*.mlp.*": "fp8", "lm_head": "fp32"},
                    phases=[{"from_step": SWITCH, "formats": {"fp8": "bf16"}}])


def _model(which: str):
    from conftest import tiny_gpt2, tiny_llama

    warnings.filterwarnings("ignore", message=".*can only emulate.*")
    return (tiny_gpt2() if which == "gpt2" else tiny_llama()).train()


def _policy(which: str, engine: str = "autoprec") -> Policy:
    return Policy(**(GPT2_POLICY if which == "gpt2" else LLAMA_POLICY), engine=engine)


def _train(model, policy: Policy, *, by_apply: bool, steps: int = STEPS, start: int = 0,
           opt=None, compiled=None):
    """Train ``steps`` steps: switching phases with the switcher, or (``by_apply``) by
    applying each phase's policy at its step."""
    batches = byte_batches(4, 4, 32, seed=3)
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)
    if by_apply:
        autoprec.apply(model, policy.phase(0))
    elif get_phases(model) is None:
        training_kit(model, policy, total_steps=steps)
    run = model if compiled is None else compiled
    for step in range(start, steps):
        if by_apply and step == SWITCH:
            autoprec.apply(model, policy.phase(1))
        elif not by_apply:
            get_phases(model).at(step)
        loss = run(**batches[step % len(batches)]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("which,engine", [("gpt2", "autoprec"), ("llama", "torchao")])
def test_switching_at_the_step_computes_what_applying_the_next_phase_computes(which, engine):
    policy = _policy(which, engine)
    switched, applied = _model(which), _model(which)
    _train(switched, policy, by_apply=False)
    _train(applied, policy, by_apply=True)
    assert _same(switched, applied)
    formats = autoprec.applied_formats(switched)
    assert formats == autoprec.applied_formats(applied)
    mlp = [f for f in formats if ".mlp." in f and formats[f] is not Format.FP32]
    assert mlp and all(formats[f] is Format.BF16 for f in mlp), formats
    # and the phase changed something: the first phase trains other numbers
    unswitched = _model(which)
    autoprec.apply(unswitched, policy.phase(0))
    _train(unswitched, policy.phase(0), by_apply=True, steps=SWITCH)
    assert not _same(switched, unswitched)


def test_a_resume_in_the_middle_of_a_phase_trains_as_the_uninterrupted_run(tmp_path):
    policy = _policy("gpt2")
    whole = _model("gpt2")
    _train(whole, policy, by_apply=False)
    # stop after SWITCH + 1 steps (inside phase 1), save, resume in a fresh process's objects
    first = _model("gpt2")
    opt = _train(first, policy, by_apply=False, steps=SWITCH + 1)
    # the step count that stops is the resumed run's total: the boundary must not move
    ckpt = {"model": first.state_dict(), "opt": opt.state_dict(),
            "phases": get_phases(first).state_dict()}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed = _model("gpt2")
    kit = training_kit(resumed, policy, total_steps=SWITCH + 1)
    resumed.load_state_dict(ckpt["model"])
    kit.phases.load_state_dict(ckpt["phases"])
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    opt.load_state_dict(ckpt["opt"])
    assert get_phases(resumed).current == 0  # until the loop says which step it is at
    _train(resumed, policy, by_apply=False, start=SWITCH + 1, opt=opt)
    assert get_phases(resumed).current == 1
    assert _same(resumed, whole)


def test_a_resume_with_another_run_length_is_refused_in_one_line():
    policy = Policy(default="fp32", layers={"transformer.h.*.mlp.*": "fp8"},
                    phases=[{"from_fraction": 0.5, "formats": {"fp8": "bf16"}}])
    a, b = _model("gpt2"), _model("gpt2")
    state = training_kit(a, policy, total_steps=100).phases.state_dict()
    with pytest.raises(PolicyError, match=r"steps \[0, 50\].*\[0, 100\].*total_steps") as e:
        training_kit(b, policy, total_steps=200).phases.load_state_dict(state)
    assert "\n" not in str(e.value)


def test_a_switch_under_torch_compile_is_one_recompile():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    model = _model("gpt2")
    policy = _policy("gpt2")
    training_kit(model, policy, total_steps=STEPS)
    compiled = torch.compile(model, backend=counter)
    _train(model, policy, by_apply=False, steps=SWITCH, compiled=compiled)
    before = counter.frame_count
    _train(model, policy, by_apply=False, start=SWITCH, compiled=compiled)
    assert before >= 1
    assert counter.frame_count - before <= 1, (before, counter.frame_count)
    # the compiled run switched for real
    assert autoprec.applied_formats(model)["transformer.h.0.mlp.c_fc"] is Format.BF16


def test_phases_by_fraction_need_the_run_length():
    policy = Policy(default="fp32", layers={"transformer.h.*.mlp.*": "fp8"},
                    phases=[{"from_fraction": 0.9, "formats": {"fp8": "bf16"}}])
    with pytest.raises(PolicyError, match="needs the run's length: pass total_steps"):
        training_kit(_model("gpt2"), policy)
    kit = training_kit(_model("gpt2"), policy, total_steps=1000)
    assert kit.phases.starts == [0, 900]
    assert kit.phases.index_at(899) == 0 and kit.phases.index_at(900) == 1


def test_a_phase_naming_no_module_is_refused_at_start_up():
    policy = Policy(default="fp32", layers={"transformer.h.*.mlp.*": "fp8"},
                    phases=[{"from_step": 5, "layers": {"transformer.h.9.mlp": "fp32"}}])
    with pytest.raises(PolicyError, match=r"Phase 1 \(from step 5\).*`transformer.h.9.mlp`"):
        training_kit(_model("gpt2"), policy)


# ------------------------------------------------------------------ the file
def test_phases_round_trip_and_mean_the_first_phase_mapped(tmp_path):
    policy = Policy(default="bf16", layers={"a.*": "fp8", "b": "fp8:rowwise", "c": "fp16",
                                            "lm_head": "fp32"},
                    phases=[{"from_fraction": 0.9, "formats": {"fp8": "bf16"}, "name": "decay"},
                            {"from_fraction": 0.95, "formats": {"fp8:rowwise": "fp32"},
                             "layers": {"c": "fp32"}, "default": "fp32"}])
    path = tmp_path / "p.yaml"
    policy.save(path)
    text = path.read_text()
    assert text.startswith("# autoprec precision policy (schema 4)") and "from_fraction: 0.9" in text
    back = load_policy(path)
    assert back == policy
    one, two = back.phase(1), back.phase(2)
    assert (one.default, one.layers["a.*"], one.layers["b"], one.layers["c"]) == \
        (Format.BF16, Format.BF16, Format.BF16, Format.FP16)
    # a recipe's own key wins over `fp8`; the phase's layers and default over the map
    assert (two.default, two.layers["a.*"], two.layers["b"], two.layers["c"]) == \
        (Format.FP32, Format.FP8, Format.FP32, Format.FP32)
    assert not one.phases and back.phase(0).layers == policy.layers
    # every phase's formats count as used (the GradScaler, the FP8 warnings)
    assert Format.FP32 in back.formats_used()
    # a policy without phases still writes schema 2, which older autoprec reads
    plain = tmp_path / "plain.yaml"
    back.phase(0).save(plain)
    assert "autoprec: 2" in plain.read_text()


@pytest.mark.parametrize("phases,message", [
    ([{"from_step": 0, "formats": {"fp8": "bf16"}}], "from_step` must be an integer >= 1"),
    ([{"from_fraction": 1.5, "formats": {"fp8": "bf16"}}], "between 0 and 1"),
    ([{"from_step": 3, "from_fraction": 0.5, "formats": {"fp8": "bf16"}}], "exactly one of"),
    ([{"formats": {"fp8": "bf16"}}], "exactly one of"),
    ([{"from_step": 3}], "changes nothing"),
    ([{"from_step": 3, "formats": {"fp9": "bf16"}}], "Unknown format 'fp9'"),
    ([{"from_step": 3, "formats": {"fp8": "bf16"}, "when": 3}], "unknown key.*'when'"),
    ([{"from_step": 9, "formats": {"fp8": "bf16"}}, {"from_step": 4, "default": "fp32"}],
     "phase 2.*starts at from_step 4, not after phase 1"),
    ([{"from_step": 3, "layers": ["a"]}], "`layers` in phase 1 .*must be a mapping"),
    ("decay", "must be a list of phases"),
    ([{"from_step": i + 1, "default": "fp32"} for i in range(65)], "at most 64"),
])
def test_bad_phases_are_one_line_errors_naming_the_file_and_phase(tmp_path, phases, message):
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"autoprec": 3, "default": "fp8", "layers": {"a": "fp32"},
                                    "phases": phases}))
    with pytest.raises(PolicyError, match=message) as e:
        load_policy(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_phases_in_a_schema_2_file_are_refused_with_the_fix(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("autoprec: 2\ndefault: fp8\nphases: [{from_step: 3, default: bf16}]\n")
    with pytest.raises(PolicyError, match="needs schema 4: write `autoprec: 4`"):
        load_policy(path)


def test_the_switch_keeps_the_model_and_optimizer_objects():
    model = _model("gpt2")
    params = [id(p) for p in model.parameters()]
    kit = training_kit(model, _policy("gpt2"), total_steps=STEPS)
    assert kit.phases.at(SWITCH) == 1 and kit.phases.at(SWITCH + 1) is None
    assert [id(p) for p in model.parameters()] == params
    assert kit.phases.at(0) == 0  # back to the first phase (a resume from an earlier step)
    assert autoprec.applied_formats(model)["transformer.h.0.mlp.c_fc"] is Format.FP8
    copy.deepcopy(model)  # the switcher on the model does not stop a deep copy
    assert isinstance(get_phases(model), PhaseSwitcher)


# ------------------------------------------------------------------ the trainers
MLP = "transformer.h.0.mlp.c_fc"


def _formats_by_step(get_step, get_model):
    """A recorder of the format MLP computes in at each step, read in the step's forward."""
    seen: dict[int, str] = {}

    def record(module, args):
        if torch.is_grad_enabled():
            seen.setdefault(get_step(), str(autoprec.applied_formats(get_model())[MLP]))
    return seen, record


def _hf_run(out_dir: str, *, steps: int, resume: bool = False, save_steps: int = 0) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from autoprec.integrations import PolicyCallback
    from examples.train_hf_trainer import as_dataset

    model = _model("gpt2")
    state = {}

    class Step(TrainerCallback):
        def on_step_begin(self, args, st, control, **kwargs):
            state["step"] = st.global_step

    seen, record = _formats_by_step(lambda: state["step"], lambda: model)
    model.get_submodule(MLP).register_forward_pre_hook(record)
    callback = PolicyCallback(_policy("gpt2"))
    args = TrainingArguments(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=1e-3, report_to=[], disable_tqdm=True, use_cpu=True,
                             save_strategy="steps" if save_steps else "no",
                             save_steps=save_steps or 500)
    trainer = Trainer(model=model, args=args, callbacks=[callback, Step()],
                      train_dataset=as_dataset(byte_batches(STEPS, 4, 32, seed=3)))
    trainer.train(resume_from_checkpoint=f"{out_dir}/checkpoint-{SWITCH + 1}" if resume else None)
    return {"seen": seen, "params": {k: v.clone() for k, v in model.state_dict().items()}}


def test_hf_trainer_switches_at_the_global_step_and_a_resume_starts_in_its_phase(tmp_path):
    whole = _hf_run(str(tmp_path / "a"), steps=STEPS)
    assert whole["seen"] == {s: ("fp8" if s < SWITCH else "bf16")
                             for s in range(STEPS)}, whole["seen"]
    _hf_run(str(tmp_path / "b"), steps=STEPS, save_steps=SWITCH + 1)
    resumed = _hf_run(str(tmp_path / "b"), steps=STEPS, resume=True)
    assert resumed["seen"] == {s: "bf16" for s in range(SWITCH + 1, STEPS)}, resumed["seen"]
    for k, v in whole["params"].items():
        torch.testing.assert_close(resumed["params"][k], v, rtol=1e-5, atol=1e-6)


def test_lightning_switches_at_the_global_step_and_a_resume_starts_in_its_phase(tmp_path):
    L = pytest.importorskip("lightning")
    from examples import train_lightning

    def run(steps, **kw):
        model = _model("gpt2")
        box = {}

        class Step(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                box["step"] = trainer.global_step
        seen, record = _formats_by_step(lambda: box["step"], lambda: model)
        model.get_submodule(MLP).register_forward_pre_hook(record)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer, lit, cb = train_lightning.train(
                model, _policy("gpt2"), byte_batches(STEPS, 4, 32, seed=3), steps=steps,
                root_dir=str(tmp_path), callbacks=[Step()], **kw)
        return seen, trainer, cb

    seen, trainer, cb = run(STEPS)
    assert seen == {s: ("fp8" if s < SWITCH else "bf16") for s in range(STEPS)}, seen
    assert cb.phases.starts == [0, SWITCH]
    seen, trainer, _ = run(SWITCH + 1)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    seen, _, cb = run(STEPS, ckpt_path=str(tmp_path / "mid.ckpt"))
    assert seen == {s: "bf16" for s in range(SWITCH + 1, STEPS)}, seen


def test_accelerate_loop_switches_with_the_kits_phases():
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="no", cpu=True)
    model = _model("gpt2")
    kit = training_kit(model, _policy("gpt2"), accelerator=accelerator, total_steps=STEPS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    seen = []
    for step, batch in enumerate(byte_batches(STEPS, 4, 32, seed=3)):
        kit.phases.at(step)
        seen.append(autoprec.applied_formats(model)[MLP])
        accelerator.backward(kit.scaler.scale(model(**batch).loss))
        opt.step()
        opt.zero_grad()
    assert seen == [Format.FP8] * SWITCH + [Format.BF16] * (STEPS - SWITCH)


# ------------------------------------------------------------------ the commands
def _cli(*args, cwd=None):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "autoprec.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=900)


TASKS = __import__("os").path.join(__import__("os").path.dirname(__file__), "tasks.py")


def _phased(tmp_path, name="p.yaml", **phase) -> str:
    path = tmp_path / name
    Policy(default="fp32", layers={"transformer.h.*.mlp.*": "fp8", "lm_head": "fp32"},
           phases=[{"from_fraction": 0.5, "formats": {"fp8": "bf16"}, "name": "decay",
                    **phase}]).save(path)
    return str(path)


def test_show_diff_and_export_speak_phases(tmp_path):
    import json

    a, b = _phased(tmp_path), _phased(tmp_path, "b.yaml", from_fraction=0.75)
    show = _cli("show", a)
    assert show.returncode == 0, show.stderr
    assert "phase 1, from 50% of the run (decay): fp8 -> bf16" in show.stdout, show.stdout
    d = _cli("diff", a, b)
    assert d.returncode == 1 and "phase 1: [from 50% of the run (decay): fp8 -> bf16] -> " \
        "[from 75% of the run (decay): fp8 -> bf16]" in d.stdout, d.stdout
    assert _cli("diff", a, a).returncode == 0
    model = f"{TASKS}:tiny_gpt2_task"
    refused = _cli("export", a, "--to", "megatron", "--model", model)
    assert refused.returncode == 2 and "export one phase with --phase N" in refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    one = _cli("export", a, "--to", "fqn", "--model", model, "--phase", "1")
    assert one.returncode == 0 and json.loads(one.stdout)["layers"]["transformer.h.0.mlp.c_fc"] \
        == "bf16"
    whole = json.loads(_cli("export", a, "--to", "fqn", "--model", model).stdout)
    assert whole["layers"]["transformer.h.0.mlp.c_fc"] == "fp8:tensorwise"
    assert whole["phases"][0]["from_fraction"] == 0.5
    assert whole["phases"][0]["layers"]["transformer.h.0.mlp.c_fc"] == "bf16"


def test_validate_trains_through_the_phases(tmp_path):
    # a 6-step run, branches of 3 steps: the one from step 3 trains in the second phase
    r = _cli("validate", _phased(tmp_path), "--task", f"{TASKS}:tiny_gpt2_task", "--steps", "6")
    assert "step 3: phase 1" in r.stderr and "in force" in r.stderr, r.stderr[-3000:]
    assert "gap" in r.stdout and r.returncode in (0, 1, 3), r.stdout + r.stderr[-2000:]


def test_tune_skips_a_final_phase_that_changes_nothing_and_refuses_a_bad_one(tmp_path):
    # (tests/test_cli.py's tune writes one: its winner runs bf16 on some layers)
    out = tmp_path / "t.yaml"
    r = _cli("tune", f"{TASKS}:tiny_gpt2_task", "-o", out, "--formats", "fp32", "bf16",
             "--target", "h100", "--n-trials", "2", "--final-phase", "0.9:fp32", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    policy = load_policy(out)
    # the tiny model priced for an H100 stays all-fp32: a last phase would change nothing
    if policy.formats_used() == {Format.FP32}:
        assert "no layer computes below fp32, so no final phase is written" in r.stderr
        assert not policy.phases
    else:
        assert {policy.phase(1).default, *policy.phase(1).layers.values()} == {Format.FP32}
    bad = _cli("tune", f"{TASKS}:tiny_gpt2_task", "-o", tmp_path / "x.yaml", "--final-phase",
               "1.5", cwd=tmp_path)
    assert bad.returncode == 2 and "0 < FRACTION < 1" in bad.stderr


def test_a_final_phase_maps_every_format_below_its_own():
    policy = Policy(default="bf16", layers={"a": "fp8", "b": "fp8:rowwise", "c": "fp16",
                                            "d": "fp32"})
    decay = policy.with_final_phase(0.9)
    assert decay.phases[0].formats == {"scaled": Format.BF16}
    last = decay.phase(1)
    assert [last.format_for(x) for x in "abcd"] == [Format.BF16, Format.BF16, Format.FP16,
                                                   Format.FP32]
    assert {f for f in policy.with_final_phase(0.8, "fp32").phase(1).layers.values()} == \
        {Format.FP32}
    assert Policy(default="fp32").with_final_phase(0.9) == Policy(default="fp32")
    with pytest.raises(PolicyError, match="switches to one of bf16, fp16, fp32"):
        policy.with_final_phase(0.9, "fp8")


def test_the_shipped_phased_example_trains_through_its_decay_phase(capsys):
    import os

    from examples import train_plain

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "policies", "gpt2_bytes.phased.yaml")
    policy = load_policy(path)
    out = train_plain.train(_model("gpt2"), policy, byte_batches(2, 4, 32, seed=0), steps=10,
                            guard=True)
    assert "step    9  phase 1 in force: from 90% of the run (decay)" in capsys.readouterr().out
    assert all(x == x for x in out["losses"])
    assert autoprec.applied_formats(out["guard"].model)[MLP] is Format.BF16


# ------------------------------------------------------------------ re-checks in training
# a budget no low-precision layer can meet: every bf16 layer whose loss rises breaks it, so the
# in-training re-check has something to demote (the reactive guard nothing: no overflow)
STRICT = Policy(default="fp32", layers={"transformer.h.*.mlp.*": "bf16"},
                tuned={"budget": {"max_loss_increase": 0.0, "max_grad_error": None}})


def _rechecked(events) -> list:
    return [(e.step, e.where) for e in events if e.where == "recheck"]


def test_hf_trainer_rechecks_every_n_steps_and_the_guard_demotes_at_that_step(tmp_path):
    from transformers import Trainer, TrainingArguments

    from autoprec.integrations import PolicyCallback
    from examples.train_hf_trainer import as_dataset

    with pytest.raises(PolicyError, match="pass guard=True as well"):
        PolicyCallback(STRICT, recheck_every=2)
    callback = PolicyCallback(STRICT, guard=True, recheck_every=2)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                             learning_rate=1e-3, report_to=[], disable_tqdm=True, use_cpu=True,
                             save_strategy="no")
    Trainer(model=_model("gpt2"), args=args, callbacks=[callback],
            train_dataset=as_dataset(byte_batches(4, 4, 32, seed=3))).train()
    # re-checked at steps 2 and 4 (a weight's loss change can cross zero in between)
    got = _rechecked(callback.guard.events)
    assert got and got[0][0] == 2 and {s for s, _ in got} <= {2, 4}, callback.guard.events
    assert callback.rechecker.runs == 2
    for e in callback.guard.events:
        assert callback.guard.policy.format_for(e.fqn) is Format.FP32


def test_lightning_rechecks_every_n_steps_and_the_guard_demotes_at_that_step(tmp_path):
    pytest.importorskip("lightning")
    from examples import train_lightning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, cb = train_lightning.train(_model("gpt2"), STRICT, byte_batches(4, 4, 32, seed=3),
                                         steps=4, guard=True, root_dir=str(tmp_path),
                                         recheck_every=2)
    # re-checked at steps 2 and 4; whether step 2 already finds a loss change above the 0%
    # budget depends on the CPU's bf16 kernels (on a Zen 4 every change at step 2 was <= 0
    # and the first demotion came at step 4)
    got = _rechecked(cb.guard.events)
    assert got and {s for s, _ in got} <= {2, 4}, cb.guard.events
    assert cb.rechecker.runs == 2


def test_the_guards_demotions_outlive_a_phase_switch():
    from examples import train_plain

    layer = train_plain.PLANT_LAYER
    policy = Policy(default="fp32", layers={"transformer.h.*.mlp.*": "fp8", layer: "fp16",
                                            "lm_head": "fp32"},
                    phases=[{"from_step": 8, "formats": {"fp16": "bf16", "fp8": "bf16"}}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = train_plain.train(_model("gpt2"), policy, byte_batches(2, 4, 32, seed=0),
                                steps=10, guard=True, plant_at=2)
    guard = out["guard"]
    assert [(e.fqn, e.new) for e in guard.events] == [(layer, Format.FP32)], guard.events
    assert guard.events[0].step < 8
    # after the switch: the demoted layer stays fp32 (safer than the phase's bf16), the rest
    # follow the phase
    assert guard.policy.format_for(layer) is Format.FP32
    assert guard.policy.format_for("transformer.h.0.mlp.c_fc") is Format.BF16
    assert layer not in guard.watched and "transformer.h.0.mlp.c_fc" in guard.watched
    # the amended policy keeps its phases, the demotion in each (not only the phase in force)
    amended = guard.amended_policy()
    assert [p.from_step for p in amended.phases] == [8]
    assert amended.phase(0).format_for(layer) is Format.FP32
    assert amended.phase(1).format_for(layer) is Format.FP32
    assert amended.phase(1).format_for("transformer.h.0.mlp.c_fc") is Format.BF16
    assert amended.phase(0).format_for("transformer.h.0.mlp.c_fc") is Format.FP8
    # a phase whose map alone would lower the demoted layer again keeps it safe
    up = Policy(default="fp32", layers={"a": "bf16"}, phases=[{"from_step": 2,
                                                              "formats": {"bf16": "fp8"}}])
    from autoprec.runtime.guard.demote import merge_phases
    kept = merge_phases(up, {"a": Format.FP32}, ["a"])
    assert kept.phase(0).format_for("a") is Format.FP32 and kept.phase(1).format_for("a") is \
        Format.FP32


GROUPED = {"a": "fp8", "b": "fp8:rowwise", "c": "mxfp8", "d": "nvfp4", "e": "bf16"}


def _mapped(policy: Policy) -> dict[str, str]:
    after = policy.phase(1)
    return {k: after.format_for(k).value for k in GROUPED}


def test_a_phase_key_fp8_means_every_fp8_recipe_and_scaled_every_scaled_format():
    fp8 = Policy(default="fp32", layers=GROUPED, phases=[{"from_step": 2,
                                                         "formats": {"fp8": "bf16"}}])
    assert _mapped(fp8) == {"a": "bf16", "b": "bf16", "c": "mxfp8", "d": "nvfp4", "e": "bf16"}
    scaled = Policy(default="fp32", layers=GROUPED, phases=[{"from_step": 2,
                                                            "formats": {"scaled": "bf16"}}])
    assert _mapped(scaled) == {"a": "bf16", "b": "bf16", "c": "bf16", "d": "bf16", "e": "bf16"}
    # a format's own key wins over fp8, and fp8 over scaled
    both = Policy(default="fp32", layers=GROUPED, phases=[{"from_step": 2, "formats": {
        "scaled": "fp32", "fp8": "bf16", "fp8:rowwise": "fp16"}}])
    assert _mapped(both) == {"a": "bf16", "b": "fp16", "c": "fp32", "d": "fp32", "e": "bf16"}
    # the same word means the same formats in a candidate set and in the guard's
    assert set(autoprec.formats.expand_formats(["fp8"])) == {
        f for f in Format.registered() if f.recipe is not None}
    assert set(autoprec.GuardConfig(formats=("scaled",)).formats) == {
        f for f in Format.registered() if f.is_scaled}
    assert Format.MXFP8 not in autoprec.GuardConfig(formats=("fp8",)).formats
    assert Format.MXFP8 in autoprec.GuardConfig().formats  # the default watches every scaled


def test_a_schema_3_file_keeps_what_its_fp8_key_said_and_is_written_as_schema_4(tmp_path):
    layers = "".join(f"  {k}: {v}\n" for k, v in GROUPED.items())
    old = tmp_path / "old.yaml"
    old.write_text(f"autoprec: 3\ndefault: fp32\nlayers:\n{layers}"
                   "phases: [{from_step: 2, formats: {fp8: bf16}}]\n")
    policy = load_policy(old)
    assert _mapped(policy) == {k: "bf16" for k in GROUPED}  # every scaled format, as it said
    new = tmp_path / "new.yaml"
    policy.save(new)
    text = new.read_text()
    assert "autoprec: 4" in text and "scaled: bf16" in text
    assert _mapped(load_policy(new)) == _mapped(policy)
    # `scaled` is schema 4's word: a schema 3 file that names it is refused in one line
    old.write_text("autoprec: 3\ndefault: fp32\nphases: [{from_step: 2, formats: {scaled: bf16}}]\n")
    with pytest.raises(PolicyError, match=r"key `scaled` needs schema 4.*old\.yaml") as e:
        load_policy(old)
    assert "\n" not in str(e.value)


def test_no_format_may_take_a_group_words_name():
    from autoprec.formats import register

    with pytest.raises(ValueError, match="group word"):
        register(dataclasses.replace(Format.BF16.numerics, name="scaled", label="scaled"))
