"""The H100 cost model against published measurements it did not make: torchtitan's Llama-3-8B
float8 training on 8 H100s (FSDP2, torch.compile, local batch 1 x 8192 tokens, per-op SAC) and
torchao's float8 linear microbenchmarks. Pure pricing: no GPU, no timing, deterministic.

    python benchmarks/bench_published.py

A whole step is priced by ``autoprec.titan_step.price_training_step``: all 32 blocks' linears
(forward, dgrad, wgrad, the recipe's casts and scales, FP8 all-gather for tensorwise) with the
layer model the tune uses, the forwards per-op SAC recomputes, the BF16 output layer, flash
attention, the norms and elementwise ops, the loss, AdamW on this GPU's shard and FSDP2's
collectives over NVLink that compute does not hide. One constant is fitted,
``StepSpec.time_scale`` (measured / priced seconds, every part alike), to one figure: the
torchtitan bf16 step. Every speed-up is held out: no constant was fitted to any of them.

"before": the model as it was before this check, i.e. ``time_scale`` 1 and rowwise without
the rescale of its backward GEMMs' outputs (the cast table at commit 0e0d62e; reconstructed
here by taking those kernels' priced time off). "after": the model as it is.

Peak memory per GPU is published for every step (torchtitan logs the CUDA caching
allocator's peak *reserved* bytes in GiB; torchao's README copies those figures under "GB").
``autoprec.titan_step.price_training_memory`` prices it by part, as torchtitan runs the step:
FSDP2's sharded FP32 weights, AdamW state and gradients (the gradients' blocks cached in the
reduce-scatter stream's pool), the all-gather stream's pool, the unsharded parameters held
(the root, never resharded after forward, and the last block; FP8 with FP8 all-gather), what
per-op SAC saves in every block, the loss backward's three FP32 tokens x vocab tensors (the
peak; the first block's backward is priced too and is lower), and, for the rowwise run made
before torchtitan#820, the abs() outputs its save list kept. One constant is fitted,
``StepSpec.reserved_ratio`` (reserved / allocated), to one figure: the torchtitan bf16
47.65 GiB. Every other memory row is held out.

autoprec itself prints no priced memory figure for a target: its memory model
(``autoprec.memory``) is calibrated by training steps measured on the task's device, so a
tune's predicted peak is a measurement's extrapolation, not this model's price.
"""

from __future__ import annotations

import dataclasses
import math

import _common  # noqa: F401  (puts the repo root on sys.path)
from _common import print_table

from autoprec.calibration import (
    BLACKWELL_PUBLISHED,
    CALIBRATION,
    LLAMA3_8B_GB200,
    MEASURED_H200,
    PUBLISHED,
    blackwell_rows,
    check_rows,
    measured_rows,
    memory_rows,
)
from autoprec.devices import DEVICES, resolve_target
from autoprec.pricing import calibration_line
from autoprec.titan_step import LLAMA3_8B, STEP_SPECS, price_training_memory, price_training_step

TARGET = "h100"
_GIB = 2**30
# the runs whose memory is priced by part: (recipe, FP8 all-gather, SAC saves abs())
_MEMORY_RUNS = {"bf16": ("bf16", False, False),
                "tensorwise, fp8 all-gather": ("fp8:tensorwise", True, False),
                "rowwise": ("fp8:rowwise", False, False),
                "rowwise, abs() saved": ("fp8:rowwise", False, True)}


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


def _priced_memory(fmt: str, gather: bool, saves: bool, moment: str | None = None,
                   step=None) -> dict[str, float]:
    return price_training_memory(LLAMA3_8B, fmt, TARGET, fp8_all_gather=gather,
                                 sac_saves_abs=saves, step=step, moment=moment)


