"""benchmarks/predict_scale.py's check of its sharded split: the smallest size's shared (S,
with P) and whole (R, with the head) parts predict the largest size's peaks."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import predict_scale  # noqa: E402  (after the path set-up above)

MIB = 2**20


def _log(rows: list[tuple[str, float, float, float]]) -> list[str]:
    """A bench_profile_memory table: (size, P, one process, per rank on 2) in MiB."""
    lines = ["| model | P (fp32 params) | tune-lean (x P, x step) | tune-lean@2 (x P, x step) |\n",
             "|---|---|---|---|\n"]
    for size, P, one, two in rows:
        lines.append(f"| {size} | {P:.0f} MiB | {one:.0f} MiB (0 P, 0x) | "
                     f"{two:.0f} MiB (0 P, 0x) |\n")
    return lines


def _peaks(P: float, hidden: int, S: float, heads: float) -> tuple[float, float]:
    """One process and per rank on 2, when S x P is shared and ``heads`` heads held whole."""
    whole = heads * predict_scale.BENCH_VOCAB * hidden * 4 / MIB
    return S * P + whole, S * P / 2 + whole


def _checked(rows) -> tuple[float, float]:
    """(per rank, one process), measured / predicted, of the largest size."""
    parts, table, sizes = predict_scale.read_table(_log(rows))
    return predict_scale.check_split(["tune-lean"], table, sizes)["tune-lean"]


def test_peaks_that_follow_the_split_read_one_and_a_whole_part_that_grows_reads_more():
    small, large = _peaks(427, 1024, 3.4, 5.0), _peaks(958, 1024, 3.4, 5.0)
    rows = [("1024x4", 427, *small), ("1024x16", 958, *large)]
    assert _checked(rows) == pytest.approx((1.0, 1.0), abs=1e-3)
    grown = _peaks(958, 1024, 3.4, 7.0)  # each rank holds two heads' more at 16 blocks
    rows = [("1024x4", 427, *small), ("1024x16", 958, *grown)]
    per_rank, alone = _checked(rows)
    assert per_rank > 1.05 and alone > 1.03
    # a wider model's head grows with its width, and the split follows it
    wide = _peaks(1700, 2048, 3.4, 5.0)
    rows = [("1024x4", 427, *small), ("2048x4", 1700, *wide)]
    assert _checked(rows) == pytest.approx((1.0, 1.0), abs=1e-3)


def test_one_size_is_not_checked(capsys):
    rows = [("1024x4", 427, *_peaks(427, 1024, 3.4, 5.0))]
    parts, table, sizes = predict_scale.read_table(_log(rows))
    predict_scale.check_split(["tune-lean"], table, sizes)
    assert "not checked" in capsys.readouterr().out
