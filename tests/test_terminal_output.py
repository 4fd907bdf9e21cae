"""Nothing autoprec prints can be turned against its user, and no output it writes replaces a
device: text from policies, profiles and studies reaches the terminal escaped (`show`, `diff`,
`tune`, error lines), outputs that are devices, pipes or links into /proc are refused, and the
noise of other programs (torch's profiler) stays off the terminal. Through the real console
script wherever a command shows the behaviour."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import sys

import pytest

from autoprec._util import EscapingStream, atomic_write, not_a_file, quoted, shown, terminal_safe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "tasks.py")
AUTOPREC = shutil.which("autoprec", path=os.path.dirname(sys.executable)) or "autoprec"
QUICK = ("--formats", "fp32", "bf16", "--target", "h100", "--n-trials", "2")

# What a terminal acts on: C0 controls but the line feed (ESC starts every cursor, erase and
# title sequence; CR rewrites a line), DEL, C1 controls (a one-character CSI), bidi overrides
# and isolates, zero-width characters, line and paragraph separators.
_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e"
                      "\u2060-\u2069\ufeff]")
ESC_NAME = "evil\x1b[2J\x1b[H\r\u202e\x9b31m"


def cli(*args, cwd=None, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([AUTOPREC, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def no_control(text: str) -> None:
    found = _CONTROL.search(text)
    assert found is None, (repr(found.group()), repr(text[max(0, found.start() - 80):found.end() + 80]))


def one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout[-1000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("autoprec: error: ")]
    assert len(errors) == 1, r.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


# ============================================================================ the one function
@pytest.mark.parametrize("text", ["\x1b[2J", "a\rb", "x\u202ey", "new\nline", "\x07", "\x9b1A",
                                  "zero\u200bwidth", "sep\u2028arator", "del\x7f"])
def test_shown_makes_every_control_and_format_character_visible(text):
    out = shown(text)
    no_control(out)
    assert "\n" not in out and out != text
    assert shown(out) == out  # escaping twice changes nothing: text already shown stays put


def test_shown_bounds_what_it_quotes_and_says_how_much_it_left_out():
    out = quoted("x" * 1_000_000)
    assert len(out) < 200 and "999880 more characters" in out
    # the bound is on the characters taken, before escaping: at most 10 characters each
    assert len(shown("\x1b" * 10_000, 50)) < 50 * 10 + 40


def test_the_terminal_stream_escapes_what_fields_missed_but_keeps_lines_and_redraws():
    class Sink:
        def __init__(self):
            self.text = ""

        def write(self, t):
            self.text += t

        def isatty(self):
            return True

    sink = Sink()
    stream = EscapingStream(sink)
    assert stream.write("ok\n\ttab\rredraw \x1b[2J\u202e") == len("ok\n\ttab\rredraw \x1b[2J\u202e")
    assert sink.text == "ok\n\ttab\rredraw \\x1b[2J\\u202e" and stream.isatty()
    assert terminal_safe("plain ascii and ≤ × µ") == "plain ascii and ≤ × µ"


# ============================================================================ show, diff, tune
def _hostile_policy(path) -> str:
    path.write_text(
        "autoprec: 3\n"
        f"model: {{name: {json.dumps('GPT2' + ESC_NAME)}, fingerprint: {json.dumps('sha256:' + ESC_NAME)}}}\n"
        "default: bf16\n"
        "layers:\n"
        # a pattern that would print as its own line `lm_head: fp32` if newlines went through
        f"  {json.dumps('x' + chr(10) + 'lm_head: fp32')}: bf16\n"
        f"  {json.dumps('lm_head' + ESC_NAME)}: fp8\n"
        f"phases: [{{from_fraction: 0.9, name: {json.dumps('p' + ESC_NAME)}, formats: {{fp8: bf16}}}}]\n"
        "tuned:\n"
        f"  device: {json.dumps('cpu' + ESC_NAME)}\n"
        f"  task: {json.dumps('t' + ESC_NAME)}\n"
        f"  verdict: [{json.dumps('ok' + chr(13) + chr(27) + '[2Klm_head: fp32')}]\n"
        f"  study: {{name: {json.dumps('s' + ESC_NAME)}, trials: 3}}\n"
        f"  {json.dumps('k' + ESC_NAME)}: {json.dumps('v' + ESC_NAME)}\n")
    return str(path)


def _hostile_profile(path, fqn: str) -> None:
    layer = {"fqn": fqn, "kind": "linear", "module_type": "Linear" + ESC_NAME,
             "matmuls": [[1, 16, 32, 64]], "calls": ["linear"], "flops": 65536, "bytes": 1000,
             "params": 2048}
    sens = {"layer": fqn, "format": "bf16", "loss_rel_change": 0.001, "grad_rel_error": 0.01,
            "layer_grad_rel_error": None, "output_sqnr_db": 40.0, "act_overflow": None,
            "act_underflow": None, "grad_overflow": None, "grad_underflow": None,
            "finite": True, "n_batches": 1, "source": "measured"}
    times = {f: {"fqn": fqn, "format": f, "seconds": s, "raw_seconds": s}
             for f, s in (("fp32", 1e-5), ("bf16", 2e-5))}
    path.write_text(json.dumps({
        "autoprec_profile": 2, "task_name": "t" + ESC_NAME, "model_name": "M" + ESC_NAME,
        "device": "cpu" + ESC_NAME, "target": None, "capture_method": "hooks",
        "formats": ["fp32", "bf16"],
        "layers": [{"layer": layer, "sensitivity": {"bf16": sens}, "times": times}]}))


def test_show_and_diff_of_a_hostile_policy_and_profile_print_no_control_character(tmp_path):
    policy = _hostile_policy(tmp_path / "hostile.yaml")
    _hostile_profile(tmp_path / "hostile.profile.json", "lm_head" + ESC_NAME)
    (tmp_path / "plain.yaml").write_text("autoprec: 2\ndefault: bf16\nlayers:\n  lm_head: fp32\n")
    show = cli("show", policy)
    assert show.returncode == 0, show.stderr[-2000:]
    for text in (show.stdout, show.stderr):
        no_control(text)
    assert "lm_headevil\\x1b[2J" in show.stdout  # the hostile name, visibly
    # a newline inside a field stays inside its line: no line of its own says lm_head is fp32
    lines = show.stdout.splitlines()
    assert not any(line.strip().startswith("lm_head: fp32") for line in lines), show.stdout
    assert any("verdict: ok\\r\\x1b[2Klm_head: fp32" in line for line in lines), show.stdout
    diff = cli("diff", policy, tmp_path / "plain.yaml")
    assert diff.returncode == 1, diff.stderr[-2000:]
    for text in (diff.stdout, diff.stderr):
        no_control(text)
    assert "lm_headevil\\x1b[2J" in diff.stdout and "GPT2evil\\x1b" in diff.stdout


def test_a_file_name_in_an_error_line_is_escaped(tmp_path):
    r = cli("show", tmp_path / f"missing{ESC_NAME}.yaml")
    line = one_line_error(r, "missing")
    no_control(r.stderr)
    assert "\\x1b[2J" in line


@pytest.mark.slow
def test_a_tampered_study_cannot_write_to_the_terminal_through_tune(tmp_path):
    args = ("tune", f"{TASKS}:tiny_gpt2_task", "-o", tmp_path / "p.yaml", *QUICK)
    first = cli(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    with sqlite3.connect(tmp_path / "p.study.db") as con:
        n = con.execute("UPDATE trial_user_attributes SET value_json = ? WHERE key = 'origin'",
                        (json.dumps("warm" + ESC_NAME),)).rowcount
    assert n >= 1
    again = cli(*args, cwd=tmp_path)  # resumes the study: its trials are read back
    assert again.returncode == 0, again.stderr[-3000:]
    for text in (again.stdout, again.stderr):
        no_control(text)
    assert "(warmevil\\x1b[2J" in again.stdout, again.stdout
    # and the log of the first run had none of someone else's debug output
    assert "USDT" not in first.stderr and "profiler_start" not in first.stderr, first.stderr
    # the sensitivity pass counts from 1, and says which batch a layer's line is about
    counts = re.findall(r"^sensitivity: (\d+)/(\d+) (\S+) \(first-order estimate, batch (\d)/2\)$",
                        first.stderr, re.M)
    assert counts and counts[0][0] == "1", first.stderr[-3000:]
    by_layer: dict[str, list[str]] = {}
    for _, _, name, batch in counts:
        by_layer.setdefault(name, []).append(batch)
    # (a unit's last tick is its "N/N (time)" line, without a label)
    assert all(batches in (["1", "2"], ["1"]) for batches in by_layer.values()), by_layer
    assert sum(batches == ["1", "2"] for batches in by_layer.values()) > len(by_layer) / 2


# ============================================================================ outputs that are not files
def _char_device(path) -> bool:
    """A character device like /dev/null at ``path``: False where this user may not make one."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError):
        return False
    return True


