"""The forecaster: per watched layer and kind (outputs, gradients at the output), the trend of
its amax toward its format's range, and the verdict "will hit the range within H steps", with
the evidence (slope per step, headroom, the fit's residual, the outlier statistic).

The rule, on y = ln(amax / limit) (<= 0 while in range) over the last ``window`` finite steps:

- at least ``window // 2`` points (and 8) in the window: several steps of trend;
- an ordinary least-squares line whose slope is positive with a t-statistic of at least
  ``TREND_T`` (the slope many standard errors from flat: ordinary noisy training, whose amax
  wanders, never gets there);
- the fitted line, and a robust (Theil-Sen: median of pairwise slopes) line through the same
  points, both reach y = 0 within ``horizon`` steps of the latest step;
- all of it on ``patience`` observed steps in a row.

Kurtosis (about zero, E[x^4] / E[x^2]^2: 3 for a Gaussian, large for outlier features) and the
share of nonzero values below the format's smallest normal (fp16 only) are recorded with every
point and reported in the evidence, but decide nothing: in large trained transformers a few
massive activations are normal, so a kurtosis in the hundreds need not mean trouble and a
threshold would be a model's, not the guard's (on the planted drift's layer it stayed about
1.6-2.8); and an fp16 underflow loses precision, not range, which demoting for would trade
speed for a risk the loss does not show. The amax's trend is what hits the range.

Everything here is plain Python on numbers read with the step's one host sync.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from autoprec.formats import Format
from autoprec.runtime.guard.terms import limit

__all__ = ["Forecaster", "Point", "Trend", "fit", "hits"]

# The kinds forecast (record.KINDS' outputs and gradients at the output), in words.
NAMES = {"out": "outputs", "grad": "gradients"}
# A trend counts when its slope is this many standard errors above zero.
TREND_T = 4.0
# Fewest points a fit needs, whatever the window.
MIN_POINTS = 8
# Growth no trend is assumed to beat: a series further than horizon * this (natural log) from
# its range cannot reach it within the horizon, and is not fitted (bf16's 88 nats of headroom
# for values ~1: the fit is skipped for every bf16 and fp8 layer of a healthy run).
MAX_SLOPE = math.log(2.0)
# Most points per series a state read back may hold (untrusted input: bounded).
MAX_STATE_POINTS = 4096


@dataclass(frozen=True)
class Point:
    """One step's summary of one layer and kind: the amax (mean over the step's calls), the
    kurtosis and underflow share of a fixed sample of the values (None: not measured)."""

    step: int
    amax: float
    kurtosis: float | None = None
    underflow: float | None = None


@dataclass(frozen=True)
class Trend:
    """The fit of one layer's and kind's recent headroom, ``y = ln(amax / limit)``."""

    kind: str
    amax: float  # the latest point's
    limit: float
    slope: float  # growth of y per step (robust, Theil-Sen, where the forecast is near)
    points: int
    span: int  # steps from the first point to the last
    residual: float  # RMS residual of the least-squares fit (natural log)
    t: float  # least-squares slope / its standard error
    steps_left: float  # steps until the lower of both fitted lines reaches the limit
    kurtosis: float | None
    underflow: float | None

    def describe(self, fmt: Format | None) -> str:
        """E.g. "outputs' amax 41000 (0.63 of fp16 max 65504), growing 1.2%/step over 24
        steps (t 9.1, fit residual 0.05): reaches 65504 in ~39 steps; kurtosis 4.2"."""
        name = fmt.value if fmt is not None else "its format's"
        text = (f"{NAMES.get(self.kind, self.kind)}' amax {self.amax:.4g} "
                f"({self.amax / self.limit:.2g} of {name} max {self.limit:.6g}), growing "
                f"{math.expm1(self.slope):.2%}/step over {self.span} steps (t {self.t:.1f}, fit "
                f"residual {self.residual:.2g}): reaches {self.limit:.6g} in ~{self.steps_left:.0f} "
                "steps")
        if self.kurtosis is not None:
            text += f"; kurtosis {self.kurtosis:.3g}"
        if self.underflow is not None:
            text += f"; {self.underflow:.2%} of nonzero values below {name}'s smallest normal"
        return text


def _ols(xs: list[float], ys: list[float]) -> tuple[float, float, float, float]:
    """(slope, mean y, RMS residual, t of the slope) of the least-squares line: one pass of
    sums, centred on the first point (steps are large numbers, their spread is small)."""
    n, x0 = len(xs), xs[0]
    sx = sy = sxx = sxy = syy = 0.0
    for x, y in zip(xs, ys):
        x -= x0
        sx, sy, sxx, sxy, syy = sx + x, sy + y, sxx + x * x, sxy + x * y, syy + y * y
    cxx, cxy, cyy = sxx - sx * sx / n, sxy - sx * sy / n, syy - sy * sy / n
    b = cxy / cxx
    ssr = max(0.0, cyy - b * cxy)
    se = math.sqrt(ssr / (n - 2) / cxx)
    return b, sy / n, math.sqrt(ssr / n), (math.inf if se == 0 else b / se)


