"""Does a profile taken at initialisation still describe the model after training? (issue 23)

Builds the bundled example (``examples/gpt2_bytes.py:task``: GPT-2 4x256, batch 16x128,
seeded), measures every computing layer's sensitivity (``measure_sensitivity``: bf16, fp16,
fp8 with the default recipe, on the task's calibration batch) at step 0, trains in FP32
(AdamW, the task's ``train_batches``, seeded) and measures again at each of ``--steps``.
Numerics are measured on this CPU whatever device a tune would price for: the ranking asked
about is the same for ``--target h100`` (its profile measures the same numbers).

Per format it prints:

1. the Spearman rank correlation over layers of ``loss_rel_change`` and of ``grad_rel_error``
   between step 0 and each later step, and between consecutive later steps, each with a
   bootstrap 95% interval over layers (layers resampled with replacement): how far the
   ranking a tune would act on moves;
2. at each step: the largest |loss change| and its layer, the gradient-error and SQNR ranges;
3. with ``--planted`` (examples/drift.py's ``plant_drift`` on the same model, aimed to reach
   FP16's max at step ``--overflow-at``; in FP32 training nothing overflows): what each
   profile says about the drifted layer in fp16 (loss change, its rank among the layers,
   overflow shares, finite, verdict) next to its actual output amax and FP16 headroom.

``--mode fast`` uses the first-order estimate instead of the exact measurement (the truth);
``--mode exact,fast`` measures both at every step (one training run) and also prints how the
estimate ranks against the exact numbers at each step. ``--out`` saves every raw row as JSON;
``--report`` prints a saved run's tables again. ``--layers/--width/--batch-size/--seq-len``
shrink the example, for a run that does not fit at its size (the results say which size).

    python benchmarks/bench_drift.py [--steps 200,1000] [--mode exact] [--planted] [--out F]
    python benchmarks/bench_drift.py --report F      # the tables of a saved run again
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import _common  # noqa: F401  (sets the import path and HF's offline mode)
import numpy as np
import torch
from _common import device_line
from scipy.stats import rankdata, spearmanr

from autoprec._util import decode_float, encode_float, optimizer_step, read_json, write_json
from autoprec.formats import Format
from autoprec.measure.capture import capture
from autoprec.measure.sensitivity import (
    SENSITIVITY_MODES,
    LayerSensitivity,
    measure_sensitivity,
)
from autoprec.runtime.calls import COMPUTING_KINDS
from autoprec.task import Task
from examples import gpt2_bytes
from examples.drift import DRIFT_LAYER, FP16_MAX, plant_drift

FORMATS = (Format.BF16, Format.FP16, Format.FP8)
# (column, LayerSensitivity field) ranked between steps
METRICS = (("loss change", "loss_rel_change"), ("grad error", "grad_rel_error"))
BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95
# training losses averaged into the "train loss" of a checkpoint
LOSS_WINDOW = 20


@dataclass(frozen=True)
class Settings:
    """One run of the benchmark."""

    # the checkpoints after step 0, strictly increasing
    steps: tuple[int, ...] = (200, 1000)
    # sensitivity modes measured at every checkpoint ("exact" is the truth)
    modes: tuple[str, ...] = ("exact",)
    # plant examples/drift.py's slow drift before step 0
    planted: bool = False
    # the step the drift is aimed to reach FP16's max at
    overflow_at: int = 300
    lr: float = 1e-3
    # seeds the model, the data order and the bootstrap
    seed: int = 0

    def __post_init__(self):
        steps = list(self.steps)
        if not steps or any(s < 1 for s in steps) or steps != sorted(set(steps)):
            raise ValueError(f"--steps must be strictly increasing positive step counts, got "
                             f"{','.join(map(str, steps)) or 'nothing'}; e.g. --steps 200,1000.")
        bad = [m for m in self.modes if m not in SENSITIVITY_MODES] or \
            ([] if self.modes else ["(none)"])
        if bad:
            raise ValueError(f"--mode {bad[0]} is not a sensitivity mode; expected one of "
                             f"{', '.join(SENSITIVITY_MODES)}, or several joined by commas.")


# ------------------------------------------------------------------------------ measuring
def computing_layers(task: Task, model: torch.nn.Module) -> list[str]:
    """The layers a profile measures: every computing layer with FLOPs, in execution order."""
    graph = capture(model, task.model_call(model, task.example_batch()))
    return [L.fqn for L in graph.layers if L.kind in COMPUTING_KINDS and L.flops > 0]


def checkpoint(task: Task, model: torch.nn.Module, layers: list[str], settings: Settings,
               train_losses: list[float]) -> dict:
    """Every mode's sensitivity of ``model`` as it is now, with what it was measured on."""
    amax: list[float] = []  # the drifted layer's largest |output| in FP32, per call
    hook = model.get_submodule(DRIFT_LAYER).register_forward_hook(
        lambda m, args, y: amax.append(float(y.detach().abs().max()))) \
        if settings.planted else None
    try:
        with torch.no_grad():
            calib_loss = float(task.loss(model, task.example_batch()))
    finally:
        if hook is not None:
            hook.remove()
    recent = train_losses[-LOSS_WINDOW:]
    out = {"train_loss": sum(recent) / len(recent) if recent else math.nan,
           "calib_loss": calib_loss, "modes": {}, "seconds": {}}
    if amax:
        out["drift_amax"] = max(amax)
    now = dataclasses.replace(task, model=model)  # measured on a copy of the model as it is
    for mode in settings.modes:
        t0 = time.perf_counter()
        res = measure_sensitivity(now, layers, FORMATS, mode=mode, seed=settings.seed)
        out["seconds"][mode] = time.perf_counter() - t0
        out["modes"][mode] = {n: dict(res[n]) for n in layers}
    return out


