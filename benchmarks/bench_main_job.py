"""The README's main job (``autoprec tune examples/gpt2_bytes.py:task -o ...``) run by this
checkout (A) and by another revision (B, a ``git worktree`` of ``--against``, removed after),
in turn (A B A B ...), each run a fresh process writing to a fresh folder, paired: the A/B
ratio of each pair's wall time, and each side's median [min-max] of wall and CPU seconds and
peak RSS (the child's own accounting, ``os.wait4``).

A whole run's time depends on how long the tune's final re-timing runs: it stops early once
its verdict is significant and runs to its cap (40 rounds by default) where two finalists
are within noise, which differs from run to run with what the search found and how the
machine was. So each run is also split, from its study's trial times and its policy, into
the phases before the first trial (capture, profile), the trials, and after the last trial
(the final re-timing, validation, writing), with the re-timing's rounds and the number of
trials; the phases before and during the trials are compared pair by pair too, and the part
after over the pairs whose re-timings ran as many rounds. A difference in whole time that the
re-timing's rounds explain is the search's luck, not the code's speed.

    python benchmarks/bench_main_job.py --against REV [--pairs 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import sqlite3
import subprocess
import sys
import tempfile
import time

from _common import ROOT, device_line, median_range, worktree

TASK = "examples/gpt2_bytes.py:task"


def run_once(root: str, folder: str) -> dict:
    """The main job with the ``autoprec`` of ``root``, writing into ``folder``."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=root)
    cmd = [sys.executable, "-m", "autoprec.cli", "tune", TASK,
           "-o", os.path.join(folder, "p.yaml")]
    began = dt.datetime.now()
    t0 = time.monotonic()
    with open(os.path.join(folder, "out.log"), "wb") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    code = proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    if code != 0:
        raise SystemExit(f"the main job exited {code} in {root}: see "
                         f"{os.path.join(folder, 'out.log')}")
    run = {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime,
           "rss": usage.ru_maxrss / 1024}  # Linux: KiB
    run.update(phases(folder, began, wall))
    return run


def phases(folder: str, began: dt.datetime, wall: float) -> dict:
    """Seconds before the first trial, of the trials and after the last, the trials' count
    and the final re-timing's rounds, from the run's study (SQLite) and policy."""
    import yaml

    with sqlite3.connect(os.path.join(folder, "p.study.db")) as db:
        rows = db.execute("select datetime_start, datetime_complete from trials").fetchall()
    starts = [dt.datetime.fromisoformat(a) for a, _ in rows if a]
    ends = [dt.datetime.fromisoformat(b) for _, b in rows if b]
    with open(os.path.join(folder, "p.yaml")) as f:
        tuned = (yaml.safe_load(f) or {}).get("tuned") or {}
    rounds = (tuned.get("timing") or {}).get("rounds") or 0
    if not starts or not ends:
        return {"before": math.nan, "trials": math.nan, "after": math.nan, "n": len(rows),
                "rounds": rounds}
    before = (min(starts) - began).total_seconds()
    during = (max(ends) - min(starts)).total_seconds()
    return {"before": before, "trials": during, "after": wall - before - during,
            "n": len(rows), "rounds": rounds}


def report(a: list[dict], b: list[dict]) -> str:
    lines = ["| | A median [min-max] | B median [min-max] | A/B per pair, median [min-max] |",
             "|---|---|---|---|"]
    for key, label, fmt in (("wall", "wall s", ".1f"), ("cpu", "cpu s", ".1f"),
                            ("rss", "peak RSS MiB", ".0f"),
                            ("before", "before the trials s", ".1f"),
                            ("trials", "trials s", ".1f"), ("n", "trials", ".0f"),
                            ("after", "after the trials s", ".1f"),
                            ("rounds", "re-timing rounds", ".0f")):
        ratios = [x[key] / y[key] for x, y in zip(a, b) if y[key]]
        lines.append(f"| {label} | {median_range([r[key] for r in a], fmt)} | "
                     f"{median_range([r[key] for r in b], fmt)} | "
                     f"{median_range(ratios) if key not in ('n', 'rounds') else '-'} |")
    # the part after the trials compared only where both re-timings ran as many rounds
    same = [x["after"] / y["after"] for x, y in zip(a, b) if x["rounds"] == y["rounds"]]
    lines.append(f"| after the trials, pairs of equal rounds ({len(same)}) | | | "
                 f"{median_range(same)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the revision B runs (a git revision)")
    ap.add_argument("--pairs", type=int, default=3, help="A/B pairs of runs (default 3)")
    ap.add_argument("--keep", help="keep every run's folder (policy, study, output) here")
    args = ap.parse_args()
    if args.pairs < 1:
        raise SystemExit(f"--pairs must be at least 1, got {args.pairs}.")
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    keep = args.keep or tempfile.mkdtemp(prefix="main_job.")
    print(device_line())
    with worktree(args.against) as other:
        sides: dict[str, list[dict]] = {"A": [], "B": []}
        print(f"A = {head} (this checkout), B = {args.against}; {args.pairs} pairs; "
              f"folders under {keep}", flush=True)
        for k in range(args.pairs):
            for side, root in (("A", ROOT), ("B", other)):
                folder = os.path.join(keep, f"{side}{k}")
                os.makedirs(folder, exist_ok=True)
                r = run_once(root, folder)
                sides[side].append(r)
                print(f"pair {k} {side}: wall {r['wall']:.1f} s, before the trials "
                      f"{r['before']:.1f}, {r['n']} trials {r['trials']:.1f}, after "
                      f"{r['after']:.1f} ({r['rounds']} re-timing rounds), "
                      f"peak {r['rss']:.0f} MiB", flush=True)
    print(report(sides["A"], sides["B"]))


if __name__ == "__main__":
    main()
