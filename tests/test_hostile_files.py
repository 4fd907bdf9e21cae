"""Files autoprec reads are untrusted and files it writes must not be hijacked: hostile globs,
planted symlinks, full disks, oversized or deeply nested policies, profiles and guard states.
CLI cases run the real `autoprec` console script."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

import autoprec
from autoprec import Format, Policy, PolicyError, Profile, load_policy
from autoprec._util import atomic_write, read_json

AUTOPREC = shutil.which("autoprec", path=os.path.dirname(sys.executable)) or "autoprec"


def cli(*args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([AUTOPREC, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)


def one_line_error(r, *needles):
    """The run failed as bad input: exit 2, one `autoprec: error:` line, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("autoprec: error: ")]
    assert len(errors) == 1, r.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def write(path, text):
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def tiny_profile(fqn="lm_head") -> dict:
    """A minimal valid profile record (what `tune` writes beside a policy), one Linear layer."""
    layer = {"fqn": fqn, "kind": "linear", "module_type": "Linear", "matmuls": [[1, 8, 32, 64]],
             "calls": ["linear"], "flops": 32768, "bytes": 1000, "params": 2048}
    sens = {"layer": fqn, "format": "bf16", "loss_rel_change": 0.001, "grad_rel_error": 0.01,
            "layer_grad_rel_error": None, "output_sqnr_db": 40.0, "act_overflow": None,
            "act_underflow": None, "grad_overflow": None, "grad_underflow": None,
            "finite": True, "n_batches": 1, "source": "measured"}

    def t(fmt, s):
        return {"fqn": fqn, "format": fmt, "seconds": s, "raw_seconds": s}

    return {"autoprec_profile": 2, "task_name": "t", "model_name": "M", "device": "cpu",
            "target": None, "capture_method": "hooks", "formats": ["fp32", "bf16"],
            "layers": [{"layer": layer, "sensitivity": {"bf16": sens},
                        "times": {"fp32": t("fp32", 1e-5), "bf16": t("bf16", 2e-5)}}]}


SIMPLE_POLICY = "autoprec: 2\ndefault: bf16\nlayers:\n  lm_head: fp32\n"


# ============================================================================ 1. globs
HOSTILE = ["*" * 199 + "!", "*?" * 100, "**a" * 66 + "!!", "?*" * 99 + "**", "**." * 66 + "!!"]
NAMES = ["transformer.h.0.mlp.c_fc", "a" * 120, "a." * 60 + "a", "model.layers.31.self_attn"]


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (instead of hanging) when the block runs past ``seconds``: the regex engine checks
    for signals, so the alarm interrupts a backtracking match."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_hostile_globs_are_decided_in_linear_time():
    for pattern in HOSTILE:
        assert len(pattern) == 200
        policy = Policy(default="bf16", layers={pattern: "fp32"})
        t0 = time.perf_counter()
        with deadline(10):
            for name in NAMES:
                policy.format_for(name)
        # generous: a backtracking matcher needs years on these, a linear one microseconds
        assert time.perf_counter() - t0 < 1.0, pattern


def test_hostile_glob_through_show(tmp_path):
    # `show` with a profile beside the policy matches every profiled layer against the globs
    layer = "transformer.h.0.mlp.c_fc_with_a_long_name_for_the_matcher"
    pattern = "*" * 199 + "!"
    write(tmp_path / "p.yaml", f'autoprec: 2\ndefault: bf16\nlayers:\n  "{pattern}": fp32\n')
    (tmp_path / "p.profile.json").write_text(json.dumps(tiny_profile(layer)))
    t0 = time.perf_counter()
    try:
        r = cli("show", tmp_path / "p.yaml", timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("show hung on a 200-character glob")
    assert r.returncode == 0, r.stderr[-3000:]
    assert layer in r.stdout
    assert time.perf_counter() - t0 < 30


def test_glob_semantics_unchanged():
    p = Policy(default="bf16", layers={"a.*.c": "fp32"})
    assert p.match("a.b.c") == "a.*.c" and p.match("a..c") == "a.*.c"
    assert p.match("a.b.x.c") is None and p.match("a.c") is None
    p = Policy(default="bf16", layers={"a.**.c": "fp32"})
    assert p.match("a.b.c") and p.match("a.b.x.c") and p.match("a.c") is None
    p = Policy(default="bf16", layers={"h.?": "fp32", "x*y": "fp16", "**z": "fp8", "q**": "fp32"})
    assert p.match("h.1") == "h.?" and p.match("h.12") is None and p.match("h..") is None
    assert p.match("xy") == "x*y" and p.match("xaby") == "x*y" and p.match("xa.by") is None
    assert p.match("z") == "**z" and p.match("a.b.z") == "**z" and p.match("a.b.zz") == "**z"
    assert p.match("q") == "q**" and p.match("q.r.s") == "q**"
    # literal characters that are regex syntax elsewhere stay literal
    p = Policy(default="bf16", layers={"a+b.[x]": "fp32", "c|d": "fp16"})
    assert p.match("a+b.[x]") == "a+b.[x]" and p.match("aab.x") is None and p.match("c") is None


def test_overlong_pattern_is_refused(tmp_path):
    path = write(tmp_path / "p.yaml", f'autoprec: 2\ndefault: bf16\nlayers:\n  "{"a." * 500}": fp32\n')
    with pytest.raises(PolicyError, match=r"line 4 is 1000 characters.*at most 512"):
        load_policy(path)


class _RootComputes(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))
        self.child = nn.Linear(16, 16)

    def forward(self, x):
        return self.child(x @ self.w)