def run(task: Task, settings: Settings, log: Callable[[str], None] = print) -> dict:
    """Profile at step 0, train in FP32 and profile again at each checkpoint."""
    torch.manual_seed(settings.seed)
    model = task.build_model().train()
    layers = computing_layers(task, model)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    drift = plant_drift(model, opt, task.example_batch(),
                        overflow_at=settings.overflow_at) if settings.planted else None
    stream = task.train_batches(settings.steps[-1], settings.seed)
    result = {"task": task.name, "layers": layers, "checkpoints": {}, "train_seconds": 0.0,
              "drift_scale": drift.start_scale if drift else None}
    losses: list[float] = []
    done = 0
    for step in (0, *settings.steps):
        t0 = time.perf_counter()
        for batch in stream[done:step]:
            loss = task.loss(model, batch)
            optimizer_step(loss, opt)
            losses.append(float(loss.detach()))
        result["train_seconds"] += time.perf_counter() - t0
        done = step
        result["checkpoints"][step] = checkpoint(task, model, layers, settings, losses)
        c = result["checkpoints"][step]
        log(f"step {step}: train loss {c['train_loss']:.4f}, calibration loss "
            f"{c['calib_loss']:.4f}; measured in "
            + ", ".join(f"{m} {s:.1f} s" for m, s in c["seconds"].items()))
    if drift is not None:
        drift.remove()
    return result


# ------------------------------------------------------------------------------ summarising
def metric(rows: dict, layers: Sequence[str], fmt: Format, field: str) -> list[float]:
    """``field`` of every layer in ``fmt``; a non-finite run counts as the worst (+inf)."""
    out = []
    for name in layers:
        s = rows[name][fmt]
        v = getattr(s, field)
        out.append(v if s.finite and v is not None and math.isfinite(v) else math.inf)
    return out


