"""autoprec.recheck: a policy re-measured on the run's own weights (HF GPT-2, the planted drift
of examples/drift.py), checkpoints read as untrusted files, the CLI's checks, and the
Rechecker inside training with the runtime guard."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
import yaml

import autoprec
from autoprec.checkpoint import load_checkpoint, read_state_dict
from autoprec.formats import Format
from autoprec.integrations import training_kit
from autoprec.measure.sensitivity import LayerSensitivity
from autoprec.policy import Budget, Policy, load_policy
from autoprec.recheck import PROMOTE_SHARE, Rechecker, judge, recheck
from autoprec.runtime.rewrite import applied_policy
from examples.data import byte_batches
from examples.drift import DRIFT_LAYER, drift_policy, plant_drift
from examples.gpt2_bytes import gpt2_config, make_model

STEPS = 1000
# aimed so that the drifted layer's outputs pass FP16's max a little before step 1000 (its
# FP32 training never overflows)
OVERFLOW_AT = 900


def _train_fp32(model, batches, steps, *, planted: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    drift = plant_drift(model, opt, batches[0], overflow_at=OVERFLOW_AT) if planted else None
    for s in range(steps):
        loss = model(**batches[s % len(batches)]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if drift is not None:
        drift.remove()
    return model


# two noisy shared cores: one thread each is 10x faster than two threads fighting others
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def batches():
    return byte_batches(8, 4, 64, seed=1)


@pytest.fixture(scope="module")
def planted(batches):
    torch.manual_seed(0)
    return _train_fp32(make_model(2, 64, 1, 64), batches, STEPS, planted=True)


@pytest.fixture(scope="module")
def unplanted(batches):
    torch.manual_seed(0)
    return _train_fp32(make_model(2, 64, 1, 64), batches, STEPS, planted=False)


# ------------------------------------------------------------------------------ verdicts
def _sens(fmt="fp16", loss=1e-4, grad=1e-3, over=0.0, finite=True, gover=0.0):
    ranged = Format.parse(fmt) is Format.FP16 or Format.parse(fmt).is_scaled
    return LayerSensitivity(layer="x", format=fmt, loss_rel_change=loss, grad_rel_error=grad,
                            layer_grad_rel_error=None, output_sqnr_db=60.0,
                            act_overflow=over if ranged else None, act_underflow=0.0 if ranged else None,
                            grad_overflow=gover if ranged else None,
                            grad_underflow=0.0 if ranged else None, finite=finite, n_batches=1)


BUDGET = Budget(max_loss_increase=0.02, max_grad_error=0.2)


@pytest.mark.parametrize("sens, candidate, verdict, says", [
    (_sens(), False, "keep", "within the budget"),
    (_sens(loss=0.03), False, "demote", "loss change +3.00%"),
    (_sens(loss=-0.03), False, "keep", "within"),           # a lower loss breaks no budget
    (_sens(grad=0.3), False, "demote", "gradient error 0.300"),
    (_sens(over=0.05), False, "demote", "5.00% of its activations beyond fp16's range"),
    (_sens(gover=0.5), False, "demote", "output gradients beyond fp16's range"),
    (_sens(loss=math.nan, finite=False), False, "demote", "non-finite"),
    (_sens("bf16", loss=0.005, grad=0.05), True, "may promote", "well inside"),
    (_sens("bf16", loss=-0.015), True, "stay", "|loss change| 1.50%"),    # both signs count
    (_sens("bf16", grad=0.1), True, "stay", "gradient error 0.100"),      # exactly half: not below
    (_sens("fp16", over=1e-4), True, "stay", "beyond fp16's range"),
    (_sens("fp8", finite=False, loss=math.nan), True, "stay", "non-finite"),
])
def test_verdict_table(sens, candidate, verdict, says):
    got, why = judge(sens, BUDGET, candidate=candidate)
    assert (got, says in why) == (verdict, True), why


def test_a_budget_without_gradient_limit_judges_the_loss_only():
    budget = Budget(max_loss_increase=0.02, max_grad_error=None)
    assert judge(_sens(grad=5.0), budget, candidate=False)[0] == "keep"
    assert judge(_sens("bf16", grad=5.0, loss=0.001), budget, candidate=True)[0] == "may promote"


# ------------------------------------------------------------------------------ the planted drift
def test_recheck_at_step_1000_of_the_planted_drift_names_the_drifted_layer(planted, batches):
    before = copy.deepcopy(planted.state_dict())
    result = recheck(planted, drift_policy(), batches[:2])
    assert result.demote == {DRIFT_LAYER: Format.FP32}, result.format()
    assert "beyond fp16's range" in result.reason(DRIFT_LAYER)
    # every other fp16 layer was measured and kept
    kept = {r.fqn for r in result.rows if r.verdict == "keep"}
    assert len(kept) == 7 and DRIFT_LAYER not in kept, result.format()
    # the model was not modified
    assert all(torch.equal(before[k], v) for k, v in planted.state_dict().items())
    amended = result.amended_policy()
    assert amended.format_for(DRIFT_LAYER) is Format.FP32
    assert amended.format_for("transformer.h.0.mlp.c_proj") is Format.FP16
    assert amended.tuned["recheck"]["demoted"] == {DRIFT_LAYER: "fp32"}


def test_the_drift_is_not_named_before_it_grows(batches):
    torch.manual_seed(0)
    model = make_model(2, 64, 1, 64)
    plant_drift(model, torch.optim.AdamW(model.parameters()), batches[0], overflow_at=OVERFLOW_AT)
    result = recheck(model, drift_policy(), batches[:2])
    assert result.demote == {}, result.format()


def test_recheck_of_the_unplanted_model_demotes_nothing(unplanted, batches):
    result = recheck(unplanted, drift_policy(), batches[:2])
    assert result.demote == {}, result.format()
    assert {r.verdict for r in result.rows} <= {"keep", "may promote", "stay"}
    # the head kept in fp32 is measured in the policy's lower format, fp16
    head = [r for r in result.rows if r.fqn == "lm_head"]
    assert [r.measured for r in head] == [Format.FP16]


def test_promotions_are_listed_and_applied_only_on_request(unplanted, batches):
    policy = Policy(default="fp32", layers={"transformer.h.*.mlp.c_fc": "bf16",
                                            "transformer.h.*.attn.c_attn": "fp8"})
    result = recheck(unplanted, policy, batches[:1], formats=["bf16"])
    promote = result.promote
    assert promote and all(f is Format.BF16 for f in promote.values())
    assert "transformer.h.0.mlp.c_proj" in promote
    # fp8 layers are not promotion candidates in bf16 (bf16 is not lower than fp8)
    assert not any(k.endswith("attn.c_attn") for k in promote)
    assert result.amended_policy().format_for("transformer.h.0.mlp.c_proj") is Format.FP32
    applied = result.amended_policy(promote=True)
    assert applied.format_for("transformer.h.0.mlp.c_proj") is Format.BF16
    # a promoted parent changes only its own computation: its children keep their formats
    if "transformer.h.0.attn" in promote:
        assert applied.format_for("transformer.h.0.attn.c_attn") is Format.FP8
    rows = {(r.fqn, r.measured): r for r in result.rows}
    r = rows[("transformer.h.0.mlp.c_proj", Format.BF16)]
    assert abs(r.loss_change) < PROMOTE_SHARE * result.budget.max_loss_increase


def test_the_budget_defaults_to_the_policys_tuned_one(unplanted, batches):
    policy = Policy(default="fp32", layers={"transformer.h.0.mlp.c_fc": "fp16"},
                    tuned={"budget": {"max_loss_increase": 0.05, "max_grad_error": 0.0}})
    result = recheck(unplanted, policy, batches[:1])
    assert result.budget == Budget(0.05, 0.0)
    # a gradient error limit of 0: the fp16 layer's own (non-zero) error breaks it
    assert result.demote == {"transformer.h.0.mlp.c_fc": Format.FP32}, result.format()
    report = result.to_dict()
    json.dumps(report, allow_nan=False)
    assert report["demote"] == {"transformer.h.0.mlp.c_fc": "fp32"}
    assert "demote transformer.h.0.mlp.c_fc: fp16 -> fp32" in result.format()


# ------------------------------------------------------------------------------ checkpoints
def _fresh():
    torch.manual_seed(1)
    return make_model(2, 64, 1, 64)


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("kind", ["safetensors", "pt", "training", "hf_folder", "hf_shards",
                                  "compiled", "ddp", "bf16"])
def test_checkpoint_formats_load(tmp_path, kind):
    source = _fresh()
    sd = source.state_dict()
    path = str(tmp_path / "ckpt")
    if kind == "safetensors":
        from safetensors.torch import save_file
        path += ".safetensors"
        # safetensors refuses shared tensors: the tied head is left out, as HF does
        save_file({k: v for k, v in sd.items() if k != "lm_head.weight"}, path)
    elif kind in ("pt", "compiled", "ddp", "bf16"):
        prefix = {"compiled": "_orig_mod.", "ddp": "module.", "pt": "", "bf16": ""}[kind]
        data = {prefix + k: v for k, v in sd.items()}
        if kind == "bf16":
            data = {k: v.bfloat16() for k, v in data.items()}
            source.load_state_dict({k: v.float() for k, v in data.items()})
        path += ".pt"
        torch.save(data, path)
    elif kind == "training":
        path += ".pt"
        torch.save({"model": sd, "optimizer": {"state": {}, "param_groups": []}, "step": 7}, path)
    else:
        source.save_pretrained(path, **({"max_shard_size": "200KB"} if kind == "hf_shards" else {}))
        if kind == "hf_shards":
            assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    target = make_model(2, 64, 1, 64)
    assert not _same_weights(source, target)
    load_checkpoint(target, path)
    assert _same_weights(source, target)
    # tied weights stay tied
    assert target.lm_head.weight.data_ptr() == target.transformer.wte.weight.data_ptr()


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _one_line_error(target, path, *needles):
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        load_checkpoint(target, path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg, msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_hostile_checkpoints_are_one_line_errors(tmp_path):
    target = make_model(2, 64, 1, 64)
    before = copy.deepcopy(target.state_dict())
    sd = _fresh().state_dict()
    cases = {
        "list.pt": ([1, 2, 3], "holds a list, not a state dict"),
        "evil.pt": ({"transformer.wte.weight": Evil()}, "Python objects other than tensors"),
        "nested.pt": ({"config": {"lr": 1e-3}}, "is not a state dict"),
        "strings.pt": ({**sd, "note": "hello"}, "`note`"),
        "wide.pt": (make_model(2, 128, 2, 64).state_dict(), "have another shape"),
        "short.pt": ({k: v for k, v in sd.items() if "h.1." not in k}, "are missing"),
        "extra.pt": ({**sd, "adapter.weight": torch.ones(3)}, "are not the model's"),
    }
    for name, (obj, needle) in cases.items():
        torch.save(obj, tmp_path / name)
        _one_line_error(target, tmp_path / name, needle)
    (tmp_path / "garbage.bin").write_bytes(os.urandom(4096))
    _one_line_error(target, tmp_path / "garbage.bin", "torch.load can read")
    (tmp_path / "garbage.safetensors").write_bytes(b"\xff" * 64)
    _one_line_error(target, tmp_path / "garbage.safetensors", "not a readable safetensors")
    _one_line_error(target, tmp_path / "absent.pt", "does not exist")
    os.mkdir(tmp_path / "empty")
    _one_line_error(target, tmp_path / "empty", "holds none of model.safetensors")
    # nothing was loaded from any of them
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert not (tmp_path / "pwned").exists()


def test_checkpoint_size_and_shard_names_are_bounded(tmp_path):
    torch.save(_fresh().state_dict(), tmp_path / "big.pt")
    with pytest.raises(ValueError, match="more than the 0.0 MiB"):
        read_state_dict(tmp_path / "big.pt", max_bytes=1000)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"transformer.wte.weight": "../big.pt"}}))
    with pytest.raises(ValueError, match="plain file name inside the checkpoint folder"):
        read_state_dict(folder, max_bytes=2 ** 30)


# ------------------------------------------------------------------------------ the command
TASK_FILE = '''
import autoprec
from examples.data import byte_batches
from examples.gpt2_bytes import make_model


def task():
    return autoprec.Task(model=lambda: make_model(2, 64, 1, 64),
                         batches=byte_batches(2, 4, 64, seed=1), name="tiny")
'''


def _cli(argv):
    from autoprec.cli import _parser

    args = _parser().parse_args(["recheck", *map(str, argv)])
    return args.fn(args)


@pytest.fixture()
def cli_files(tmp_path):
    task = tmp_path / "tiny_task.py"
    task.write_text(TASK_FILE)
    torch.manual_seed(0)
    ckpt = tmp_path / "ckpt.pt"
    torch.save(make_model(2, 64, 1, 64).state_dict(), ckpt)
    policy = tmp_path / "policy.yaml"
    Policy(default="fp32", layers={"transformer.h.*.mlp.c_fc": "fp16"}).save(policy)
    return f"{task}:task", policy, ckpt, tmp_path


def test_cli_writes_the_report_and_the_amended_policy(cli_files, capsys):
    task, policy, ckpt, tmp = cli_files
    code = _cli([task, "--policy", policy, "--checkpoint", ckpt, "-o", tmp / "report.yaml",
                 "--amended", tmp / "amended.yaml", "--batches", 1, "--max-grad-error", 0])
    assert code == 1  # something to demote
    report = yaml.safe_load((tmp / "report.yaml").read_text())
    assert report["demote"] == {"transformer.h.0.mlp.c_fc": "fp32",
                                "transformer.h.1.mlp.c_fc": "fp32"}
    assert report["budget"] == {"max_loss_increase": 0.01, "max_grad_error": 0.0}
    assert report["source"] == str(ckpt)
    amended = load_policy(tmp / "amended.yaml")
    assert amended.format_for("transformer.h.1.mlp.c_fc") is Format.FP32
    assert "demote transformer.h.0.mlp.c_fc: fp16 -> fp32" in capsys.readouterr().out
    assert _cli([task, "--policy", policy, "--checkpoint", ckpt, "-o", tmp / "r2.yaml",
                 "--batches", 1]) == 0


@pytest.mark.parametrize("clash", ["policy", "checkpoint", "task", "amended", "link"])
def test_cli_refuses_an_output_that_is_an_input(cli_files, clash):
    task, policy, ckpt, tmp = cli_files
    os.symlink(policy, tmp / "link.yaml")
    target = {"policy": policy, "checkpoint": ckpt, "task": task.rpartition(":")[0],
              "amended": tmp / "a.yaml", "link": tmp / "link.yaml"}[clash]
    before = open(target, "rb").read() if os.path.exists(target) else None
    extra = ["--amended", tmp / "a.yaml"] if clash == "amended" else []
    with pytest.raises(ValueError) as info:
        _cli([task, "--policy", policy, "--checkpoint", ckpt, "-o", target, *extra])
    assert "\n" not in str(info.value) and "Choose another path" in str(info.value), info.value
    if before is not None:
        assert open(target, "rb").read() == before


def test_cli_promote_needs_amended(cli_files):
    task, policy, ckpt, tmp = cli_files
    with pytest.raises(ValueError, match="--promote .* give --amended"):
        _cli([task, "--policy", policy, "--checkpoint", ckpt, "-o", tmp / "r.yaml",
              "--promote"])


# ------------------------------------------------------------------------------ in training
TRAIN_POLICY = Policy(default="fp32", layers={"transformer.h.*.mlp.c_fc": "fp16",
                                              "transformer.h.*.attn.c_attn": "bf16"})


def _guarded_run(rechecker, steps=30, batches=None):
    """A short training run of a GPT-2 with dropout (so any RNG use would show) under a
    guarded policy; returns the model, guard and the re-checks' results."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config(2, 64, 1, 64, dropout=0.1))
    batches = batches or byte_batches(4, 4, 64, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, scaler, guard = training_kit(model, TRAIN_POLICY, guard=True)
    results = []
    for step in range(1, steps + 1):
        batch = batches[step % len(batches)]
        loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if rechecker is not None:
            results.append(rechecker.maybe(model, batch, step))
        guard.step()
    return model, guard, results, torch.random.get_rng_state()


def test_rechecker_leaves_training_bit_identical():
    rechecker = Rechecker(TRAIN_POLICY, every=10)
    with_it, guard, results, rng_with = _guarded_run(rechecker)
    without, _, _, rng_without = _guarded_run(None)
    assert [r is not None for r in results].count(True) == 3 and rechecker.runs == 3
    assert all(r.demote == {} for r in results if r is not None)
    assert guard.events == []
    for (name, a), (_, b) in zip(with_it.named_parameters(), without.named_parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(rng_with, rng_without)


def test_rechecker_demotion_is_applied_by_the_guard_at_the_next_step(planted, batches):
    model = copy.deepcopy(planted)
    model, scaler, guard = training_kit(model, drift_policy(), guard=True)
    rechecker = Rechecker(drift_policy(), every=1)
    result = rechecker.check(model, batches[0], 1000)
    assert result.demote == {DRIFT_LAYER: Format.FP32} and result.step == 1000
    assert guard.events == []  # asked for, not yet applied
    assert autoprec.applied_formats(model)[DRIFT_LAYER] is Format.FP16
    events = guard.step()
    assert [(e.fqn, e.new, e.where) for e in events] == [(DRIFT_LAYER, Format.FP32, "recheck")]
    assert "re-check at step 1000" in events[0].reason
    assert applied_policy(model).format_for(DRIFT_LAYER) is Format.FP32
    assert guard.amended_policy().format_for(DRIFT_LAYER) is Format.FP32
    # the next re-check measures the policy in force: nothing left to demote
    assert rechecker.check(model, batches[0], 1001).demote == {}
    state = rechecker.state_dict()
    assert state["runs"] == 2 and state["requested"][0]["fqn"] == DRIFT_LAYER
    again = Rechecker(drift_policy(), every=1)
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_rechecker_needs_a_guard_and_a_sane_setup(batches):
    model = make_model(2, 64, 1, 64)
    autoprec.apply(model, TRAIN_POLICY)
    rechecker = Rechecker(TRAIN_POLICY, every=5)
    assert rechecker.maybe(model, batches[0], 3) is None
    assert rechecker.maybe(model, batches[0], 0) is None
    with pytest.raises(RuntimeError, match="guard=True"):
        rechecker.maybe(model, batches[0], 5)
    for every in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="every"):
            Rechecker(TRAIN_POLICY, every=every)
    with pytest.raises(ValueError, match="state_dict"):
        rechecker.load_state_dict({"version": 1, "runs": "many"})


# ------------------------------------------------------------------------------ both outputs or none
def _marked_full_disk(monkeypatch, marker: bytes):
    """os.write fails as on a full disk for the payload that starts with ``marker``."""
    import errno

    real = os.write

    def write(fd, data):
        if bytes(data[:len(marker)]) == marker:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)
    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("earlier", [True, False])
