"""tune(): warm starts, the integer program, constraints, reproducibility, resuming after
SIGKILL and several workers sharing one Optuna storage (SQLite, journal file, PostgreSQL)."""

from __future__ import annotations

import functools
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import optuna
import pytest
import torch
from tasks import overflow_gpt2_task, small_gpt2_task, tiny_gpt2_task

import autoprec
from autoprec import Format, Policy
from autoprec.policy import Interval
from autoprec.profiling import profile
from autoprec.tuning import tune
from autoprec.tuning.space import group_layers
from autoprec.tuning.storage import open_storage
from autoprec.tuning.warmstart import milp_assignments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "tasks.py")


@pytest.fixture(scope="module")
def small_profile():
    return profile(small_gpt2_task(), target="cpu-amx", progress=False)


def test_group_layers():
    fqns = ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc", "transformer.h.0.attn",
            "lm_head"]
    assert group_layers(fqns, "layer") == {f: [f] for f in fqns}
    g = group_layers(fqns, "role")
    assert g == {"transformer.h.*.mlp.c_fc": fqns[:2], "transformer.h.*.attn": [fqns[2]],
                 "lm_head": ["lm_head"]}
    assert group_layers(fqns, "auto", max_units=3) == g
    assert group_layers(fqns, "auto", max_units=16) == {f: [f] for f in fqns}


def test_milp_respects_budgets(small_profile):
    prof = small_profile
    units = group_layers([lp.fqn for lp in prof.layers], "layer")
    fmts = [Format.FP32, Format.BF16]
    sols = milp_assignments(prof, units, fmts, [0.0, 1e-5, 1.0])
    assert sols, "the integer program found nothing"
    for budget, choice in sols:
        err = sum(abs(prof.loss_change(u, Format(f))) for u, f in choice.items())
        assert err <= budget * (1 + 1e-5) + 1e-12, (budget, err)
    # budget 0 allows only formats with zero measured error; a loose budget takes every
    # layer whose bf16 time beats fp32
    loose = dict(sols)[1.0]
    faster = {u for u in units if prof.seconds(u, Format.BF16) < prof.seconds(u, Format.FP32)}
    assert {u for u, f in loose.items() if f == "bf16"} == faster
    assert faster, "cost model should price some bf16 layer faster on cpu-amx"


def test_tune_writes_policy_front_and_provenance(tmp_path, small_profile):
    out = tmp_path / "small.yaml"
    res = tune(small_gpt2_task(), target="cpu-amx", n_trials=10, seed=1, output=str(out),
               prof=small_profile, progress=False)
    written = res.save(out)
    assert set(map(os.path.basename, written)) >= {"small.yaml", "small.pareto.csv",
                                                   "small.pareto.png"}
    pol = autoprec.load_policy(out)
    prov = pol.provenance
    assert prov.budget == autoprec.Budget(0.01, 0.25)
    assert prov.speedup.value > 1.0 and prov.speedup.rounds == 0  # priced: exact
    assert "cpu-amx" in prov.device
    # the winner is the fastest feasible trial, and it beats all-fp32 on the cost model
    feasible = [t for t in res.trials if t.feasible]
    assert res.best.step_seconds == min(t.step_seconds for t in feasible)
    assert any(t.origin == "warm:fp32" for t in res.trials)
    over = res.improvement_over_warm_start
    assert over is None or (math.isfinite(over.value) and over.value >= 1.0)
    # the policy applies to a fresh model of the task without complaint (fingerprint matches)
    model = small_gpt2_task().build_model()
    autoprec.apply(model, pol)
    rows = (tmp_path / "small.pareto.csv").read_text().splitlines()
    assert rows[0].startswith("trial,origin,step_seconds") and len(rows) == len(res.trials) + 1


def test_same_seed_same_policy(tmp_path, small_profile):
    kw = dict(target="cpu-amx", n_trials=12, prof=small_profile, progress=False)
    a = tune(small_gpt2_task(), seed=7, output=str(tmp_path / "a.yaml"), **kw)
    b = tune(small_gpt2_task(), seed=7, output=str(tmp_path / "b.yaml"), **kw)
    assert a.policy == b.policy
    assert [t.assignment for t in a.trials] == [t.assignment for t in b.trials]


