"""Phases of a run: how a policy's formats change over training, as the policy file says.

```yaml
default: bf16
layers: {"transformer.h.*.mlp.*": fp8, lm_head: fp32}
phases:                           # later phases; the policy above is the first (from step 0)
  - from_fraction: 0.9            # from 90% of the run's optimizer steps (or from_step: 9000)
    name: decay                   # optional, for logs and `show`
    formats: {fp8: bf16}          # each layer in a key format computes in its value
    layers: {lm_head: fp32}       # optional entries that override the mapped ones
    default: bf16                 # optional: the phase's own default
```

A phase's policy is the first phase's with every format of ``default`` and ``layers`` mapped
through ``formats``, then ``layers`` added. A key is a format or a group word as in every set
of formats (:data:`autoprec.formats.GROUPS`): ``fp8`` stands for every FP8 recipe, ``scaled``
for every scaled format (the FP8 recipes, mxfp8, nvfp4); a format's own key wins over ``fp8``,
and ``fp8`` over ``scaled``. Policy files of schema 3 and older meant every scaled format by
``fp8`` here: they read as if they said ``scaled``. The map applies to the *policy's
entries*, so a layer that inherits its parent's format follows its parent's mapped entry, as
it would in the file.

Where a phase starts: ``from_step: N`` (after N optimizer steps, N >= 1) or
``from_fraction: F`` (0 < F < 1: after ``floor(F * total + 1/2)`` of the run's ``total``
steps, which the training integration knows; a run whose length is not known refuses a
fraction in one line). The phases of one unit must be listed in the order they start; where
units mix, the order is checked once the run's length is known. This module is plain data:
:mod:`autoprec.runtime.switcher` switches a model at the boundaries.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec._util import MAX_INT, brief, quoted, shown
from autoprec.formats import FP4_E2M1, GROUPS, Format, format_group, in_group

__all__ = ["Phase", "parse_phases", "phase_starts", "phase_index", "FINAL_FORMATS", "final_phase",
           "kept_for_range"]

# A run with more phases than this is a schedule of another kind (and a hostile file's way to
# make every step check thousands of boundaries).
MAX_PHASES = 64
PHASE_KEYS = ("name", "from_step", "from_fraction", "formats", "layers", "default")
MAX_NAME_CHARS = 64
# What a final high-precision phase may switch to (autoprec tune --final-phase F:FORMAT).
FINAL_FORMATS = ("bf16", "fp16", "fp32")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Phase:
    """One later phase of a run (see the module docstring)."""

    # Optimizer steps done when the phase starts (>= 1); or None with from_fraction.
    from_step: int | None = None
    # Share of the run's steps done when it starts (0 < F < 1); or None with from_step.
    from_fraction: float | None = None
    # Format -> format; a key is a format's label or a group word (fp8: every FP8 recipe;
    # scaled: every scaled format); a format's own key wins, then fp8, then scaled.
    formats: Mapping[str, Format] = field(default_factory=dict)
    # Layer entries of this phase, over the mapped ones (patterns as in `layers`).
    layers: Mapping[str, Format] = field(default_factory=dict)
    # The phase's default; None: the first phase's, mapped.
    default: Format | None = None
    # A label for logs and `show`.
    name: str | None = None

    def __post_init__(self):
        if (self.from_step is None) == (self.from_fraction is None):
            raise ValueError("a phase names where it starts with exactly one of `from_step: N` "
                             "(optimizer steps done) or `from_fraction: F` (a share of the run)")
        if self.from_step is not None and not (_is_int(self.from_step)
                                               and 1 <= self.from_step < MAX_INT):
            raise ValueError(f"`from_step` must be an integer >= 1 (the first phase is the "
                             f"policy itself, from step 0), got {brief(self.from_step)}")
        if self.from_fraction is not None:
            f = self.from_fraction
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1:
                raise ValueError(f"`from_fraction` must be a number between 0 and 1 (0.9: from "
                                 f"90% of the run), got {brief(f)}")
            object.__setattr__(self, "from_fraction", float(f))
        if self.name is not None and (not isinstance(self.name, str)
                                      or len(self.name) > MAX_NAME_CHARS):
            raise ValueError(f"a phase's `name` must be text of at most {MAX_NAME_CHARS} "
                             f"characters, got {brief(self.name)}")

    # ---------------------------------------------------------------- meaning
    def start(self, total_steps: int | None) -> int:
        """The optimizer step count at which the phase comes into force."""
        if self.from_step is not None:
            return self.from_step
        if total_steps is None:
            raise ValueError(f"the phase {self.describe()} needs the run's length: pass "
                             "total_steps= (the number of optimizer steps the run will take)")
        return max(1, math.floor(self.from_fraction * total_steps + 0.5))

    def describe(self) -> str:
        """``"from step 9000"`` or ``"from 90% of the run"``, with its name."""
        where = (f"from step {self.from_step}" if self.from_step is not None
                 else f"from {self.from_fraction:.4g} of the run"
                 if self.from_fraction * 100 != round(self.from_fraction * 100)
                 else f"from {self.from_fraction * 100:.0f}% of the run")
        return f"{where} ({shown(self.name)})" if self.name else where

    def maps(self, fmt: Format) -> Format:
        """What a layer the first phase puts in ``fmt`` computes in during this phase."""
        for key in (fmt.label, *GROUPS):  # its own key, then the group words, narrowest first
            to = self.formats.get(key)
            if to is not None and (key == fmt.label or in_group(fmt, key)):
                return to
        return fmt

    def to_dict(self, spell: Callable[[Format], str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.name is not None:
            out["name"] = self.name
        if self.from_step is not None:
            out["from_step"] = int(self.from_step)
        else:
            out["from_fraction"] = float(self.from_fraction)
        if self.formats:
            out["formats"] = {k: spell(v) for k, v in self.formats.items()}
        if self.layers:
            out["layers"] = {p: spell(f) for p, f in self.layers.items()}
        if self.default is not None:
            out["default"] = spell(self.default)
        return out


def _format_key(key: Any, fp8_recipe: str, where: str) -> str:
    """A `formats:` key as stored: a group word (``fp8``, ``scaled``) or a format's label."""
    if not isinstance(key, str):
        raise ValueError(f"a `formats` key must be a format name, got {brief(key)}{where}")
    text = key.strip().lower()
    if format_group(text) is not None:
        return text
    return Format.parse(text, where=f"as a `formats` key{where}", fp8_recipe=fp8_recipe).label


