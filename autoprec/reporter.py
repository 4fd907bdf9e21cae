"""Where long work says what it is doing: one object instead of a ``log`` function passed
beside a ``progress`` flag."""

from __future__ import annotations

from dataclasses import dataclass

from autoprec._util import ProgressBar, log

__all__ = ["Reporter"]


@dataclass(frozen=True)
class Reporter:
    """Log lines and progress bars on stderr, or nothing at all (``enabled=False``)."""

    enabled: bool = True

    @classmethod
    def of(cls, progress: bool | Reporter) -> Reporter:
        """A reporter as given, or one that reports when ``progress`` is true."""
        return progress if isinstance(progress, Reporter) else cls(bool(progress))

    def log(self, msg: str) -> None:
        """One line on stderr."""
        log(msg, self.enabled)

    def bar(self, title: str) -> ProgressBar:
        """A progress bar, ``bar(done, total, label)``, drawn only when enabled."""
        return ProgressBar(title, enabled=self.enabled)