def test_the_atomic_write_neither_replaces_nor_writes_into_a_device_a_fifo_or_a_proc_link(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc_link, dev_link = tmp_path / "stdout", tmp_path / "devnull"
    os.symlink("/proc/self/fd/1", proc_link)
    os.symlink("/dev/null", dev_link)
    cases = [(fifo, "a FIFO"), (proc_link, "a link into /proc"), (dev_link, "a link into /dev")]
    if _char_device(tmp_path / "null"):
        cases.append((tmp_path / "null", "a character device"))
    for path, kind in cases:
        before = os.lstat(path)
        with pytest.raises(ValueError, match=re.escape(kind)):
            atomic_write(path, "x")
        after = os.lstat(path)
        assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino), path
    assert [f for f in os.listdir(tmp_path) if f.endswith(".tmp")] == []
    # a link to a regular file (or to nothing) is replaced, never followed, as before
    target = tmp_path / "target"
    target.write_text("keep")
    os.symlink(target, tmp_path / "link")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    for link in ("link", "dangling"):
        assert not_a_file(tmp_path / link) is None
        atomic_write(tmp_path / link, "new")
        assert not os.path.islink(tmp_path / link) and (tmp_path / link).read_text() == "new"
    assert target.read_text() == "keep"


@pytest.mark.parametrize("kind", ["device", "proc-link", "fifo"])
def test_tune_and_export_refuse_an_output_that_is_not_a_file_before_any_work(tmp_path, kind):
    out = tmp_path / "out"
    if kind == "device":
        if not _char_device(out):
            pytest.skip("this user may not make device nodes (mknod)")
    elif kind == "proc-link":
        os.symlink("/proc/self/fd/1", out)
    else:
        os.mkfifo(out)
    before = os.lstat(out)
    r = cli("tune", f"{TASKS}:tiny_gpt2_task", "-o", out, *QUICK, cwd=tmp_path, timeout=60)
    one_line_error(r, "-o", "not a file")
    assert "profiling" not in r.stderr
    policy = tmp_path / "p.yaml"
    policy.write_text("autoprec: 2\ndefault: bf16\nlayers:\n  lm_head: fp32\n")
    r = cli("export", policy, "--to", "fqn", "--model", f"{TASKS}:tiny_gpt2_task", "-o", out,
            cwd=tmp_path, timeout=60)
    one_line_error(r, "not a file")
    after = os.lstat(out)
    assert (after.st_mode, after.st_ino, after.st_rdev) == \
        (before.st_mode, before.st_ino, before.st_rdev)
    assert sorted(os.listdir(tmp_path)) == ["out", "p.yaml"]


