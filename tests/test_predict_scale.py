"""benchmarks/predict_scale.py's check of its sharded split: the shared part (S, with P) and
what each rank holds whole (R = h x head + a x activations), fitted over all sizes but one,
predict the one left out."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import predict_scale  # noqa: E402  (after the path set-up above)

MIB = 2**20
SIZES = {"512x16": 302, "1024x4": 427, "1024x16": 958}  # the bench's P of each, MiB


def _log(rows: list[tuple[str, float, float, float]]) -> list[str]:
    """A bench_profile_memory table: (size, P, one process, per rank on 2) in MiB."""
    lines = ["| model | P (fp32 params) | fast (x P, x step) | fast@2 (x P, x step) |\n",
             "|---|---|---|---|\n"]
    for size, P, one, two in rows:
        lines.append(f"| {size} | {P:.0f} MiB | {one:.0f} MiB (0 P, 0x) | "
                     f"{two:.0f} MiB (0 P, 0x) |\n")
    return lines


def _row(size: str, S: float, h: float, a: float) -> tuple[str, float, float, float]:
    """A size's row when S x P is shared and each rank holds h heads and a activation units."""
    P = SIZES[size]
    head, act = predict_scale.bench_shape(size)
    whole = (h * head + a * act) / MIB
    return size, P, S * P + whole, S * P / 2 + whole


def _checked(rows) -> dict:
    parts, table, sizes = predict_scale.read_table(_log(rows))
    return predict_scale.check_split(["fast"], table, sizes)["fast"]


def test_peaks_that_follow_the_split_read_one_where_the_others_tell_the_terms_apart(capsys):
    rows = [_row(size, 1.0, 3.0, 20.0) for size in SIZES]
    got = _checked(rows)
    # 1024x4 left out: 512x16 and 1024x16 differ only in width, head and activations alike
    assert set(got) == {"512x16", "1024x16"}
    for ratios in got.values():
        assert ratios == pytest.approx((1.0, 1.0), abs=2e-3)
    assert "fast 1024x4: not checked" in capsys.readouterr().out


def test_a_whole_part_that_grows_otherwise_reads_off():
    # 1024x16's ranks hold 40 more activation units than the others' fit allows
    rows = [_row("512x16", 1.0, 3.0, 20.0), _row("1024x4", 1.0, 3.0, 20.0),
            _row("1024x16", 1.0, 3.0, 60.0)]
    per_rank, alone = _checked(rows)["1024x16"]
    assert per_rank > 1.1 and alone > 1.05


def test_the_fit_recovers_the_terms_and_refuses_one_direction():
    head, act = predict_scale.bench_shape("1024x4")
    head2, act2 = predict_scale.bench_shape("1024x16")
    pts = [(head, act, 3 * head + 20 * act), (head2, act2, 3 * head2 + 20 * act2)]
    assert predict_scale.fit_whole(pts) == pytest.approx((3.0, 20.0))
    same = [(head, act, 1.0), (2 * head, 2 * act, 2.0)]
    assert predict_scale.fit_whole(same) is None


def test_fewer_than_three_sizes_are_not_checked(capsys):
    rows = [_row(size, 1.0, 3.0, 20.0) for size in ("1024x4", "1024x16")]
    parts, table, sizes = predict_scale.read_table(_log(rows))
    assert predict_scale.check_split(["fast"], table, sizes) == {}
    assert "not checked" in capsys.readouterr().out
