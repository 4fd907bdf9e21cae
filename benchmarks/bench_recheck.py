"""Cost of the re-check (autoprec.recheck): one re-check against one training step, and the
overhead of re-checking every N steps inside a training run.

1. On the GPT-2 example (examples/gpt2_bytes.py task(): 4 layers, 256 wide, batch 16x128),
   the policy all-bf16 with the head in fp32, guarded: interleaved rounds of an FP32 training
   step (unpoliced), a training step under the policy, and ``Rechecker.check`` on the same
   batch (the live weights copied into its private copy, then the first-order estimate).
   Ratios of the re-check to each step, with their 95% paired-bootstrap intervals.
2. A training run of ``--run-steps`` steps (GPT-2 2x64, batch 4x64, AdamW, the same policy,
   guarded), with and without a Rechecker every ``--every`` steps, in alternated pairs of runs.
   Each run is cut into windows of ``--every`` steps (one re-check in each window of the run
   with it); the ratio is over paired windows, with its interval, and the whole-run ratio.

    python benchmarks/bench_recheck.py [--rounds 8] [--run-steps 1000] [--every 200]
                                       [--pairs 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import _common  # noqa: F401  (sets up sys.path)
import torch
from _common import device_line, interleaved, median_range, print_table, ratio_cell
from bench_guard import plain_step  # the same training step the guard's overhead is timed on

from autoprec import Policy
from autoprec.integrations import training_kit
from autoprec.measure.timer import ratio_interval
from autoprec.recheck import Rechecker
from examples.data import byte_batches
from examples.gpt2_bytes import make_model, task

POLICY = Policy(default="bf16", layers={"lm_head": "fp32"})


def cost_per_recheck(rounds: int) -> None:
    t = task()
    batch = t.batches[0]
    fp32 = t.build_model()
    policed, _, guard = training_kit(t.build_model(), POLICY, guard=True)
    rechecker = Rechecker(POLICY, every=1)
    steps = iter(range(1, 10 ** 9))
    cmp = interleaved({"fp32 step": plain_step(fp32, batch),
                       "policy step": plain_step(policed, batch, guard),
                       "recheck": lambda: rechecker.check(policed, batch, next(steps))},
                      warmup=2, rounds=rounds, repeats=1)
    layers = len(rechecker.check(policed, batch, next(steps)).rows)
    print(f"\n1. one re-check vs one training step: {t.name}, batch 16x128, {layers} layer x "
          f"format rows, {rounds} interleaved rounds")
    print_table([["recheck / policy step", ratio_cell(cmp.ratio("recheck", "policy step")),
                  f"{cmp.seconds('recheck'):.2f} s"],
                 ["recheck / fp32 step", ratio_cell(cmp.ratio("recheck", "fp32 step")),
                  f"{cmp.seconds('fp32 step'):.3f} s (fp32 step)"],
                 ["policy step / fp32 step", ratio_cell(cmp.ratio("policy step")),
                  f"{cmp.seconds('policy step'):.3f} s (policy step)"]],
                ["ratio", "value [95%]", "time (20% quantile)"])


def _run(steps: int, every: int, with_recheck: bool, batches) -> tuple[list[float], float]:
    """One training run: the time of each window of ``every`` steps, and the time spent in
    the re-checks (measured directly: contention blurs it less than a ratio of runs)."""
    torch.manual_seed(0)
    model, scaler, guard = training_kit(make_model(2, 64, 1, 64), POLICY, guard=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rechecker = Rechecker(POLICY, every=every) if with_recheck else None
    windows, inside, t0 = [], 0.0, time.perf_counter()
    for step in range(1, steps + 1):
        batch = batches[step % len(batches)]
        loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if rechecker is not None:
            t1 = time.perf_counter()
            rechecker.maybe(model, batch, step)
            inside += time.perf_counter() - t1
        guard.step()
        if step % every == 0:
            now = time.perf_counter()
            windows.append(now - t0)
            t0 = now
    return windows, inside


def overhead_in_training(steps: int, every: int, pairs: int) -> None:
    batches = byte_batches(8, 4, 64, seed=1)
    with_w, without_w, totals, direct = [], [], [], []
    _run(every, every, True, batches)  # warm the process (allocator, first re-check's imports)
    for p in range(pairs):
        order = (True, False) if p % 2 == 0 else (False, True)
        got, inside = {}, 0.0
        for flag in order:
            got[flag], spent = _run(steps, every, flag, batches)
            inside += spent
        with_w += got[True]
        without_w += got[False]
        totals.append(sum(got[True]) / sum(got[False]))
        direct.append(1.0 + inside / (sum(got[True]) - inside))
    print(f"\n2. in training: GPT-2 2x64, batch 4x64, {steps} steps, a re-check every {every} "
          f"steps ({steps // every} per run), {pairs} alternated pairs of runs")
    print_table([["with / without, paired windows", ratio_cell(ratio_interval(with_w, without_w)),
                  f"{len(with_w)} windows of {every} steps"],
                 ["with / without, whole runs", _spread(totals),
                  f"{sum(without_w) / pairs:.1f} s per run without"],
                 ["1 + re-check time / rest of the run", _spread(direct),
                  "timed around maybe(), per run"]],
                ["ratio", "value", "over"])


def _spread(values: list[float]) -> str:
    """The median of per-run ratios with their range."""
    return f"{median_range(values)} ({len(values)} runs)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--run-steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=200)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core machine two threads fight)")
    ap.add_argument("--skip-cost", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(device_line())
    if not args.skip_cost:
        cost_per_recheck(args.rounds)
    overhead_in_training(args.run_steps, args.every, args.pairs)


if __name__ == "__main__":
    main()