def _theil_sen(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the Theil-Sen line: the median pairwise slope, the median of
    y - slope * x."""
    slopes = sorted((ys[j] - ys[i]) / (xs[j] - xs[i])
                    for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i])
    b = _median(slopes)
    return b, _median(sorted(y - b * x for x, y in zip(xs, ys)))


def _median(v: list[float]) -> float:
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def fit(points: list[Point], bound: float, horizon: int, *,
        min_points: int = MIN_POINTS) -> Trend | None:
    """The trend of ``points`` (oldest first) toward ``bound``; None where there is none to
    speak of: too few points, a series too far from its range to reach it within ``horizon``
    steps (MAX_SLOPE), or a flat or falling least-squares line. Where that line is confident
    (TREND_T) and reaches the range within ``horizon``, the robust Theil-Sen line is fitted
    too and the later of the two crossings counts (its slope is the one reported)."""
    if len(points) < max(3, min_points):
        return None
    xs = [float(p.step) for p in points]
    ys = [math.log(p.amax / bound) for p in points]
    if -ys[-1] > MAX_SLOPE * horizon or xs[-1] == xs[0]:
        return None
    b, my, residual, t = _ols(xs, ys)
    if not b > 0:
        return None
    now = xs[-1]
    # steps until the line reaches y = 0 (0: it is there already)
    slope = b
    left = max(0.0, -(my + b * (now - sum(xs) / len(xs))) / b)
    if t >= TREND_T and left <= horizon:
        slope, intercept = _theil_sen(xs, ys)
        robust_left = math.inf if slope <= 0 else max(0.0, -(intercept + slope * now) / slope)
        left = max(left, robust_left)
    last = points[-1]
    return Trend(kind="", amax=last.amax, limit=bound, slope=slope, points=len(points),
                 span=int(xs[-1] - xs[0]), residual=residual, t=t, steps_left=left,
                 kurtosis=last.kurtosis, underflow=last.underflow)


def hits(trend: Trend | None, horizon: int) -> bool:
    """Whether ``trend`` is confident and reaches the range within ``horizon`` steps."""
    return trend is not None and trend.t >= TREND_T and trend.steps_left <= horizon


class Forecaster:
    """The recent points of every watched layer and kind, the trends fitted to them, and how
    many observed steps in a row each layer was forecast to hit its range."""

    def __init__(self, window: int, horizon: int, patience: int):
        self.window, self.horizon, self.patience = window, horizon, patience
        # fqn -> kind -> the last ``window`` points
        self.history: dict[str, dict[str, deque[Point]]] = {}
        # fqn -> the format its points were taken in (a change of format starts afresh)
        self.formats: dict[str, Format] = {}
        # fqn -> consecutive observed steps forecast to hit
        self.streaks: dict[str, int] = {}
        # fqn -> the trend of the latest step that hits (the evidence)
        self.hitting: dict[str, Trend] = {}

    def observe(self, step: int, stats: Mapping[str, Mapping[str, tuple]],
                formats: Mapping[str, Format]) -> None:
        """Take one step's ``stats`` (kind -> fqn -> (amax, kurtosis, underflow)) of the
        watched layers (``formats``: fqn -> format). Non-finite or zero amaxes (a failing or
        a dead step) are left out: the reactive check judges those."""
        self.forget([f for f, fmt in self.formats.items() if formats.get(f) is not fmt])
        for kind, found in stats.items():
            for fqn, (amax, kurt, under) in found.items():
                if fqn not in formats or not (math.isfinite(amax) and amax > 0):
                    continue
                self.formats[fqn] = formats[fqn]
                series = self.history.setdefault(fqn, {}).setdefault(
                    kind, deque(maxlen=self.window))
                series.append(Point(step, amax, _number(kurt), _number(under)))
        self.hitting = {}
        for fqn in self.history:
            trends = [t for t in self.trends(fqn) if hits(t, self.horizon)]
            if trends:
                self.hitting[fqn] = min(trends, key=lambda t: t.steps_left)
        self.streaks = {f: self.streaks.get(f, 0) + 1 for f in self.hitting}

    def trends(self, fqn: str) -> list[Trend]:
        """The trends fitted now to ``fqn``'s series (none where there is no trend)."""
        bound = limit(self.formats[fqn])
        out = []
        for kind, series in self.history.get(fqn, {}).items():
            trend = fit(list(series), bound, self.horizon,
                        min_points=max(MIN_POINTS, self.window // 2))
            if trend is not None:
                out.append(replace(trend, kind=kind))
        return out

    def due(self) -> dict[str, Trend]:
        """fqn -> its evidence, for the layers forecast to hit on ``patience`` steps in a
        row: to be demoted now."""
        return {f: t for f, t in self.hitting.items() if self.streaks[f] >= self.patience}

    def forget(self, fqns: Iterable[str]) -> None:
        """Drop the history of ``fqns`` (their format changed, or they are not watched)."""
        for f in list(fqns):
            self.history.pop(f, None)
            self.formats.pop(f, None)
            self.streaks.pop(f, None)
            self.hitting.pop(f, None)

    def state_dict(self) -> dict[str, Any]:
        """Plain data: fqn -> {"format": ..., "streak": n, kind: [[step, amax, kurtosis,
        underflow], ...]}."""
        return {fqn: {"format": self.formats[fqn].value, "streak": self.streaks.get(fqn, 0),
                      **{k: [[p.step, p.amax, p.kurtosis, p.underflow] for p in s]
                         for k, s in kinds.items()}}
                for fqn, kinds in self.history.items()}

    def load(self, state: Mapping[str, Any], formats: Mapping[str, Format]) -> None:
        """Take up what :meth:`state_dict` wrote (checked by ``state.check_forecast``): the
        series of layers still watched in the same format; the newest ``window`` points."""
        self.history, self.formats, self.streaks, self.hitting = {}, {}, {}, {}
        for fqn, entry in state.items():
            fmt = Format.parse(entry["format"])
            if formats.get(fqn) is not fmt:
                continue
            self.formats[fqn] = fmt
            if entry["streak"]:
                self.streaks[fqn] = int(entry["streak"])
            self.history[fqn] = {
                k: deque((Point(int(s), float(a), _number(c), _number(u))
                          for s, a, c, u in entry[k]), maxlen=self.window)
                for k in NAMES if k in entry}


def _number(v: Any) -> float | None:
    return float(v) if v is not None and math.isfinite(v) else None
