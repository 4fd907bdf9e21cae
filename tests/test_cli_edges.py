"""The `autoprec` command at its edges, through the real console script: an output that is
one of the inputs, diff of policies that differ only in their settings, a closed pipe, options
that can only fail, storages that are read-only or locked, SIGTERM during a tune and its
resume, a missing --profile, odd provenance."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import optuna
import pytest

from autoprec import Policy
from autoprec.policy import LossScaling, Provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "tasks.py")
CONSOLE = shutil.which("autoprec", path=os.path.dirname(sys.executable)) or "autoprec"
# the smallest tune: cost-model prices, two formats
QUICK = ("--formats", "fp32", "bf16", "--target", "h100", "--n-trials", "2")


def cli(*args, cwd=None, timeout=300, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([CONSOLE, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout, **kw)


def one_line_error(r, *needles):
    """Exit 2, one `autoprec: error:` line on stderr naming each needle, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout[-1000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    # ours, or argparse's (`autoprec tune: error: argument --study: ...`)
    errors = [line for line in r.stderr.splitlines()
              if re.match(r"autoprec( \w+)?: error: ", line)]
    assert len(errors) == 1, r.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def task_file(folder, name="t.py", body="", imports="") -> str:
    """A task file of the user's (the tiny GPT-2 task of tests/tasks.py); returns its path."""
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(f"import sys\nsys.path.insert(0, {os.path.join(ROOT, 'tests')!r})\n{imports}"
                f"from tasks import tiny_gpt2_task\n\n\ndef task():\n    t = tiny_gpt2_task()\n"
                f"{body}    return t\n")
    return path


# ----------------------------------------------------------------------------- outputs = inputs
def _link(kind: str, src: str, dst: str) -> None:
    os.symlink(src, dst) if kind == "symlink" else os.link(src, dst)


@pytest.mark.parametrize("case", ["same", "relative", "symlink", "hardlink-profile",
                                  "symlink-study", "storage"])
def test_tune_refuses_an_output_that_is_its_task_file(tmp_path, case):
    task = task_file(tmp_path)
    before = open(task).read()
    args = ["tune", "t.py:task", *QUICK]
    (tmp_path / "sub").mkdir()
    if case == "same":
        args += ["-o", "t.py"]
    elif case == "relative":
        args += ["-o", os.path.join("sub", "..", "t.py")]
    elif case == "symlink":
        _link("symlink", task, tmp_path / "sub" / "p.yaml")
        args += ["-o", "sub/p.yaml"]
    elif case == "hardlink-profile":  # a side output: the profile beside the policy
        _link("hardlink", task, tmp_path / "sub" / "p.profile.json")
        args += ["-o", "sub/p.yaml"]
    elif case == "symlink-study":  # the default study beside the policy
        _link("symlink", task, tmp_path / "sub" / "p.study.db")
        args += ["-o", "sub/p.yaml"]
    else:
        args += ["-o", "sub/p.yaml", "--storage", f"sqlite:///{task}"]
    r = cli(*args, cwd=tmp_path)
    one_line_error(r, "t.py", "task file")
    assert open(task).read() == before
    assert sorted(os.listdir(tmp_path / "sub")) == sorted(
        {"same": [], "relative": [], "symlink": ["p.yaml"], "hardlink-profile": ["p.profile.json"],
         "symlink-study": ["p.study.db"], "storage": []}[case])


def test_profile_refuses_to_write_over_its_task_file(tmp_path):
    task = task_file(tmp_path)
    before = open(task).read()
    r = cli("profile", "t.py:task", "-o", "./t.py", "--formats", "fp32", "bf16", "--target",
            "h100", cwd=tmp_path)
    one_line_error(r, "t.py")
    assert open(task).read() == before


@pytest.mark.parametrize("case", ["policy", "model", "name-map"])
def test_export_refuses_an_output_that_is_one_of_its_inputs(tmp_path, case):
    task_file(tmp_path)
    # a policy every target takes: the export would succeed and write over its input
    Policy(default="bf16").save(tmp_path / "pol.yaml")
    (tmp_path / "map.yaml").write_text("'^lm_head$': output_layer\n")
    args = ["export", "pol.yaml", "--to", "fqn", "--model", "t.py:task"]
    out = {"policy": "pol.yaml", "model": "t.py", "name-map": "map.yaml"}[case]
    if case == "name-map":
        args[3] = "megatron"
        args += ["--name-map", "map.yaml"]
    before = (tmp_path / out).read_text()
    r = cli(*args, "-o", os.path.join(".", out), cwd=tmp_path)
    one_line_error(r, out)
    assert (tmp_path / out).read_text() == before


@pytest.mark.parametrize("where", ["cwd", "sys.path"])
def test_every_command_finds_a_modules_task_file_the_same_way(tmp_path, monkeypatch, capsys,
                                                              where):
    # `package.module:function` resolves to one file for every command (autoprec.task.task_file),
    # from the working directory (not on sys.path until the task loads) or from sys.path
    import autoprec.task
    from autoprec.cli import main

    folder = tmp_path / ("lib" if where == "sys.path" else "")
    (folder / "mypkg").mkdir(parents=True)
    task = folder / "mypkg" / "mytask.py"
    task.write_text("def task():\n    raise AssertionError('never loaded')\n")
    if where == "sys.path":
        monkeypatch.syspath_prepend(str(folder))
    monkeypatch.chdir(tmp_path)
    found = autoprec.task.task_file("mypkg.mytask:task")
    assert found is not None and os.path.samefile(found, task)
    assert os.path.samefile(autoprec.task.task_file(f"{task}:task"), found)
    before = task.read_text()
    out = os.path.relpath(task)
    for argv in (["profile", "mypkg.mytask:task", "-o", out],
                 ["recheck", "mypkg.mytask:task", "--policy", "p.yaml", "--checkpoint", "c.pt",
                  "-o", out]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"-o {out} is the task file" in err and "destroy an input" in err, (argv, err)
    assert task.read_text() == before


# ----------------------------------------------------------------------------- diff
@pytest.mark.parametrize("change, needle", [
    ({"loss_scaling": LossScaling(init_scale=1024.0)}, "loss_scaling"),
    ({"engine": "autoprec"}, "scaled engine"),
    ({"fp8_recipe": "rowwise"}, "fp8 recipe"),
    ({"fingerprint": "sha256:" + "1" * 64}, "fingerprint"),
    ({"model_name": "LlamaForCausalLM"}, "model"),
])
def test_diff_reports_every_setting_that_changes_training(tmp_path, change, needle):
    base = dict(default="bf16", layers={"lm_head": "fp32"}, model_name="GPT2LMHeadModel",
                fingerprint="sha256:" + "0" * 64)
    a, b = Policy(**base), Policy(**{**base, **change})
    assert a != b
    a.save(tmp_path / "a.yaml")
    b.save(tmp_path / "b.yaml")
    r = cli("diff", tmp_path / "a.yaml", tmp_path / "b.yaml")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "the same" not in r.stdout and needle in r.stdout, r.stdout


# ----------------------------------------------------------------------------- pipes
def test_show_into_a_closed_pipe_exits_quietly(tmp_path):
    layers = {f"transformer.h.{i}.mlp.c_fc": "fp32" for i in range(2000)}  # > a pipe buffer
    Policy(default="bf16", layers=layers).save(tmp_path / "big.yaml")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.Popen([CONSOLE, "show", str(tmp_path / "big.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.read(100)  # `| head -c 100`
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 141), err
    assert "Traceback" not in err and "Broken pipe" not in err.replace("BrokenPipe", ""), err
    assert err.strip() == "", err


# ----------------------------------------------------------------------------- options that can only fail
def test_a_negative_validate_steps_is_refused_before_any_work(tmp_path):
    r = cli("tune", f"{TASKS}:tiny_gpt2_task", "-o", tmp_path / "p.yaml", *QUICK,
            "--validate-steps", "-5", cwd=tmp_path)
    assert r.returncode == 2 and "--validate-steps" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and os.listdir(tmp_path) == []


@pytest.mark.parametrize("where", ["output-journal", "storage-journal", "storage-sqlite"])
def test_a_path_under_a_regular_file_is_refused_before_any_work(tmp_path, where):
    (tmp_path / "afile").write_text("x")
    out, storage = tmp_path / "p.yaml", f"journal:{tmp_path / 'j.log'}"
    if where == "output-journal":
        out = tmp_path / "afile" / "p.yaml"
    elif where == "storage-journal":
        storage = f"journal:{tmp_path / 'afile' / 'j.log'}"
    else:
        storage = f"sqlite:///{tmp_path / 'afile' / 's.db'}"
    r = cli("tune", f"{TASKS}:tiny_gpt2_task", "-o", out, "--storage", storage, *QUICK,
            cwd=tmp_path)
    line = one_line_error(r, "afile", "not a folder")
    assert "host, port" not in line
    assert sorted(os.listdir(tmp_path)) == ["afile"] and "profiling" not in r.stderr


@pytest.mark.parametrize("study", ["", "   "])
def test_an_empty_study_name_is_refused(tmp_path, study):
    r = cli("tune", f"{TASKS}:tiny_gpt2_task", "-o", tmp_path / "p.yaml", "--study", study,
            *QUICK, cwd=tmp_path)
    one_line_error(r, "--study")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("cmd", ["tune", "profile"])
def test_fp32_alone_leaves_nothing_to_choose(tmp_path, cmd):
    r = cli(cmd, f"{TASKS}:tiny_gpt2_task", "-o", tmp_path / "p.yaml", "--formats", "fp32",
            "--target", "h100", cwd=tmp_path)
    line = one_line_error(r, "--formats fp32", "bf16")
    assert "measure_sensitivity" not in line and "profiling" not in r.stderr
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- storages
def _without_dac_override():
    """A child that runs as root but without the capabilities that let root ignore file
    permissions: it sees a read-only file as an unprivileged user would."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            os._exit(99)


def _as_user(**kw):
    """subprocess kwargs that make permission bits apply to the child, or skip."""
    if os.geteuid() != 0:
        return kw
    probe = subprocess.run([sys.executable, "-c", "pass"], preexec_fn=_without_dac_override)
    if probe.returncode != 0:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here, and root ignores permission bits")
    return dict(kw, preexec_fn=_without_dac_override)


def _study_db(path) -> str:
    url = f"sqlite:///{path}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(storage=url, study_name="other")
    return url


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_read_only_sqlite_study_is_a_one_line_error(tmp_path, what):
    (tmp_path / "db").mkdir()
    url = _study_db(tmp_path / "db" / "s.db")
    os.chmod(tmp_path / "db" / "s.db" if what == "file" else tmp_path / "db", 0o555)
    try:
        r = cli("tune", f"{TASKS}:tiny_gpt2_task", "-o", tmp_path / "p.yaml", "--storage", url,
                *QUICK, cwd=tmp_path, **_as_user())
    finally:
        os.chmod(tmp_path / "db", 0o755)
        os.chmod(tmp_path / "db" / "s.db", 0o644)
    line = one_line_error(r, "s.db" if what == "file" else str(tmp_path / "db"), "read-only"
                          if what == "file" else "not writable")
    assert "max length" not in line and "host, port" not in line


@pytest.mark.slow
def test_a_locked_sqlite_study_says_another_process_holds_it(tmp_path):
    url = _study_db(tmp_path / "s.db")
    holder = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        r = cli("tune", f"{TASKS}:tiny_gpt2_task", "-o", tmp_path / "p.yaml", "--storage", url,
                *QUICK, cwd=tmp_path)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    line = one_line_error(r, "s.db", "locked", "another process")
    assert "host, port" not in line


# ----------------------------------------------------------------------------- SIGTERM, resume
def _running_trials(db) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as c:
        return c.execute("SELECT count(*) FROM trials WHERE state = 'RUNNING'").fetchone()[0]


def _trials(db) -> list:
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}")
    (study,) = [s for s in storage.get_all_studies() if ".profile." not in s.study_name]
    return optuna.load_study(study_name=study.study_name, storage=storage).trials


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_tune_killed_during_a_trial_reruns_it_at_once_on_resume(tmp_path, sig):
    # the trial's loss sleeps while the `slow` file exists, so the test can catch it running
    task_file(tmp_path, imports="import os, time\n",
              body=("    def loss(model, batch):\n"
                    f"        if os.path.exists({str(tmp_path / 'slow')!r}):\n"
                    "            time.sleep(0.3)\n"
                    "        return model(**batch).loss\n"
                    "    t.loss_fn = loss\n"))
    args = [CONSOLE, "tune", "t.py:task", "-o", "p.yaml", *QUICK]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "warm start" in line:
            break
    assert proc.poll() is None, "".join(seen)
    (tmp_path / "slow").write_text("")
    deadline = time.monotonic() + 120
    while _running_trials(tmp_path / "p.study.db") == 0:
        assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
        time.sleep(0.05)
    if sig == signal.SIGKILL:
        # SIGTERM comes at once, whatever Optuna is doing; SIGKILL into the measurement (a
        # trial killed in Optuna's bookkeeping, before it says whose it is, waits for the
        # storage's heartbeat grace period)
        time.sleep(0.5)
        assert _running_trials(tmp_path / "p.study.db") == 1
    proc.send_signal(sig)
    err = "".join(seen) + proc.stderr.read()
    code = proc.wait(timeout=120)
    if sig == signal.SIGTERM:
        assert code == 143, err[-3000:]
        assert "Traceback" not in err and "terminated" in err and "rerun" in err, err[-3000:]
        # the trial was abandoned cleanly: not left RUNNING for a grace period
        assert _running_trials(tmp_path / "p.study.db") == 0
    else:
        assert code == -signal.SIGKILL
    (tmp_path / "slow").unlink()
    again = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    trials = _trials(tmp_path / "p.study.db")
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert any(t.user_attrs.get("origin") == "warm:fp32" for t in done), \
        [(t.state, t.user_attrs.get("origin")) for t in trials]
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]


# ----------------------------------------------------------------------------- show
def test_show_with_a_missing_profile_is_an_error(tmp_path):
    Policy(default="bf16").save(tmp_path / "p.yaml")
    one_line_error(cli("show", tmp_path / "p.yaml", "--profile", tmp_path / "nope.json"),
                   "nope.json")


def test_provenance_with_odd_values_is_shown_as_written():
    from autoprec.policy_text import _provenance_text

    prov = Provenance.from_dict({
        "device": "cpu", "study": {"name": "s", "trials": "many"},
        "memory": {"predicted_peak_bytes": "lots"},
        "timing": {"rounds": "x", "aa_noise": "noisy", "fp32_drift": "wide", "too_noisy": 1},
        "validation": [1, 2]})
    text = _provenance_text(prov)
    assert "lots" in text and "noisy" in text and "wide" in text and "many" in text, text
    prov = Provenance.from_dict({"memory": {"predicted_peak_bytes": 2 ** 20},
                                 "timing": {"rounds": 10, "aa_noise": 0.02,
                                            "fp32_drift": [0.98, 1.03]}})
    text = _provenance_text(prov)
    assert "1.0 MiB" in text and "2.0%" in text and "0.98-1.03x" in text, text


def test_show_of_a_policy_with_odd_provenance_does_not_crash(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("autoprec: 2\ndefault: bf16\ntuned:\n  device: cpu\n"
                    "  timing: {rounds: x, aa_noise: noisy, fp32_drift: [a]}\n"
                    "  memory: {predicted_peak_bytes: lots}\n  study: {name: s}\n")
    r = cli("show", path)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    if r.returncode == 2:  # refused on load (naming the key) is fine too
        one_line_error(r, "p.yaml")
    else:
        assert r.returncode == 0 and "provenance:" in r.stdout, r.stdout


def test_a_write_the_storage_refuses_mid_tune_is_one_line(capsys):
    """A lock taken after the tune opened its study (another process's long transaction): the
    write Optuna gives up on is a one-line error with the driver's reason, not a traceback."""
    from types import SimpleNamespace

    from autoprec.cli import _dispatch

    def tune(args):
        try:
            raise sqlite3.OperationalError("database is locked")
        except sqlite3.OperationalError as e:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the "
                                                         "commit. ... exceeding max length.") from e

    assert _dispatch(SimpleNamespace(fn=tune, cmd="tune")) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoprec: error:") and len(err.strip().splitlines()) == 1, err
    assert "database is locked" in err and "Another process holds a lock" in err, err
    assert "max length" not in err
