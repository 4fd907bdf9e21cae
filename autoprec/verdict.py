"""Can this format win on this layer? One rule, read by every stage that asks.

The tune's profile asks before it measures numerics (a format that cannot win is not measured), the
search space asks before it offers a format for a unit, and ``autoprec profile``/``show`` ask
to explain a layer's format. Each passes what it knows of the layer; the rules run in one
order and the first that rules the format out names it:

    skipped      the profile recorded that it cannot win (the recorded reason; a profile
                 made with only_winnable, as the tune's is, does not measure those numerics)
    blocked      fp8 whose matmuls the kernel does not take (it would run bf16)
    emulated     the device only emulates it: never faster than fp32
    slow         it failed, or takes at least SLOWER_THAN_FP32 x the fp32 time
    bf16         an fp8 recipe no faster than bf16 (which is as fast and more precise)
    unmeasured   no numbers for it (only asked once the numerics were measured)
    non-finite   the loss or gradients overflowed with the layer alone in it
    over budget  the layer alone raises the loss past the error budget
    untimed      no finite time for it

The rules read seconds as given: measured on the device or priced by the cost model (see
:mod:`autoprec.pricing`) are judged alike (both mark an emulated format, and a format the
device cannot run as failed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoprec.formats import Format

__all__ = ["Verdict", "can_win", "unit_can_win", "SLOWER_THAN_FP32", "CANNOT_WIN_RULES"]

# A format this many times slower than fp32 on a layer cannot win on this device: the profile
# does not measure its numerics. Far from 1: one layer's time is noisy (a parent's own time is
# a difference of two timings), and only the search's step timing decides close calls.
SLOWER_THAN_FP32 = 2.0

# The rules that say the format cannot win on speed (so the profile does not measure it).
CANNOT_WIN_RULES = ("skipped", "emulated", "slow", "bf16")


@dataclass(frozen=True)
class Verdict:
    """Whether a format can win on a layer: ``rule`` names the first rule that rules it out
    ("" when none does) and ``why`` says it in a sentence."""

    fmt: Format
    rule: str = ""
    why: str = ""

    @property
    def can_win(self) -> bool:
        return not self.rule


def can_win(fmt: Format, times: Mapping[Format, Any], *, blocker: str = "",
            skipped: Mapping[Format, str] | None = None,
            sensitivity: Mapping[Format, Any] | None = None,
            max_loss_increase: float | None = None) -> Verdict:
    """The verdict on ``fmt`` for one layer, from what is known of it.

    ``times``: format -> the layer's LayerTime (measured or priced). ``blocker``: why fp8
    would not run the layer's matmuls ("" when it would). ``skipped``: the profile's recorded
    formats that cannot win, with why. ``sensitivity``: format -> LayerSensitivity, once the
    numerics were measured (None before: the numerics and time rules are not asked).
    ``max_loss_increase``: the error budget on the layer's own loss change (None: not asked).
    fp32, the reference, always can win.
    """
    if fmt is Format.FP32:
        return Verdict(fmt)
    if skipped is not None and fmt in skipped:
        return Verdict(fmt, "skipped", skipped[fmt])
    if fmt.is_scaled and blocker:
        return Verdict(fmt, "blocked", blocker)
    measured = sensitivity is not None and fmt in sensitivity
    speed = _speed(fmt, times, "" if measured else "; numerics not measured")
    if speed is not None or sensitivity is None:
        return speed or Verdict(fmt)
    return _numerics(fmt, times, sensitivity, max_loss_increase)


def _speed(fmt: Format, times: Mapping[Format, Any], tail: str) -> Verdict | None:
    t = times.get(fmt)
    if t is None:
        return None
    t32, t16 = times.get(Format.FP32), times.get(Format.BF16)
    if t.emulated:
        return Verdict(fmt, "emulated",
                       f"{fmt} only emulated here: never faster than fp32{tail}")
    if t32 is not None and t32.ok and (not t.ok or t.seconds >= SLOWER_THAN_FP32 * t32.seconds):
        what = "failed" if not t.ok else f"{t.seconds / t32.seconds:.1f}x the fp32 time"
        return Verdict(fmt, "slow", f"{fmt} cannot win here ({what}){tail}")
    if fmt.is_scaled and t16 is not None and t16.ok and t.seconds >= t16.seconds:
        return Verdict(fmt, "bf16", f"{fmt} not faster than bf16 here ({microseconds(t.seconds)} "
                                    f"vs {microseconds(t16.seconds)}): bf16 is as fast and more "
                                    "precise")
    return None


def _numerics(fmt: Format, times: Mapping[Format, Any], sensitivity: Mapping[Format, Any],
              max_loss_increase: float | None) -> Verdict:
    err = sensitivity.get(fmt)
    if err is None:
        return Verdict(fmt, "unmeasured", f"{fmt.label} not measured")
    if not err.finite:
        return Verdict(fmt, "non-finite", f"{fmt.label} non-finite (loss or gradients overflowed)")
    lc = err.loss_rel_change
    if max_loss_increase is not None and math.isfinite(lc) and lc > max_loss_increase:
        return Verdict(fmt, "over budget", f"{fmt.label} alone changes the loss by {lc:+.2%} "
                                           f"(> {max_loss_increase:.2%})")
    t = times.get(fmt)
    if t is None or not math.isfinite(t.seconds):
        return Verdict(fmt, "untimed", f"{fmt.label} has no finite time in the profile")
    return Verdict(fmt)


def unit_can_win(verdicts: Sequence[Verdict], seconds: float, fp32_seconds: float) -> str:
    """Why a format is not offered for a search unit ("" when it is), from its layers'
    verdicts (numerics measured, no budget: the search judges policies by their own loss) and
    the unit's summed seconds in it and in fp32: a format not faster than fp32 on the unit is
    dominated (fp32 has zero error), so offering it would only spend trials."""
    if any(v.rule in CANNOT_WIN_RULES for v in verdicts):
        return "cannot win here on speed"
    if any(v.rule == "blocked" for v in verdicts):
        return "FP8 does not take its matmuls"
    if not all(v.can_win for v in verdicts):
        return "non-finite"
    if not (math.isfinite(seconds) and seconds < fp32_seconds):
        return "not faster than fp32 in the profile"
    return ""


def microseconds(seconds: float) -> str:
    """``123 us``, or ``4.5 us`` below 10 us."""
    return f"{seconds * 1e6:.0f} us" if seconds >= 1e-5 else f"{seconds * 1e6:.1f} us"
