"""Where long work says what it is doing: one object instead of a ``log`` function passed
beside a ``progress`` flag."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoprec._util import ProgressBar, log

__all__ = ["Reporter"]


@dataclass(frozen=True)
class Reporter:
    """Log lines and progress bars on stderr, or nothing at all (``enabled=False``)."""

    enabled: bool = True

    @classmethod
    def of(cls, progress: Any) -> Reporter:
        """A reporter as given, one enabled like another reporter-like object (its
        ``enabled``), or one that reports when ``progress`` is true."""
        if isinstance(progress, Reporter):
            return progress
        return cls(bool(getattr(progress, "enabled", progress)))

    def log(self, msg: str) -> None:
        """One line on stderr."""
        log(msg, self.enabled)

    def __call__(self, msg: str) -> None:
        """``reporter(msg)``: as :meth:`log`, where a ``log`` function was passed before."""
        log(msg, self.enabled)

    def bar(self, title: str) -> ProgressBar:
        """A progress bar, ``bar(done, total, label)``, drawn only when enabled."""
        return ProgressBar(title, enabled=self.enabled)
