"""Shared benchmark helpers: interleaved timing against an anchor measured in the same run."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from autoprec.formats import device_name  # noqa: E402  (after the path set-up above)


def device_line() -> str:
    dev = device_name("cuda" if torch.cuda.is_available() else "cpu")
    return (f"device: {dev}; torch {torch.__version__}; threads {torch.get_num_threads()}; "
            f"{time.strftime('%Y-%m-%d %H:%M')}")


def interleaved(fns: dict[str, Callable[[], None]], *, warmup: int = 3, rounds: int = 10,
                sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Time each callable ``rounds`` times, round-robin (A B C A B C ...), after ``warmup``
    calls each, so drift in machine load hits every variant alike. Returns seconds per call."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> float:
    """Interquartile range over median: how noisy the measurement was."""
    if len(xs) < 4:
        return float("nan")
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs)


def print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