def _memory_parts_table() -> None:
    parts = {name: _priced_memory(*run) for name, run in _MEMORY_RUNS.items()}
    keys = list(parts["rowwise, abs() saved"])  # every part of the others, in order
    rows = [[k] + [f"{parts[n][k] / _GIB:.2f}" if k in parts[n] else "-" for n in parts]
            for k in keys]
    rows.append(["peak (sum)"] + [f"{sum(p.values()) / _GIB:.2f}" for p in parts.values()])
    # the other candidate for the peak, priced the same way: lower in every run
    block = [_priced_memory(*run, moment="first block's backward") for run in _MEMORY_RUNS.values()]
    rows.append(["(at the first block's backward)"] + [f"{sum(b.values()) / _GIB:.2f}"
                                                       for b in block])
    print(f"\n{LLAMA3_8B.name}: priced GiB per GPU at the step's peak, the loss backward "
          f"(reserved_ratio {STEP_SPECS[TARGET].reserved_ratio})")
    print_table(rows, ["part"] + list(parts))


def _memory_table(rows) -> None:
    published = {(p.where, p.fmt, p.fp8_all_gather): p.peak_memory for p in PUBLISHED
                 if p.peak_memory}
    table = []
    for r, p in zip(rows, [p for p in PUBLISHED if p.peak_memory]):
        written = published[(p.where, p.fmt, p.fp8_all_gather)]
        table.append([r.figure, r.where, written, f"{r.published:.2f}", f"{r.priced:.2f}",
                      f"{r.error:+.1%}", "fitted" if r.fitted else "held out"])
    print("\npeak memory per GPU against the model's prices (GiB; torchao's \"GB\" are "
          "torchtitan's GiB; error = priced / published - 1):")
    print_table(table, ["figure", "published in", "as written", "GiB", "priced", "error", "use"])


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
          f"{priced:.4f} s = time_scale {measured / priced:.4f} (titan_step: "
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
    fitted = next(p for p in PUBLISHED if p.fitted)
    allocated = sum(_priced_memory(fitted.fmt, fitted.fp8_all_gather, fitted.sac_saves_abs,
                                   step=dataclasses.replace(unscaled, reserved_ratio=1.0)).values())
    print(f"\nfit: {fitted.where} bf16 peak {fitted.peak_memory} (max reserved) / priced "
          f"{allocated / _GIB:.2f} GiB allocated = reserved_ratio "
          f"{fitted.peak_memory_bytes() / allocated:.4f} (titan_step: "
          f"{STEP_SPECS[TARGET].reserved_ratio})")
    _memory_parts_table()
    memory = memory_rows(TARGET)
    _memory_table(memory)
    print("\nmemory (held-out rows):")
    errs = [r.error for r in memory if not r.fitted]
    found["memory"] = max(abs(e) for e in errs)
    stated["memory"] = cal.memory_error
    print(f"  memory: {len(errs)} held-out rows, max |error| {found['memory']:.1%}, RMS "
          f"{math.sqrt(sum(e * e for e in errs) / len(errs)):.1%}")
    for name, err in found.items():
        ok = err <= stated[name] < err + 0.005
        print(f"  CALIBRATION states {name} within {stated[name]:.1%}: "
              f"{'matches' if ok else 'DOES NOT MATCH'} the {err:.1%} found")
    print(f"\nwhat a priced figure says: {calibration_line(TARGET)}")
    print("(no memory error in it: autoprec prints no priced memory for a target; its memory "
          "model, autoprec.memory, is calibrated by steps measured on the task's device)")
    _blackwell()
    _h200()