def test_cli_a_full_disk_at_the_amended_policy_writes_no_report(cli_files, monkeypatch, earlier):
    task, policy, ckpt, tmp = cli_files
    report, amended = tmp / "report.yaml", tmp / "amended.yaml"
    if earlier:
        report.write_text("an earlier report\n")
    # the report is written first, the policy second: the disk fills up on the policy
    _marked_full_disk(monkeypatch, b"# autoprec precision policy")
    with pytest.raises(ValueError) as info:
        _cli([task, "--policy", policy, "--checkpoint", ckpt, "-o", report, "--amended",
              amended, "--batches", 1, "--max-grad-error", 0])
    msg = str(info.value)
    assert "\n" not in msg and "No space left" in msg and "nothing was written" in msg, msg
    assert (report.read_text() == "an earlier report\n") if earlier else not report.exists()
    assert not amended.exists()
    assert not [n for n in os.listdir(tmp) if n.endswith((".tmp", ".old"))], os.listdir(tmp)


@pytest.mark.slow  # a subprocess: the real console script (7 s on two shared cores)
def test_cli_an_amended_path_the_os_refuses_writes_no_report(cli_files):
    # a real failure, even as root: a file name longer than the file system allows passes the
    # checks made before the work (its folder is there and writable) and fails at the write
    import subprocess
    import sys
    from shutil import which

    task, policy, ckpt, tmp = cli_files
    report, amended = tmp / "report.yaml", tmp / ("a" * 300 + ".yaml")
    report.write_text("an earlier report\n")
    exe = which("autoprec", path=os.path.dirname(sys.executable)) or "autoprec"
    r = subprocess.run([exe, "recheck", task, "--policy", str(policy), "--checkpoint",
                        str(ckpt), "-o", str(report), "--amended", str(amended), "--batches", "1"],
                       capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert report.read_text() == "an earlier report\n"
    assert sorted(os.listdir(tmp)) == ["ckpt.pt", "policy.yaml", "report.yaml", "tiny_task.py"]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("autoprec: error: ")]
    assert len(errors) == 1 and "nothing was written" in errors[0], r.stderr[-3000:]


