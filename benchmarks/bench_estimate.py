"""The first-order sensitivity estimate against the exact measurement, on the bundled examples
and a Llama-style model, in one run:

1. every layer x format's loss change estimated (mode "fast") and measured (mode "exact"):
   Spearman rank correlation over all pairs (signed, and of the magnitudes), the largest
   difference relative to the budget, and the time each mode took;
2. the policy tuned in the default mode ("auto") against the one tuned with every pair
   measured ("exact"), both for an H100 (priced: the cost model is deterministic, so the
   comparison of their speed has no timing noise), with their measured loss change.

    python benchmarks/bench_estimate.py [--skip-tune]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

import _common  # noqa: F401
from _common import device_line, print_table
from scipy.stats import spearmanr

from autoprec.measure.capture import capture
from autoprec.measure.sensitivity import measure_sensitivity
from autoprec.runtime.calls import COMPUTING_KINDS
from autoprec.tuning import tune
from examples import cnn, gpt2_bytes, llama_bytes, minilm

BUDGET = 0.01
TRANSFORMER = ["bf16", "fp8", "fp8:rowwise"]


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


def rank_rows() -> list[list[str]]:
    rows = []
    for name, task, fmts in cases():
        layers = layers_of(task)
        t0 = time.perf_counter()
        fast = measure_sensitivity(task, layers, fmts, mode="fast")
        t1 = time.perf_counter()
        exact = measure_sensitivity(task, layers, fmts, mode="exact")
        t2 = time.perf_counter()
        pairs = [(n, f) for n in layers for f in exact[n]
                 if exact[n][f].finite and fast[n][f].finite]
        xs = [exact[n][f].loss_rel_change for n, f in pairs]
        ys = [fast[n][f].loss_rel_change for n, f in pairs]
        worst = max(abs(x - y) for x, y in zip(xs, ys)) / BUDGET
        rows.append([name, str(len(pairs)), f"{spearmanr(xs, ys)[0]:.3f}",
                     f"{spearmanr([abs(x) for x in xs], [abs(y) for y in ys])[0]:.3f}",
                     f"{worst:.4f}", f"{t1 - t0:.1f}", f"{t2 - t1:.1f}",
                     f"{(t2 - t1) / (t1 - t0):.1f}x"])
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
                     f"{e.profile.elapsed:.0f}", a.profile.sensitivity_summary()
                     .split(": ", 1)[1].split(",")[1].strip()])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-tune", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(device_line())
    print("\n1. first-order estimate vs exact measurement, every layer x format "
          f"(budget {BUDGET:.0%} for the difference column)")
    print_table(rank_rows(), ["model", "pairs", "Spearman (signed)", "Spearman |.|",
                              "max |est-exact| / budget", "fast s", "exact s",
                              "exact/fast time"])
    if args.skip_tune:
        return
    print("\n2. the policy tuned in the default mode (auto) vs all pairs measured (exact), "
          "priced for h100")
    print_table(tune_rows(), ["task", "auto speed-up", "exact speed-up", "auto/exact",
                              "auto loss", "exact loss", "same policy", "auto profile s",
                              "exact profile s", "auto: measured exactly"])


if __name__ == "__main__":
    main()
