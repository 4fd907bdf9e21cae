"""The first-order sensitivity estimate against the exact measurement, on the bundled examples
and a Llama-style model, in one run:

1. every layer x format estimated (mode "fast") and measured (mode "exact"): the Spearman
   rank correlation of *every* number the estimate gives against the measured one (the loss
   change signed and in magnitude, the whole-model gradient error, the layer's own gradient
   error, the output SQNR), over all pairs of a model and within each format (the ranking
   the issue is about: which layers of one format hurt most), the estimated/measured ratio
   of the gradient error, the largest loss difference relative to the budget, and the time
   each mode took. With ``--seeds N`` the estimate is rerun with N-1 other seeds (other
   random probe directions): the spread of its gradient-error Spearman is its own noise;
2. the policy tuned in the default mode ("auto") against the one tuned with every pair
   measured ("exact"), both for an H100 (priced: the cost model is deterministic, so the
   comparison of their speed has no timing noise), with their measured loss change.

    python benchmarks/bench_estimate.py [--skip-tune] [--seeds N] [--only NAME]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
import warnings

import _common  # noqa: F401
from _common import device_line, print_table
from scipy.stats import spearmanr

from autoprec import profile_view
from autoprec.formats import Format
from autoprec.measure.capture import capture
from autoprec.measure.sensitivity import measure_sensitivity
from autoprec.runtime.calls import COMPUTING_KINDS
from autoprec.tuning import tune
from examples import cnn, gpt2_bytes, llama_bytes, minilm

BUDGET = 0.01
TRANSFORMER = ["bf16", "fp8", "fp8:rowwise"]
# (column, LayerSensitivity field, also ranked by magnitude): every number the estimate gives
METRICS = (("loss", "loss_rel_change", True), ("grad", "grad_rel_error", False),
           ("layer grad", "layer_grad_rel_error", False), ("SQNR", "output_sqnr_db", False))


def llama_task():
    return llama_bytes.gpu_task(n_layer=4, hidden=512, intermediate=1408, heads=8, kv_heads=2,
                                seq_len=2048)


def cases():
    return [("gpt2_bytes (4x256)", gpt2_bytes.task(), TRANSFORMER),
            ("llama-style (4x512, GQA)", llama_task(), TRANSFORMER),
            ("MiniLM (pretrained)", minilm.task(), ["bf16", "fp8"]),
            ("CNN", cnn.task(), ["bf16", "fp16"])]


def layers_of(task) -> list[str]:
    model = task.build_model()
    graph = capture(model, task.model_call(model, task.example_batch()))
    return [L.fqn for L in graph.layers if L.kind in COMPUTING_KINDS and L.flops > 0]


def rho(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation; nan for fewer than 3 pairs or a constant side."""
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return math.nan
    return float(spearmanr(xs, ys)[0])


def values(fast, exact, pairs, field: str) -> tuple[list[float], list[float]]:
    """(exact, estimated) of ``field`` over the pairs where both are finite numbers."""
    xs, ys = [], []
    for n, f in pairs:
        x, y = getattr(exact[n][f], field), getattr(fast[n][f], field)
        if x is not None and y is not None and math.isfinite(x) and math.isfinite(y):
            xs.append(x)
            ys.append(y)
    return xs, ys


def cells(fast, exact, pairs) -> list[str]:
    """The Spearman of every metric over ``pairs``, the gradient error's est/exact ratio and
    the largest loss difference relative to the budget."""
    out = []
    for _, field, magnitude in METRICS:
        xs, ys = values(fast, exact, pairs, field)
        out.append(f"{rho(xs, ys):.3f}")
        if magnitude:
            out.append(f"{rho([abs(x) for x in xs], [abs(y) for y in ys]):.3f}")
    xs, ys = values(fast, exact, pairs, "grad_rel_error")
    ratios = [y / x for x, y in zip(xs, ys) if x > 0]
    out.append(f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
               if ratios else "-")
    xs, ys = values(fast, exact, pairs, "loss_rel_change")
    out.append(f"{max(abs(x - y) for x, y in zip(xs, ys)) / BUDGET:.4f}" if xs else "-")
    return out


