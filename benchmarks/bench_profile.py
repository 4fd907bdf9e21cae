"""Profile cost vs model depth, and its peak memory against a training step's.

GPT-2 with 4, 8, 16 and 32 blocks (256 wide, batch 16x128), all formats, default settings
(sensitivity "auto": first-order estimates, the doubtful and near-budget ones measured
exactly), measured on this machine. Each profile runs in a fresh process, so its peak RSS is
its own; a plain training step (forward, backward, AdamW) of the same model on the same batch
runs in another fresh process as the memory anchor. The target: time per layer at 32 blocks
<= 1.2x that at 4 blocks, and peak RSS <= 1.5x the training step's.

    python benchmarks/bench_profile.py [--blocks 4 8 16 32] [--exact-at 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import _common  # noqa: F401
from _common import ROOT, device_line, print_table

CHILD = """
import json, resource, sys, time, warnings
sys.path.insert(0, {root!r})
warnings.filterwarnings("ignore")
import torch
from examples.gpt2_bytes import task
t = task(n_layer={n}, n_embd=256, batch_size=16, seq_len=128, n_batches=4)
out = {{}}
if {what!r} == "train":
    model = t.build_model().train()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        t.loss_fn(model, t.batches[0]).backward() if t.loss_fn else \\
            model(**t.batches[0]).loss.backward()
        opt.step()
else:
    from autoprec import profile_view
    from autoprec.profiling import profile
    t0 = time.perf_counter()
    prof = profile(t, progress=False, sensitivity={what!r})
    out["wall"] = time.perf_counter() - t0
    out["layers"] = len(prof.layers)
    out["summary"] = profile_view.sensitivity_summary(prof)
out["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps(out))
"""


def run(n: int, what: str) -> dict:
    code = CHILD.format(root=ROOT, n=n, what=what)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{what} at {n} blocks failed:\n{proc.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--exact-at", type=int, nargs="*", default=[],
                    help="also profile these depths with every pair measured exactly")
    args = ap.parse_args()
    print(device_line())
    rows, base = [], None
    for n in args.blocks:
        prof, train = run(n, "auto"), run(n, "train")
        per = prof["wall"] / prof["layers"]
        base = base or per
        measured = prof["summary"].split(", ")[1]
        rows.append([str(n), str(prof["layers"]), f"{prof['wall']:.1f}", f"{per:.2f}",
                     f"{per / base:.2f}", f"{prof['rss'] / 2**30:.2f}",
                     f"{train['rss'] / 2**30:.2f}", f"{prof['rss'] / train['rss']:.2f}",
                     measured])
    print_table(rows, ["blocks", "layers", "profile s", "s per layer",
                       "per layer / first row's", "profile peak RSS GiB",
                       "train step peak RSS GiB", "RSS ratio", "auto: measured exactly"])
    for n in args.exact_at:
        prof = run(n, "exact")
        print(f"exact mode at {n} blocks: {prof['wall']:.1f} s, "
              f"{prof['wall'] / prof['layers']:.2f} s per layer")
    print("formats: fp32, bf16, fp16, fp8 (three recipes); on this CPU fp16 is timed and "
          "skipped (far slower than fp32) and the FP8 recipes, only emulated, are neither timed "
          "nor measured; 1 calibration batch of 16x128")


if __name__ == "__main__":
    main()
