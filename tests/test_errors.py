"""Bad input gets a one-line error and loses nothing: through the real `autoprec` console
script, each mistake a user makes ends with `autoprec: error: ...` naming the file, key or URL
at fault, exit code 2, no traceback and no file left behind. And the wrong results that used to
pass silently: a stale study reused for an edited model, a policy for another model validated,
an alias bomb, a model on the meta device."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import tracemalloc
import warnings

import pytest
import torch
from torch import nn

import autoprec
from autoprec import Policy, PolicyError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "tasks.py")
CONSOLE = shutil.which("autoprec", path=os.path.dirname(sys.executable)) or "autoprec"


def cli(*args, cwd=None, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([CONSOLE, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def one_line_error(r, *needles):
    """Exit 2, one `autoprec: error:` line on stderr naming each needle, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout[-1000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("autoprec: error:", "usage:"))]
    assert errors, r.stderr
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)
    return r.stderr


def files(folder) -> list[str]:
    return sorted(os.listdir(folder))


# ----------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("args, needle", [
    (["--n-trials", "0"], "--n-trials"),
    (["--max-loss-increase", "-0.01"], "--max-loss-increase"),
    (["--max-grad-error", "-1"], "--max-grad-error"),
    (["--target", "h999"], "h999"),
    (["--timeout", "0"], "--timeout"),
])
def test_impossible_tune_options_fail_before_any_work(tmp_path, args, needle):
    t0 = time.perf_counter()
    r = cli("tune", f"{TASKS}:tiny_gpt2_task", "-o", tmp_path / "p.yaml", *args, cwd=tmp_path)
    one_line_error(r, needle)
    assert files(tmp_path) == [] and time.perf_counter() - t0 < 60


def test_impossible_validate_and_profile_options(tmp_path):
    Policy(default="fp32").save(tmp_path / "p.yaml")
    one_line_error(cli("validate", tmp_path / "p.yaml", "--task", f"{TASKS}:tiny_gpt2_task",
                       "--steps", "0"), "--steps")
    one_line_error(cli("profile", f"{TASKS}:tiny_gpt2_task", "--batches", "-1"), "--batches")


# ----------------------------------------------------------------------------- task specs
@pytest.mark.parametrize("spec, needles", [
    (f"{TASKS}:no_such_function", ["no function 'no_such_function'", "tasks.py"]),
    (f"{TASKS}:NOT_A_FUNCTION", ["NOT_A_FUNCTION", "not a function"]),
    (os.path.join(ROOT, "tests", "bad_task_import.py") + ":task",
     ["Could not import task file", "bad_task_import.py", "a_module_that_does_not_exist"]),
    ("no_such_package.tasks:task", ["Could not import task module no_such_package.tasks"]),
    ("missing/file.py:task", ["missing/file.py", "does not exist"]),
])
def test_bad_task_specs_are_one_line_errors(tmp_path, spec, needles):
    r = cli("tune", spec, "-o", tmp_path / "p.yaml", cwd=tmp_path)
    one_line_error(r, *needles)
    assert files(tmp_path) == []


def test_a_model_with_nothing_to_tune_says_so(tmp_path):
    r = cli("tune", f"{TASKS}:no_layer_task", "-o", tmp_path / "p.yaml", "--target", "h100",
            cwd=tmp_path)
    one_line_error(r, "no linear, conv, attention or matmul layer")


# ----------------------------------------------------------------------------- outputs
def test_an_output_that_cannot_be_written_is_refused_before_profiling(tmp_path):
    (tmp_path / "dir").mkdir()
    one_line_error(cli("tune", f"{TASKS}:tiny_gpt2_task", "-o", tmp_path / "dir", cwd=tmp_path),
                   "is a directory")
    (tmp_path / "a_file").write_text("x")
    one_line_error(cli("tune", f"{TASKS}:tiny_gpt2_task", "-o", tmp_path / "a_file" / "p.yaml",
                       cwd=tmp_path), "a_file")
    assert files(tmp_path) == ["a_file", "dir"] and files(tmp_path / "dir") == []


