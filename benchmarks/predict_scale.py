"""A prediction, not a measurement: the peak memory of a profile and a tune of Llama-3-8B and
Llama-3-70B, extrapolated from ``bench_profile_memory.py``'s measured peaks (issue 38).

For each part (the training step, ``fast``, ``exact``, ``tune``) it fits ``peak = a * P + b``
(least squares over the measured sizes: ``a`` the multiple of the parameter bytes, ``b`` what
does not grow with them, mostly the capture machinery's fixed cost), prints the fit and how far
each measured size lies from it, then the fitted peak at the two models' FP32 parameter bytes,
against one H200's 141 GB. The calibration is the bench's (2 batches of 2x64 tokens), so
activations are as small there as in the fit; a longer calibration adds its activations.

Then the tune's time: the bench divides each part's wall seconds by one FP32 forward + backward
pass of a calibration batch timed in the same process, so a part's cost is a number of passes.
It fits ``passes = a * blocks + b`` over the measured sizes and prices one pass of each model on
an H200 with the cost model (``costmodel.linear_seconds`` in fp32 for every linear at the
calibration's tokens: the work a pass does that grows with the model). passes x priced pass is
a floor: the GPU's work alone, none of the host's (Python, hooks, launches beyond the linears').
The same arithmetic is checked against the one GPU measurement of a profile's time (an H200,
BENCHMARKS.md), and the floor scaled by that check's measured / predicted is printed beside it:
a scale fitted on one run of one model. On the CPU the FP8 trials are emulated, slower than an
FP32 pass, where a GPU runs them faster, so that count is high for a GPU.

Sharded (issue 38, item 4): where the log has a part on 2 ranks (``fast@2``), each rank's
peak is taken as its shards (``P / n``) plus what it holds whole, ``R = peak - P / 2``, fitted
by least squares as ``h x head + a x activations + c`` over the sizes: the head (vocabulary x
hidden x 4 bytes, the largest unit: FSDP2's gather of it and its local re-runs, on the rank
that estimates it), one calibration batch's activations, which every rank holds whole (blocks
x tokens x (hidden + intermediate) x 4 bytes: one FP32 vector of each width per block and
token, the unit ``a`` counts) and a fixed cost (the machinery's). One process is fitted the
same way (``R = peak - P``). The check leaves each size out in turn, fits the others and
predicts its peaks: the assumptions tested between the bench's sizes (four, two widths and
two depths, for a check of each), not at 8B or 70B; a prediction to check on GPUs.

What it cannot say: GPU memory (the bench reads host RSS; on the H200 a 3.2B Llama's fast
profile was 1.04x its step, see BENCHMARKS.md).

    python benchmarks/bench_profile_memory.py --sizes 512x4 512x16 1024x4 1024x16 \\
        --parts step fast fast@2 tune-spilled tune-spilled@2 | tee mem.log
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
# the bench's calibration batch: 2 sequences of 64 tokens
TOKENS = 2 * 64
_PASSES = re.compile(r"([\w@-]+) ([\d.]+) s = (\d+) passes")


def shapes() -> dict:
    """The two models' shapes (blocks, widths, vocabulary) as the cost model's
    ``TrainingSetup``; :func:`pass_seconds` prices them at the calibration's tokens."""
    from autoprec.titan_step import LLAMA3_8B, TrainingSetup

    # Llama-3-70B's config.json: 80 layers, hidden 8192, SwiGLU 28672, 64 heads, 8 KV heads
    big = TrainingSetup(name="Llama-3-70B", layers=80, hidden=8192, intermediate=28672,
                        heads=64, kv_heads=8, vocab=128256, seq_len=TOKENS)
    return {"Llama-3-8B": LLAMA3_8B, "Llama-3-70B": big}


def pass_seconds(setup, target: str = "h200") -> float:
    """The cost model's seconds of one FP32 forward + backward of a calibration batch's
    linears (every block's and the output layer)."""
    from autoprec.costmodel import linear_seconds

    block = sum(linear_seconds(TOKENS, k, n, "fp32", target) for k, n in setup.linears().values())
    return setup.layers * block + linear_seconds(TOKENS, setup.hidden, setup.vocab, "fp32", target)


