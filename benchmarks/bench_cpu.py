"""What this CPU's matmul units are fast at: one square matmul in fp32, bf16 and fp16,
interleaved in the same rounds, as ratios against fp32 with their 95% intervals, beside the
CPU features autoprec detects (autoprec.formats.cpu_features). Which format can win on a host
is decided here, not assumed: with BF16 dot-product instructions (Zen 4, AMX parts) bf16
beats fp32; without them (Zen 3's AVX2, Intel AVX512 parts before Cooper Lake) it loses.

    python benchmarks/bench_cpu.py [--size 1024] [--rounds 6] [--threads 2]

fp16 is timed at half the size (it runs ~200x slower than fp32 on CPUs without FP16
units, and its ratio is reported for that size, with fp32 timed again at it).
"""

from __future__ import annotations

import argparse

import torch

from _common import device_line, interleaved, print_table, ratio_cell
from autoprec.formats import cpu_features


def _matmul(n: int, dtype: torch.dtype):
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return lambda: torch.mm(a, b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(device_line())
    print(f"cpu: {cpu_features().describe()}")
    n, small = args.size, max(args.size // 2, 16)
    rows = []
    big = interleaved({"fp32": _matmul(n, torch.float32), "bf16": _matmul(n, torch.bfloat16)},
                      warmup=2, rounds=args.rounds, repeats=2)
    rows.append([f"{n}^3", "bf16", f"{big.seconds('fp32') * 1e3:.1f}",
                 f"{big.seconds('bf16') * 1e3:.1f}", ratio_cell(big.ratio("bf16", "fp32"))])
    half = interleaved({"fp32": _matmul(small, torch.float32),
                        "fp16": _matmul(small, torch.float16)},
                       warmup=1, rounds=args.rounds, repeats=1)
    rows.append([f"{small}^3", "fp16", f"{half.seconds('fp32') * 1e3:.2f}",
                 f"{half.seconds('fp16') * 1e3:.1f}", ratio_cell(half.ratio("fp16", "fp32"))])
    print_table(rows, ["matmul", "format", "fp32 ms", "format ms", "time / fp32 [95%]"])


if __name__ == "__main__":
    main()