def test_held_out_gradients_recomputed_per_trial_give_the_same_trials(tmp_path, small_profile,
                                                                     monkeypatch, capsys):
    # "auto" recomputes the reference's held-out gradients beside each trial when keeping them
    # would take over a quarter of the free memory (here: a machine with 1 KiB free); every
    # trial's numbers are those of a tune that kept them, bitwise
    deviation = sys.modules["autoprec.measure.deviation"]
    kw = dict(target="cpu-amx", n_trials=6, seed=3, prof=small_profile,
              formats=("fp32", "bf16", "fp16", "fp8"))
    kept = tune(small_gpt2_task(), holdout_gradients="kept", output=str(tmp_path / "k.yaml"),
                progress=False, **kw)
    monkeypatch.setattr(deviation, "free_memory", lambda device: 1024)
    lean = tune(small_gpt2_task(), output=str(tmp_path / "r.yaml"), **kw)
    assert "each trial computes each batch's again" in capsys.readouterr().err
    numbers = lambda r: [(t.assignment, t.loss_increase, t.grad_error, t.grad_bias)  # noqa: E731
                         for t in r.trials]
    assert numbers(lean) == numbers(kept) and lean.policy == kept.policy
    assert any(Format.FP16 in t.assignment.values() for t in lean.trials)
    # kept outside memory (a temporary file here), read back as each trial's arrive: the same
    spilled = tune(small_gpt2_task(), holdout_gradients="spilled",
                   output=str(tmp_path / "s.yaml"), progress=False, **kw)
    assert numbers(spilled) == numbers(kept) and spilled.policy == kept.policy
    with pytest.raises(ValueError, match="holdout_gradients must be one of auto, kept, "
                                         "recomputed, spilled; got 'some'"):
        autoprec.TuneConfig(holdout_gradients="some")


def test_nonfinite_trials_are_infeasible_not_crashes(tmp_path):
    task = overflow_gpt2_task()
    res = tune(task, formats=("fp32", "fp16"), target="h100", n_trials=8,
               output=str(tmp_path / "o.yaml"), progress=False, grouping="layer")
    # the planted layer overflows FP16: the profile flags it, so the search never offers it
    prof = res.profile
    assert not prof.allows("transformer.h.1.mlp.c_proj", Format.FP16)
    assert prof.layer("transformer.h.1.mlp.c_proj").sensitivity[Format.FP16].finite is False
    assert res.policy.format_for("transformer.h.1.mlp.c_proj") is not Format.FP16
    # and a policy that forces it anyway is judged infeasible by evaluation, not a crash
    from autoprec.tuning import evaluate_policy

    bad = evaluate_policy(task, Policy(default="fp16"), prof=prof, target="h100")
    assert not bad.finite and not bad.feasible


# ----------------------------------------------------------------------------- processes
def _cli(*args, env=None):
    return [sys.executable, "-m", "autoprec.cli", *args]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _complete(storage, name):
    try:
        study = optuna.load_study(study_name=name, storage=open_storage(storage, "")[0])
    except KeyError:
        return []
    return [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]


