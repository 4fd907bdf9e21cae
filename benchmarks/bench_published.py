"""The H100 cost model against published measurements it did not make: torchtitan's Llama-3-8B
float8 training on 8 H100s (FSDP2, torch.compile, local batch 1 x 8192 tokens, per-op SAC) and
torchao's float8 linear microbenchmarks. Pure pricing: no GPU, no timing, deterministic.

    python benchmarks/bench_published.py

A whole step is priced by ``autoprec.costmodel.price_training_step``: all 32 blocks' linears
(forward, dgrad, wgrad, the recipe's casts and scales, FP8 all-gather for tensorwise) with the
layer model the tune uses, the forwards per-op SAC recomputes, the BF16 output layer, flash
attention, the norms and elementwise ops, the loss, AdamW on this GPU's shard and FSDP2's
collectives over NVLink that compute does not hide. One constant is fitted,
``StepSpec.time_scale`` (measured / priced seconds, every part alike), to one figure: the
torchtitan bf16 step. Every speed-up is held out: no constant was fitted to any of them.

"before": the model as it was before this check, i.e. ``time_scale`` 1 and rowwise without
the rescale of its backward GEMMs' outputs (the cast table at commit 0e0d62e; reconstructed
here by taking those kernels' priced time off). "after": the model as it is.

Peak memory is published for every step; autoprec's memory model cannot price it (see the
memory rows), so those rows say so instead of inventing a figure.
"""

from __future__ import annotations

import dataclasses
import math

import _common  # noqa: F401  (puts the repo root on sys.path)
from _common import print_table

from autoprec.costmodel import (
    CALIBRATION,
    LLAMA3_8B,
    PUBLISHED,
    STEP_SPECS,
    check_rows,
    price_training_step,
    resolve_target,
)
from autoprec.pricing import calibration_line

TARGET = "h100"
_MEMORY_WHY = ("not priced: autoprec's memory model is calibrated by a step measured on the "
               "task's device and models neither FSDP2's sharding nor selective checkpointing")


def _rescale_seconds() -> float:
    """Priced seconds of rowwise's backward rescale kernels in a step (before time_scale): a
    read and a write in BF16 of each backward GEMM's output, dgrad (tokens x in) and wgrad
    (in x out), for every block's linear; what the model lacked before this check."""
    _, spec = resolve_target(TARGET)
    bw = spec.bandwidth * spec.bandwidth_efficiency
    t = LLAMA3_8B.tokens
    return LLAMA3_8B.layers * sum(max(4 * t * k / bw, spec.launch_s) + max(4 * k * n / bw,
                                                                          spec.launch_s)
                                  for k, n in LLAMA3_8B.linears().values())


def _before_rows(unscaled) -> list:
    """``check_rows`` of the model before this check: time_scale 1, and rowwise steps without
    the rescale kernels (a step's speed-up = bf16 seconds / recipe seconds)."""
    rows = check_rows(TARGET, step=unscaled)
    bf16 = sum(price_training_step(LLAMA3_8B, "bf16", TARGET, step=unscaled).values())
    rowwise = sum(price_training_step(LLAMA3_8B, "fp8:rowwise", TARGET, step=unscaled).values())
    old = bf16 / (rowwise - _rescale_seconds())
    return [dataclasses.replace(r, priced=old) if r.kind == "step" and "rowwise" in r.figure
            else r for r in rows]


