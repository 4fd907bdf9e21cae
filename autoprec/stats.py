"""Statistics the stages report: a measured ratio with its confidence interval."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autoprec._util import brief, number

__all__ = ["Interval"]


@dataclass(frozen=True)
class Interval:
    """A measured ratio with its confidence interval, e.g. a speed-up over FP32."""

    value: float
    low: float
    high: float
    # Timing rounds behind it (0: not measured, e.g. priced by a cost model).
    rounds: int = 0

    def __str__(self) -> str:
        if self.rounds == 0 or self.low == self.high:
            return f"{self.value:.2f}x"
        return f"{self.value:.2f}x [{self.low:.2f}-{self.high:.2f}]"

    @property
    def excludes_one(self) -> bool:
        """The interval lies wholly above or below 1: a difference, not a tie."""
        return self.low > 1.0 or self.high < 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"value": round(self.value, 4), "low": round(self.low, 4),
                "high": round(self.high, 4), "rounds": int(self.rounds)}

    @classmethod
    def from_value(cls, value: Any, what: str = "interval") -> Interval | None:
        """From a file: a mapping as to_dict writes it (``value``, optional ``low``, ``high``,
        ``rounds``), or a bare number (older files). Anything else is a ValueError naming
        ``what``."""
        if value is None:
            return None
        if not isinstance(value, Mapping):
            v = number(value, what)
            return cls(v, v, v, 0)
        unknown = [k for k in value if k not in ("value", "low", "high", "rounds")]
        if unknown or "value" not in value:
            raise ValueError(f"{what} must be a number or a mapping with `value` (and optional "
                             f"low, high, rounds), got {brief(value)}.")
        v = number(value["value"], f"{what}.value")
        bounds = [v if value.get(k) is None else number(value[k], f"{what}.{k}")
                  for k in ("low", "high")]
        rounds = value.get("rounds", 0)
        if isinstance(rounds, bool) or not isinstance(rounds, int) or not 0 <= rounds < 2 ** 31:
            raise ValueError(f"{what}.rounds must be a non-negative integer, got "
                             f"{brief(rounds)}.")
        return cls(v, bounds[0], bounds[1], rounds)