@pytest.mark.parametrize("storage, needle", [
    ("nonsense-url", "not a database URL"),
    ("postgresql://someone:secret@127.0.0.1:9/nodb", "check the host"),
    ("mysql://someone@127.0.0.1/nodb", "driver"),
    ("journal:", "names no"),
])
def test_bad_storages_are_one_line_errors(tmp_path, storage, needle):
    r = cli("tune", f"{TASKS}:tiny_gpt2_task", "-o", tmp_path / "p.yaml", "--storage", storage,
            "--target", "h100", cwd=tmp_path)
    err = one_line_error(r, needle)
    assert "secret" not in err  # a password in the URL is never printed
    assert files(tmp_path) == []


# ----------------------------------------------------------------------------- policy files
def test_binary_and_non_utf8_policy_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"autoprec: 1\ndefault: \xff\xfe bf16\n")
    for args in (["show", bad], ["diff", bad, bad],
                 ["validate", bad, "--task", f"{TASKS}:tiny_gpt2_task"]):
        one_line_error(cli(*args), "bad.yaml", "not UTF-8")
    with pytest.raises(PolicyError, match="not UTF-8"):
        autoprec.load_policy(bad)


def test_a_corrupt_profile_beside_a_policy_prints_nothing_but_the_error(tmp_path):
    Policy(default="bf16").save(tmp_path / "p.yaml")
    (tmp_path / "p.profile.json").write_text('{"autoprec_profile": 2, "layers": [')
    r = cli("show", tmp_path / "p.yaml")
    one_line_error(r, "p.profile.json")
    assert r.stdout == ""


@pytest.mark.parametrize("text, needles", [
    ("autoprec: 1\ndefault: bf16\nloss_scaling: {growth_interval: x}\n",
     ["growth_interval", "line 3"]),
    ('autoprec: "1"\ndefault: bf16\n', ["must be an integer: 2", "no quotes"]),
    ("autoprec: true\ndefault: bf16\n", ["must be an integer: 2"]),
    ("autoprec: 1\ndefault: bf16\nlayers:\n  lm_head: fp32\n  lm_head: bf16\n",
     ["Duplicate key 'lm_head'", "lines 4 and 5"]),
])
def test_policy_values_of_the_wrong_kind_name_the_key(tmp_path, text, needles):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as e:
        autoprec.load_policy(path)
    for needle in needles:
        assert needle in str(e.value), str(e.value)
    one_line_error(cli("show", path), *needles)