def _parts_table() -> None:
    runs = {"bf16": ("bf16", False), "fp8 tensorwise, fp8 all-gather": ("fp8:tensorwise", True),
            "fp8 rowwise": ("fp8:rowwise", False)}
    parts = {name: price_training_step(LLAMA3_8B, fmt, TARGET, fp8_all_gather=gather)
             for name, (fmt, gather) in runs.items()}
    keys = list(parts["bf16"])
    rows = [[k] + [f"{parts[n][k] * 1e3:.1f}" for n in runs] for k in keys]
    rows.append(["step (sum)"] + [f"{sum(parts[n].values()) * 1e3:.1f}" for n in runs])
    rows.append(["tokens/s per GPU"] + [f"{LLAMA3_8B.tokens / sum(parts[n].values()):,.0f}"
                                        for n in runs])
    # what a tune of the blocks' linears alone compares, before the rest dilutes it
    linears = {n: parts[n]["block linears"] + parts[n]["recompute (SAC)"] for n in runs}
    rows.append(["speed-up, block linears alone"] + [f"{linears['bf16'] / linears[n]:.3f}x"
                                                     for n in runs])
    rows.append(["speed-up, whole step"] + [
        f"{sum(parts['bf16'].values()) / sum(parts[n].values()):.3f}x" for n in runs])
    print(f"\n{LLAMA3_8B.name}: priced milliseconds per step and GPU ({TARGET} model, "
          f"time_scale {STEP_SPECS[TARGET].time_scale})")
    print_table(rows, ["part"] + list(runs))


def _fmt(x: float, figure: str) -> str:
    return f"{x:,.0f}" if "tokens" in figure else f"{x:.3f}x"


def _check_table(before, after) -> None:
    rows = []
    for b, a in zip(before, after):
        rows.append([a.figure, a.where, _fmt(a.published, a.figure), _fmt(b.priced, a.figure),
                     f"{b.error:+.1%}", _fmt(a.priced, a.figure), f"{a.error:+.1%}",
                     "fitted" if a.fitted else "held out"])
    print("\npublished figures against the model's prices (error = priced / published - 1):")
    print_table(rows, ["figure", "published in", "published", "before", "error", "after",
                       "error", "use"])
    mem = [[f"{p.fmt.removeprefix('fp8:')} peak memory", p.where, p.peak_memory, "-"]
           for p in PUBLISHED if p.peak_memory]
    print(f"\npeak memory per GPU, {_MEMORY_WHY}:")
    print_table(mem, ["figure", "published in", "published", "priced"])


def _summary(rows) -> dict[str, float]:
    """Largest and RMS relative error of the held-out rows, by kind of figure."""
    out = {}
    kinds = {"step speed-ups": lambda r: r.kind == "step" and "speed-up" in r.figure,
             "step tokens/s": lambda r: r.kind == "step" and "tokens" in r.figure,
             "single linears": lambda r: r.kind == "linear"}
    for name, keep in kinds.items():
        errs = [r.error for r in rows if keep(r) and not r.fitted]
        out[name] = max(abs(e) for e in errs)
        print(f"  {name}: {len(errs)} held-out rows, max |error| {out[name]:.1%}, RMS "
              f"{math.sqrt(sum(e * e for e in errs) / len(errs)):.1%}")
    return out


def main() -> None:
    unscaled = dataclasses.replace(STEP_SPECS[TARGET], time_scale=1.0)
    bf16 = next(p for p in PUBLISHED if p.fitted)
    priced = sum(price_training_step(LLAMA3_8B, "bf16", TARGET, step=unscaled).values())
    measured = LLAMA3_8B.tokens / bf16.value
    print(f"fit: {bf16.where} bf16 step {measured:.4f} s ({bf16.value:,.0f} tokens/s) / priced "
          f"{priced:.4f} s = time_scale {measured / priced:.4f} (costmodel: "
          f"{STEP_SPECS[TARGET].time_scale})")
    _parts_table()
    before, after = _before_rows(unscaled), check_rows(TARGET)
    _check_table(before, after)
    print("\nbefore this check (held-out rows):")
    _summary(before)
    print("after (held-out rows):")
    found = _summary(after)
    cal = CALIBRATION[TARGET]
    stated = {"step speed-ups": cal.speedup_error, "step tokens/s": cal.time_error,
              "single linears": cal.linear_error}
    for name, err in found.items():
        ok = err <= stated[name] < err + 0.005
        print(f"  CALIBRATION states {name} within {stated[name]:.1%}: "
              f"{'matches' if ok else 'DOES NOT MATCH'} the {err:.1%} found")
    print(f"\nwhat a priced figure says: {calibration_line(TARGET)}")


if __name__ == "__main__":
    main()
