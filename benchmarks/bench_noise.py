"""Verdicts on a noisy machine: tune the GPT-2 example several times on a quiet machine and as
many times with a background load this script starts itself (a process burning one core in
random 0.2-2 s bursts, idle 0.2-2 s between them), then re-time every winner on the quiet
machine, interleaved against FP32 (autoprec.measure.timer, the tune's own protocol).

Claims checked (printed, not asserted):
- every loaded tune's winner, re-timed quietly, is within 5% of the quiet tunes' winner's
  speed (the best quiet winner, as re-timed here);
- every interval a tune reported (speed-up over FP32 in the policy's provenance) covers that
  policy's quiet re-timing.

    python benchmarks/bench_noise.py [--tunes 3] [--trials 40] [--rounds 16]
        [--task examples/gpt2_bytes.py:task]

Run it on an otherwise idle machine: the quiet tunes and the re-timing assume nothing else
runs. It takes about 6 tunes x 4-5 minutes plus the re-timing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import tempfile
import time

import _common  # noqa: F401  (sets up sys.path)
import torch
from _common import device_line, print_table

import autoprec
from autoprec.measure.numerics import prepare_for_measurement
from autoprec.measure.timer import Comparison, StepTimer
from autoprec.task import load_task
from autoprec.tuning import tune


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


def run_tunes(task, n: int, trials: int, loaded: bool, folder: str) -> list[dict]:
    out = []
    for i in range(n):
        path = os.path.join(folder, f"{'loaded' if loaded else 'quiet'}-{i}.yaml")
        t0 = time.perf_counter()
        print(f"\n== tune {i + 1}/{n} {'with background load' if loaded else 'quiet'}",
              flush=True)
        if loaded:
            with BackgroundLoad(seed=100 + i):
                res = tune(task, output=path, n_trials=trials, seed=i)
        else:
            res = tune(task, output=path, n_trials=trials, seed=i)
        res.save(path, plot=False)
        prov = res.policy.provenance
        out.append({"name": f"{'loaded' if loaded else 'quiet'} {i + 1}", "path": path,
                    "policy": res.policy, "reported": prov.speedup,
                    "verdict": list(prov.verdict), "seconds": time.perf_counter() - t0})
        print(f"tune took {out[-1]['seconds']:.0f} s; winner {_describe(res.policy)} at "
              f"{prov.speedup}", flush=True)
    return out


def retime(t, runs: list[dict], rounds: int) -> dict[str, autoprec.policy.Interval]:
    """Every distinct winner against FP32, interleaved, on the quiet machine."""
    model = prepare_for_measurement(t.build_model())
    timer = StepTimer(model, t.example_batch(), lambda m, b: m(**b).loss, t.make_optimizer,
                      device=t.device)
    distinct: dict[str, autoprec.Policy] = {}
    for r in runs:
        key = json.dumps(r["policy"].to_dict()["layers"] | {"": r["policy"].default.value},
                         sort_keys=True)
        distinct.setdefault(key, r["policy"])
        r["key"] = key
    cmp = Comparison({"fp32": timer.runner(autoprec.Policy(default="fp32")),
                      "fp32 again": timer.runner(autoprec.Policy(default="fp32")),
                      **{k: timer.runner(p) for k, p in distinct.items()}},
                     "fp32", repeats=2, seed=0)
    cmp.run(rounds, warmup=True)
    print(f"\nquiet re-timing: {rounds} rounds; fp32 against itself {cmp.speedup('fp32 again')}")
    return {k: cmp.speedup(k) for k in distinct}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tunes", type=int, default=3)
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--task", default="examples/gpt2_bytes.py:task")
    args = ap.parse_args()
    print(device_line(), flush=True)
    task = load_task(args.task)
    folder = tempfile.mkdtemp(prefix="bench-noise-")
    runs = run_tunes(task, args.tunes, args.trials, False, folder)
    runs += run_tunes(task, args.tunes, args.trials, True, folder)
    quiet = retime(task, runs, args.rounds)
    best_quiet = max(quiet[r["key"]].value for r in runs if r["name"].startswith("quiet"))
    rows, within, covered = [], [], []
    for r in runs:
        q = quiet[r["key"]]
        rep = r["reported"]
        cover = rep.low <= q.value <= rep.high
        rel = q.value / best_quiet
        covered.append(cover)
        if r["name"].startswith("loaded"):
            within.append(rel >= 0.95)
        rows.append([r["name"], f"{r['seconds']:.0f}", _describe(r["policy"])[:48], str(rep),
                     str(q), "yes" if cover else "NO", f"{rel:.3f}"])
    print()
    print_table(rows, ["tune", "tune s", "winner", "reported vs fp32", "quiet re-timed vs fp32",
                       "covers", "speed / best quiet winner's"])
    print(f"\nloaded winners within 5% of the best quiet winner: {sum(within)}/{len(within)}; "
          f"reported intervals covering the quiet re-timing: {sum(covered)}/{len(covered)}")
    for r in runs:
        for note in r["verdict"]:
            print(f"  {r['name']}: {note}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