def _phase(raw: Any, index: int, fp8_recipe: str, where: str) -> Phase:
    at = f" in phase {index}{where}"
    if not isinstance(raw, Mapping):
        raise ValueError(f"each entry of `phases`{where} is a mapping (from_step or "
                         f"from_fraction, formats, layers, default, name); entry {index} is "
                         f"{brief(raw)}")
    unknown = [k for k in raw if k not in PHASE_KEYS]
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise ValueError(f"unknown key(s) {', '.join(quoted(k, 40) for k in unknown[:3])}{more}"
                         f"{at}; valid keys are {', '.join(PHASE_KEYS)}")
    for key in ("formats", "layers"):
        if not isinstance(raw.get(key) or {}, Mapping):
            raise ValueError(f"`{key}`{at} must be a mapping, got {brief(raw.get(key))}")
    if not raw.get("formats") and not raw.get("layers") and raw.get("default") is None:
        raise ValueError(f"phase {index}{where} changes nothing: give it `formats` (e.g. "
                         "`{fp8: bf16}`), `layers` or a `default`")

    def fmt(value: Any, what: str) -> Format:
        return Format.parse(value, where=f"for {what}{at}", fp8_recipe=fp8_recipe)

    formats: dict[str, Format] = {}
    spelled: dict[str, Any] = {}
    for k, v in (raw.get("formats") or {}).items():
        key = _format_key(k, fp8_recipe, at)
        if key in formats:  # `fp8` and ` FP8 `: a mapping would keep the last silently
            raise ValueError(f"`formats`{at} names {key} twice (as {quoted(spelled[key], 60)} "
                             f"and {quoted(k, 60)}); give each format one entry")
        formats[key], spelled[key] = fmt(v, f"`formats: {shown(k, 60)}`"), k
    layers = {p: fmt(v, f"layer `{shown(p)}`") for p, v in (raw.get("layers") or {}).items()}
    default = raw.get("default")
    try:
        return Phase(from_step=raw.get("from_step"), from_fraction=raw.get("from_fraction"),
                     formats=formats, layers=layers, name=raw.get("name"),
                     default=fmt(default, "`default`") if default is not None else None)
    except ValueError as e:
        raise ValueError(f"{e}{at}") from None


