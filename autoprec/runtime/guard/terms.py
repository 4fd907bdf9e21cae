"""What the guard is told (GuardConfig) and what it reports (GuardEvent), and the ranges it
judges values against."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from autoprec._util import quoted
from autoprec.formats import Format, expand_formats

__all__ = ["GuardConfig", "GuardEvent", "watched"]

BF16_MAX = float(torch.finfo(torch.bfloat16).max)
FP16_MAX = float(torch.finfo(torch.float16).max)
# What the diagnosis names when the non-finite values were in the model's inputs already; no
# module is named so (a module name holds no "<").
INPUT = "<input batch>"
# GuardEvent.where, in the words the log and the checkpoint use: what the reactive check saw,
# "forecast" (the predictive check), "recheck" (a demotion requested by autoprec's re-check).
WHERE = ("outputs", "gradients", "weight gradients", "backward", "forecast", "recheck")
# What else Guard.request_demotion(where=...) accepts (and a checkpoint may hold): a short label.
WHERE_LABEL = re.compile(r"[a-z][a-z0-9 _-]{0,39}")


def check_where(where: object) -> str | None:
    """None if ``where`` is a GuardEvent.where the guard writes or reads, else what is wrong."""
    if isinstance(where, str) and (where in WHERE or WHERE_LABEL.fullmatch(where)):
        return None
    return (f"{quoted(where, 60)} is not one of {', '.join(WHERE)} or a short label "
            "(lowercase letters, digits, spaces, '-' and '_', at most 40)")


def watched(fmt: Format, formats: tuple[Format, ...]) -> bool:
    """Whether a guard watching ``formats`` (GuardConfig.formats) watches a layer of ``fmt``:
    one of them, or a per-GEMM mix whose scaled GEMMs' formats all are (so the default's
    ``fp8`` watches every mix of scaled formats, whichever mixes exist, and which mixes some
    input spelled before changes nothing)."""
    if fmt in formats:
        return True
    scaled = [p for p in fmt.parts if p.is_scaled]
    return bool(scaled) and all(p in formats for p in scaled)


def limit(fmt: Format) -> float:
    """Largest magnitude a layer of ``fmt`` can hand on: the range of its output dtype."""
    return FP16_MAX if fmt.output_dtype is torch.float16 else BF16_MAX


@dataclass(frozen=True)
class GuardConfig:
    """How the runtime guard judges and demotes layers.

    Args:
        patience: consecutive steps a layer must be blamed before it is demoted (>= 2: a
            layer's first failing step makes it a suspect, and only the next one checks
            whether its inputs were already non-finite).
        check_gradients: watch dL/d(output) of each watched layer as well as its outputs.
        formats: layers whose policy format is one of these are watched; a group word stands
            for its formats as they are registered when the config is made (``"scaled"``, the
            default's: every scaled format; ``"fp8"``: every FP8 recipe). A per-GEMM mix is
            watched when the formats of its scaled GEMMs are: see ``watched``.
        min_loss_scale: with an enabled GradScaler, non-finite gradients count against a
            layer only once the scaler's scale is at or below this (above it, backing off the
            scale is the remedy).
        save_to: write the amended policy here after every demotion (None: only on
            ``guard.save()``). Under torch.distributed only rank 0 writes it (every rank holds
            the same amended policy).
        distributed: under an initialized torch.distributed, every rank demotes the same
            layers at the same step (one small all_reduce per step). False: each rank decides
            for itself (ranks that hold different parts of the model, e.g. pipeline stages).
        predict: the predictive check (see ``autoprec.runtime.guard.forecast``): demote a
            layer whose amax trend reaches its format's range within ``horizon`` steps,
            before any non-finite step.
        horizon: how far ahead (training steps) a forecast crossing demotes; >= 1.
        window: steps of history each trend is fitted to (half of it, and 8, at least, before
            a forecast counts); >= 8. Longer: steadier, slower to see a trend start.

    Raises:
        ValueError: a field out of its range, or ``formats`` holding fp32.
    """

    patience: int = 2
    check_gradients: bool = True
    formats: tuple[Format | str, ...] = (Format.FP16, "scaled", Format.BF16)
    min_loss_scale: float = 1.0
    save_to: str | None = None
    distributed: bool = True
    predict: bool = True
    horizon: int = 50
    window: int = 32

    def __post_init__(self):
        if int(self.patience) != self.patience or self.patience < 2:
            raise ValueError(
                f"GuardConfig.patience must be an integer >= 2, got {self.patience!r}: a "
                "layer's first failing step makes it a suspect, and only the next one checks "
                "whether its inputs were already non-finite (the fault upstream, not its own).")
        # group words as everywhere (formats.GROUPS): "fp8" every FP8 recipe, "scaled" every
        # registered scaled format (not the per-GEMM mixes some input spelled: `watched`
        # covers those), in the order given
        formats = tuple(dict.fromkeys(g for f in self.formats
                                      for g in expand_formats([f], where="in GuardConfig.formats")))
        if Format.FP32 in formats:
            raise ValueError("GuardConfig.formats cannot include fp32: an fp32 layer has no "
                             "safer format to be demoted to. Use a subset of fp16, bf16 and the scaled "
                             "formats.")
        object.__setattr__(self, "formats", formats)
        if not self.min_loss_scale > 0:
            raise ValueError(f"GuardConfig.min_loss_scale must be positive, got "
                             f"{self.min_loss_scale!r}.")
        for name, low in (("horizon", 1), ("window", 8)):
            v = getattr(self, name)
            if isinstance(v, bool) or int(v) != v or v < low:
                raise ValueError(f"GuardConfig.{name} must be an integer >= {low} (steps), "
                                 f"got {v!r}.")
            object.__setattr__(self, name, int(v))
        if self.save_to is not None:
            object.__setattr__(self, "save_to", os.fspath(self.save_to))


@dataclass(frozen=True)
class GuardEvent:
    """One demotion."""

    # Training step at which the layer was demoted (guard.step() count, or the step passed).
    step: int
    # Module fqn of the demoted layer.
    fqn: str
    old: Format
    new: Format
    # What was measured, e.g. "26% of outputs overflow fp16 max 65504 or are NaN; 2 steps in
    # a row".
    reason: str
    # One of WHERE: "outputs", "gradients" (at the layer's output, beyond its format's range),
    # "weight gradients", "backward" (it sent non-finite gradients upstream), "forecast" (its
    # amax trend was to reach the range within the horizon), or what request_demotion was told
    # ("recheck" by default).
    where: str

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "layer": self.fqn, "from": self.old.value,
                "to": self.new.value, "reason": self.reason}

    def __str__(self) -> str:
        return f"step {self.step}: {self.fqn} {self.old} -> {self.new} ({self.reason})"