def seed_spread(task, layers, fmts, exact, seeds: int) -> dict[Format, list[float]]:
    """Per format, the gradient-error Spearman of the estimate rerun with seeds 1..seeds-1."""
    out: dict[Format, list[float]] = {}
    for seed in range(1, seeds):
        fast = measure_sensitivity(task, layers, fmts, mode="fast", seed=seed)
        for f in {f for n in layers for f in exact[n]}:
            xs, ys = values(fast, exact, [(n, f) for n in layers if f in exact[n]],
                            "grad_rel_error")
            out.setdefault(f, []).append(rho(xs, ys))
    return out


def rank_rows(seeds: int, only: str | None) -> list[list[str]]:
    rows = []
    for name, task, fmts in cases():
        if only and only.lower() not in name.lower():
            continue
        layers = layers_of(task)
        t0 = time.perf_counter()
        fast = measure_sensitivity(task, layers, fmts, mode="fast")
        t1 = time.perf_counter()
        exact = measure_sensitivity(task, layers, fmts, mode="exact")
        t2 = time.perf_counter()
        spread = seed_spread(task, layers, fmts, exact, seeds)
        everything = [(n, f) for n in layers for f in exact[n]]
        rows.append([name, "all", str(len(everything)), *cells(fast, exact, everything), "",
                     f"{t1 - t0:.1f}", f"{t2 - t1:.1f}", f"{(t2 - t1) / (t1 - t0):.1f}x"])
        for f in dict.fromkeys(f for _, f in everything):
            pairs = [(n, g) for n, g in everything if g == f]
            other = spread.get(f, [])
            rows.append(["", f.label, str(len(pairs)), *cells(fast, exact, pairs),
                         f"{min(other):.3f}-{max(other):.3f}" if other else "", "", "", ""])
    return rows


def tune_rows() -> list[list[str]]:
    rows = []
    for name, task in (("gpt2_bytes gpu_task", gpt2_bytes.gpu_task()),
                       ("llama-style gpu_task", llama_task())):
        results = {}
        for mode in ("auto", "exact"):
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                res = tune(task, target="h100", sensitivity=mode, progress=False,
                           output=os.path.join(tmp, "p.yaml"))
                results[mode] = (res, time.perf_counter() - t0)
        a, e = results["auto"][0], results["exact"][0]
        same = a.policy.layers == e.policy.layers and a.policy.default == e.policy.default
        rows.append([name, f"{a.speedup.value:.3f}", f"{e.speedup.value:.3f}",
                     f"{a.speedup.value / e.speedup.value:.3f}",
                     f"{a.best.loss_increase:+.3%}", f"{e.best.loss_increase:+.3%}",
                     "yes" if same else "no", f"{a.profile.elapsed:.0f}",
                     f"{e.profile.elapsed:.0f}", profile_view.sensitivity_summary(a.profile)
                     .split(": ", 1)[1].split(",")[1].strip()])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-tune", action="store_true")
    ap.add_argument("--seeds", type=int, default=1,
                    help="estimate with this many seeds (random probe directions); the "
                         "spread of the gradient-error Spearman over them is its noise")
    ap.add_argument("--only", help="only the models whose name contains this")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(device_line())
    print("\n1. first-order estimate (fast) vs exact measurement, every layer x format: "
          "Spearman of each metric over all pairs of a model and within each format; grad "
          "est/exact: median [min-max] of the ratio; the loss difference is relative to a "
          f"{BUDGET:.0%} budget")
    print_table(rank_rows(args.seeds, args.only),
                ["model", "format", "pairs", "loss", "loss |.|", "grad", "layer grad",
                 "SQNR", "grad est/exact", "max |dloss| / budget",
                 f"grad, {args.seeds - 1} other seeds" if args.seeds > 1 else "other seeds",
                 "fast s", "exact s", "exact/fast"])
    if args.skip_tune:
        return
    print("\n2. the policy tuned in the default mode (auto) vs all pairs measured (exact), "
          "priced for h100")
    print_table(tune_rows(), ["task", "auto speed-up", "exact speed-up", "auto/exact",
                              "auto loss", "exact loss", "same policy", "auto profile s",
                              "exact profile s", "auto: measured exactly"])


if __name__ == "__main__":
    main()