def parse_phases(raw: Any, fp8_recipe: str, where: str = "") -> tuple[Phase, ...]:
    """The ``phases:`` list of a policy file, checked (ValueError naming the phase)."""
    if raw is None:
        return ()
    if isinstance(raw, Phase):
        raw = [raw]
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"`phases`{where} must be a list of phases, got {brief(raw)}")
    if len(raw) > MAX_PHASES:
        raise ValueError(f"`phases`{where} lists {len(raw)} phases; a policy may have at most "
                         f"{MAX_PHASES}")
    phases = tuple(p if isinstance(p, Phase) else _phase(p, i, fp8_recipe, where)
                   for i, p in enumerate(raw, start=1))
    for unit in ("from_step", "from_fraction"):
        starts = [(i, getattr(p, unit)) for i, p in enumerate(phases, start=1)
                  if getattr(p, unit) is not None]
        for (i, a), (j, b) in zip(starts, starts[1:]):
            if not b > a:
                raise ValueError(f"phase {j}{where} starts at {unit} {b}, not after phase {i} "
                                 f"({unit} {a}): list phases in the order they start")
    return phases


def phase_starts(phases: tuple[Phase, ...], total_steps: int | None,
                 where: str = "") -> list[int]:
    """The step count at which each phase starts, the first phase's 0 included; checked to
    rise (ValueError naming the two phases otherwise)."""
    if total_steps is not None and not (_is_int(total_steps) and 1 <= total_steps < MAX_INT):
        raise ValueError(f"total_steps must be a positive integer, got {brief(total_steps)}")
    starts = [0] + [p.start(total_steps) for p in phases]
    for i in range(1, len(starts) - 1):
        if not starts[i + 1] > starts[i]:
            raise ValueError(
                f"with a run of {total_steps} steps, phase {i + 1}{where} "
                f"({phases[i].describe()}) starts at step {starts[i + 1]}, not after phase {i} "
                f"({phases[i - 1].describe()}, step {starts[i]}): reorder the phases or change "
                "where they start")
    return starts


def phase_index(starts: list[int], step: int) -> int:
    """Which phase is in force when ``step`` optimizer steps are done."""
    index = 0
    for i, s in enumerate(starts):
        if step >= s:
            index = i
    return index


def final_phase(fraction: float, target: Format | str, used: set[Format]) -> Phase | None:
    """A last phase from ``fraction`` of the run in which every layer in a format of fewer
    mantissa bits than ``target`` computes in ``target`` (``bf16``: the FP8 layers; ``fp32``:
    all); None when the policy has no such layer (the phase would change nothing). A layer
    whose unscaled format reaches further than ``target`` keeps it (:func:`kept_for_range`:
    bf16 under an fp16 final phase, whose largest value is 65504, not bf16's 3.4e38)."""
    target = Format.parse(target, where="for the final phase")
    if target.value not in FINAL_FORMATS:
        raise ValueError(f"a final phase switches to one of {', '.join(FINAL_FORMATS)}, not "
                         f"{target}")
    kept = kept_for_range(target, used)
    lower = sorted({f for f in used if _mantissa(f) < _mantissa(target) and f not in kept},
                   key=lambda f: f.label)
    if not lower:
        return None
    formats = {("scaled" if f.is_scaled else f.label): target for f in lower}
    return Phase(from_fraction=fraction, formats=formats, name="final")


def kept_for_range(target: Format, used: set[Format]) -> set[Format]:
    """The formats of ``used`` that a final phase in ``target`` leaves alone although they
    have fewer mantissa bits: unscaled ones whose range is wider than ``target``'s, so moving
    their layers would trade overflow for precision (bf16 under fp16). Scaled formats move:
    their scales fit the data to a range far narrower than fp16's."""
    return {f for f in used if not f.is_scaled and _mantissa(f) < _mantissa(target)
            and f.max_value > target.max_value}


def _mantissa(fmt: Format) -> int:
    """Mantissa bits of a format's forward GEMM operands (FP8's E4M3: 3, FP4's E2M1: 1)."""
    return {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7,
            FP4_E2M1: 1}.get(fmt.compute_dtype, 3)
