"""benchmarks/predict_scale.py's check of its sharded fit: each rank's shards (P / 2) and what
it holds whole (h x head + a x activations + c), fitted over all sizes but one, predict the
one left out."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import predict_scale  # noqa: E402  (after the path set-up above)

MIB = 2**20
SIZES = {"512x4": 169, "512x16": 302, "1024x4": 427, "1024x16": 958}  # the bench's P, MiB


def _log(rows: list[tuple[str, float, float, float]]) -> list[str]:
    """A bench_profile_memory table: (size, P, one process, per rank on 2) in MiB."""
    lines = ["| model | P (fp32 params) | fast (x P, x step) | fast@2 (x P, x step) |\n",
             "|---|---|---|---|\n"]
    for size, P, one, two in rows:
        lines.append(f"| {size} | {P:.0f} MiB | {one:.0f} MiB (0 P, 0x) | "
                     f"{two:.0f} MiB (0 P, 0x) |\n")
    return lines


def _row(size: str, h: float, a: float, c: float) -> tuple[str, float, float, float]:
    """A size's row when each process holds its parameters (P, or P / 2 per rank) and h heads,
    a activation units and c MiB besides."""
    P = SIZES[size]
    head, act = predict_scale.bench_shape(size)
    whole = (h * head + a * act) / MIB + c
    return size, P, P + whole, P / 2 + whole


def _checked(rows) -> dict:
    parts, table, sizes = predict_scale.read_table(_log(rows))
    return predict_scale.check_fit(["fast"], table, sizes)["fast"]


def test_peaks_that_follow_the_fit_read_one_at_every_size_left_out():
    got = _checked([_row(size, 3.0, 20.0, 100.0) for size in SIZES])
    assert set(got) == set(SIZES)
    for ratios in got.values():
        assert ratios == pytest.approx((1.0, 1.0), abs=2e-3)


def test_a_size_holding_more_than_the_others_allow_reads_off():
    rows = [_row(size, 3.0, 20.0, 100.0) for size in SIZES]
    rows[-1] = _row("1024x16", 3.0, 60.0, 100.0)  # 40 more activation units at 1024x16
    per_rank, alone = _checked(rows)["1024x16"]
    assert per_rank > 1.1 and alone > 1.05


def test_the_fit_recovers_the_terms_and_refuses_what_cannot_tell_them_apart():
    pts = []
    for size in ("512x4", "1024x4", "1024x16"):
        head, act = predict_scale.bench_shape(size)
        pts.append((head, act, 3 * head + 20 * act + 7e6))
    assert predict_scale.fit_whole(pts) == pytest.approx((3.0, 20.0, 7e6))
    assert predict_scale.fit_whole(pts[:2]) is None  # two points, three terms
    head, act = predict_scale.bench_shape("512x16")
    line = [(head * k, act * k, float(k)) for k in (1, 2, 3)]  # no constant to tell apart
    assert predict_scale.fit_whole(line) is None


def test_three_sizes_are_fitted_but_not_checked(capsys):
    rows = [_row(size, 3.0, 20.0, 100.0) for size in ("512x4", "1024x4", "1024x16")]
    parts, table, sizes = predict_scale.read_table(_log(rows))
    assert predict_scale.check_fit(["fast"], table, sizes) == {"fast": {}}
    assert "not checked" in capsys.readouterr().out
    predict_scale.predict_sharded(parts, table, sizes)
    assert "GB" in capsys.readouterr().out