def _h200() -> None:
    """The h200 model against the linears measured on one (MEASURED_H200): before its cast
    kernels' bandwidth was fitted to them (the H100's, with the H200's bandwidth) and after."""
    before = measured_rows(dataclasses.replace(DEVICES["h200"], cast_efficiency=None))
    after = measured_rows("h200")
    table = [[a.figure, f"{a.published:.3f}", f"{b.priced:.2f}", f"{b.error:+.1%}",
              f"{a.priced:.2f}", f"{a.error:+.1%}", "fitted" if a.fitted else "held out"]
             for b, a in zip(before, after)]
    print(f"\n=== H200 ===\n{MEASURED_H200[0].where}: FP8 linears, speed-up over bf16 (95% "
          f"interval), priced before (cast kernels at {DEVICES['h100'].bandwidth_efficiency} of "
          f"the bandwidth, as the H100's) and after the fit (cast_efficiency "
          f"{DEVICES['h200'].cast_efficiency}):")
    print_table(table, ["figure", "measured", "before", "error", "after", "error", "use"])
    cal = CALIBRATION["h200"]
    held = [abs(r.error) for r in after if not r.fitted]
    ok = max(held) <= cal.linear_error < max(held) + 0.005
    print(f"  {len(held)} held-out rows, max |error| {max(held):.1%} (before the fit "
          f"{max(abs(r.error) for r in before if not r.fitted):.1%}); CALIBRATION states "
          f"{cal.linear_error:.1%}: {'matches' if ok else 'DOES NOT MATCH'}")
    print(f"what a priced figure says: {calibration_line('h200')}")


def _blackwell() -> None:
    """The b200 (and b300) model against the published Blackwell figures."""
    unscaled = dataclasses.replace(STEP_SPECS["b200"], time_scale=1.0)
    bf16 = next(p for p in BLACKWELL_PUBLISHED if p.fitted and p.fmt == "bf16")
    priced = sum(price_training_step(bf16.setup, "bf16", "b200", step=unscaled).values())
    measured = bf16.setup.tokens / bf16.value
    print(f"\n=== Blackwell ===\nfit: {bf16.where} bf16 step {measured:.4f} s "
          f"({bf16.value:,.0f} tokens/s) / priced {priced:.4f} s = time_scale "
          f"{measured / priced:.4f} (titan_step: {STEP_SPECS['b200'].time_scale}); "
          f"scaled_efficiency b200 {dict(DEVICES['b200'].scaled_efficiency)}, b300 "
          f"{dict(DEVICES['b300'].scaled_efficiency)}")
    runs = {"bf16": ("bf16", 0, "bf16"), "mxfp8 (all Linear)": ("mxfp8", 0, "mxfp8"),
            "nvfp4, last 5 blocks bf16": ("nvfp4", 5, "bf16"),
            "nvfp4 (all Linear)": ("nvfp4", 0, "nvfp4")}
    parts = {n: price_training_step(LLAMA3_8B_GB200, f, "b200", bf16_tail=t, output=o)
             for n, (f, t, o) in runs.items()}
    rows = [[k] + [f"{parts[n].get(k, 0.0) * 1e3:.1f}" for n in runs]
            for k in dict.fromkeys(k for p in parts.values() for k in p)]
    rows.append(["tokens/s per GPU"] + [f"{LLAMA3_8B_GB200.tokens / sum(parts[n].values()):,.0f}"
                                        for n in runs])
    print(f"\n{LLAMA3_8B_GB200.name}: priced milliseconds per step and GPU (b200 model)")
    print_table(rows, ["part"] + list(runs))
    found = blackwell_rows()
    table = [[r.figure, r.where, _fmt(r.published, r.figure), _fmt(r.priced, r.figure),
              f"{r.error:+.1%}", "fitted" if r.fitted else "held out"] for r in found]
    print("\npublished Blackwell figures against the model's prices (error = priced / "
          "published - 1):")
    print_table(table, ["figure", "published in", "published", "priced", "error", "use"])
    cal = CALIBRATION["b200"]
    for name, kind, stated in (("step speed-ups", "step", cal.speedup_error),
                               ("GEMM-only speed-ups", "linear", cal.linear_error)):
        errs = [abs(r.error) for r in found if r.kind == kind and not r.fitted
                and "speed-up" in r.figure]
        ok = max(errs) <= stated < max(errs) + 0.005
        print(f"  {name}: {len(errs)} held-out rows, max |error| {max(errs):.1%}; CALIBRATION "
              f"states {stated:.1%}: {'matches' if ok else 'DOES NOT MATCH'}")
    print(f"what a priced figure says: {calibration_line('b200')}")


if __name__ == "__main__":
    main()
