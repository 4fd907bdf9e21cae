"""Where a layer's or a step's seconds come from: measured on this device, or priced by the
cost model for a target device. Every stage that branches on it (profile, tune, evaluate,
report) asks one :class:`CostSource` instead of testing ``target is None`` itself.

    CostSource.of(None)     -> measured: time kernels on the task's device
    CostSource.of("h100")   -> priced: the cost model's roofline for an H100 (numerics are
                               still measured on the task's device)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autoprec.calibration import CALIBRATION
from autoprec.costmodel import estimate_layer, estimate_step
from autoprec.devices import resolve_target
from autoprec.formats import Format

__all__ = ["CostSource", "calibration_error", "calibration_line", "priced_tie"]

# the target whose model was checked against measurements; the others share its structure
_CHECKED = "h100"


def _key(target: Any) -> str:
    """The cost model's name for ``target``; a name it does not know (a DeviceSpec's, as a
    policy's provenance records it) as written."""
    try:
        return resolve_target(target)[0]
    except ValueError:
        return str(target).strip()


def calibration_error(target: Any) -> float:
    """How far off the cost model of ``target`` was on the published whole-step speed-ups it
    was checked against (``autoprec.calibration.CALIBRATION``): the largest relative error of
    the figures no constant was fitted to. A target never checked against a measurement gets
    the checked one's (it is at least that uncertain)."""
    return (CALIBRATION.get(_key(target)) or CALIBRATION[_CHECKED]).speedup_error


def calibration_line(target: Any) -> str:
    """The one line every priced figure carries: which model priced it, which measurements
    that model was checked against and how far off it was."""
    key = _key(target)
    cal = CALIBRATION.get(key)
    if cal is None:
        ref = CALIBRATION[_CHECKED]
        return (f"priced by the {key} cost model, not checked against a measurement (the "
                f"{ref.target} model is, against {ref.checked_against}: step speed-ups within "
                f"{ref.speedup_error:.0%})")
    return (f"priced by the {key} cost model, checked against {cal.checked_against}: step "
            f"speed-ups within {cal.speedup_error:.0%} (single linears within "
            f"{cal.linear_error:.0%})")


def priced_tie(a: float, b: float, target: Any) -> bool:
    """Whether two figures priced for ``target`` (two seconds, or two speed-ups) are a tie:
    they differ by no more than the model's calibration error, so the price cannot say
    which is faster."""
    if not (a > 0 and b > 0) or not (math.isfinite(a) and math.isfinite(b)):
        return a == b
    return max(a, b) / min(a, b) - 1 <= calibration_error(target)


@dataclass(frozen=True)
class CostSource:
    """Measured on this device (``target`` None) or priced for cost-model ``target``."""

    # None: times measured on the task's device; else a cost-model target ("h100", ...) as
    # the caller spelled it (a profile records it as given)
    target: str | None = None

    @classmethod
    def of(cls, target: str | CostSource | None) -> CostSource:
        """The source for ``target``; an unknown target is a ValueError listing the known
        ones, raised here, before any measurement."""
        if isinstance(target, CostSource) or target is None:
            return target if isinstance(target, CostSource) else cls(None)
        resolve_target(target)
        return cls(target)

    @property
    def measured(self) -> bool:
        """Seconds come from timing kernels on this device."""
        return self.target is None

    @property
    def priced(self) -> bool:
        """Seconds come from the cost model for ``target`` (at the task's production shapes,
        its ``shape_batch``, when it has one)."""
        return self.target is not None

    @property
    def key(self) -> str | None:
        """The target as the cost model names it (stripped, lower case); None when measured."""
        if self.target is None:
            return None
        return resolve_target(self.target)[0]

    def calibration(self) -> str | None:
        """:func:`calibration_line` of a priced source; None when measured."""
        return calibration_line(self.target) if self.priced else None

    def label(self, device: str) -> str:
        """Where the seconds of a table come from: ``cost model h100`` or
        ``measured on cpu (...)`` (``device`` is where the numerics were measured)."""
        return f"cost model {self.target}" if self.priced else f"measured on {device}"

    def provenance_device(self, device: torch.device, profiled_on: str) -> str:
        """The ``device`` a tuned policy records: the cost model and where the numerics ran,
        the CUDA device's name, or the profile's device description (``profiled_on``)."""
        if self.priced:
            return f"cost model: {self.target} (numerics on {device})"
        if device.type == "cuda":
            return torch.cuda.get_device_name(device)
        return profiled_on

    def price_layer(self, layer: Any, fmt: Format):
        """The cost model's seconds of ``layer`` in ``fmt`` (a LayerTime), without the casts
        in and out of the layer: a step is priced with the graph's edges, where a cast is paid
        only between layers of different dtypes (:meth:`price_step`)."""
        self._need_target("price_layer")
        return estimate_layer(layer, fmt, self.target, boundary_casts=False)

    def price_step(self, layers: Iterable[Any], assignment: Mapping[str, Format], *,
                   edges: Iterable[tuple[str, str]] | None = None) -> float:
        """The cost model's seconds of these layers' forward+backward under ``assignment``."""
        self._need_target("price_step")
        return estimate_step(layers, assignment, self.target, edges=edges)

    def _need_target(self, what: str) -> None:
        if self.target is None:
            raise ValueError(f"CostSource.{what} needs a cost-model target; this source "
                             "measures on the device (CostSource.of('h100') prices).")