@pytest.mark.parametrize("glob", ["*", "**", "?*"])
def test_glob_never_matches_the_root(glob):
    p = Policy(default="bf16", layers={glob: "fp32"})
    assert p.match("") is None
    assert p.format_for("") is Format.BF16          # only `default` governs the root
    assert p.format_for("child") is Format.FP32
    assert p.format_for("child.sub") is Format.FP32
    assigned, unused = p.resolve(_RootComputes())
    assert "" not in assigned and assigned == {"child": Format.FP32} and not unused


def test_star_policy_root_matmul_runs_default():
    model = _RootComputes()
    autoprec.apply(model, Policy(default="bf16", layers={"*": "fp32"}))
    assert autoprec.applied_formats(model).get("") is Format.BF16


# ============================================================================ 2, 3. writes
def test_atomic_write_ignores_a_symlink_at_the_old_temp_name(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "p.yaml"
    os.symlink(victim, tmp_path / f".p.yaml.tmp-{os.getpid()}")
    Policy(default="fp32").save(out)
    assert victim.read_text() == "precious\n"
    assert not out.is_symlink() and out.is_file()
    assert load_policy(out).default is Format.FP32


def _tune_result(tmp_path):
    from autoprec.policy import Interval
    from autoprec.tuning.report import TrialResult, TuneResult

    trial = TrialResult(number=0, assignment={"lm_head": "bf16"}, step_seconds=1.0,
                        speedup=Interval(1.2, 1.1, 1.3, 5), loss_increase=0.001,
                        grad_error=0.01, feasible=True, finite=True)
    return TuneResult(policy=Policy(default="bf16"), best=trial, fp32_seconds=1.2,
                      pareto=[trial], trials=[trial], best_warm_start=None, study_name="s",
                      storage=f"sqlite:///{tmp_path}/s.db")


def test_every_output_replaces_a_symlink_instead_of_following_it(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    out.mkdir()
    victims = {}
    for name in ("p.yaml", "p.pareto.csv", "p.pareto.png", "p.profile.json",
                 f".p.yaml.tmp-{os.getpid()}", f".p.pareto.csv.tmp-{os.getpid()}",
                 f".p.profile.json.tmp-{os.getpid()}"):
        victim = tmp_path / f"victim-{name}"
        victim.write_text("precious\n")
        os.symlink(victim, out / name)
        victims[name] = victim
    written = _tune_result(tmp_path).save(out / "p.yaml")
    prof = Profile.from_dict(tiny_profile())
    prof.save(out / "p.profile.json")
    for victim in victims.values():
        assert victim.read_text() == "precious\n", victim
    assert sorted(os.path.basename(p) for p in written) == ["p.pareto.csv", "p.pareto.png",
                                                            "p.yaml"]
    for name in ("p.yaml", "p.pareto.csv", "p.pareto.png", "p.profile.json"):
        assert not (out / name).is_symlink() and (out / name).is_file(), name
    assert (out / "p.pareto.png").read_bytes().startswith(b"\x89PNG")
    assert Profile.load(out / "p.profile.json").layers[0].fqn == "lm_head"


def test_atomic_write_bytes_mode_and_no_leftovers(tmp_path):
    old = os.umask(0o022)
    try:
        path = atomic_write(tmp_path / "sub" / "b.bin", b"\x00\x01bytes")
        assert open(path, "rb").read() == b"\x00\x01bytes"
        assert os.stat(path).st_mode & 0o777 == 0o644  # readable, like any file we write
        atomic_write(tmp_path / "t.txt", "text é\n")
        assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "text é\n"
    finally:
        os.umask(old)
    assert sorted(os.listdir(tmp_path)) == ["sub", "t.txt"]
    assert os.listdir(tmp_path / "sub") == ["b.bin"]


def test_full_disk_keeps_the_old_file_and_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "p.yaml"
    Policy(default="bf16").save(path)
    before = path.read_bytes()
    real_write = os.write

    def full(fd, data):
        if fd > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(ValueError) as e:
        Policy(default="fp32", layers={"x": "fp16"}).save(path)
    monkeypatch.undo()
    # a plain ValueError: the CLI prints it as `autoprec: error: ...` and exits 2
    assert type(e.value) is ValueError
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "space" in msg and "unchanged" in msg
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["p.yaml"]  # no temp file left behind


def test_unwritable_paths_are_one_line_errors(tmp_path):
    regular = tmp_path / "file"
    regular.write_text("x")
    with pytest.raises(ValueError, match=r"not a folder|Not a directory") as e:
        atomic_write(regular / "p.yaml", "x")
    assert type(e.value) is ValueError and str(regular) in str(e.value)
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ValueError, match="directory") as e:
        Policy(default="bf16").save(tmp_path / "dir.yaml")
    assert type(e.value) is ValueError


# ============================================================================ 5. policies
def test_oversized_policy_is_refused_quickly(tmp_path):
    path = tmp_path / "big.yaml"
    with open(path, "w") as f:
        f.write(SIMPLE_POLICY)
        f.write(("# " + "x" * 1000 + "\n") * 5000)  # 5 MB of comment: valid YAML
    t0 = time.perf_counter()
    with pytest.raises(PolicyError, match=r"big.yaml.*MiB"):
        load_policy(path)
    assert time.perf_counter() - t0 < 5
    one_line_error(cli("show", path), "big.yaml", "MiB")


@pytest.mark.parametrize("nest", ["[" * 3000 + "]" * 3000, "{a: " * 3000 + "1" + "}" * 3000])
def test_deeply_nested_tuned_is_one_line_error(tmp_path, nest):
    path = write(tmp_path / "p.yaml", SIMPLE_POLICY + f"tuned: {nest}\n")
    with pytest.raises(PolicyError, match=r"line 5.*nest"):
        load_policy(path)
    one_line_error(cli("show", path), "p.yaml", "nest")


def test_block_nesting_is_bounded(tmp_path):
    deep = "".join(" " * i + "a:\n" for i in range(1000)) + " " * 1000 + "b: 1\n"
    path = tmp_path / "p.yaml"
    path.write_text(SIMPLE_POLICY + "tuned:\n" + textwrap.indent(deep, " "))
    with pytest.raises(PolicyError, match="nest"):
        load_policy(path)


@pytest.mark.parametrize("tuned, field", [
    ("speedup_vs_fp32: {low: 1}", "speedup_vs_fp32"),
    ("speedup_vs_fp32: {value: fast, low: 1, high: 2}", "speedup_vs_fp32"),
    ("speedup_vs_fp32: fast", "speedup_vs_fp32"),
    ('memory: "lots"', "memory"),
    ("memory: {predicted_peak_bytes: lots}", "memory"),
    ("budget: {max_loss_increase: 0.01, colour: red}", "budget"),
    ("budget: {max_loss_increase: high}", "budget"),
    ("timing: {rounds: 3, aa_noise: loud}", "timing"),
    ("timing: {rounds: 3, aa_noise: 0.01, fp32_drift: [a, b]}", "timing"),
    ("timing: {rounds: 3, aa_noise: 0.01, run_interval: [1, 2, 3]}", "timing"),
    ("timing: 3", "timing"),
    ("study: [1, 2]", "study"),
    ("verdict: [{a: 1}]", "verdict"),
    ("device: {gpu: 1}", "device"),
    ("torch: [2]", "torch"),
    ("task: 12", "task"),
    ("loss_increase: much", "loss_increase"),
    ("grad_error: [1]", "grad_error"),
])
def test_bad_provenance_is_refused_on_load(tmp_path, tuned, field):
    path = write(tmp_path / "p.yaml", SIMPLE_POLICY + f"tuned:\n  {tuned}\n")
    with pytest.raises(PolicyError, match=rf"tuned\.{field}.*line 6") as e:
        load_policy(path)
    assert "\n" not in str(e.value)


def test_bad_provenance_through_show(tmp_path):
    path = write(tmp_path / "p.yaml", SIMPLE_POLICY + "tuned:\n  timing: {rounds: 3, aa_noise: loud}\n")
    one_line_error(cli("show", path), "p.yaml", "tuned.timing")


def test_good_provenance_shows(tmp_path):
    tuned = {"device": "cpu", "torch": "2.9", "task": "t",
             "budget": {"max_loss_increase": 0.01, "max_grad_error": None},
             "speedup_vs_fp32": {"value": 1.2, "low": 1.1, "high": 1.3, "rounds": 5},
             "loss_increase": 0.001, "grad_error": 0.01, "verdict": ["kept trial 3"],
             "study": {"name": "s", "trials": 4, "distinct": 3},
             "timing": {"rounds": 5, "aa_noise": 0.01, "too_noisy": False,
                        "fp32_drift": [0.99, 1.01], "run_interval": [1.13, 1.27]},
             "memory": {"predicted_peak_bytes": 123456},
             "fp8_runs_bf16": {"lm_head": "a shape FP8 cannot take"},
             "validation": {"steps": 10, "gap": 0.001, "noise": 0.002, "passed": True, "trial": 3},
             "guard": [{"step": 3, "layer": "lm_head", "from": "fp8", "to": "bf16"}],
             "my_note": "hand-written", "metrics": {"other": 1}}
    Policy(default="bf16", tuned=tuned).save(tmp_path / "p.yaml")
    p = load_policy(tmp_path / "p.yaml")
    prov = p.provenance
    assert prov.speedup.value == 1.2 and prov.budget.max_grad_error is None
    assert prov.verdict == ("kept trial 3",)
    r = cli("show", tmp_path / "p.yaml")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "speed-up vs fp32: 1.20x" in r.stdout and "my_note: hand-written" in r.stdout
    assert "(5 timing rounds; 95% of re-timings as long land in the interval)" in r.stdout
    assert "this run's 95% interval of the ratio 1.13-1.27x" in r.stdout, r.stdout
    # older files: a bare-number speed-up and `metrics`/`objective` still read
    old = Policy(default="bf16", tuned={"objective": {"max_loss_increase": 0.02},
                                        "metrics": {"speedup_vs_fp32": 1.5, "loss_increase": 0}})
    assert old.provenance.speedup.value == 1.5 and old.provenance.budget.max_loss_increase == 0.02


def test_integer_layer_key_suggests_quotes(tmp_path):
    path = write(tmp_path / "p.yaml", "autoprec: 2\ndefault: bf16\nlayers:\n  0: fp32\n")
    with pytest.raises(PolicyError, match=r'line 4.*quote it.*"0": fp32'):
        load_policy(path)
    one_line_error(cli("show", path), '"0": fp32')


# ============================================================================ 6. JSON
def _show_profile(tmp_path, record):
    (tmp_path / "p.yaml").write_text(SIMPLE_POLICY)
    (tmp_path / "p.profile.json").write_text(record if isinstance(record, str) else
                                             json.dumps(record))
    return cli("show", tmp_path / "p.yaml")


def test_valid_profile_shows(tmp_path):
    r = _show_profile(tmp_path, tiny_profile())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "lm_head" in r.stdout


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["layers"][0]["layer"].update(fqn=123), "fqn"),
    (lambda d: d["layers"][0]["layer"].update(flops=10 ** 400), "flops"),
    (lambda d: d["layers"][0]["layer"].update(matmuls=[[1, 8, 10 ** 400, 64]]), "matmuls"),
    (lambda d: d["layers"][0]["times"]["bf16"].update(seconds=10 ** 400), "seconds"),
    (lambda d: d["layers"][0]["sensitivity"]["bf16"].update(loss_rel_change=[1]), "loss_rel_change"),
    (lambda d: d.update(task_name={"a": 1}), "task_name"),
    (lambda d: d.update(layers={"a": 1}), "layers"),
    (lambda d: d["layers"].append(7), "layers"),
    (lambda d: d.update(edges=[["a", 5]]), "edges"),
    (lambda d: d.update(elapsed="long"), "elapsed"),
])
def test_bad_profile_fields_are_one_line_errors(tmp_path, edit, field):
    record = tiny_profile()
    edit(record)
    path = tmp_path / "p.profile.json"
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=rf"p.profile.json.*{field}") as e:
        Profile.load(path)
    assert type(e.value) is ValueError and "\n" not in str(e.value)


