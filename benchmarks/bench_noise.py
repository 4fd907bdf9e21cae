"""Do the speed-ups a tune writes survive a re-run? Tune the GPT-2 example several times, each
tune in a fresh process (some with a background load this script starts itself: a process
burning one core in random 0.2-2 s bursts, idle 0.2-2 s between them); then re-time every
tune's finalists against FP32 in a new process, on the quiet machine, as a user re-timing the
written policy would (autoprec.measure.timer, the tune's protocol: as many candidates and
rounds as the tune's first verdict, after the same warm-up). With ``--after``, also in the
tune's own process once it has returned (a fresh build of the model): a difference between the
tune's re-timing and "after" is the tune's procedure, between "after" and "fresh" the process.

Claims checked (printed, not asserted):
- the interval a tune writes (``timer.rerun_interval``: the re-timing's 95% interval widened
  for a re-run's own error) covers the fresh re-timing, for the winner and for every finalist
  (the tune's own confidence intervals are counted beside them); an all-fp32 winner is the
  reference itself, written as 1 exactly, and is not counted;
- every loaded tune's winner, re-timed fresh, is within 5% of the best quiet winner's speed.

    python benchmarks/bench_noise.py [--quiet 3] [--loaded 3] [--trials 24] [--rounds 10]
        [--after] [--space auto|measured|cpu-amx] [--task examples/gpt2_bytes.py:task]
    python benchmarks/bench_noise.py --retime FOLDER   # only the fresh re-timings, again
    python benchmarks/bench_noise.py --report FOLDER   # only the table, from the folder

``--space``: where no format is faster than fp32 on this device (a CPU without BF16
instructions: the tune's space is then all-fp32 alone, which is never timed), "auto" searches
the space a fast-BF16 CPU would have (the profile priced for cpu-amx, formats fp32 and bf16),
with every trial and every re-timing measured here; its finalists span speed-ups well below 1.
"measured": always the measured profile. The folder keeps the policies and every run's JSON;
``--retime`` re-times them without tuning again (e.g. when the machine was not quiet during
the first re-timing: the script prints fp32 measured against itself).

Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import time

import _common  # noqa: F401  (sets up sys.path)
import torch
from _common import device_line, print_table

import autoprec
from autoprec.host import cpu_features
from autoprec.measure.deviation import prepare_for_measurement
from autoprec.measure.timer import Comparison, StepTimer, rerun_interval
from autoprec.policy import Interval
from autoprec.task import load_task
from autoprec.tuning import TuneConfig, tune
from autoprec.tuning.space import assignment_policy


def _burn(seed: int, stop) -> None:
    """One core busy in random 0.2-2 s bursts, idle 0.2-2 s between them."""
    rng = random.Random(seed)
    while not stop.is_set():
        stop.wait(rng.uniform(0.2, 2.0))
        end = time.perf_counter() + rng.uniform(0.2, 2.0)
        x = 0
        while time.perf_counter() < end and not stop.is_set():
            x = (x * 1103515245 + 12345) % 2147483648


class BackgroundLoad:
    def __init__(self, seed: int):
        self.stop = mp.Event()
        self.proc = mp.Process(target=_burn, args=(seed, self.stop), daemon=True)

    def __enter__(self):
        self.proc.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


def _describe(policy: autoprec.Policy) -> str:
    layers = ", ".join(f"{p}: {f}" for p, f in policy.layers.items())
    return f"default {policy.default}" + (f"; {layers}" if layers else "")


def _priced_space(space: str) -> bool:
    if space == "auto":
        return not cpu_features().bf16_dot
    return space == "cpu-amx"


def retime(task, policies: dict[str, autoprec.Policy], rounds: int,
           seed: int) -> tuple[dict[str, Interval], Interval]:
    """Each policy's speed-up over fp32 and fp32 against itself, with the tune's protocol:
    interleaved rounds against fp32, the tune's repeats, after one untimed pass of each."""
    model = prepare_for_measurement(task.build_model())
    timer = StepTimer(model, task.example_batch(), lambda m, b: m(**b).loss, task.make_optimizer,
                      device=task.device)
    fp32 = autoprec.Policy(default="fp32")
    cmp = Comparison({"fp32": timer.runner(fp32), "fp32 again": timer.runner(fp32),
                      **{k: timer.runner(p) for k, p in policies.items()}},
                     "fp32", repeats=TuneConfig().timing.repeats, seed=seed)
    timer.settle()  # a fresh process runs its first steps slow, as the tune does
    cmp.run(rounds, warmup=True)
    return {k: cmp.speedup(k) for k in policies}, cmp.speedup("fp32 again")


def _interval(d: dict) -> Interval:
    return Interval(d["value"], d["low"], d["high"], d["rounds"])


