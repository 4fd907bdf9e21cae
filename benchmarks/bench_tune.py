"""The main job, measured: tune the GPT-2 example with default settings, then train 300 steps
with FP32, torch.autocast(bf16), torch.autocast(fp16)+GradScaler and the tuned policy from
the same initialization, in one run.

Claims checked (printed, not asserted): on this CPU the tuned policy's step is >= 1.35x faster
than FP32 with its held-out loss within 1% of FP32's (judged next to FP32's own run-to-run
noise), and the tune itself takes <= 5 minutes on 2 cores.

Step-time ratios come from interleaved timing of all variants with the tune's own protocol
(anchor in the same run, 95% intervals); losses from the training runs. On CPUs without FP16
matmul units (this one: AMD EPYC, AVX512-BF16, no AVX512-FP16) an FP16 step is tens of times
slower than FP32, so the fp16 row trains only `--fp16-steps` steps and reports no 300-step
loss.

    python benchmarks/bench_tune.py [--steps 300] [--policy PATH to skip the tune]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import _common  # noqa: F401
import torch
from _common import device_line, interleaved, print_table

import autoprec
from autoprec._util import optimizer_step
from autoprec.tuning import tune
from examples.data import byte_batches
from examples.gpt2_bytes import make_model, task
from examples.train_with_policy import train


def timed_steps(policy_path: str | None):
    batch = byte_batches(1, 16, 128, seed=0)[0]
    torch.manual_seed(0)
    base = make_model(n_layer=4, n_embd=256, n_head=4, seq_len=128).train()

    def make(policy=None, autocast=None):
        model = copy.deepcopy(base)
        scaler = None
        if policy is not None:
            pol = autoprec.load_policy(policy)
            autoprec.apply(model, pol)
            scaler = pol.grad_scaler("cpu") if pol.grad_scaler("cpu").is_enabled() else None
        if autocast == torch.float16:
            scaler = torch.amp.GradScaler("cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            with torch.autocast("cpu", dtype=autocast or torch.float32,
                                enabled=autocast is not None):
                loss = model(**batch).loss
            optimizer_step(loss, opt, scaler)
        return step

    fns = {"fp32": make(), "autocast(bf16)": make(autocast=torch.bfloat16),
           "tuned policy": make(policy=policy_path)}
    fast = interleaved(fns, warmup=3, rounds=12)
    # fp16 has no kernels on this CPU (~30x slower): timed alone, twice, for its order only
    slow = interleaved({"autocast(fp16)+GradScaler": make(autocast=torch.float16)}, warmup=1,
                       rounds=2, repeats=1)
    return fast, slow.seconds("autocast(fp16)+GradScaler")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--fp16-steps", type=int, default=3)
    ap.add_argument("--policy", default=None, help="use this policy instead of tuning")
    ap.add_argument("--output", default=None,
                    help="where the tuned policy goes (default: a temporary folder)")
    args = ap.parse_args()
    print(device_line(), flush=True)

    policy_path = args.policy
    if policy_path is None:
        policy_path = args.output or os.path.join(tempfile.mkdtemp(prefix="bench-tune-"),
                                                  "gpt2_bytes.yaml")
        study = os.path.splitext(policy_path)[0] + ".study.db"
        if os.path.exists(study):
            os.remove(study)  # a full tune, not a resumed one
        t0 = time.perf_counter()
        res = tune(task(), output=policy_path)
        tune_s = time.perf_counter() - t0
        res.save(policy_path)
        if res.profile is not None:
            res.profile.save(os.path.splitext(policy_path)[0] + ".profile.json")
        over = res.improvement_over_warm_start
        print(f"\ntune: {tune_s:.0f} s with default settings (target <= 300 s); "
              f"{len(res.trials)} trials; winner {res.speedup} fp32 as the tune re-timed it; "
              + ("it is the best warm start" if over is None else
                 f"over the best warm start {over}" + (" (a tie)" if over.low <= 1 else "")))
        print(res.summary())
        print(open(policy_path).read())

    step, fp16_seconds = timed_steps(policy_path)
    runs = {}
    for name, kw in (("fp32", {}), ("fp32 (other data order)", {"seed": 1}),
                     ("autocast(bf16)", {"autocast": "bf16"}),
                     ("tuned policy", {"policy": policy_path})):
        t0 = time.perf_counter()
        kw = dict(kw)
        seed = kw.pop("seed", 0)
        out = train(kw.pop("policy", None), steps=args.steps, seed=seed, quiet=True, **kw)
        runs[name] = out["eval_loss"]
        print(f"trained {name}: held-out loss {out['eval_loss']:.4f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    fp16 = train(None, steps=args.fp16_steps, autocast="fp16", quiet=True)
    runs["autocast(fp16)+GradScaler"] = None
    ref = runs["fp32"]
    noise = abs(runs["fp32 (other data order)"] - ref) / ref
    rows = []
    for name in ("fp32", "autocast(bf16)", "autocast(fp16)+GradScaler", "tuned policy"):
        loss = runs[name]
        if name in step.active:
            ms, vs32 = step.seconds(name) * 1e3, str(step.speedup(name, "fp32"))
            vs16 = str(step.speedup(name, "autocast(bf16)"))
        else:  # timed alone: a ratio of two separate measurements, no interval
            ms, vs32 = fp16_seconds * 1e3, f"{step.seconds('fp32') / fp16_seconds:.2f}x"
            vs16 = f"{step.seconds('autocast(bf16)') / fp16_seconds:.2f}x"
        rows.append([name, f"{ms:.0f}", vs32, vs16, "-" if loss is None else f"{loss:.4f}",
                     "-" if loss is None else f"{(loss - ref) / ref:+.2%}"])
    print()
    print_table(rows, ["variant", "step ms", "speed vs fp32 [95%]", "speed vs autocast(bf16)",
                       f"held-out loss @{args.steps}", "vs fp32"])
    print(f"FP32 run-to-run noise (data order): {noise:.2%}; fp16 trained {args.fp16_steps} steps "
          f"only (final train loss {fp16['losses'][-1]:.3f}): "
          f"{statistics.median(fp16['step_times']) * 1e3:.0f} ms/step here")


if __name__ == "__main__":
    main()
