"""Shared benchmark helpers: every variant timed in the same run as its anchor, with the tune's
own protocol (autoprec.measure.timer): interleaved rounds in random order, the minimum of short
repeats per round, the 20% quantile over rounds, and a paired-bootstrap 95% interval of each
ratio. A ratio whose interval contains 1 is a tie."""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from autoprec._util import text_table  # noqa: E402  (after the path set-up above)
from autoprec.host import device_name  # noqa: E402
from autoprec.measure.timer import Clock, Comparison  # noqa: E402
from autoprec.policy import Interval  # noqa: E402


def free_port() -> int:
    """A TCP port free on the loopback now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_line() -> str:
    dev = device_name("cuda" if torch.cuda.is_available() else "cpu")
    return (f"device: {dev}; torch {torch.__version__}; threads {torch.get_num_threads()}; "
            f"{time.strftime('%Y-%m-%d %H:%M')}")


def interleaved(fns: dict[str, Callable[[], object]], *, warmup: int = 3, rounds: int = 10,
                repeats: int = 2, device: str = "cpu") -> Comparison:
    """Time each callable in interleaved rounds (the first key is the reference) after
    ``warmup`` untimed calls each; ratios between any two come from ``.ratio(a, b)``."""
    clock = Clock(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    cmp = Comparison({k: (lambda fn=fn: clock.time(fn)) for k, fn in fns.items()},
                     next(iter(fns)), repeats=repeats, seed=0)
    cmp.run(rounds)
    return cmp


def ratio_cell(r: Interval) -> str:
    """``1.027 [0.998-1.051]``, and "tie" where the interval contains 1."""
    tie = " (tie)" if r.low <= 1.0 <= r.high else ""
    return f"{r.value:.3f} [{r.low:.3f}-{r.high:.3f}]{tie}"


def median_range(values: Sequence[float], fmt: str = ".3f") -> str:
    """``1.027 [0.998-1.051]``: the median of ``values`` and their range (NaNs left out;
    "-" where none is left)."""
    xs = [v for v in values if v == v]
    if not xs:
        return "-"
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[str]:
    """A ``git worktree`` of this repository at ``rev`` (detached), removed after: another
    revision's code, run beside this checkout's."""
    other = os.path.join(tempfile.mkdtemp(prefix="autoprec-against-"), "tree")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", other, rev],
                   check=True)
    try:
        yield other
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", other],
                       check=False)


def print_table(rows: list[list[str]], header: list[str]) -> None:
    print(text_table(header, rows))
