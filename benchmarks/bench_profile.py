"""Profile wall time vs model depth: GPT-2 with 2, 4 and 8 layers (256 wide, batch 16x128),
all four formats, measured on this machine. Profiling should grow about linearly with the
layer count; the 4-layer model should take under 2 minutes on 2 cores.

    python benchmarks/bench_profile.py [--layers 2 4 8]
"""

from __future__ import annotations

import argparse
import time

import _common  # noqa: F401
from _common import device_line, print_table

from autoprec.profiling import profile
from examples.gpt2_bytes import task


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    print(device_line())
    rows, base = [], None
    for n in args.layers:
        t = task(n_layer=n, n_embd=256, batch_size=16, seq_len=128, n_batches=4)
        t0 = time.perf_counter()
        prof = profile(t, progress=False)
        wall = time.perf_counter() - t0
        per = wall / len(prof.layers)
        base = base or (wall / n)
        rows.append([str(n), str(len(prof.layers)), f"{wall:.1f}", f"{per:.2f}",
                     f"{wall / n / base:.2f}", prof.capture_method])
    print_table(rows, ["blocks", "layers profiled", "wall s", "s per layer",
                       "s per block / first row's", "capture"])
    print("formats: fp32, bf16, fp16, fp8 (fp8 emulated on CPU); 1 calibration batch of 16x128")


if __name__ == "__main__":
    main()