# ============================================================================ messages
@pytest.mark.slow
def test_a_final_fp16_phase_leaves_bf16_layers_in_bf16_and_says_so(tmp_path):
    # cpu-amx prices bf16 fast: the tiny model's winner runs bf16 layers
    out = tmp_path / "p.yaml"
    r = cli("tune", f"{TASKS}:tiny_gpt2_task", "-o", out, "--formats", "fp32", "bf16",
            "--target", "cpu-amx", "--n-trials", "2", "--final-phase", "0.9:fp16", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    from autoprec import Format, load_policy

    policy = load_policy(out)
    if Format.BF16 not in policy.formats_used():
        pytest.skip("the tune chose no bf16 layer here: nothing for the final phase to leave")
    assert "leaves the bf16 layers as they are" in r.stderr, r.stderr[-2000:]
    for i in range(len(policy.phases) + 1):
        assert Format.FP16 not in policy.phase(i).formats_used(), policy.phase(i)


def test_a_final_phase_moves_scaled_formats_to_fp16_but_never_bf16():
    from autoprec import Format, Policy
    from autoprec.phases import final_phase, kept_for_range

    used = Policy(default="bf16", layers={"a": "fp8", "b": "fp32"}).formats_used()
    assert kept_for_range(Format.FP16, used) == {Format.BF16}
    assert final_phase(0.9, "fp16", used).formats == {"scaled": Format.FP16}
    assert final_phase(0.9, "fp16", {Format.BF16}) is None
    assert final_phase(0.9, "fp32", used).formats == {"scaled": Format.FP32, "bf16": Format.FP32}
    assert kept_for_range(Format.FP32, used) == set()


def test_a_study_of_a_newer_optuna_is_named_as_such_not_as_a_database_server(tmp_path):
    import optuna

    db = tmp_path / "p.study.db"
    optuna.create_study(storage=f"sqlite:///{db}", study_name="x")
    with sqlite3.connect(db) as con:
        # what a newer optuna's migration leaves: its schema's revision, its own version
        con.execute("UPDATE version_info SET schema_version = 999, library_version = '99.0.0'")
        con.execute("UPDATE alembic_version SET version_num = 'v99.0.0.a'")
    r = cli("tune", f"{TASKS}:tiny_gpt2_task", "-o", tmp_path / "p.yaml", *QUICK, cwd=tmp_path)
    line = one_line_error(r, "optuna 99.0.0", "newer than this optuna")
    assert "host, port" not in line and "credentials" not in line


def test_a_fifo_given_as_a_policy_or_profile_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "policy.yaml"
    os.mkfifo(fifo)
    one_line_error(cli("show", fifo, timeout=60), "not a regular file")
    plain = tmp_path / "plain.yaml"
    plain.write_text("autoprec: 2\ndefault: bf16\nlayers:\n  lm_head: fp32\n")
    os.mkfifo(tmp_path / "p.json")
    one_line_error(cli("show", plain, "--profile", tmp_path / "p.json", timeout=60))


def test_a_profile_of_millions_of_tiny_values_is_refused_in_seconds(tmp_path):
    """60 MiB of `{}` is within the byte bound but 20M objects: json would take seconds and
    gigabytes to build them (45 s under load, measured); the count before parsing refuses it."""
    import time

    from autoprec._util import MAX_JSON_VALUES, read_json

    path = tmp_path / "p.profile.json"
    path.write_bytes(b"[" + b",".join([b"{}"] * 20_000_000) + b"]")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="values") as e:
        read_json(path, "profile")
    took = time.perf_counter() - t0
    assert took < 2.0 and f"{MAX_JSON_VALUES:,}" in str(e.value), (took, str(e.value))