def test_an_alias_bomb_is_refused_in_bounded_memory_and_time(tmp_path):
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        prev = chr(ord("a") + i - 1)
        levels.append(f"{chr(ord('a') + i)}: &{chr(ord('a') + i)} "
                      f"[*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]")
    path = tmp_path / "bomb.yaml"
    path.write_text("autoprec: 1\ndefault: bf16\ntuned:\n" +
                    "\n".join("  " + line for line in levels) + "\n")
    assert path.stat().st_size < 1000
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(PolicyError, match="anchor or alias"):
        autoprec.load_policy(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 5 * 2**20 and time.perf_counter() - t0 < 2, (peak, time.perf_counter() - t0)
    r = cli("show", path, timeout=60)
    one_line_error(r, "bomb.yaml", "anchor or alias")
    assert len(r.stdout) < 1000
    # and what autoprec writes never uses aliases, even for repeated values
    shared = {"x": 1}
    text = Policy(default="bf16", tuned={"a": shared, "b": shared}).to_yaml()
    assert "&" not in text and "*" not in text


def test_diff_exits_1_when_the_policies_differ_and_2_on_an_error(tmp_path):
    Policy(default="bf16").save(tmp_path / "a.yaml")
    Policy(default="fp32").save(tmp_path / "b.yaml")
    assert cli("diff", tmp_path / "a.yaml", tmp_path / "a.yaml").returncode == 0
    assert cli("diff", tmp_path / "a.yaml", tmp_path / "b.yaml").returncode == 1
    one_line_error(cli("diff", tmp_path / "a.yaml", tmp_path / "missing.yaml"), "missing.yaml")


def test_a_shared_module_is_named_by_either_path():
    shared = nn.Linear(8, 8)
    model = nn.ModuleDict({"first": shared, "second": shared})
    assigned = Policy(default="fp32", layers={"second": "bf16"}).check_model(model)
    assert assigned == {"first": autoprec.Format.BF16}
    with pytest.raises(PolicyError, match="same module"):
        Policy(default="fp32", layers={"first": "fp16", "second": "bf16"}).check_model(model)


def test_the_non_strict_warning_does_not_tell_to_pass_strict_false(gpt2):
    with pytest.warns(UserWarning) as caught:
        autoprec.apply(gpt2, Policy(default="bf16", layers={"nope": "fp32"}), strict=False)
    text = str(caught[0].message)
    assert "matches no module" in text and "pass strict=False" not in text


# ----------------------------------------------------------------------------- wrong results
@pytest.mark.slow
def test_validate_refuses_a_policy_made_for_another_model(tmp_path):
    from tasks import wide_gpt2_task

    policy = Policy(default="bf16", model_name="GPT2LMHeadModel",
                    fingerprint=autoprec.model_fingerprint(wide_gpt2_task().build_model()))
    policy.save(tmp_path / "wide.yaml")
    r = cli("validate", tmp_path / "wide.yaml", "--task", f"{TASKS}:tiny_gpt2_task",
            "--steps", "2")
    one_line_error(r, "fingerprint", "strict=False")
    r = cli("validate", tmp_path / "wide.yaml", "--task", f"{TASKS}:tiny_gpt2_task",
            "--steps", "2", "--no-strict")
    assert r.returncode in (0, 1, 3) and "gap" in r.stdout, r.stderr[-2000:]


@pytest.mark.slow
def test_an_edited_model_starts_a_fresh_study_and_a_named_one_is_refused(tmp_path):
    from tasks import tiny_gpt2_task, wide_gpt2_task

    out = tmp_path / "p.yaml"
    kw = dict(target="h100", n_trials=3, output=str(out), progress=False)
    first = autoprec.tune(tiny_gpt2_task(), **kw)
    again = autoprec.tune(tiny_gpt2_task(), **kw)  # same model: the same study, resumed
    assert again.study_name == first.study_name
    wide = autoprec.tune(wide_gpt2_task(), **kw)
    assert wide.study_name != first.study_name
    assert wide.policy.fingerprint == autoprec.model_fingerprint(wide_gpt2_task().build_model())
    # the profile is the wide model's: its shapes, not the old ones
    assert wide.profile.layer("transformer.h.0.mlp.c_fc").layer.matmuls[0][2] == 128
    r = cli("tune", f"{TASKS}:wide_gpt2_task", "-o", out, "--target", "h100", "--n-trials", "3")
    assert r.returncode == 0 and "starting a fresh study" not in r.stderr  # wide's own, resumed
    with pytest.raises(ValueError, match="another model.*--study"):
        autoprec.tune(tiny_gpt2_task(), study_name=wide.study_name, **kw)


def test_a_model_on_the_meta_device_runs_under_a_policy():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(2, 8, device="meta")
    expected = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autoprec.apply(model, Policy(default="bf16", layers={"2": "fp32"}))
    out = model(x)
    assert out.device.type == "meta" and out.shape == expected.shape


def test_tuple_batches_with_a_loss_that_calls_the_model_on_the_inputs():
    from tasks import tuple_batches_task

    prof = autoprec.profile(tuple_batches_task(), target="h100", progress=False)
    assert [lp.fqn for lp in prof.layers] == ["0", "2"]
    assert prof.layer("0").layer.matmuls == ((1, 16, 32, 64),)
