"""The settings of each measurement, one frozen object per measurement.

:func:`~autoprec.measure.timing.measure_layers` takes a :class:`TimingOptions` and
:func:`~autoprec.measure.sensitivity.measure_sensitivity` a :class:`SensitivityOptions`, so a
stage that calls them passes one value instead of threading each setting. Both still accept
every setting as a keyword of its own (``measure_layers(..., repeats=3)``): a keyword given
overrides the same field of the options given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from autoprec._util import ProgressFn
from autoprec.formats import Format
from autoprec.policy import Budget, LossScaling

__all__ = ["TimingOptions", "SensitivityOptions", "with_keywords"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class TimingOptions:
    """How :func:`~autoprec.measure.timing.measure_layers` times each module."""

    # untimed rounds first
    warmup: int = 1
    # interleaved timing rounds per module (two repetitions each, the minimum kept)
    repeats: int = 5
    # loss_fn(model, batch), called instead of the model for the one capture run
    loss_fn: Callable[[Any, Any], Any] | None = None
    # run the model in training mode (dropout as in a training step)
    train: bool = True
    # the seconds one (module, format) may spend before it stops early with a note
    budget_s: float | None = 30.0
    # fixes the random output gradients
    seed: int = 0


@dataclass(frozen=True)
class SensitivityOptions:
    """How :func:`~autoprec.measure.sensitivity.measure_sensitivity` measures each pair."""

    # cap on the calibration batches (None: a Task's first DEFAULT_N_BATCHES, or every batch
    # given explicitly)
    n_batches: int | None = None
    # the fixed starting loss scale of fp16 runs (GradScaler's default)
    loss_scale: float = LossScaling().init_scale
    # switch a layer's whole subtree instead of keeping its listed descendants in FP32
    include_children: bool = False
    # None: the task's seed (0 for a bare model)
    seed: int | None = None
    # progress(done, total, label) after the reference and after each pair
    progress: ProgressFn | None = None
    # layer -> the only formats to measure for it (the profile skips formats that cannot win)
    only: Mapping[str, Sequence[Format | str]] | None = None
    # "exact", "fast" or "auto" (see measure_sensitivity)
    mode: str = "exact"
    # the error budget "auto" measures the near-budget estimates exactly against
    budget: Budget | None = None
    # measure a model given as such on itself, not on a copy: its dropout, BatchNorm momentum
    # and train/eval mode are put back afterwards (measurements move no weight)
    in_place: bool = False
    # how the exact comparisons get the FP32 reference's gradients: "kept", "recomputed",
    # "spilled" or "auto" (autoprec.measure.deviation.reference_gradients; "fast" has none)
    reference_gradients: str = "auto"


def with_keywords(options: _T | None, cls: type[_T], keywords: Mapping[str, Any],
                  where: str) -> _T:
    """``options`` (or the defaults of ``cls``) with the fields ``keywords`` names replaced;
    a keyword that is no field is the TypeError Python raises for an unknown keyword."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in keywords if k not in names]
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
    base = cls() if options is None else options
    if not isinstance(base, cls):
        raise TypeError(f"{where}(options=...) must be a {cls.__name__}, got "
                        f"{type(base).__name__}.")
    return dataclasses.replace(base, **keywords) if keywords else base