def _worker_tune(args) -> None:
    """One tune, in this (fresh) process; then its finalists re-timed here ("after")."""
    task = load_task(args.task)
    path = os.path.join(args.folder, f"{args.name}.yaml")
    prof, kw = None, {}
    if _priced_space(args.space):
        # fp32 and bf16: the formats a fast-BF16 CPU offers (its fp16 is ~40x slower)
        kw = {"formats": ("fp32", "bf16")}
        prof = autoprec.profile(task, target="cpu-amx", progress=False, only_winnable=True,
                                **kw)
    t0 = time.perf_counter()
    if args.loaded:
        with BackgroundLoad(seed=100 + args.seed):
            res = tune(task, output=path, n_trials=args.trials, seed=args.seed, prof=prof, **kw)
    else:
        res = tune(task, output=path, n_trials=args.trials, seed=args.seed, prof=prof, **kw)
    seconds = time.perf_counter() - t0
    res.save(path, plot=False)
    sel = res.selection
    by_number = {t.number: t for t in res.trials}
    finalists = {}
    for number, iv in sel.speedup.items():
        policy = assignment_policy(res.units, by_number[number].assignment)
        finalists[str(number)] = {"policy": policy.to_dict(), "tune": iv.to_dict(),
                                  "written": rerun_interval(iv).to_dict()}
    aa = None
    if args.after:
        after, aa = retime(task, {k: autoprec.Policy.from_dict(f["policy"])
                                  for k, f in finalists.items()}, args.rounds, seed=1)
        for k, iv in after.items():
            finalists[k]["after"] = iv.to_dict()
    run = {"name": args.name, "path": path, "seconds": seconds, "winner": str(sel.winner),
           "tune_rounds": sel.rounds, "tune_aa": None if sel.aa is None else sel.aa.to_dict(),
           "after_aa": aa and aa.to_dict(), "verdict": list(res.policy.provenance.verdict),
           "finalists": finalists}
    with open(os.path.join(args.folder, f"{args.name}.json"), "w") as f:
        json.dump(run, f, indent=1)


def _worker_retime(args) -> None:
    """The finalists of one tune re-timed in this (fresh) process."""
    task = load_task(args.task)
    file = os.path.join(args.folder, f"{args.name}.json")
    with open(file) as f:
        run = json.load(f)
    fresh, aa = retime(task, {k: autoprec.Policy.from_dict(f["policy"])
                              for k, f in run["finalists"].items()}, args.rounds, seed=2)
    for k, iv in fresh.items():
        run["finalists"][k]["fresh"] = iv.to_dict()
    run["fresh_aa"] = aa.to_dict()
    with open(file, "w") as f:
        json.dump(run, f, indent=1)


def _spawn(worker: str, args, name: str, **extra) -> None:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--name", name,
           "--folder", args.folder, "--task", args.task, "--trials", str(args.trials),
           "--rounds", str(args.rounds), "--space", args.space]
    if extra.get("seed") is not None:
        cmd += ["--seed", str(extra["seed"])]
    if extra.get("loaded"):
        cmd.append("--loaded")
    if args.after:
        cmd.append("--after")
    subprocess.run(cmd, check=True)


def _report(runs: list[dict]) -> None:
    rows = []
    covered = {"written": {True: [], False: []}, "tune": {True: [], False: []}}
    within = []
    quiet = [r for r in runs if r["name"].startswith("quiet")]
    best_quiet = max((_interval(r["finalists"][r["winner"]]["fresh"]).value for r in quiet),
                     default=math.nan)
    for r in runs:
        for k, f in sorted(r["finalists"].items(), key=lambda kv: int(kv[0])):
            ci, fresh = _interval(f["tune"]), _interval(f["fresh"])
            wrote = rerun_interval(ci)  # as the code now writes it (the JSON keeps the CI)
            after = _interval(f["after"]) if "after" in f else "-"
            winner = k == r["winner"]
            # an all-fp32 winner is the reference itself, written as 1 exactly: a re-timing
            # of it is an A/A check, not a re-run of a speed-up
            reference = ci.rounds == 0
            if not reference:
                for key, iv in (("written", wrote), ("tune", ci)):
                    covered[key][winner].append(_covers(iv, fresh.value))
            if winner and r["name"].startswith("loaded"):
                within.append(fresh.value / best_quiet >= 0.95)
            cover = ("n/a (all-fp32)" if reference
                     else "yes" if covered["written"][winner][-1] else "NO")
            rows.append([r["name"] + (" *" if winner else ""), k, str(ci), str(wrote), str(after),
                         str(fresh), cover, f"{math.log(fresh.value / ci.value) * 100:+.1f}"])
    print_table(rows, ["tune (* winner)", "trial", "tune's 95% CI", "written (re-run)",
                       "after, same process", "fresh process", "covers", "fresh/tune %"])
    for key, what in (("written", "written (re-run) intervals"), ("tune", "the tune's CIs")):
        won, rest = covered[key][True], covered[key][False]
        print(f"{what} covering the fresh re-timing: winners {sum(won)}/{len(won)}, all "
              f"finalists {sum(won) + sum(rest)}/{len(won) + len(rest)}")
    for other, label in (("fresh", "fresh vs tune"), ("after", "after vs tune"),
                         ("fresh", "fresh vs after")):
        base = "after" if label == "fresh vs after" else "tune"
        shifts = [math.log(_interval(f[other]).value / _interval(f[base]).value)
                  for r in runs for f in r["finalists"].values()
                  if other in f and base in f and f["tune"]["rounds"]]
        if shifts:
            mean = sum(shifts) / len(shifts)
            sd = math.sqrt(sum((x - mean) ** 2 for x in shifts) / max(1, len(shifts) - 1))
            print(f"{label}, log ratio over {len(shifts)} finalists: mean {mean * 100:+.1f}%, "
                  f"sd {sd * 100:.1f}%, range {min(shifts) * 100:+.1f}% to "
                  f"{max(shifts) * 100:+.1f}%")
    _per_run(runs)
    if within:
        print(f"loaded winners within 5% of the best quiet winner: {sum(within)}/{len(within)}")
    for r in runs:
        aa = r["tune_aa"] and _interval(r["tune_aa"])
        print(f"  {r['name']}: tune {r['seconds']:.0f} s, winner trial {r['winner']} after "
              f"{r['tune_rounds']} rounds; fp32 against itself: tune {aa}, "
              f"after {r['after_aa'] and _interval(r['after_aa'])}, "
              f"fresh {_interval(r['fresh_aa'])}")
        for note in r["verdict"]:
            print(f"    {note}")


