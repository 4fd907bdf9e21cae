"""Reprice a gpu_check run's measured rows with the cost model as it is now, beside the prices
the run printed: the old and new measured / priced per row of sections 2 and 3.

    python benchmarks/gpu/reprice.py [benchmarks/gpu/h200-2026-12-04]

The folder holds the run's gpu_check.txt, and the policy and profile it measured
(tuned-before-refit.yaml / .profile.json). Pure pricing: no GPU, deterministic."""

from __future__ import annotations

import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import _common  # noqa: E402,F401  (the repo root on sys.path)
from _common import print_table  # noqa: E402
from gpu_check import Variant, _priced_layers, _priced_linear, _priced_steps  # noqa: E402

from autoprec import Policy, Profile, load_policy  # noqa: E402

LABELS = {"h.0.attn.c_attn": "transformer.h.0.attn.c_attn",
          "h.0.attn.c_proj": "transformer.h.0.attn.c_proj", "h.0.attn (whole)": "transformer.h.0.attn",
          "h.0.mlp.c_fc": "transformer.h.0.mlp.c_fc", "h.0.mlp.c_proj": "transformer.h.0.mlp.c_proj",
          "h.0 (whole block)": "transformer.h.0", "lm_head": "lm_head"}


def _x(cell: str) -> float:
    return float(cell.rstrip("x*"))


def _table_rows(text: str, header: str) -> list[list[str]]:
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.startswith(header):
            for row in lines[i + 2:]:
                if not row.strip() or row.startswith(("(", "[", "fp32 run")):
                    break
                out.append(re.split(r"\s{2,}", row.strip()))
    return out


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "h200-2026-12-04")
    with open(os.path.join(folder, "gpu_check.txt")) as f:
        text = f.read()
    prof = Profile.load(os.path.join(folder, "tuned-before-refit.profile.json"))
    rows = []
    for r in _table_rows(text, "layer "):
        name = r[0]
        if name in LABELS:
            new = _priced_layers(prof, [LABELS[name]], "h200")[LABELS[name]]
        else:
            m, k, n = (int(v) for v in name.split()[1].split("x"))
            new = _priced_linear(m, k, n, "h200")
        bf_m, f8_m = _x(r[4]), _x(r[7])
        bf_p, f8_p = new["fp32"] / new["bf16"], new["bf16"] / new["fp8"]
        rows.append([name, f"{bf_m:.2f}", r[8], r[9], f"{bf_p:.2f}x", f"{bf_m / bf_p:.2f}",
                     f"{f8_m:.2f}", r[10], r[11], f"{f8_p:.2f}x", f"{f8_m / f8_p:.2f}"])
    print("section 2: measured (eager) against the price the run printed (old) and today's (new)")
    print_table(rows, ["layer", "bf16/fp32", "old price", "meas/old", "new price", "meas/new",
                       "fp8/bf16", "old price", "meas/old", "new price", "meas/new"])
    tuned = load_policy(os.path.join(folder, "tuned-before-refit.yaml"))
    variants = [Variant("fp32"), Variant("autocast(bf16)", autocast=True),
                Variant("bf16 policy", policy=Policy(default="bf16")),
                Variant("fp8 uniform", policy=Policy(default="fp8")),
                Variant("tuned (CPU, h200)", policy=tuned)]
    new = _priced_steps(prof, variants)
    rows = []
    for r in _table_rows(text, "variant "):
        if r[0] not in new:
            continue
        fb = float(r[5].split()[0])
        price = new["fp32"] / new[r[0]]
        rows.append([r[0], f"{fb:.2f}", r[6], r[7], f"{price:.2f}x", f"{fb / price:.2f}"])
    print("\nsection 3: forward + backward speed-up over fp32 (eager) against the priced layers'")
    print_table(rows, ["variant", "measured f+b", "old price", "meas/old", "new price",
                       "meas/new"])


if __name__ == "__main__":
    main()