def test_atomic_write_all_puts_back_what_a_failed_rename_replaced(tmp_path, monkeypatch):
    import errno

    from autoprec._util import atomic_write_all

    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("before\n")
    real = os.replace

    def replace(src, dst):
        if os.fspath(dst) == os.fspath(second):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(ValueError, match=r"Read-only file system \(nothing was written"):
        atomic_write_all([(first, "new\n"), (second, "new\n")])
    assert first.read_text() == "before\n" and not second.exists()
    assert sorted(os.listdir(tmp_path)) == ["first.yaml"]
    monkeypatch.setattr(os, "replace", real)
    assert atomic_write_all([(first, "new\n"), (second, b"2\n")]) == [str(first), str(second)]
    assert (first.read_text(), second.read_text()) == ("new\n", "2\n")
    assert oct(os.stat(second).st_mode & 0o777) == oct(0o644 & ~_umask())


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_cli_reports_every_phase_of_a_phased_policy(cli_files, capsys):
    task, _, ckpt, tmp = cli_files
    policy = tmp / "phased.yaml"
    Policy(default="fp32", layers={"transformer.h.*.mlp.c_fc": "fp16"},
           phases=[{"from_fraction": 0.9, "name": "decay", "formats": {"fp16": "bf16"}}]
           ).save(policy)
    code = _cli([task, "--policy", policy, "--checkpoint", ckpt, "-o", tmp / "report.yaml",
                 "--amended", tmp / "amended.yaml", "--batches", 1, "--max-grad-error", 0])
    assert code == 1
    report = yaml.safe_load((tmp / "report.yaml").read_text())
    assert report["phases"] == ["from step 0", "from 90% of the run (decay)"]
    rows = {(r["fqn"], r["format"], r["measured"]): r["phases"] for r in report["rows"]}
    # c_fc computes fp16 in phase 0 and bf16 in phase 1: both measured, each in its phase
    assert rows[("transformer.h.0.mlp.c_fc", "fp16", "fp16")] == [0]
    assert rows[("transformer.h.0.mlp.c_fc", "bf16", "bf16")] == [1]
    amended = load_policy(tmp / "amended.yaml")
    assert [amended.phase(i).format_for("transformer.h.0.mlp.c_fc") for i in (0, 1)] == \
        [Format.FP32, Format.FP32]
    assert "2 phases, each checked" in capsys.readouterr().out