def read_passes(lines: list[str]) -> dict[str, list[tuple[int, int]]]:
    """The bench's "wall seconds" lines: per part, the (blocks, passes) of each size."""
    rows: dict[str, list[tuple[int, int]]] = {}
    for line in lines:
        m = re.match(r"(\d+)x(\d+): ", line)
        if m:
            for part, _, passes in _PASSES.findall(line):
                rows.setdefault(part, []).append((int(m.group(2)), int(passes)))
    return rows


# The one GPU measurement of a profile's time (BENCHMARKS.md, "One NVIDIA H200", section 6:
# gpu_check.py on a Llama 4096 x 16, vocabulary 32,000, batches of 2 x 64 tokens): seconds
CHECK = {"fast": 18.0, "exact": 104.0}


def _passes_fit(points: list[tuple[int, int]]) -> tuple[float, float]:
    """``passes = a * blocks + b``, with ``a`` held at 0 or above: more blocks never mean less
    work, so a falling fit is the machine's noise (then the mean is used)."""
    if len({b for b, _ in points}) > 1:
        a, b = fit(points)
        if a >= 0:
            return a, b
    return 0.0, sum(p for _, p in points) / len(points)


def predict_time(lines: list[str]) -> None:
    from autoprec.titan_step import TrainingSetup

    # one process's parts: the time of one GPU doing all the work
    rows = {k: v for k, v in read_passes(lines).items() if k != "step" and "@" not in k}
    if not rows:
        print("\n(no passes in the log: rerun bench_profile_memory.py for the time prediction)")
        return
    fits = {part: _passes_fit(points) for part, points in rows.items()}
    # the check: the same arithmetic for the GPU run's model, against its measured seconds
    checked = TrainingSetup(name="Llama 4096x16", layers=16, hidden=4096,
                            intermediate=4096 * 43 // 16, heads=8, kv_heads=4, vocab=32000,
                            seq_len=TOKENS)
    ratios = []
    print("\nCHECK of the time arithmetic against the one GPU measurement (H200, Llama 4096x16):")
    for part, seconds in CHECK.items():
        if part in fits:
            a, b = fits[part]
            predicted = (a * checked.layers + b) * pass_seconds(checked)
            ratios.append(seconds / predicted)
            print(f"  {part}: predicted {predicted:.1f} s, measured {seconds:.0f} s: "
                  f"measured / predicted {ratios[-1]:.2f}")
    scale = sum(ratios) / len(ratios) if ratios else None
    models = shapes()
    per_pass = {name: pass_seconds(setup) for name, setup in models.items()}
    print("\nPREDICTION of the time, one H200 doing all the work: FP32 passes of a calibration "
          "batch (fitted linear in the blocks) x one pass priced by the cost model ("
          + ", ".join(f"{n} {t * 1e3:.0f} ms" for n, t in per_pass.items()) + "); "
          "the floor counts the GPU work alone"
          + (f", 'checked' scales it by the check's measured / predicted {scale:.2f}"
             if scale else "") + ":")
    print("| part | measured (blocks: passes) | fit | "
          + " | ".join(f"{m} floor | {m} checked" for m in models) + " |")
    print("|---|---|---|" + "---|---|" * len(models))
    for part, points in rows.items():
        a, b = fits[part]
        cells = []
        for name, setup in models.items():
            floor = (a * setup.layers + b) * per_pass[name]
            cells += [f"{floor / 60:.1f} min",
                      f"{floor * scale / 60:.1f} min" if scale else "-"]
        measured = ", ".join(f"{b}: {p}" for b, p in points)
        print(f"| {part} | {measured} | {a:.1f} x blocks + {b:.0f} | " + " | ".join(cells)
              + " |")


