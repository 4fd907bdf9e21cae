"""Where a layer's or a step's seconds come from: measured on this device, or priced by the
cost model for a target device. Every stage that branches on it (profile, tune, evaluate,
report) asks one :class:`CostSource` instead of testing ``target is None`` itself.

    CostSource.of(None)     -> measured: time kernels on the task's device
    CostSource.of("h100")   -> priced: the cost model's roofline for an H100 (numerics are
                               still measured on the task's device)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autoprec.costmodel import estimate_layer, estimate_step, resolve_target
from autoprec.formats import Format

__all__ = ["CostSource"]


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