def rho(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation; nan for fewer than 3 pairs or a constant side."""
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return math.nan
    return float(spearmanr(xs, ys)[0])


def bootstrap_rho(xs: Sequence[float], ys: Sequence[float], seed: int = 0,
                  resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float, float]:
    """Spearman and its percentile bootstrap interval (layers resampled with replacement,
    ranks averaged over ties as spearmanr does); resamples whose Spearman is undefined (a
    constant side) are left out."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(x), (resamples, len(x)))
    rx, ry = (rankdata(v[idx], axis=1) for v in (x, y))
    rx, ry = rx - rx.mean(axis=1, keepdims=True), ry - ry.mean(axis=1, keepdims=True)
    norm = np.sqrt((rx * rx).sum(axis=1) * (ry * ry).sum(axis=1))
    defined = norm > 0
    draws = (rx * ry).sum(axis=1)[defined] / norm[defined]
    if draws.size == 0:
        return rho(xs, ys), math.nan, math.nan
    tail = (1.0 - CONFIDENCE) / 2.0
    return rho(xs, ys), float(np.quantile(draws, tail)), float(np.quantile(draws, 1.0 - tail))


def step_pairs(steps: Sequence[int]) -> list[tuple[int, int]]:
    """(0, s) for each later step, then each later step against the next."""
    later = [s for s in steps if s != 0]
    return [(0, s) for s in later] + list(zip(later, later[1:]))


def rho_cell(r: tuple[float, float, float]) -> str:
    value, low, high = r
    if math.isnan(value):
        return "n/a"
    return f"{value:+.2f} [{low:+.2f}, {high:+.2f}]" if not math.isnan(low) else f"{value:+.2f}"


def rank_rows(result: dict, mode: str, seed: int = 0) -> list[list[str]]:
    """Per format and pair of steps: the Spearman of each metric over layers, with its
    bootstrap interval."""
    cps, layers = result["checkpoints"], result["layers"]
    rows = []
    for fmt in FORMATS:
        for a, b in step_pairs(list(cps)):
            cells = []
            for _, field in METRICS:
                xs = metric(cps[a]["modes"][mode], layers, fmt, field)
                ys = metric(cps[b]["modes"][mode], layers, fmt, field)
                cells.append(rho_cell(bootstrap_rho(xs, ys, seed)))
            rows.append([fmt.label, f"{a} vs {b}", *cells])
    return rows


def largest(rows: dict, layers: Sequence[str], fmt: Format) -> tuple[str, float]:
    """The layer whose |loss change| in ``fmt`` is largest (a non-finite run first)."""
    values = metric(rows, layers, fmt, "loss_rel_change")
    i = max(range(len(layers)), key=lambda j: abs(values[j]))
    return layers[i], values[i]


def spread(values: Sequence[float], fmt_spec: str) -> str:
    finite = [v for v in values if math.isfinite(v)]
    text = f"{min(finite):{fmt_spec}} to {max(finite):{fmt_spec}}" if finite else "-"
    bad = len(values) - len(finite)
    return text + (f" ({bad} non-finite)" if bad else "")


def step_rows(result: dict, mode: str) -> list[list[str]]:
    """Per step and format: the largest |loss change| and its layer, the gradient-error and
    output-SQNR ranges over layers."""
    layers, rows = result["layers"], []
    first = next(iter(result["checkpoints"].values()))["modes"][mode]
    for step, c in result["checkpoints"].items():
        measured = c["modes"][mode]
        for fmt in FORMATS:
            name, value = largest(measured, layers, fmt)
            start = abs(largest(first, layers, fmt)[1])
            sqnr = [measured[n][fmt].output_sqnr_db for n in layers]
            grad = metric(measured, layers, fmt, "grad_rel_error")
            rows.append([str(step), f"{c['calib_loss']:.3f}", fmt.label, signed(value),
                         f"{abs(value) / start:.2f}x" if 0 < start < math.inf
                         and math.isfinite(value) else "-", name,
                         spread(grad, ".2e"), spread(sqnr, ".1f")])
    return rows


def signed(value: float) -> str:
    return f"{value:+.2e}" if math.isfinite(value) else "non-finite"


def rank_of(values: Sequence[float], i: int) -> int:
    """1 + how many values are strictly larger than ``values[i]`` (1 = the worst)."""
    return 1 + sum(v > values[i] for v in values)


def planted_rows(result: dict, mode: str) -> list[list[str]]:
    """Per step: what the profile says about the drifted layer in fp16, and its real range."""
    layers, rows = result["layers"], []
    i = layers.index(DRIFT_LAYER)
    for step, c in result["checkpoints"].items():
        measured = c["modes"][mode]
        s = measured[DRIFT_LAYER][Format.FP16]
        loss = [abs(v) for v in metric(measured, layers, Format.FP16, "loss_rel_change")]
        grad = metric(measured, layers, Format.FP16, "grad_rel_error")
        rows.append([str(step), f"{c['drift_amax']:.4g}", f"{FP16_MAX / c['drift_amax']:.3g}x",
                     signed(s.loss_rel_change), f"{rank_of(loss, i)}/{len(layers)}",
                     signed(s.grad_rel_error), f"{rank_of(grad, i)}/{len(layers)}",
                     f"{s.act_overflow:.2e}", f"{s.grad_overflow:.2e}",
                     "yes" if s.finite else "no", s.verdict])
    return rows


def estimate_rows(result: dict, seed: int = 0) -> list[list[str]]:
    """With both modes measured: how the fast estimate ranks against the exact numbers."""
    layers, rows = result["layers"], []
    for step, c in result["checkpoints"].items():
        for fmt in FORMATS:
            cells = [rho_cell(bootstrap_rho(metric(c["modes"]["exact"], layers, fmt, field),
                                            metric(c["modes"]["fast"], layers, fmt, field),
                                            seed)) for _, field in METRICS]
            rows.append([str(step), fmt.label, *cells])
    return rows


# ------------------------------------------------------------------------------ output
def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def report(result: dict, settings: Settings) -> str:
    """Every table of the run, as markdown."""
    out = []
    n = len(result["layers"])
    for mode in settings.modes:
        out.append(f"\n### {mode} mode: Spearman over {n} layers between steps "
                   f"[bootstrap {CONFIDENCE:.0%} interval, layers resampled]\n")
        out.append(markdown(["format", "steps", "loss change", "grad error"],
                            rank_rows(result, mode, settings.seed)))
        out.append(f"\n### {mode} mode: each profile\n")
        out.append(markdown(["step", "calib loss", "format", "largest loss change",
                             "vs step 0", "its layer", "grad error range", "SQNR dB range"],
                            step_rows(result, mode)))
        if settings.planted:
            out.append(f"\n### {mode} mode: the drifted layer `{DRIFT_LAYER}` in fp16 (rank 1 "
                       f"= worst of {n}; amax is its FP32 output's on the calibration batch)\n")
            out.append(markdown(["step", "amax", "fp16 headroom", "loss change", "loss rank",
                                 "grad error", "grad rank", "act overflow", "grad overflow",
                                 "finite", "verdict"], planted_rows(result, mode)))
    if {"exact", "fast"} <= set(settings.modes):
        out.append("\n### fast estimate vs exact measurement at each step (Spearman over "
                   "layers)\n")
        out.append(markdown(["step", "format", "loss change", "grad error"],
                            estimate_rows(result, settings.seed)))
    return "\n".join(out)


def raw(result: dict, settings: Settings, elapsed: float) -> dict:
    """The run as plain JSON data: settings, and every LayerSensitivity row."""
    cps = {}
    for step, c in result["checkpoints"].items():
        cps[str(step)] = {
            **{k: encode_float(v) for k, v in c.items() if k not in ("modes",)},
            "rows": {mode: [s.to_dict() for n in result["layers"] for s in rows[n].values()]
                     for mode, rows in c["modes"].items()}}
    return {"benchmark": "bench_drift", "device": device_line(),
            "task": result["task"], "settings": dataclasses.asdict(settings),
            "layers": result["layers"],
            "drift_layer": DRIFT_LAYER if settings.planted else None,
            "drift_scale": encode_float(result["drift_scale"]),
            "train_seconds": result["train_seconds"], "elapsed_seconds": elapsed,
            "checkpoints": cps}


def load_raw(path: str) -> tuple[dict, Settings]:
    """A run saved by ``--out``, back as :func:`run`'s result and its settings; a file that
    is not one is a one-line ValueError naming it."""
    data = read_json(path, "bench_drift result")
    if not isinstance(data, dict) or data.get("benchmark") != "bench_drift":
        raise ValueError(f"{path} is not a bench_drift result (no \"benchmark\": "
                         "\"bench_drift\"); pass a file written by --out.")
    try:
        given = data["settings"]
        settings = Settings(**{k: tuple(v) if isinstance(v, list) else v
                               for k, v in given.items()})
        cps = {}
        for step, c in data["checkpoints"].items():
            modes = {}
            for mode, rows in c["rows"].items():
                for row in rows:
                    s = LayerSensitivity.from_dict(row)
                    modes.setdefault(mode, {}).setdefault(s.layer, {})[s.format] = s
            cps[int(step)] = {"train_loss": decode_float(c["train_loss"], "checkpoint"),
                              "calib_loss": decode_float(c["calib_loss"], "checkpoint"),
                              "seconds": {m: float(v) for m, v in c["seconds"].items()},
                              "modes": modes}
            if "drift_amax" in c:
                cps[int(step)]["drift_amax"] = decode_float(c["drift_amax"], "checkpoint")
        result = {"task": str(data.get("task", "")), "layers": list(data["layers"]),
                  "checkpoints": cps,
                  "train_seconds": float(data["train_seconds"]),
                  "drift_scale": decode_float(data["drift_scale"], "bench_drift result")}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path} is not a readable bench_drift result ({type(e).__name__}: "
                         f"{e}); write it again with --out.") from None
    return result, settings