def test_bad_profile_through_show(tmp_path):
    record = tiny_profile()
    record["layers"][0]["layer"]["fqn"] = 123
    one_line_error(_show_profile(tmp_path, record), "p.profile.json", "layers[0].layer.fqn")
    record = tiny_profile()
    record["layers"][0]["layer"]["flops"] = 10 ** 400
    one_line_error(_show_profile(tmp_path, record), "p.profile.json", "flops", "401 digits")


def test_deeply_nested_profile_is_one_line_error(tmp_path):
    record = json.dumps(tiny_profile())[:-1] + ', "edges": ' + "[" * 100_000 + "]" * 100_000 + "}"
    one_line_error(_show_profile(tmp_path, record), "p.profile.json", "nest")
    with pytest.raises(ValueError, match="nest"):
        read_json(tmp_path / "p.profile.json", "profile")


def test_oversized_json_is_refused(tmp_path):
    path = tmp_path / "big.json"
    with open(path, "wb") as f:
        f.truncate(65 * 2 ** 20)  # sparse: no disk used, no time spent
    with pytest.raises(ValueError, match=r"big.json.*MiB"):
        read_json(path, "profile")


def test_huge_json_int_is_one_line_error(tmp_path):
    path = tmp_path / "p.profile.json"
    path.write_text(json.dumps(tiny_profile())[:-1] + ', "elapsed": ' + "9" * 5000 + "}")
    with pytest.raises(ValueError, match="p.profile.json") as e:
        read_json(path, "profile")
    assert type(e.value) is ValueError


