"""The certificate a policy carries: the record of paired training runs that says whether it
trains like its reference (``tuned.certificate`` in a policy file), as plain typed data.

:func:`autoprec.certification.certify` makes one; a policy file keeps it under ``tuned:``, ``show``
prints it, ``diff`` compares it, and a policy whose computing part (layers, default, phases,
fp8 recipe and engine, loss scaling) changed after certification is no longer covered by it:
the record holds the digest of what it certified (:meth:`autoprec.policy.Policy.digest`).

A file is untrusted: :meth:`Certificate.from_dict` checks every field (types, ranges, the
verdict against its own interval) and refuses anything else in one line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autoprec._util import brief, number, shown

__all__ = ["Certificate", "VERDICTS", "HELD_EQUAL", "verdict_of"]

# What a certificate concludes: the interval's upper end within the tolerance, its lower end
# beyond it, or neither (more branches or longer ones would tell).
VERDICTS = ("pass", "fail", "undecided")
# What the paired runs hold equal between the policy and the reference (common random
# numbers): the words a certificate may list.
HELD_EQUAL = ("init", "batches", "batch order", "dropout", "stochastic rounding",
              "optimizer state", "learning rate schedule", "eval batches")
_KEYS = ("reference", "digest", "design", "steps", "horizon", "branches", "tokens",
         "policy_steps", "gap", "low", "high", "confidence", "tolerance", "verdict",
         "held_equal", "gaps", "stopped_early")
_MAX_BRANCHES = 1024


def verdict_of(low: float, high: float, tolerance: float, *, finite: bool = True) -> str:
    """``pass`` when the interval's upper end is within ``tolerance``, ``fail`` when its lower
    end is beyond it (or a run went non-finite), else ``undecided``."""
    if not finite or (math.isfinite(low) and low > tolerance):
        return "fail"
    if math.isfinite(high) and high <= tolerance:
        return "pass"
    return "undecided"


@dataclass(frozen=True)
class Certificate:
    """Paired training runs of a policy against a reference, and their verdict."""

    # What the policy was held against: "bf16", "fp32", or "policy <digest>".
    reference: str
    # The certified policy's digest (Policy.digest(): its computing part, not its provenance).
    digest: str
    # "branches": pairs branched from checkpoints of one reference run (see certify).
    design: str
    # Steps of the reference run the branches start from.
    steps: int
    # Steps each branch trains, policy and reference alike.
    horizon: int
    # Branches (pairs) measured.
    branches: int
    # Training tokens of one branch, where the batches say (token ids), else None.
    tokens: int | None
    # Steps the policy trained in all (the certificate's cost in policy steps).
    policy_steps: int
    # Mean relative held-out loss gap, (policy - reference) / reference, over the branches.
    gap: float
    # Its interval at `confidence` (Student t over the branches, widened for every look the
    # sequential stop took).
    low: float
    high: float
    confidence: float
    # The largest gap that passes, relative.
    tolerance: float
    # pass / fail / undecided (VERDICTS).
    verdict: str
    # What the pairs hold equal (HELD_EQUAL words).
    held_equal: tuple[str, ...]
    # Each branch's gap, in branch order (the paired-difference curve over the run).
    gaps: tuple[float, ...] = ()
    # The sequential stop decided before every branch ran.
    stopped_early: bool = False

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"A certificate's verdict is one of {', '.join(VERDICTS)}, not "
                             f"{brief(self.verdict)}.")

    def covers(self, digest: str) -> bool:
        """Whether this certificate is about a policy of ``digest`` (not edited since)."""
        return digest == self.digest

    def describe(self) -> str:
        """One line: the verdict, the gap with its interval, against what, at what cost."""
        return (f"{self.verdict.upper()}: gap vs {shown(self.reference)} {self.gap:+.2%} "
                f"[{self.low:+.2%}, {self.high:+.2%}] ({self.confidence:.0%}), tolerance "
                f"{self.tolerance:.2%}; {self.branches} branches of {self.horizon} steps from a "
                f"{self.steps}-step reference run ({self.policy_steps} policy steps"
                + (", stopped early" if self.stopped_early else "") + ")")

    def to_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "digest": self.digest, "design": self.design,
                "steps": self.steps, "horizon": self.horizon, "branches": self.branches,
                "tokens": self.tokens, "policy_steps": self.policy_steps,
                "gap": _rounded(self.gap), "low": _rounded(self.low),
                "high": _rounded(self.high), "confidence": self.confidence,
                "tolerance": self.tolerance, "verdict": self.verdict,
                "held_equal": list(self.held_equal), "gaps": [_rounded(g) for g in self.gaps],
                "stopped_early": self.stopped_early}

    @classmethod
    def from_dict(cls, data: Any, what: str = "tuned.certificate") -> Certificate:
        """A certificate from a file's mapping, every field checked; a ValueError naming
        ``what`` and the field otherwise."""
        if not isinstance(data, Mapping):
            raise ValueError(f"`{what}` must be a mapping, got {brief(data)}.")
        unknown = [k for k in data if k not in _KEYS]
        if unknown:
            raise ValueError(f"`{what}` has the unknown key {shown(unknown[0], 60)}; its keys "
                             f"are {', '.join(_KEYS)}.")
        try:
            fields = {k: _text(data, k, what) for k in ("reference", "digest", "design")}
            fields.update({k: _count(data, k, what) for k in ("steps", "horizon", "branches",
                                                               "policy_steps")})
            tokens = data.get("tokens")
            fields["tokens"] = None if tokens is None else _count(data, "tokens", what)
            fields.update({k: _float(data, k, what) for k in ("gap", "low", "high")})
            fields["confidence"] = _share(data, "confidence", what)
            fields["tolerance"] = _float(data, "tolerance", what)
            fields["verdict"] = _text(data, "verdict", what)
            fields["held_equal"] = _words(data, what)
            fields["gaps"] = _gaps(data, what)
            fields["stopped_early"] = _flag(data, "stopped_early", what)
        except KeyError as e:
            raise ValueError(f"`{what}` lacks the key {e.args[0]}.") from None
        cert = cls(**fields)
        _check_consistent(cert, what)
        return cert


def _check_consistent(cert: Certificate, what: str) -> None:
    if not cert.low <= cert.gap <= cert.high and all(map(math.isfinite, (cert.low, cert.high))):
        raise ValueError(f"`{what}`: its gap {cert.gap:+.4g} is not inside its interval "
                         f"[{cert.low:+.4g}, {cert.high:+.4g}].")
    if cert.branches > _MAX_BRANCHES or len(cert.gaps) > cert.branches:
        raise ValueError(f"`{what}` lists {len(cert.gaps)} gaps for {cert.branches} branches "
                         f"(at most {_MAX_BRANCHES}).")
    finite = all(map(math.isfinite, cert.gaps)) and math.isfinite(cert.gap)
    if cert.verdict != verdict_of(cert.low, cert.high, cert.tolerance, finite=finite):
        raise ValueError(f"`{what}` says {cert.verdict!r}, but its interval "
                         f"[{cert.low:+.4g}, {cert.high:+.4g}] against the tolerance "
                         f"{cert.tolerance:.4g} says "
                         f"{verdict_of(cert.low, cert.high, cert.tolerance, finite=finite)!r}.")


def _rounded(x: float) -> float | str:
    return round(x, 6) if math.isfinite(x) else ("nan" if math.isnan(x) else
                                                  ("inf" if x > 0 else "-inf"))


def _text(data: Mapping, key: str, what: str) -> str:
    value = data[key]
    if not isinstance(value, str) or not value or len(value) > 200:
        raise ValueError(f"`{what}.{key}` must be text of at most 200 characters, got "
                         f"{brief(value)}.")
    return value


def _count(data: Mapping, key: str, what: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** 53:
        raise ValueError(f"`{what}.{key}` must be a whole number >= 0, got {brief(value)}.")
    return value


def _float(data: Mapping, key: str, what: str) -> float:
    value = data[key]
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    return number(value, f"`{what}.{key}`")


def _share(data: Mapping, key: str, what: str) -> float:
    value = _float(data, key, what)
    if not 0 < value < 1:
        raise ValueError(f"`{what}.{key}` must be between 0 and 1, got {value!r}.")
    return value


def _flag(data: Mapping, key: str, what: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"`{what}.{key}` must be true or false, got {brief(value)}.")
    return value


def _words(data: Mapping, what: str) -> tuple[str, ...]:
    value = data["held_equal"]
    if not isinstance(value, (list, tuple)) or any(w not in HELD_EQUAL for w in value):
        raise ValueError(f"`{what}.held_equal` must list some of {', '.join(HELD_EQUAL)}, got "
                         f"{brief(value)}.")
    return tuple(value)


def _gaps(data: Mapping, what: str) -> tuple[float, ...]:
    value = data.get("gaps", [])
    if not isinstance(value, (list, tuple)) or len(value) > _MAX_BRANCHES:
        raise ValueError(f"`{what}.gaps` must be a list of at most {_MAX_BRANCHES} numbers, got "
                         f"{brief(value)}.")
    return tuple(_float({"gap": v}, "gap", f"{what}.gaps") for v in value)