def _covers(iv: Interval, value: float) -> bool:
    return iv.low <= value <= iv.high


def _per_run(runs: list[dict]) -> None:
    """Per run: finalists covered, and the mean shift of its ratios (all share the run's fp32
    reference, so its error moves them together: runs, not finalists, are independent)."""
    means, whole = [], 0
    for r in runs:
        timed = [f for f in r["finalists"].values() if f["tune"]["rounds"]]
        if not timed:
            continue
        ok = [_covers(rerun_interval(_interval(f["tune"])), f["fresh"]["value"]) for f in timed]
        whole += all(ok)
        means.append(sum(math.log(f["fresh"]["value"] / f["tune"]["value"]) for f in timed)
                     / len(timed))
    if len(means) >= 2:
        m = sum(means) / len(means)
        se = math.sqrt(sum((x - m) ** 2 for x in means) / (len(means) - 1) / len(means))
        print(f"runs whose every finalist was covered: {whole}/{len(means)}; each run's mean "
              f"shift (fresh vs tune): {', '.join(f'{x * 100:+.1f}%' for x in means)}; "
              f"over runs {m * 100:+.1f}% +- {se * 100:.1f}% (standard error)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quiet", type=int, default=3, help="tunes on the quiet machine")
    ap.add_argument("--loaded", type=int, default=3, help="tunes with a background load")
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=10,
                    help="rounds of each re-timing (the tune's first verdict comes after 10)")
    ap.add_argument("--after", action="store_true",
                    help="also re-time each tune's finalists in its own process once it returns")
    ap.add_argument("--space", choices=("auto", "measured", "cpu-amx"), default="auto")
    ap.add_argument("--task", default="examples/gpt2_bytes.py:task")
    ap.add_argument("--retime", metavar="FOLDER", default=None,
                    help="re-time the finalists of an earlier run kept in FOLDER; no tuning")
    ap.add_argument("--report", metavar="FOLDER", default=None,
                    help="only print the table of an earlier run kept in FOLDER")
    # internal: one tune or one re-timing in a fresh process
    ap.add_argument("--worker", choices=("tune", "retime"), help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        torch.manual_seed(0)
        (_worker_tune if args.worker == "tune" else _worker_retime)(args)
        return
    print(device_line(), flush=True)
    if _priced_space(args.space):
        print("no format is faster than fp32 here: searching the space a fast-BF16 CPU has "
              "(profile priced for cpu-amx), every trial and re-timing measured here", flush=True)
    if args.report:
        names = sorted(n[:-5] for n in os.listdir(args.report) if n.endswith(".json"))
        runs = []
        for name in names:
            with open(os.path.join(args.report, f"{name}.json")) as f:
                runs.append(json.load(f))
        _report(runs)
        return
    if args.retime:
        args.folder = args.retime
        names = sorted(n[:-5] for n in os.listdir(args.folder) if n.endswith(".json"))
    else:
        args.folder = tempfile.mkdtemp(prefix="bench-noise-")
        print(f"policies and runs in {args.folder}", flush=True)
        names = [f"quiet-{i + 1}" for i in range(args.quiet)]
        names += [f"loaded-{i + 1}" for i in range(args.loaded)]
        for i, name in enumerate(names):
            print(f"\n== tune {i + 1}/{len(names)}: {name}", flush=True)
            _spawn("tune", args, name, seed=i, loaded=name.startswith("loaded"))
    for name in names:
        print(f"\n== fresh re-timing: {name}", flush=True)
        _spawn("retime", args, name)
    runs = []
    for name in names:
        with open(os.path.join(args.folder, f"{name}.json")) as f:
            runs.append(json.load(f))
    print()
    _report(runs)


if __name__ == "__main__":
    main()
