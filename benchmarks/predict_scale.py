"""A prediction, not a measurement: the peak memory of a profile and a tune of Llama-3-8B and
Llama-3-70B, extrapolated from ``bench_profile_memory.py``'s measured peaks (issue 38).

For each part (the training step, ``fast``, ``exact``, ``tune``) it fits ``peak = a * P + b``
(least squares over the measured sizes: ``a`` the multiple of the parameter bytes, ``b`` what
does not grow with them, mostly the capture machinery's fixed cost), prints the fit and how far
each measured size lies from it, then the fitted peak at the two models' FP32 parameter bytes,
against one H200's 141 GB. The calibration is the bench's (2 batches of 2x64 tokens), so
activations are as small there as in the fit; a longer calibration adds its activations.

What it cannot say: anything about sharding (every figure is one process holding the whole
model: issue 38's item 4, FSDP2 across ranks, is not built), or GPU memory (the bench reads
host RSS; on the H200 a 3.2B Llama's fast profile was 1.04x its step, see BENCHMARKS.md).

    python benchmarks/bench_profile_memory.py --sizes 512x4 1024x4 1024x8 | tee mem.log
    python benchmarks/predict_scale.py mem.log
"""

from __future__ import annotations

import argparse
import re
import sys

# FP32 parameter bytes of the two models (8.03e9 and 70.6e9 parameters)
MODELS = {"Llama-3-8B": 8.03e9 * 4, "Llama-3-70B": 70.6e9 * 4}
H200 = 141e9
_CELL = re.compile(r"([\d.]+) MiB")


def read_table(lines: list[str]) -> tuple[list[str], dict[str, list[tuple[float, float]]]]:
    """The bench's markdown table: its parts, and per part the (P, peak) bytes of each size."""
    start = next((i for i, line in enumerate(lines) if line.startswith("| model | P")), None)
    if start is None:
        raise SystemExit("no bench_profile_memory table in the log; run that bench first")
    parts = [c.split(" (")[0].strip() for c in lines[start].strip("|\n").split("|")[2:]]
    rows: dict[str, list[tuple[float, float]]] = {p: [] for p in parts}
    for line in lines[start + 2:]:  # the first table only
        cells = line.strip("|\n").split("|")
        if not re.fullmatch(r"\s*\d+x\d+\s*", cells[0]) or len(cells) != len(parts) + 2:
            break
        P = float(_CELL.search(cells[1]).group(1)) * 2**20
        for p, cell in zip(parts, cells[2:]):
            rows[p].append((P, float(_CELL.search(cell).group(1)) * 2**20))
    return parts, rows


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``peak = a * P + b``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    a = sum((x - mx) * (y - my) for x, y in points) / sxx
    return a, my - a * mx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log", help="bench_profile_memory.py's output")
    args = ap.parse_args()
    with open(args.log) as f:
        parts, rows = read_table(f.readlines())
    if len(rows[parts[0]]) < 2:
        raise SystemExit("the fit needs at least two sizes in the table")
    print("PREDICTION (extrapolated from the measured sizes; one process, whole model):")
    print("| part | fit | worst residual | " + " | ".join(MODELS) + " |")
    print("|---|---|---|" + "---|" * len(MODELS))
    for p in parts:
        a, b = fit(rows[p])
        worst = max(abs(y - (a * x + b)) / y for x, y in rows[p])
        cells = []
        for P in MODELS.values():
            peak = a * P + b
            cells.append(f"{peak / 1e9:.0f} GB ({peak / H200:.2f} H200)")
        print(f"| {p} | {a:.2f} P + {b / 2**20:.0f} MiB | {worst:.1%} | " + " | ".join(cells)
              + " |")


if __name__ == "__main__":
    sys.exit(main())