@pytest.mark.slow
def test_sigkill_mid_study_then_rerun_keeps_every_completed_trial(tmp_path):
    out = tmp_path / "k.yaml"
    db = f"sqlite:///{tmp_path / 'k.study.db'}"
    args = _cli("tune", f"{TASKS}:small_gpt2_task", "-o", str(out), "--target", "cpu-amx",
                "--n-trials", "30", "--study", "kill-test", "--storage", db)
    proc = subprocess.Popen(args, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=tmp_path)
    deadline = time.time() + 240
    while time.time() < deadline and len(_complete(db, "kill-test")) < 4:
        if proc.poll() is not None:
            pytest.fail(f"tune exited early: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {t.number: (t.values, t.params) for t in _complete(db, "kill-test")}
    assert 4 <= len(before) < 30, f"{len(before)} trials completed before the kill"
    assert not out.exists()

    rerun = subprocess.run(args, env=_env(), capture_output=True, text=True, cwd=tmp_path,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resuming study kill-test" in rerun.stderr
    assert "reusing the profile stored in study" in rerun.stderr
    after = {t.number: (t.values, t.params) for t in _complete(db, "kill-test")}
    for number, (values, params) in before.items():
        assert after[number] == (values, params), f"trial {number} changed or was lost"
    # --n-trials counts distinct policies: a repeated proposal reuses a measurement
    assert len({json.dumps(p, sort_keys=True) for _, p in after.values()}) == 30
    assert out.exists()


def _two_workers(tmp_path, storage, name, n_trials=16):
    args = _cli("tune", f"{TASKS}:small_gpt2_task", "-o", str(tmp_path / f"{name}.yaml"),
                "--target", "cpu-amx", "--n-trials", str(n_trials), "--study", name,
                "--storage", storage)
    procs = [subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (_o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-3000:]
    study = optuna.load_study(study_name=name, storage=open_storage(storage, "")[0])
    trials = study.trials
    numbers = [t.number for t in trials]
    assert numbers == list(range(len(trials))), "trial numbers must be unique and contiguous"
    states = {t.state for t in trials}
    assert states == {optuna.trial.TrialState.COMPLETE}, states
    # n_trials counts distinct policies, checked after each trial: each worker may finish one
    # more
    distinct = {json.dumps(t.params, sort_keys=True) for t in trials}
    assert n_trials <= len(distinct) <= n_trials + 2
    warm = [t.user_attrs.get("origin") for t in trials
            if str(t.user_attrs.get("origin", "")).startswith("warm")]
    assert len(warm) == len(set(warm)), f"warm starts enqueued twice: {warm}"
    # both workers really worked on the one study: trials, or units of the shared profile
    # (a worker that profiled may find the trials all taken by the other, priced ones are fast)
    assert all("trial" in e or "profile: unit" in e for _, e in outs), \
        [e[-1500:] for _, e in outs]
    units = json.loads(study.user_attrs["profile"])["units"]
    assert sum(u["tries"] for u in units) == len(units), units  # each unit done once
    return study


@pytest.mark.slow
def test_two_workers_share_a_sqlite_study(tmp_path):
    # the first worker creates the study and profiles; start the second once it exists
    _two_workers(tmp_path, f"sqlite:///{tmp_path / 'shared.db'}", "shared-sqlite")


@pytest.mark.slow
def test_two_workers_share_a_journal_file(tmp_path):
    _two_workers(tmp_path, f"journal:{tmp_path / 'journal.log'}", "shared-journal")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bin():
    for version in ("17", "16", "15", "14", "13"):
        path = f"/usr/lib/postgresql/{version}/bin"
        if os.path.exists(os.path.join(path, "initdb")):
            return path
    return None


@pytest.fixture
def postgres():
    """A real PostgreSQL server on loopback, in a temporary data directory."""
    import tempfile

    pg = _pg_bin()
    if pg is None:
        pytest.skip("PostgreSQL server binaries not installed (.ci/run installs them)")
    pytest.importorskip("psycopg")
    # pytest's tmp_path is private to root; the server runs as the `postgres` user
    base = tempfile.mkdtemp(prefix="autoprec-pg-")
    os.chmod(base, 0o755)
    data = os.path.join(base, "data")
    port = _free_port()
    run_as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if run_as:
        shutil.chown(base, "postgres")

    def run(cmd):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")

    try:
        run([*run_as, f"{pg}/initdb", "-D", data, "-A", "trust", "-U", "autoprec"])
        run([*run_as, f"{pg}/pg_ctl", "-D", data, "-w", "-l", os.path.join(base, "pg.log"),
             "-o", f"-p {port} -k {base} -c listen_addresses=127.0.0.1", "start"])
        try:
            run([f"{pg}/createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "autoprec",
                 "studies"])
            yield f"postgresql://autoprec@127.0.0.1:{port}/studies"
        finally:
            subprocess.run([*run_as, f"{pg}/pg_ctl", "-D", data, "-m", "fast", "stop"],
                           capture_output=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_two_workers_share_a_postgresql_study(tmp_path, postgres):
    _two_workers(tmp_path, postgres, "shared-pg")


def test_postgres_fixture_is_not_silently_skipped_in_ci():
    # .ci/run installs the server and says it is CI (AUTOPREC_CI=1; it used to test CI=true,
    # which nothing set, so this always skipped): a skipped PostgreSQL test there would hide
    # a gap. On a developer's machine without the server it is skipped, and says so.
    if os.environ.get("AUTOPREC_CI") != "1":
        pytest.skip("only meaningful in CI (.ci/run sets AUTOPREC_CI=1)")
    assert _pg_bin() is not None, "CI must install postgresql so the shared-study test runs"
    import psycopg  # noqa: F401


def test_tune_needs_two_batches():
    task = small_gpt2_task()
    task.batches = task.batches[:1]
    with pytest.raises(ValueError, match="at least 2 calibration batches"):
        tune(task, target="h100", n_trials=1, progress=False)


def test_uniform_warm_starts_and_milp_are_enqueued(tmp_path, small_profile):
    res = tune(small_gpt2_task(), target="cpu-amx", n_trials=6, output=str(tmp_path / "w.yaml"),
               prof=small_profile, progress=False)
    origins = [t.origin for t in res.trials]
    assert origins[0] == "warm:fp32" and "warm:bf16" in origins
    # all-fp32 is always feasible and costs exactly the anchor
    fp32 = next(t for t in res.trials if t.origin == "warm:fp32")
    assert fp32.loss_increase == 0 and fp32.grad_error == 0
    assert fp32.speedup.value == pytest.approx(1.0)
    assert torch.isfinite(torch.tensor([t.step_seconds for t in res.trials])).all()


@pytest.mark.slow
def test_a_measured_tune_reports_its_speedup_with_an_interval(tmp_path):
    from autoprec.tuning import TimingConfig

    out = tmp_path / "measured.yaml"
    # the search space comes from a profile priced for a CPU with fast bf16, so it holds more
    # than all-fp32 on every host (measured here, a CPU without BF16 instructions offers only
    # fp32, a space of one policy that is not timed at all); the trials and the final
    # re-timing are measured on this CPU
    prof = profile(small_gpt2_task(), formats=("fp32", "bf16"), target="cpu-amx",
                   progress=False, only_winnable=True)
    res = tune(small_gpt2_task(), formats=("fp32", "bf16"), n_trials=5, output=str(out),
               progress=False, prof=prof,
               timing=TimingConfig(final_rounds=6, max_final_rounds=8))
    res.save(out, plot=False)
    prov = autoprec.load_policy(out).provenance
    s = prov.speedup
    assert s.value == pytest.approx(res.speedup.value, abs=1e-4)
    timing = prov.extra["timing"]
    assert timing["rounds"] >= 6 and 0 <= timing["aa_noise"] < 1
    assert len(timing["fp32_drift"]) == 2
    # every finalist was re-timed against fp32 in the same rounds; the winner is one of them
    assert res.best.number in res.selection.speedup
    assert res.selection.aa is not None and res.selection.aa.rounds >= 6
    over = res.improvement_over_warm_start
    claimed = "improvement_over_warm_start" in prov.extra
    assert claimed is (over is not None and over.low > 1.0)
    show = subprocess.run([sys.executable, "-m", "autoprec.cli", "show", str(out)],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert show.returncode == 0 and f"speed-up vs fp32: {s}" in show.stdout, show.stdout
    if res.policy.formats_used() == {autoprec.Format.FP32}:
        # (where bf16 is slow, as on a CPU without BF16 instructions) all-fp32 is the
        # reference itself: 1 by construction, not its A/A-like timing, and said so
        assert (s.value, s.low, s.high, s.rounds) == (1.0, 1.0, 1.0, 0), s
        assert any("1 by construction" in n for n in prov.verdict), prov.verdict
        assert "run_interval" not in timing and "timing rounds" not in show.stdout
        return
    assert s.rounds == timing["rounds"] and s.low <= s.value <= s.high and s.high < 1e3, s
    # the written interval is where a re-timing as long lands: it holds the run's own and is
    # wider
    lo, hi = timing["run_interval"]
    assert s.low <= lo <= s.value <= hi <= s.high and s.high / s.low > hi / lo, (s, lo, hi)
    assert (lo, hi) == pytest.approx((res.best.speedup.low, res.best.speedup.high), abs=1e-4)
    assert "95% of re-timings as long land in the interval" in show.stdout, show.stdout
    assert f"this run's 95% interval of the ratio {lo:.2f}-{hi:.2f}x" in show.stdout, show.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_a_tune_interrupted_at_20_random_moments_never_hangs_or_loses_a_trial(tmp_path, sig):
    """A tune of a tiny model, signalled at 20 random moments (starting up, profiling, in a
    trial, around Optuna's heartbeat), each time rerun: every process is gone within 10 s of
    the signal (a first Ctrl-C finishes the running trial), and the last rerun ends with the
    requested number of distinct completed policies; no orphan RUNNING trial is counted."""
    rng = random.Random(int(sig))
    out = tmp_path / "p.yaml"
    console = shutil.which("autoprec", path=os.path.dirname(sys.executable))
    cmd = [console, "tune", f"{TASKS}:small_gpt2_task", "-o", str(out), "--target",
           "cpu-amx", "--n-trials", "12", "--seed", "1"]
    codes = []
    for _ in range(20):
        # a hang is reported with every thread's stack (faulthandler dumps them on SIGABRT)
        p = subprocess.Popen(cmd, env=dict(_env(), PYTHONFAULTHANDLER="1"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(rng.uniform(1.0, 14.0))
        if p.poll() is None:
            p.send_signal(sig)
            t0 = time.perf_counter()
            try:
                _, err = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGABRT)
                _, err = p.communicate(timeout=60)
                pytest.fail(f"still running 10 s after {sig.name}: {err[-6000:]}")
            assert time.perf_counter() - t0 < 10
            if sig == signal.SIGINT:
                assert p.returncode in (130, 0), err[-2000:]
                assert "Traceback" not in err, err[-3000:]
            codes.append(p.returncode)
        else:
            codes.append(p.returncode)
    assert any(c not in (0,) for c in codes), "no run was actually interrupted"
    final = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]
    assert "(12 distinct policies" in final.stdout, final.stdout
    study = optuna.load_study(study_name=final.stdout.split("study: ")[1].split()[0],
                              storage=f"sqlite:///{tmp_path / 'p.study.db'}")
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    distinct = {json.dumps(t.params, sort_keys=True) for t in complete}
    assert len(distinct) == 12, len(distinct)


def test_a_warm_start_whose_trial_failed_is_queued_again_and_repeats_do_not_count(tmp_path):
    out = str(tmp_path / "w.yaml")
    kw = dict(target="cpu-amx", output=out, progress=False)
    first = tune(small_gpt2_task(), n_trials=1, **kw)
    storage = open_storage(None, str(tmp_path / "w.study.db"))[0]
    study = optuna.load_study(study_name=first.study_name, storage=storage)
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert waiting, "the other warm starts wait in the queue"
    lost = waiting[0].user_attrs["origin"]
    trial = study.ask()  # a worker takes it ... and dies (its trial failed)
    assert trial.user_attrs["origin"] == lost
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    again = tune(small_gpt2_task(), n_trials=8, **kw)
    origins = [t.origin for t in again.trials]
    assert lost in origins, origins
    # n_trials counts distinct policies: repeated proposals are measured once
    distinct = {tuple(sorted(t.assignment.items())) for t in again.trials}
    assert len(distinct) == 8, (len(distinct), [t.origin for t in again.trials])


@pytest.mark.slow
def test_without_bf16_instructions_a_measured_tune_writes_fp32_and_says_why(tmp_path):
    # What the host implies, asked first: on a CPU without BF16 dot-product instructions
    # (Zen 3, Intel AVX512 before Cooper Lake) bf16 loses to fp32 on every layer, so the
    # profile says so per layer and the tune writes all-fp32. Hosts with them are covered by
    # tests/test_timing.py (bf16 faster on a large linear).
    from tests.conftest import host_bf16_is_fast

    if host_bf16_is_fast():
        pytest.skip("this CPU has BF16 dot-product instructions: bf16 can win here")
    out = tmp_path / "p.yaml"
    res = tune(small_gpt2_task(), formats=("fp32", "bf16"), n_trials=4, output=str(out),
               progress=False)
    res.save(out, plot=False)
    slow = [lp.skipped[Format.BF16] for lp in res.profile.layers if Format.BF16 in lp.skipped]
    # most layers' bf16 is over 2x their fp32 time (so not even measured); a small one may
    # come in under that on an AVX512 part, measured, and still lose
    assert len(slow) >= len(res.profile.layers) // 2, [lp.fqn for lp in res.profile.layers]
    assert all("cannot win here" in why and "the fp32 time" in why for why in slow), slow
    written = autoprec.load_policy(out)
    assert written.default is Format.FP32 and set(written.layers.values()) <= {Format.FP32}, \
        written.layers


def test_a_search_space_of_one_policy_is_not_timed_against_itself(tmp_path, capsys):
    # fp8 is only emulated on a CPU, so every unit offers fp32 alone: the one policy is the
    # reference, so no A/A check, no trial timing and no final re-timing (each would time
    # fp32 against itself); its numerics are still measured, and the speed-up is 1 exactly
    out = tmp_path / "p.yaml"
    res = tune(tiny_gpt2_task(), formats=("fp32", "fp8"), n_trials=3, output=str(out))
    messages = capsys.readouterr().err.splitlines()
    assert [t.assignment for t in res.trials] and all(
        set(t.assignment.values()) == {"fp32"} for t in res.trials), res.trials
    assert res.selection.speedup[res.best.number] == Interval(1.0, 1.0, 1.0, 0)
    assert res.selection.aa is None and res.selection.rounds == 0
    assert any("nothing was re-timed" in n for n in res.selection.notes), res.selection.notes
    assert not any(m.startswith(("timing noise before", "re-timing")) for m in messages), messages
    assert any("holds one policy, all-fp32" in m for m in messages), messages
    assert res.best.finite and res.best.loss_increase == 0.0
    res.save(out, plot=False)
    written = autoprec.load_policy(out)
    assert written.default is Format.FP32 and written.provenance.speedup.value == 1.0


def test_a_ctrl_c_swallowed_outside_the_search_is_raised_again_until_the_tune_returns():
    # seen in CI: a Ctrl-C during the profile landed in a regex object's __del__, which
    # swallowed it ("Exception ignored in ..."), and the tune went on waiting for a unit
    from autoprec.tuning.tune import _AGAIN_S, _Interrupts

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("another SIGINT handler is installed: the tune would leave it alone")
    interrupts = _Interrupts()
    again = 0
    with interrupts.installed():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:
            pass  # swallowed, as a destructor would
        deadline = time.monotonic() + 4 * _AGAIN_S
        try:
            while time.monotonic() < deadline:
                time.sleep(0.05)
        except KeyboardInterrupt:
            again += 1
    # a swallowed interrupt's "Exception ignored in ..." traceback is not printed
    seen = []
    previous, sys.unraisablehook = sys.unraisablehook, seen.append
    try:
        with _Interrupts().installed():
            sys.unraisablehook(_Unraisable(KeyboardInterrupt()))
            sys.unraisablehook(_Unraisable(ValueError("x")))
    finally:
        sys.unraisablehook = previous
    assert [type(u.exc_value) for u in seen] == [ValueError]
    assert again == 1 and interrupts.count == 1  # raised again, not counted as a second one
    # once the tune has returned, nothing is raised any more
    time.sleep(2 * _AGAIN_S)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class _Unraisable:
    def __init__(self, exc):
        self.exc_type, self.exc_value, self.exc_traceback = type(exc), exc, None
        self.err_msg, self.object = None, None


class _SwallowsCtrlC:
    def __del__(self):
        raise KeyboardInterrupt  # a Ctrl-C landing in a finalizer: Python swallows it


def test_the_console_script_delivers_a_ctrl_c_a_finalizer_swallowed_again(capsys):
    # seen in a fresh-clone run: a Ctrl-C outside the tune's own handling landed in a weakref
    # callback during GC; Python printed "Exception ignored ... KeyboardInterrupt" and went on
    from autoprec.cli import _interrupt_again

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("another SIGINT handler is installed")
    seen = []
    previous = sys.unraisablehook
    sys.unraisablehook = functools.partial(_interrupt_again, seen.append)
    try:
        with pytest.raises(KeyboardInterrupt):
            obj = _SwallowsCtrlC()
            del obj  # swallowed here ...
            time.sleep(1)  # ... and raised again in the main thread
        sys.unraisablehook(_Unraisable(ValueError("x")))  # anything else: the hook it wraps
    finally:
        sys.unraisablehook = previous
    assert [type(u.exc_value) for u in seen] == [ValueError]
    assert "Exception ignored" not in capsys.readouterr().err
