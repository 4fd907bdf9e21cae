"""A GPT-2-small-shaped model (12 blocks x 768 wide, byte vocabulary, 86M parameters) tuned
end to end with default settings on this machine, then validated.

Batch 2x128 (4 calibration batches): the search times every trial for real, and on 2 CPU
cores a step of this model at 16x128 takes ~10 s. Target: the tune (profile, search, final
re-timing) within 15 minutes; the policy passes `validate` (here 50 training steps per run
instead of the CLI's 100, with the FP32 noise run).

    python benchmarks/bench_scale.py [--validate-steps 50]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

import _common  # noqa: F401
from _common import device_line

from autoprec import profile_view
from autoprec.certification import certify
from autoprec.tuning import tune
from examples.gpt2_bytes import task


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--validate-steps", type=int, default=50)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(device_line())
    t = task(n_layer=12, n_embd=768, batch_size=2, seq_len=128, n_batches=4)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = tune(t, output=os.path.join(tmp, "gpt2-small.yaml"))
        wall = time.perf_counter() - t0
        print(result.summary())
        prof = result.profile
        print(f"\ntune wall time: {wall:.0f} s ({wall / 60:.1f} min; target <= 15 min); profile "
              f"{prof.elapsed:.0f} s for {len(prof.layers)} layers; "
              f"{len(result.trials)} trials")
        print(profile_view.sensitivity_summary(prof))
        t1 = time.perf_counter()
        val = certify(t, result.policy, steps=args.validate_steps)
        print(val.report())
        print(f"certificate: {val.verdict} in {time.perf_counter() - t1:.0f} s")


if __name__ == "__main__":
    main()