def test_deeply_nested_guard_state_is_one_line_error(tmp_path):
    from autoprec.integrations import GUARD_STATE_FILE, load_guard_state
    from autoprec.runtime.guard import Guard

    (tmp_path / GUARD_STATE_FILE).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PolicyError, match=rf"{GUARD_STATE_FILE}.*nest"):
        load_guard_state(Guard(), tmp_path)


def test_guard_outputs_carry_hostile_module_names_as_escaped_text(tmp_path):
    # the amended policy's comment lines and the guard state name modules of the model; a name
    # with a line break must stay inside its comment, and planted symlinks at either output
    # must be replaced, not followed
    import torch
    from torch import nn

    import autoprec
    from autoprec.integrations import GUARD_STATE_FILE, save_guard_state

    hostile = "fc\ndefault: fp8\n#"
    model = nn.Sequential()
    model.add_module("inp", nn.Linear(8, 8))
    model.add_module(hostile, nn.Linear(8, 8))
    autoprec.apply(model, Policy(default="fp32", layers={hostile: "fp16"}),
                   guard=autoprec.GuardConfig(patience=2))
    guard = autoprec.get_guard(model)
    with torch.no_grad():
        model.get_submodule(hostile).weight[0, 0] = float("inf")
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        model.zero_grad(set_to_none=True)
        guard.step()
    assert guard.events and hostile in str(guard.events[0])
    victims = {}
    for name in ("amended.yaml", GUARD_STATE_FILE):
        victims[name] = tmp_path / f"victim-{name}"
        victims[name].write_text("precious\n")
        os.symlink(victims[name], tmp_path / name)
    guard.save(tmp_path / "amended.yaml")
    save_guard_state(guard, tmp_path)
    for name, victim in victims.items():
        assert victim.read_text() == "precious\n", name
        assert not (tmp_path / name).is_symlink()
    text = (tmp_path / "amended.yaml").read_text()
    assert all(line.startswith("#") for line in text.splitlines()[:len(guard.events)]), text
    amended = load_policy(tmp_path / "amended.yaml")
    assert amended.default is Format.FP32 and amended.layers == {hostile: Format.FP32}