def parse(argv: Sequence[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="200,1000", help="checkpoints after step 0")
    ap.add_argument("--mode", default="exact",
                    help="exact (default, the truth), fast, auto, or several: exact,fast")
    ap.add_argument("--planted", action="store_true",
                    help="plant examples/drift.py's slow drift first")
    ap.add_argument("--overflow-at", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=4, help="the example's size (a smaller "
                    "one only where a run at the default size does not fit)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--out", help="save the raw rows as JSON here")
    ap.add_argument("--report", metavar="JSON",
                    help="print the tables of a run saved by --out (measures nothing)")
    args = ap.parse_args(argv)
    try:
        steps = tuple(int(s) for s in args.steps.split(",") if s.strip())
    except ValueError:
        ap.error(f"--steps {args.steps!r} is not a comma-separated list of step counts; "
                 "e.g. --steps 200,1000.")
    try:
        settings = Settings(steps=steps, modes=tuple(m.strip() for m in args.mode.split(",")),
                            planted=args.planted, overflow_at=args.overflow_at, lr=args.lr,
                            seed=args.seed)
    except ValueError as e:
        ap.error(str(e))
    return settings, args


def main(argv: Sequence[str] | None = None) -> None:
    settings, args = parse(argv)
    if args.report:
        result, settings = load_raw(args.report)
        print(f"{result['task']} (saved in {args.report}): steps 0,"
              f"{','.join(map(str, settings.steps))}; modes {','.join(settings.modes)}")
        print(report(result, settings))
        return
    out = args.out
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    print(device_line())
    task = gpt2_bytes.task(n_layer=args.layers, n_embd=args.width, batch_size=args.batch_size,
                           seq_len=args.seq_len)
    print(f"{task.name}: formats {', '.join(f.label for f in FORMATS)}; steps 0,"
          f"{','.join(map(str, settings.steps))}; modes {','.join(settings.modes)}; FP32 "
          f"AdamW lr {settings.lr}; seed {settings.seed}"
          + (f"; planted drift on {DRIFT_LAYER}, aimed at step {settings.overflow_at}"
             if settings.planted else ""))
    result = run(task, settings)
    elapsed = time.perf_counter() - t0
    if out:  # first: a table that fails to print must not lose the measurements
        write_json(out, raw(result, settings, elapsed))
    print(report(result, settings))
    print(f"\ntraining {result['train_seconds']:.0f} s; whole run {elapsed:.0f} s"
          + (f"; raw rows: {out}" if out else ""))


if __name__ == "__main__":
    main()
