"""Tuning on this CPU *for a GPU*: `tune(target="h100")` on GPT-2 4x1024, numerics measured
here on small calibration batches, layers priced by the H100 cost model at 8x1024 tokens.

Prints the share of matmul FLOPs the tuned policy puts in fp8, the cost-model speed-up over
fp32 and over uniform bf16 (with the measurements the model was checked against and how far
off it was; a priced difference inside that error is written as a tie), the reason each layer
kept out of fp8 has, and a short validation (FP32 vs policy from one initialization, judged
against FP32's own run-to-run noise).

    python benchmarks/bench_target.py [--target h100] [--trials 40] [--validate-steps 40]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import _common  # noqa: F401
from _common import device_line

from autoprec import Format, Policy, profile_view
from autoprec.pricing import calibration_line, priced_tie
from autoprec.tuning import tune, validate_front
from examples.gpt2_bytes import gpu_task


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="h100")
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--validate-steps", type=int, default=40)
    args = ap.parse_args()
    print(device_line(), flush=True)
    task = gpu_task()
    t0 = time.perf_counter()
    out = tempfile.mkdtemp(prefix="bench-target-") + "/policy.yaml"
    res = tune(task, target=args.target, formats=("fp32", "bf16", "fp8"),
               n_trials=args.trials, output=out)
    tune_s = time.perf_counter() - t0
    prof = res.profile
    res = validate_front(res, task, steps=args.validate_steps)
    pol = res.policy
    layers = {lp.fqn: lp.layer for lp in prof.layers}
    total = sum(L.flops for L in layers.values())
    fp8 = sum(L.flops for f, L in layers.items() if pol.format_for(f).is_scaled)
    mix: dict[str, float] = {}
    for f, L in layers.items():
        mix[pol.format_for(f).label] = mix.get(pol.format_for(f).label, 0.0) + L.flops
    step = prof.estimate_step({f: pol.format_for(f) for f in layers}, args.target)
    bf16 = prof.estimate_step({f: Format.BF16 for f in layers}, args.target)
    fp32 = prof.estimate_step({f: Format.FP32 for f in layers}, args.target)
    print(f"\ntune for {args.target}: {tune_s:.0f} s, {len(res.trials)} trials")
    print(pol.to_yaml())
    print(f"matmul FLOPs in fp8: {fp8 / total:.1%} ("
          + ", ".join(f"{k} {v / total:.1%}" for k, v in sorted(mix.items(), key=lambda kv: -kv[1]))
          + ")")
    vs_bf16 = " (a tie: inside the calibration error)" if priced_tie(step, bf16, args.target) \
        else ""
    print(f"cost-model time of the searched layers: policy / fp32 = {step / fp32:.3f} "
          f"({fp32 / step:.2f}x), policy / uniform bf16 = {step / bf16:.3f}{vs_bf16}")
    print(calibration_line(args.target))
    if res.validation is not None:
        print(res.validation.report())
    else:
        print("certificate: no Pareto policy's passed; fell back to fp32")
    print("\nper layer: why not fp8, or why this recipe (speed vs bf16 priced, loss measured):")
    for f in layers:
        fmt = pol.format_for(f)
        print(f"  {f:<30} {fmt.label:<22} {profile_view.fp8_reason(prof, f, fmt)}")
    uniform = prof.estimate_step({f: Policy(default="fp8").format_for(f) for f in layers},
                                 args.target)
    tie = " (a tie)" if priced_tie(uniform, bf16, args.target) else ""
    print(f"(uniform fp8 would cost {uniform / bf16:.3f}x uniform bf16{tie})")


if __name__ == "__main__":
    main()