def read_table(lines: list[str]) -> tuple[list[str], dict[str, list[tuple[float, float]]],
                                          list[str]]:
    """The bench's markdown table: its parts, per part the (P, peak) bytes of each size, and
    the sizes (``HIDDENxLAYERS``) in the same order."""
    start = next((i for i, line in enumerate(lines) if line.startswith("| model | P")), None)
    if start is None:
        raise SystemExit("no bench_profile_memory table in the log; run that bench first")
    parts = [c.split(" (")[0].strip() for c in lines[start].strip("|\n").split("|")[2:]]
    rows: dict[str, list[tuple[float, float]]] = {p: [] for p in parts}
    sizes: list[str] = []
    for line in lines[start + 2:]:  # the first table only
        cells = line.strip("|\n").split("|")
        if not re.fullmatch(r"\s*\d+x\d+\s*", cells[0]) or len(cells) != len(parts) + 2:
            break
        sizes.append(cells[0].strip())
        P = float(_CELL.search(cells[1]).group(1)) * 2**20
        for p, cell in zip(parts, cells[2:]):
            rows[p].append((P, float(_CELL.search(cell).group(1)) * 2**20))
    return parts, rows, sizes


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a * x + b`` (a peak against P, or passes against blocks)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    a = sum((x - mx) * (y - my) for x, y in points) / sxx
    return a, my - a * mx


# the bench's vocabulary and SwiGLU width, and the two models' (Llama 3's tokenizer): their
# heads (vocabulary x hidden x 4 bytes) and (blocks, hidden, intermediate)
BENCH_VOCAB = 32_000
HEADS = {"Llama-3-8B": 128_256 * 4096 * 4, "Llama-3-70B": 128_256 * 8192 * 4}
BLOCKS = {"Llama-3-8B": (32, 4096, 14336), "Llama-3-70B": (80, 8192, 28672)}
GPUS = 8


