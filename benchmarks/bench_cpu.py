"""What this CPU's matmul units are fast at: one square matmul in fp32, bf16 and fp16,
interleaved in the same rounds, as ratios against fp32 with their 95% intervals, beside the
CPU features autoprec detects (autoprec.host.cpu_features). Which format can win on a host
is decided here, not assumed: with BF16 dot-product instructions (Zen 4, AMX parts) bf16
beats fp32; without them (Zen 3's AVX2, Intel AVX512 parts before Cooper Lake) it loses.

    python benchmarks/bench_cpu.py [--size 1024] [--rounds 6] [--threads 2]

fp16 is timed at half the size (it runs ~200x slower than fp32 on CPUs without FP16
units, and its ratio is reported for that size, with fp32 timed again at it).

Then what a host without 16-bit units costs the measurements (autoprec.measure.deviation: one
forward + backward of an HF Llama, ``--llama-layers`` of width ``--llama-width`` on 2 x 64
tokens, compared with its FP32 reference): under an all-bf16 and an all-fp16 policy on
autocast's kernels and by the FP32 emulation of the same GEMMs (runtime.fp8.emulating, what the
measurements use where the host lacks the units), each against the all-fp32 measurement timed
in the same rounds.
"""

from __future__ import annotations

import argparse

import torch
from _common import device_line, interleaved, print_table, ratio_cell

from autoprec import Policy
from autoprec.formats import Format
from autoprec.host import cpu_features
from autoprec.measure.deviation import DeviationMeter, prepare_for_measurement
from examples.data import byte_batches
from examples.llama_bytes import make_model


def _matmul(n: int, dtype: torch.dtype):
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return lambda: torch.mm(a, b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-layers", type=int, default=2)
    ap.add_argument("--llama-width", type=int, default=512)
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
    _measurements(args)


def _measurements(args) -> None:
    w = args.llama_width
    torch.manual_seed(0)
    model = prepare_for_measurement(make_model(args.llama_layers, hidden=w,
                                               intermediate=w * 7 // 2, heads=w // 64,
                                               kv_heads=max(w // 256, 1), seq_len=64))
    num = DeviationMeter(model, byte_batches(1, 2, 64, seed=1), lambda m, b: m(**b).loss)
    num.reference()

    def measure(fmt: Format, emulated: bool):
        def run():
            num.emulated = frozenset({fmt.autocast_dtype}) if emulated else frozenset()
            return num.compare(Policy(default=fmt))
        return run

    fns = {"fp32": measure(Format.FP32, False)}
    for fmt in (Format.BF16, Format.FP16):
        fns[f"{fmt} (autocast's kernels)"] = measure(fmt, False)
        fns[f"{fmt} (FP32 emulation)"] = measure(fmt, True)
    res = interleaved(fns, warmup=1, rounds=args.rounds, repeats=1)
    print(f"\nmeasuring a Llama of {args.llama_layers} layers x {w} on 2x64 tokens "
          "(DeviationMeter.compare: forward + backward against FP32)")
    print_table([[name, f"{res.seconds(name) * 1e3:.0f}", ratio_cell(res.ratio(name, "fp32"))]
                 for name in fns], ["policy", "ms", "time / fp32 [95%]"])


if __name__ == "__main__":
    main()