def bench_shape(size: str) -> tuple[float, float]:
    """``(head, activations)`` bytes of a bench size ``HIDDENxLAYERS`` (its model's widths:
    bench_profile_memory's config, intermediate = hidden x 43 / 16)."""
    hidden, layers = (int(x) for x in size.split("x"))
    return BENCH_VOCAB * hidden * 4, activations(layers, hidden, hidden * 43 // 16)


def activations(blocks: int, hidden: int, intermediate: int) -> float:
    """One calibration batch's activations in the unit the fit counts: an FP32 vector of the
    hidden and of the intermediate width per block and token."""
    return blocks * TOKENS * (hidden + intermediate) * 4


def fit_whole(points: list[tuple[float, float, float]]) -> tuple[float, float, float] | None:
    """Least squares ``R = h x head + a x activations + c`` over ``(head, activations, R)``
    points: ``(h, a, c)``, or None where the points do not tell the three apart (fewer than
    three, or all of them on one line)."""
    import numpy as np

    x = np.array([[head, act, 1.0] for head, act, _ in points])
    if len(points) < 3 or np.linalg.matrix_rank(x / x.max(axis=0)) < 3:
        return None
    sol = np.linalg.lstsq(x, np.array([r for _, _, r in points]), rcond=None)[0]
    return float(sol[0]), float(sol[1]), float(sol[2])


def held(whole: tuple[float, float, float], head: float, act: float) -> float:
    """What a fit ``(h, a, c)`` says a process holds whole beside its parameters."""
    return whole[0] * head + whole[1] * act + whole[2]


def _rows(p: str, rows: dict, sizes: list[str], ranks: int) -> list[tuple[str, float, float]]:
    """``(size, P, peak)`` of part ``p`` on ``ranks`` ranks (1: the part itself, 2: ``p@2``)."""
    key = p if ranks == 1 else f"{p}@{ranks}"
    return [(size, P, peak) for size, (P, peak) in zip(sizes, rows[key])]


def _fitted(points: list[tuple[str, float, float]], ranks: int):
    """:func:`fit_whole` of each size's peak less its shards (``P / ranks``)."""
    return fit_whole([(*bench_shape(size), peak - P / ranks) for size, P, peak in points])


def predict_sharded(parts: list[str], rows: dict, sizes: list[str]) -> None:
    """Per-GPU peaks of a sharded tune or profile on ``GPUS`` GPUs (see the module docstring)."""
    pairs = [p for p in parts if f"{p}@2" in rows]
    if not pairs:
        print("\n(no part measured on 2 ranks: no sharded prediction)")
        return
    check_fit(pairs, rows, sizes)
    print(f"\nPREDICTION per GPU of a sharded run on {GPUS} GPUs (P / GPUs of shards, and "
          "h x head + a x activations + c held whole by each, fitted on 2 ranks over every "
          "size):")
    print("| part | h | a | c | " + " | ".join(f"{m} on {GPUS}" for m in MODELS) + " |")
    print("|---|---|---|---|" + "---|" * len(MODELS))
    for p in pairs:
        whole = _fitted(_rows(p, rows, sizes, 2), 2)
        if whole is None:
            print(f"| {p} | (fewer than three sizes, or all of one shape: nothing fitted) |")
            continue
        cells = []
        for name, params in MODELS.items():
            peak = params / GPUS + held(whole, HEADS[name], activations(*BLOCKS[name]))
            cells.append(f"{peak / 1e9:.0f} GB ({peak / H200:.2f} H200)")
        h, a, c = whole
        print(f"| {p} | {h:.2f} x head | {a:.1f} | {c / 2**20:.0f} MiB | " + " | ".join(cells)
              + " |")


def check_fit(pairs: list[str], rows: dict, sizes: list[str]) -> dict:
    """The fit's assumptions checked by leaving each size out: the others' fit predicts its
    per-rank and one-process peaks, printed beside what was measured. Returns ``{part: {size:
    (per rank, one process)}}``, each measured / predicted, for the sizes it could check."""
    out: dict = {}
    print("\nCHECK of the fit, each size predicted from the others' (per rank on 2, one "
          "process):")
    for p in pairs:
        out[p] = {}
        two, one = _rows(p, rows, sizes, 2), _rows(p, rows, sizes, 1)
        for i, (size, P, peak2) in enumerate(two):
            fits = [_fitted(r[:i] + r[i + 1:], n) for r, n in ((two, 2), (one, 1))]
            if None in fits:
                print(f"  {p} {size}: not checked (the other sizes cannot fit three terms)")
                continue
            shape = bench_shape(size)
            rank, alone = P / 2 + held(fits[0], *shape), P + held(fits[1], *shape)
            out[p][size] = (peak2 / rank, one[i][2] / alone)
            print(f"  {p} {size}: per rank predicted {rank / 2**20:.0f} MiB, measured "
                  f"{peak2 / 2**20:.0f} (measured / predicted {peak2 / rank:.2f}); one "
                  f"process predicted {alone / 2**20:.0f}, measured {one[i][2] / 2**20:.0f} "
                  f"({one[i][2] / alone:.2f})")
    return out


def predict_whole(parts: list[str], rows: dict) -> None:
    print("PREDICTION (extrapolated from the measured sizes; one process, whole model):")
    print("| part | fit | worst residual | " + " | ".join(MODELS) + " |")
    print("|---|---|---|" + "---|" * len(MODELS))
    for p in [p for p in parts if "@" not in p]:
        a, b = fit(rows[p])
        worst = max(abs(y - (a * x + b)) / y for x, y in rows[p])
        cells = []
        for P in MODELS.values():
            peak = a * P + b
            cells.append(f"{peak / 1e9:.0f} GB ({peak / H200:.2f} H200)")
        print(f"| {p} | {a:.2f} P + {b / 2**20:.0f} MiB | {worst:.1%} | " + " | ".join(cells)
              + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log", help="bench_profile_memory.py's output")
    args = ap.parse_args()
    with open(args.log) as f:
        lines = f.readlines()
    parts, rows, sizes = read_table(lines)
    if len(rows[parts[0]]) < 2:
        print("(one size in the table: the one-process peaks need two or more to fit)")
    else:
        predict_whole(parts, rows)
    predict_sharded(parts, rows, sizes)
    predict_time(lines)


if __name__ == "__main__":
    sys.exit(main())
