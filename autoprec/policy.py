"""The precision policy: which format each layer computes in, as a YAML file (schema 2; 4 with
phases; 5 with an engine other than ``auto``).

```yaml
autoprec: 2                     # schema version (version 1 files read unchanged)
model: {name: GPT2LMHeadModel, fingerprint: "sha256:..."}
default: bf16                   # every layer not matched below
layers:                         # fqn or glob -> format; the most specific match wins
  lm_head: fp32
  "transformer.h.*.mlp.*": fp8              # the default recipe below
  "model.layers.*.self_attn.k_proj": fp8:rowwise
fp8: {recipe: tensorwise}                  # what a bare `fp8` means in this file
scaled: {engine: torchao}                  # who runs scaled nn.Linear layers (schema 5; default auto)
loss_scaling: {init_scale: 65536, growth_interval: 2000}
tuned: {...}                    # provenance written by `tune`; informational
```

A policy may also say how its formats change over the run (``phases:``, schema 4; see
:mod:`autoprec.phases`), e.g. ``phases: [{from_fraction: 0.9, formats: {scaled: bf16}}]``.

Patterns (:mod:`autoprec.globs`): ``*`` matches within one dotted component, ``**`` across
components, ``?`` one character (not a dot); matched in linear time, at most MAX_PATTERN_CHARS
long. A module's format is its own best match (an exact fqn beats any glob; among globs, more literal
characters win, then fewer wildcards), else its nearest matched ancestor's, else ``default``.
No pattern matches the root module (fqn ``""``): ``default`` alone is its format.

A policy file is untrusted input: read in bounded size, depth and time by
:mod:`autoprec.policy_file` (a safe loader; no anchors, aliases or duplicate keys), then every
field checked here, ``tuned:`` included (see :func:`check_provenance`). A policy given as
data (a guard state's) is held to the same bounds before any of it is compiled
(:func:`check_bounds`).

This module is on the production path: it imports neither Optuna nor SciPy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import yaml
from torch import nn

from autoprec._util import (
    BOOL,
    INT,
    MAX_INT,
    NUM,
    PAIR,
    TEXT,
    atomic_write,
    brief,
    fits,
    number,
    quoted,
    shown,
)
from autoprec.certificate import Certificate
from autoprec.fingerprint import model_fingerprint
from autoprec.formats import Format, fp8_recipes, torchao_takes
from autoprec.globs import MAX_PATTERN_CHARS, Glob, specificity
from autoprec.phases import MAX_PHASES, Phase, final_phase, parse_phases, phase_starts
from autoprec.policy_file import (
    BOUNDS_WHY,
    MAX_POLICY_BYTES,
    MAX_POLICY_DEPTH,
    MAX_POLICY_VALUES,
    PATH_CHARS,
    PolicyFileError,
    read_policy_file,
)
from autoprec.stats import Interval

__all__ = [
    "Policy",
    "Budget",
    "Interval",
    "Provenance",
    "LossScaling",
    "PolicyError",
    "DEFAULT_MAX_LOSS_INCREASE",
    "DEFAULT_BIAS_BUDGET",
    "load_policy",
]

# Version 2 added FP8 recipes per layer (`fp8:rowwise`) and `fp8: {engine: ...}`; version 1
# files read unchanged (their `fp8` is tensorwise, the only recipe version 1 had).
# Version 3 added `phases` (written only by policies that have phases, so that a policy
# without them still reads in an autoprec that knows version 2).
# Version 4 gave a phase's `formats:` key `fp8` the meaning it has in every set of formats,
# every FP8 recipe, and added the key `scaled` (every scaled format); a version 3 file's `fp8`
# key meant every scaled format, so it reads as `scaled`.
# Version 5 moved the engine from `fp8: {engine: ...}` to `scaled: {engine: ...}`: it runs every
# scaled format's nn.Linear layers (MXFP8 too), not only FP8's. Versions 2-4 keep their spelling.
# A file is written with the lowest version that says all of it: 2, 4 with phases, 5 with an
# engine other than `auto`.
SCHEMA_VERSION = 5
_PLAIN_VERSION = 2
_PHASES_VERSION = 4
_READABLE_VERSIONS = (1, 2, 3, 4, 5)
_OLD_PHASE_KEYS = 3  # the last version whose phase key `fp8` meant every scaled format
_OLD_ENGINE_KEY = 4  # the last version whose engine was `fp8: {engine: ...}`
AUTO_ENGINE = "auto"  # the default: torchao where it takes the layer, else autoprec's kernels
ENGINES = (AUTO_ENGINE, "torchao", "autoprec")

_TOP_KEYS = ("autoprec", "model", "default", "layers", "fp8", "scaled", "loss_scaling", "phases",
             "tuned")
_MODEL_KEYS = ("name", "fingerprint")
_FP8_KEYS = ("recipe",)
_SCALED_KEYS = ("engine",)
# The error budget when nobody names one: a relative loss change of 1% vs FP32 on held-out
# batches. Every default budget (Budget, the CLI, validation, the profile's verdicts) reads it.
DEFAULT_MAX_LOSS_INCREASE = 0.01
# The largest gradient bias (relative to the gradient, over a few batches, on the run's trained
# state) that trains like BF16, as measured against certificates (autoprec.runtime.bias).
DEFAULT_BIAS_BUDGET = 0.21
_LOSS_SCALING_KEYS = ("init_scale", "growth_interval")


class _NoAliasDumper(yaml.SafeDumper):
    """Writes repeated values out in full: policy files have no anchors or aliases."""

    def ignore_aliases(self, data):
        return True


class PolicyError(ValueError):
    """A policy file or Policy that cannot be used as written; the message says the fix.

    A ``ValueError``: what :func:`load_policy`, :class:`Policy` and ``apply`` raise for a
    policy they cannot use.
    """


@dataclass(frozen=True)
class LossScaling:
    """GradScaler settings, used when any layer computes in fp16.

    Args:
        init_scale: first loss scale; 2**16 is ``torch.amp.GradScaler``'s default.
        growth_interval: steps without overflow before the scale doubles.

    Raises:
        PolicyError: ``init_scale`` is not a positive finite number, or ``growth_interval``
            not a positive integer.
    """

    init_scale: float = 65536.0
    growth_interval: int = 2000

    def __post_init__(self):
        scale = self.init_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not 0 < scale < MAX_INT:
            raise PolicyError(f"loss_scaling.init_scale must be a positive finite number, "
                              f"got {brief(scale)}.")
        growth = self.growth_interval
        if isinstance(growth, bool) or not isinstance(growth, (int, float)) \
                or not 1 <= growth < 2 ** 31 or int(growth) != growth:
            raise PolicyError(f"loss_scaling.growth_interval must be a positive integer, "
                              f"got {brief(growth)}.")


@dataclass(frozen=True)
class Budget:
    """How far a policy may move training from FP32: the constraints a tune searches under
    and the tolerance validation judges with.

    Args:
        max_loss_increase: relative loss change vs FP32 allowed on held-out batches (0.01 =
            1%).
        max_grad_error: relative L2 error of all parameter gradients vs FP32 allowed; None: no
            limit.
        max_grad_bias: gradient bias vs FP32 allowed (the error of the gradients summed over
            the held-out batches, relative to their sum: ``autoprec.runtime.bias``); None: no
            limit. It predicts the certificate when measured on a trained state (a tune's
            ``budget_at``), not at init.

    Raises:
        ValueError: a limit that is not a finite number >= 0.
    """

    max_loss_increase: float = DEFAULT_MAX_LOSS_INCREASE
    max_grad_error: float | None = 0.25
    max_grad_bias: float | None = None

    def __post_init__(self):
        for name in ("max_loss_increase", "max_grad_error", "max_grad_bias"):
            value = getattr(self, name)
            if value is None and name != "max_loss_increase":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not (0 <= value < math.inf):
                raise ValueError(f"{name} must be a finite number >= 0, got {brief(value)}.")
            object.__setattr__(self, name, float(value))

    @classmethod
    def trained(cls, max_loss_increase: float = DEFAULT_MAX_LOSS_INCREASE) -> Budget:
        """The budget measured against certificates: the gradient bias within
        :data:`DEFAULT_BIAS_BUDGET` (no separate gradient-error limit)."""
        return cls(max_loss_increase, max_grad_error=None, max_grad_bias=DEFAULT_BIAS_BUDGET)

    def allows(self, loss_increase: float, grad_error: float,
               grad_bias: float | None = None) -> bool:
        """Whether a policy with these measured numbers is within the budget (a bias limit
        with no bias measured is not met)."""
        if self.max_grad_bias is not None and (grad_bias is None or not math.isfinite(grad_bias)
                                               or grad_bias > self.max_grad_bias):
            return False
        return (math.isfinite(loss_increase) and math.isfinite(grad_error)
                and loss_increase <= self.max_loss_increase
                and (self.max_grad_error is None or grad_error <= self.max_grad_error))

    def to_dict(self) -> dict[str, Any]:
        out = {"max_loss_increase": self.max_loss_increase,
               "max_grad_error": self.max_grad_error}
        if self.max_grad_bias is not None:
            out["max_grad_bias"] = self.max_grad_bias
        return out


@dataclass(frozen=True)
class Provenance:
    """Where a tuned policy came from (the policy file's ``tuned:``), as typed data. Every
    field is optional: a hand-written or older policy has fewer."""

    device: str | None = None
    torch: str | None = None
    task: str | None = None
    # The budget the policy was tuned (and validated) under.
    budget: Budget | None = None
    # Speed-up over FP32 as re-timed at the end of the tune (or priced, with a target).
    speedup: Interval | None = None
    loss_increase: float | None = None
    grad_error: float | None = None
    # How the winner was decided: ties, re-measurements, noise; one sentence each.
    verdict: tuple[str, ...] = ()
    # Paired training runs against a reference and their verdict (autoprec.certification).
    certificate: Certificate | None = None
    # Everything else (study, fp8_runs_bf16, validation, guard, ...) as written.
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any],
                  where: Callable[[str], str] | None = None) -> Provenance:
        """The typed fields from a ``tuned:`` mapping, each checked: a value of the wrong type
        is a PolicyError naming ``tuned.<field>`` (``where(field)`` says the file and line).
        The rest is kept in ``extra`` as plain values; :func:`check_provenance` checks the
        parts of it that tune writes, as loading a policy file does."""
        if not isinstance(data, Mapping):
            raise _tuned_error("`tuned` must be a mapping, got " + brief(data), "", where)
        data = {k: _plain(v) for k, v in data.items()}
        try:
            strings = {}
            for key in ("device", "torch", "task"):
                value = data.pop(key, None)
                if value is not None and not isinstance(value, str):
                    raise _Bad(key, f"`tuned.{key}` must be text, got {brief(value)}")
                strings[key] = value
            budget_key = "budget" if data.get("budget") is not None else "objective"
            budget = data.pop("budget", None) or data.pop("objective", None)
            data.pop("objective", None)
            if budget is not None:
                budget = _budget(budget, budget_key)
            metrics = data.pop("metrics", None)
            if metrics is not None and not isinstance(metrics, Mapping):
                raise _Bad("metrics", f"`tuned.metrics` must be a mapping, got {brief(metrics)}")
            metrics = dict(metrics or {})
            found: dict[str, tuple[str, Any]] = {}
            for key in ("speedup_vs_fp32", "loss_increase", "grad_error"):
                value = data.pop(key, None)
                if value is not None:
                    found[key] = (key, value)
                elif metrics.get(key) is not None:  # older files kept them under `metrics`
                    found[key] = (f"metrics.{key}", metrics.pop(key))
            if metrics:
                data["metrics"] = metrics
            speedup, numbers = None, {}
            for key, (name, value) in found.items():
                try:
                    if key == "speedup_vs_fp32":
                        speedup = Interval.from_value(value, f"tuned.{name}")
                    else:
                        numbers[key] = number(value, f"tuned.{name}")
                except ValueError as e:
                    raise _Bad(name, str(e)) from None
            certificate = _certificate(data.pop("certificate", None))
            verdict = data.pop("verdict", None) or ()
            if isinstance(verdict, str):
                verdict = [verdict]
            if not isinstance(verdict, (list, tuple)) or \
                    not all(isinstance(v, str) for v in verdict):
                raise _Bad("verdict", "`tuned.verdict` must be a list of sentences (text), got "
                                      + brief(verdict))
        except _Bad as e:
            raise _tuned_error(e.message, e.key, where) from None
        return cls(device=strings["device"], torch=strings["torch"], task=strings["task"],
                   budget=budget, speedup=speedup, loss_increase=numbers.get("loss_increase"),
                   grad_error=numbers.get("grad_error"), verdict=tuple(verdict),
                   certificate=certificate, extra=data)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in (("device", self.device),
                                                  ("torch", self.torch), ("task", self.task))
                               if v is not None}
        if self.budget is not None:
            out["budget"] = self.budget.to_dict()
        if self.speedup is not None:
            out["speedup_vs_fp32"] = self.speedup.to_dict()
        if self.loss_increase is not None:
            out["loss_increase"] = round(self.loss_increase, 6)
        if self.grad_error is not None:
            out["grad_error"] = round(self.grad_error, 6)
        if self.verdict:
            out["verdict"] = list(self.verdict)
        if self.certificate is not None:
            out["certificate"] = self.certificate.to_dict()
        out.update(self.extra)
        return out


def _certificate(value: Any) -> Certificate | None:
    if value is None:
        return None
    try:
        return Certificate.from_dict(value)
    except ValueError as e:
        raise _Bad("certificate", str(e)) from None


class _Bad(Exception):
    """A bad field of ``tuned:`` (``key``: its top-level key, for the line number)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key, self.message = key.partition(".")[0], message.rstrip(".")


def _tuned_error(message: str, key: str, where: Callable[[str], str] | None) -> PolicyError:
    place = (where(f"tuned.{key}" if key else "tuned") if where else "").strip()
    return PolicyError(f"{message}{f' ({place})' if place else ''}; fix or delete it "
                       "(`tuned:` is the provenance tune writes; nothing trains by it).")


def _budget(value: Any, key: str) -> Budget:
    name = f"tuned.{key}"
    if not isinstance(value, Mapping):
        raise _Bad(key, f"`{name}` must be a mapping with max_loss_increase and "
                         f"max_grad_error, got {brief(value)}")
    known = [f.name for f in dataclasses.fields(Budget)]
    unknown = [k for k in value if k not in known]
    if unknown:
        raise _Bad(key, f"`{name}` has unknown key(s) {listed(unknown)}; its "
                         f"keys are {', '.join(known)}")
    try:
        return Budget(**value)
    except ValueError as e:
        raise _Bad(key, f"`{name}`: {e}") from None


# What `check_provenance` requires of the parts of `tuned:` that tune writes and `show` reads:
# field -> a type or a check; these sections are mappings of them.
_EXTRA_SCHEMA: dict[str, dict[str, str]] = {
    "study": {"name": TEXT, "trials": INT, "distinct": INT},
    "timing": {"rounds": INT, "aa_noise": NUM, "too_noisy": BOOL, "fp32_drift": PAIR,
               "run_interval": PAIR},
    "memory": {"predicted_peak_bytes": INT, "*": NUM},
    "validation": {"steps": INT, "gap": NUM, "noise": NUM, "passed": BOOL, "trial": INT,
                   "note": TEXT},
    "fp8_runs_bf16": {"*": TEXT},
    "bias": {"grad_bias": NUM, "step": INT, "run_steps": INT, "batches": INT},
}
# How deep a free-form value of `tuned:` may nest (the guard's events: a list of mappings).
_EXTRA_DEPTH = 3


def check_provenance(tuned: Mapping[str, Any],
                     where: Callable[[str], str] | None = None) -> Provenance:
    """Check a ``tuned:`` mapping as read from a file: the typed fields (see
    :meth:`Provenance.from_dict`), the sections tune writes (study, timing, memory,
    validation, fp8_runs_bf16, improvement_over_warm_start, guard: each field its type, null
    allowed) and everything else shallow plain data, so that ``show`` prints any of it.
    Returns the Provenance; a bad field is a PolicyError naming it."""
    prov = Provenance.from_dict(tuned, where)
    _descriptions = {PAIR: "a list of two numbers", INT: INT, NUM: NUM, TEXT: TEXT,
                     BOOL: BOOL}
    try:
        for key, value in prov.extra.items():
            name = f"tuned.{shown(key, 60)}"
            schema = _EXTRA_SCHEMA.get(key)
            if key == "improvement_over_warm_start":
                try:
                    Interval.from_value(value, name)
                except ValueError as e:
                    raise _Bad(key, str(e)) from None
            elif schema is not None:
                if not isinstance(value, Mapping):
                    raise _Bad(key, f"`{name}` must be a mapping, got {brief(value)}")
                for field_, item in value.items():
                    kind = schema.get(field_, schema.get("*"))
                    if item is None or kind is None and _shallow(item, _EXTRA_DEPTH - 1):
                        continue
                    if kind is None or not fits(item, kind):
                        raise _Bad(key, f"`{name}.{shown(field_, 60)}` must be "
                                        f"{_descriptions.get(kind, 'plain data')}, got "
                                        f"{brief(item)}")
            elif key == "guard" and not (isinstance(value, list)
                                         and all(isinstance(e, Mapping) for e in value)):
                raise _Bad(key, f"`{name}` must be a list of the guard's demotions (mappings), "
                                f"got {brief(value)}")
            if not _shallow(value, _EXTRA_DEPTH):
                raise _Bad(key, f"`{name}` must be plain values (text, numbers, true/false) "
                                f"in lists or mappings at most {_EXTRA_DEPTH} deep, got "
                                f"{brief(value)}")
    except _Bad as e:
        raise _tuned_error(e.message, e.key, where) from None
    return prov


def _shallow(value: Any, depth: int) -> bool:
    """Plain scalars (text, sane numbers, bools, null) nested at most ``depth`` levels."""
    if isinstance(value, (list, tuple)):
        return depth > 0 and all(_shallow(v, depth - 1) for v in value)
    if isinstance(value, Mapping):
        return depth > 0 and all(_shallow(k, 0) and _shallow(v, depth - 1)
                                 for k, v in value.items())
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) < MAX_INT
    return value is None or isinstance(value, (str, float, bool))


@dataclass(frozen=True)
class Policy:
    """A per-layer precision assignment. Build by hand, load with :func:`load_policy`, or get
    one from ``tune``.

    Args:
        default: format of every module no pattern matches (applied as a region around the
            root).
        layers: fqn or glob -> format, in file order; see the module docstring for matching.
        model_name: class name of the model the policy was made for (informational, shown in
            errors).
        fingerprint: ``"sha256:<hex>"`` of the model's layer list, see
            :func:`~autoprec.fingerprint.model_fingerprint`; None = not checked.
        fp8_recipe: the FP8 recipe a bare ``fp8`` means (torchao's names: tensorwise, rowwise,
            rowwise_with_gw_hp); a layer may name its own (``fp8:rowwise``).
        engine: who runs the scaled formats' ``nn.Linear`` layers: torchao's
            Float8Linear, and MXFP8Linear on a GPU with MX kernels (``"torchao"``),
            autoprec's own scaled matmul (``"autoprec"``), or torchao where it is installed
            and takes the layer (``"auto"``; MXFP8 only on Blackwell). The same numbers
            either way; everything that is not an ``nn.Linear``, and NVFP4, runs on
            autoprec's. The file writes it ``scaled: {engine: ...}`` (schema 5; an older
            file's ``fp8: {engine: ...}`` reads the same).
        loss_scaling: GradScaler settings for policies with fp16 layers (a
            :class:`LossScaling` or a mapping of its fields).
        tuned: provenance written by tune (device, torch version, objective, metrics);
            free-form.
        phases: later phases of the run (``autoprec.phases``); the fields above are the first
            phase.

    Raises:
        PolicyError: an unknown fp8 recipe or engine, a fingerprint not of the form
            ``sha256:<hex>``, a bad layer pattern or bad ``phases``.
        ValueError: a format that names none.
    """

    default: Format = Format.BF16
    layers: Mapping[str, Format] = field(default_factory=dict)
    model_name: str | None = None
    fingerprint: str | None = None
    fp8_recipe: str = "tensorwise"
    engine: str = AUTO_ENGINE
    loss_scaling: LossScaling = field(default_factory=LossScaling)
    tuned: Mapping[str, Any] | None = None
    phases: tuple[Phase, ...] = ()
    # Where the policy was read from, for error messages; not part of equality.
    source: str | None = field(default=None, compare=False)
    # YAML line of each layer pattern (and top-level key), for error messages.
    lines: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.fp8_recipe not in fp8_recipes():
            raise PolicyError(f"Unknown fp8 recipe {quoted(self.fp8_recipe)}{self._where('fp8')}; "
                              f"expected one of {', '.join(fp8_recipes())}.")
        if self.engine not in ENGINES:
            at = self._where("scaled" if "scaled" in self.lines else "fp8")  # where the file says it
            raise PolicyError(f"Unknown engine {quoted(self.engine)}{at}; "
                              f"expected one of {', '.join(ENGINES)}.")
        recipe = self.fp8_recipe
        object.__setattr__(self, "default", Format.parse(
            self.default, where=f"for `default`{self._where('default')}", fp8_recipe=recipe))
        layers = {}
        for pattern, fmt in dict(self.layers).items():
            self._check_pattern(pattern, fmt)
            try:
                layers[pattern] = Format.parse(fmt, fp8_recipe=recipe)
            except ValueError:  # again, saying where (built only then: thousands of entries)
                Format.parse(fmt, fp8_recipe=recipe,
                             where=f"for layer `{shown(pattern)}`{self._where(pattern)}")
                raise
        object.__setattr__(self, "layers", layers)
        if isinstance(self.loss_scaling, Mapping):
            object.__setattr__(self, "loss_scaling", LossScaling(**self.loss_scaling))
        if self.fingerprint is not None and not str(self.fingerprint).startswith("sha256:"):
            raise PolicyError(f"model.fingerprint {quoted(self.fingerprint)}{self._where('model')} "
                              "must look like `sha256:<hex>`; delete the key to skip the check.")
        try:
            phases = parse_phases(self.phases or None, recipe, self._where("phases"))
        except ValueError as e:
            raise PolicyError(f"Bad `phases`: {e}.") from None
        object.__setattr__(self, "phases", phases)
        for ph in phases:  # each phase's layer patterns checked like the first's
            for pattern, fmt in ph.layers.items():
                self._check_pattern(pattern, fmt)
        object.__setattr__(self, "_compiled", {p: Glob(p) for p in layers})
        # fqn -> its match: a model asks about the same few hundred names again and again
        object.__setattr__(self, "_matches", {})

    def _check_pattern(self, pattern: Any, fmt: Any) -> None:
        """A layer pattern is a non-empty string of at most MAX_PATTERN_CHARS."""
        if not isinstance(pattern, str) or not pattern.strip():
            quote = (f" (YAML reads an unquoted {quoted(pattern)} as a {type(pattern).__name__}: "
                     f'quote it, e.g. `"{shown(pattern)}": {shown(fmt)}`)'
                     if isinstance(pattern, (int, float, bool)) else "")
            raise PolicyError(f"Layer pattern {quoted(pattern)}{self._where(str(pattern))} must "
                              "be a non-empty string (a module fqn such as `lm_head` or a "
                              f"glob such as `transformer.h.*.mlp.*`){quote}.")
        if len(pattern) > MAX_PATTERN_CHARS:
            raise PolicyError(f"Layer pattern `{shown(pattern, 40)}`{self._where(pattern)} is "
                              f"{len(pattern)} characters; a pattern may have at most "
                              f"{MAX_PATTERN_CHARS} (module names are far shorter): shorten "
                              "it, e.g. with `*` for a component or `**` for several.")

    # ---------------------------------------------------------------- queries
    def _where(self, key: str | None = None) -> str:
        if self.source is None:
            return ""
        line = self.lines.get(key) if key is not None else None
        return f" in {shown(self.source, PATH_CHARS)}" + (f" line {line}" if line else "")

    def match(self, fqn: str) -> str | None:
        """The pattern that names ``fqn`` itself (most specific wins), or None. The root
        module (fqn ``""``) is never matched: ``default`` alone governs it."""
        cache = self._matches
        if fqn in cache:
            return cache[fqn]
        hits = [p for p, glob in self._compiled.items() if glob.fullmatch(fqn)] if fqn else []
        found = max(hits, key=specificity) if hits else None
        if len(cache) >= 1 << 16:  # names come from models, but bound it all the same
            cache.clear()
        cache[fqn] = found
        return found

    def format_for(self, fqn: str) -> Format:
        """The format module ``fqn`` computes in: its own match, else its nearest matched
        ancestor's, else the default."""
        name = fqn
        while True:
            pattern = self.match(name)
            if pattern is not None:
                return self.layers[pattern]
            if not name:
                return self.default
            name = name.rpartition(".")[0]

    def formats_used(self) -> set[Format]:
        """Every format some layer computes in, in any phase of the run (what each phase's
        policy holds, without building it)."""
        used = {self.default, *self.layers.values()}
        for ph in self.phases:
            used.add(ph.default if ph.default is not None else ph.maps(self.default))
            used |= {ph.maps(f) for p, f in self.layers.items() if p not in ph.layers}
            used |= set(ph.layers.values())
        return used

    # ---------------------------------------------------------------- phases
    def phase(self, index: int) -> Policy:
        """The policy in force during phase ``index`` (0: this one's own layers), as a policy
        without phases: the first phase's entries mapped through the phase's ``formats``, its
        own ``layers`` over them (see :mod:`autoprec.phases`)."""
        if index == 0:
            return dataclasses.replace(self, phases=()) if self.phases else self
        if not 1 <= index <= len(self.phases):
            raise IndexError(f"phase {index} of a policy with {len(self.phases) + 1} phases")
        ph = self.phases[index - 1]
        layers = {p: ph.maps(f) for p, f in self.layers.items()}
        layers.update(ph.layers)
        default = ph.default if ph.default is not None else ph.maps(self.default)
        return dataclasses.replace(self, default=default, layers=layers, phases=())

    def with_final_phase(self, fraction: float, fmt: Format | str = Format.BF16) -> Policy:
        """This policy with a last phase from ``fraction`` of the run (0.9: the last 10%) in
        which every layer in a format of fewer mantissa bits than ``fmt`` (bf16: the fp8
        layers) computes in ``fmt``, as NVIDIA's NVFP4 recipe runs the decay in BF16. The
        policy itself when no layer is below ``fmt`` (the phase would change nothing)."""
        try:
            phase = final_phase(fraction, fmt, self.formats_used())
        except ValueError as e:
            raise PolicyError(f"{e}.") from None
        return self if phase is None else dataclasses.replace(self, phases=(*self.phases, phase))

    def phase_starts(self, total_steps: int | None = None) -> list[int]:
        """The optimizer step count at which each phase starts (``[0, ...]``);
        ``total_steps``: the run's length, which phases by fraction need. A PolicyError
        says what is missing or out of order."""
        try:
            return phase_starts(self.phases, total_steps, self._where("phases"))
        except ValueError as e:
            raise PolicyError(f"{e}.") from None

    def uses(self, fmt: Format | str) -> bool:
        return Format.parse(fmt, fp8_recipe=self.fp8_recipe) in self.formats_used()

    @property
    def needs_loss_scaling(self) -> bool:
        """Whether any layer, in any phase, is in a format whose gradients need loss scaling
        (fp16): training needs an enabled GradScaler."""
        return any(f.needs_loss_scaling for f in self.formats_used())

    def resolve(self, model: nn.Module) -> tuple[dict[str, Format], list[str]]:
        """Map each module (by its canonical fqn, as ``named_modules()`` lists it) that a
        pattern names to its format, and list unused patterns. A module reachable at several
        paths (shared, tied) is named by any of them; two of its paths named with different
        formats are an error."""
        canonical = {id(m): fqn for fqn, m in model.named_modules()}
        assigned: dict[str, Format] = {}
        by: dict[str, str] = {}
        used: set[str] = set()
        for fqn, module in model.named_modules(remove_duplicate=False):
            pattern = self.match(fqn)
            if pattern is None:
                continue
            used.add(pattern)
            name, fmt = canonical[id(module)], self.layers[pattern]
            if name in assigned and assigned[name] is not fmt:
                raise PolicyError(
                    f"`{shown(fqn)}` and `{shown(by[name])}` are the same module, and the policy"
                    f"{self._where(pattern)} gives them {fmt.label} and {assigned[name].label}: give a "
                    "shared module one format.")
            if name not in assigned or fqn == name:
                assigned[name], by[name] = fmt, fqn
        return assigned, [p for p in self.layers if p not in used]

    def check_model(self, model: nn.Module, *, strict: bool = True) -> dict[str, Format]:
        """Check the policy against ``model``: fingerprint and patterns. Returns the resolved
        assignment. Mismatches raise PolicyError (``strict``) or warn."""
        problems = []
        if self.fingerprint is not None:
            actual = model_fingerprint(model)
            if actual != self.fingerprint:
                made_for = f" (made for {self.model_name})" if self.model_name else ""
                problems.append((
                    f"Policy{self._where('model')}{made_for} has fingerprint "
                    f"{self.fingerprint[:19]}… but the model {type(model).__name__} has "
                    f"{actual[:19]}…: its layers (names, kinds or weight shapes) differ.",
                    "Re-tune for this model, or pass strict=False to apply it anyway."))
        assigned, unused = self.resolve(model)
        for pattern in unused:
            names = [n for n, _ in model.named_modules() if n][:6]
            problems.append((
                f"Layer pattern `{shown(pattern)}`{self._where(pattern)} matches no module of "
                f"{type(model).__name__} (module names look like "
                f"{', '.join(shown(n, 60) for n in names)}, …).",
                "Fix or delete the pattern, or pass strict=False to ignore it."))
        for msg, fix in problems:
            if strict:
                raise PolicyError(f"{msg} {fix}")
            warnings.warn(f"{msg} Applied anyway (strict=False).", stacklevel=4)
        return assigned

    # ---------------------------------------------------------------- training helpers
    def grad_scaler(self, device: str | torch.device = "cuda") -> torch.amp.GradScaler:
        """The GradScaler this policy needs: enabled with ``loss_scaling`` settings when any
        layer is fp16, a disabled pass-through otherwise."""
        device = torch.device(device)
        return torch.amp.GradScaler(
            device.type, init_scale=self.loss_scaling.init_scale,
            growth_interval=int(self.loss_scaling.growth_interval),
            enabled=self.needs_loss_scaling)

    def module_filter_fn(self, recipe: str | None = None) -> Callable[[nn.Module, str], bool]:
        """A torchao-style ``(module, fqn) -> bool`` that selects exactly this policy's fp8
        ``nn.Linear`` layers, or those of one ``recipe`` (for
        ``convert_to_float8_training(module_filter_fn=..., config=Float8LinearConfig
        .from_recipe_name(recipe))``): the layers ``apply`` gives torchao. A Linear whose
        in/out features are not multiples of 16 is left out: the FP8 kernel cannot take it
        (torchao's own auto filter skips it too), so it runs in bf16; so is a recipe torchao
        has no name for (:func:`autoprec.formats.torchao_takes`, the one rule)."""

        def keep(module: nn.Module, fqn: str) -> bool:
            if not isinstance(module, nn.Linear):
                return False
            fmt = self.format_for(fqn)
            return torchao_takes(fmt, linear=True, in_features=module.in_features,
                                 out_features=module.out_features) and \
                (recipe is None or fmt.numerics.torchao_recipe == recipe)
        return keep

    def digest(self) -> str:
        """``sha256:<hex>`` of what the policy computes and for which model: every key of its
        file but ``tuned:`` (the provenance), layer order aside. A certificate names the digest
        it certified; an edited policy has another."""
        doc = {k: v for k, v in self.to_dict().items() if k not in ("tuned", "autoprec", "scaled")}
        # the engine spelled as schemas 2-4 wrote it, whatever the file's schema: the digest is
        # of what the policy computes, so a certificate made before schema 5 still covers it
        doc["fp8"] = {"recipe": self.fp8_recipe, "engine": self.engine}
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return f"sha256:{hashlib.sha256(text.encode()).hexdigest()}"

    def with_certificate(self, certificate: Certificate) -> Policy:
        """A copy carrying ``certificate`` in its provenance (``tuned.certificate``)."""
        tuned = dict(self.tuned or {})
        tuned["certificate"] = certificate.to_dict()
        return dataclasses.replace(self, tuned=tuned)

    def certified(self) -> tuple[Certificate | None, bool]:
        """The certificate in the provenance (None: none), and whether it covers the policy
        as it is now (False: edited after certification)."""
        cert = self.provenance.certificate
        return cert, cert is not None and cert.covers(self.digest())

    def with_layers(self, updates: Mapping[str, Format | str], **changes) -> Policy:
        """A copy with ``updates`` added to (or overriding) the layer map."""
        layers = dict(self.layers)
        layers.update({k: Format.parse(v, fp8_recipe=self.fp8_recipe) for k, v in updates.items()})
        return dataclasses.replace(self, layers=layers, **changes)

    # ---------------------------------------------------------------- YAML
    def to_dict(self) -> dict[str, Any]:
        version = (SCHEMA_VERSION if self.engine != AUTO_ENGINE else
                   _PHASES_VERSION if self.phases else _PLAIN_VERSION)
        out: dict[str, Any] = {"autoprec": version}
        if self.model_name is not None or self.fingerprint is not None:
            model = {}
            if self.model_name is not None:
                model["name"] = self.model_name
            if self.fingerprint is not None:
                model["fingerprint"] = self.fingerprint
            out["model"] = model
        out["default"] = self._spell(self.default)
        out["layers"] = {p: self._spell(f) for p, f in self.layers.items()}
        out["fp8"] = {"recipe": self.fp8_recipe}
        if self.engine != AUTO_ENGINE:
            out["scaled"] = {"engine": self.engine}
        ls = self.loss_scaling
        out["loss_scaling"] = {"init_scale": ls.init_scale,
                               "growth_interval": int(ls.growth_interval)}
        if self.phases:
            out["phases"] = [p.to_dict(self._spell) for p in self.phases]
        if self.tuned is not None:
            out["tuned"] = _plain(self.tuned)
        return out

    def _spell(self, fmt: Format) -> str:
        """How the file writes ``fmt``: ``fp8`` for the policy's default recipe, ``fp8:<recipe>``
        for the others (in a per-GEMM mix too: each part as it would be written alone), so the
        file reads back the same whatever its default recipe."""
        if fmt.parts:
            return "/".join(self._spell(p) for p in fmt.parts)
        if fmt.recipe is not None:
            return "fp8" if fmt.recipe == self.fp8_recipe else f"fp8:{fmt.recipe}"
        return fmt.value

    def to_yaml(self) -> str:
        doc = self.to_dict()
        header = (f"# autoprec precision policy (schema {doc['autoprec']}): `autoprec show` "
                  "prints it as a table\n")
        return header + yaml.dump(doc, Dumper=_NoAliasDumper, sort_keys=False,
                                  default_flow_style=False, allow_unicode=True, width=100)

    def save(self, path: str | os.PathLike) -> None:
        """Write the policy as YAML; ``load_policy(path)`` gives back an equal Policy."""
        atomic_write(path, self.to_yaml())  # never leave a half-written policy behind

    @property
    def provenance(self) -> Provenance:
        """``tuned`` as typed data (empty for a hand-written policy)."""
        return Provenance.from_dict(self.tuned or {})

    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None,
                  lines: Mapping[str, int] | None = None) -> Policy:
        """Validate a parsed YAML mapping (schema 1 to 5) and build the Policy."""
        lines = dict(lines or {})
        src = f" in {shown(source, PATH_CHARS)}" if source else ""

        def where(key):
            line = lines.get(key)
            return src + (f" line {line}" if line else "")

        if not isinstance(data, Mapping):
            raise PolicyError(f"A policy{src} must be a YAML mapping with keys "
                              f"{', '.join(_TOP_KEYS)}; got {type(data).__name__}.")
        check_bounds(data, f"The policy{src}")  # before any of it is compiled
        if "autoprec" not in data:
            raise PolicyError(f"Missing schema key `autoprec: {SCHEMA_VERSION}`{src}; a policy "
                              "file starts with it.")
        _check_version(data, where)
        _reject_unknown(data, _TOP_KEYS, "top level", where)
        model = data.get("model") or {}
        _require_mapping(model, "model", where)
        _reject_unknown(model, _MODEL_KEYS, "`model`", where, "model")
        fp8, engine = _fp8_and_engine(data, where)
        ls = data.get("loss_scaling") or {}
        _require_mapping(ls, "loss_scaling", where)
        _reject_unknown(ls, _LOSS_SCALING_KEYS, "`loss_scaling`", where, "loss_scaling")
        layers = data.get("layers") or {}
        _require_mapping(layers, "layers", where)
        phases = data.get("phases")
        tuned = data.get("tuned")
        if tuned is not None:
            _require_mapping(tuned, "tuned", where)
            # provenance is checked like the rest: `show` prints every field of it
            check_provenance(tuned, lambda key: where(key if key in lines else "tuned"))
        if "default" not in data:
            raise PolicyError(f"Missing `default:`{src}: the format of every layer not listed "
                              "under `layers` (fp32, bf16, fp16, fp8 or fp8:<recipe>).")
        try:
            loss_scaling = LossScaling(**ls)
        except TypeError as e:
            raise PolicyError(f"Bad `loss_scaling`{where('loss_scaling')}: {e}") from e
        except PolicyError as e:
            raise PolicyError(f"{e}{where('loss_scaling')}") from None
        try:
            return cls(default=data["default"], layers=dict(layers),
                       model_name=model.get("name"), fingerprint=model.get("fingerprint"),
                       fp8_recipe=fp8.get("recipe", "tensorwise"),
                       engine=engine, loss_scaling=loss_scaling,
                       tuned=tuned, phases=_read_as_now(phases, data["autoprec"], where("phases")) or (),
                       source=source, lines=lines)
        except ValueError as e:
            raise PolicyError(str(e)) from None


def _fp8_and_engine(data: Mapping[str, Any], where: Callable[[str], str]) -> tuple[Mapping, Any]:
    """The file's ``fp8:`` mapping and its engine, as its version spells the engine: ``scaled:
    {engine: ...}`` from version 5, ``fp8: {engine: ...}`` before (a key each version lacks is
    refused, saying which version has it)."""
    version = data["autoprec"]
    fp8, scaled = data.get("fp8") or {}, data.get("scaled") or {}
    _require_mapping(fp8, "fp8", where)
    _require_mapping(scaled, "scaled", where)
    if version <= _OLD_ENGINE_KEY:
        if "scaled" in data:
            raise PolicyError(f"`scaled: {{engine: ...}}`{where('scaled')} needs schema "
                              f"{SCHEMA_VERSION} (schema {version} writes it `fp8: {{engine: "
                              f"...}}`): write `autoprec: {SCHEMA_VERSION}`.")
        _reject_unknown(fp8, (*_FP8_KEYS, "engine"), "`fp8`", where, "fp8")
        return fp8, fp8.get("engine", AUTO_ENGINE)
    if "engine" in fp8:
        raise PolicyError(f"`fp8: {{engine: ...}}`{where('fp8')} is written `scaled: {{engine: "
                          f"...}}` in schema {version}: the engine runs every scaled format's "
                          "nn.Linear layers; move it there.")
    _reject_unknown(fp8, _FP8_KEYS, "`fp8`", where, "fp8")
    _reject_unknown(scaled, _SCALED_KEYS, "`scaled`", where, "scaled")
    return fp8, scaled.get("engine", AUTO_ENGINE)


def _check_version(data: Mapping[str, Any], where: Callable[[str], str]) -> None:
    version = data["autoprec"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise PolicyError(f"Schema version `autoprec: {shown(version, 40)}`{where('autoprec')} must be "
                          f"an integer: {_PLAIN_VERSION}, {_PHASES_VERSION} for a policy with "
                          f"phases, {SCHEMA_VERSION} with `scaled: {{engine: ...}}` (write "
                          f"`autoprec: {_PLAIN_VERSION}`, no quotes).")
    if version not in _READABLE_VERSIONS:
        raise PolicyError(f"Unknown policy schema version {shown(version, 40)}{where('autoprec')}; "
                          f"this autoprec reads versions "
                          f"{', '.join(map(str, _READABLE_VERSIONS))}. Upgrade autoprec or "
                          "regenerate the policy.")
    if data.get("phases") is not None and version < 3:
        raise PolicyError(f"`phases`{where('phases')} needs schema {_PHASES_VERSION}: write "
                          f"`autoprec: {_PHASES_VERSION}`.")


def _read_as_now(phases: Any, version: int, at: str) -> Any:
    """A file's ``phases:`` as this schema reads them: in a version 3 file, a phase's
    ``formats:`` key ``fp8`` meant every scaled format, which is now written ``scaled``, a key
    version 3 did not have (anything malformed is left for the phases' own checks)."""
    if version > _OLD_PHASE_KEYS or not isinstance(phases, list):
        return phases
    out = []
    for phase in phases:
        keys = phase.get("formats") if isinstance(phase, Mapping) else None
        if isinstance(keys, Mapping):
            words = [k.strip().lower() if isinstance(k, str) else k for k in keys]
            if "scaled" in words:
                raise PolicyError(f"A phase's `formats:` key `scaled` needs schema "
                                  f"{_PHASES_VERSION}{at} (in schema {version}, `fp8` meant every "
                                  f"scaled format): write `autoprec: {_PHASES_VERSION}`.")
            renamed = {("scaled" if w == "fp8" else k): v
                       for k, w, v in zip(keys, words, keys.values())}
            if len(renamed) == len(keys):  # else `fp8` twice: the phases' check says so
                phase = {**phase, "formats": renamed}
        out.append(phase)
    return out


def _plain(value: Any) -> Any:
    """Provenance as plain YAML types (Formats and tuples become strings and lists)."""
    if isinstance(value, Format):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        return str(value)  # str subclasses such as torch.__version__ are not safe-dumpable
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    return str(value)


def _require_mapping(value, key, where):
    if not isinstance(value, Mapping):
        raise PolicyError(f"`{key}`{where(key)} must be a mapping, got {brief(value)}.")


def _reject_unknown(data, known, what, where, line_key=None):
    unknown = [k for k in data if k not in known]
    if unknown:
        key = line_key or unknown[0]
        raise PolicyError(f"Unknown key(s) {listed(unknown)} at {what}"
                          f"{where(key if isinstance(key, str) else None)}; valid keys are "
                          f"{', '.join(known)}.")


def listed(values: list[Any], most: int = 3) -> str:
    """Values from a file for a message: the first ``most`` quoted (bounded, escaped), then how
    many more."""
    shown_ = ", ".join(quoted(v, 40) for v in values[:most])
    return shown_ + (f" and {len(values) - most} more" if len(values) > most else "")


def load_policy(path: str | os.PathLike) -> Policy:
    """Read a policy file (at most MAX_POLICY_BYTES, MAX_POLICY_LINES lines and
    MAX_POLICY_VALUES values, ``yaml.SafeLoader`` only, parsed once; no anchors or aliases, no
    duplicate keys, nesting at most MAX_POLICY_DEPTH: :mod:`autoprec.policy_file`) and
    validate it against the policy schema (version 1, 2 or 3), its ``tuned:`` provenance
    included.

    Args:
        path: the policy YAML file.

    Returns:
        The :class:`Policy` it describes.

    Raises:
        PolicyError: a file that cannot be read, or breaks a bound or the schema; the message
            says where and the fix.
    """
    path = os.fspath(path)
    try:
        data, lines = read_policy_file(path)
    except PolicyFileError as e:
        raise PolicyError(str(e)) from None
    return Policy.from_dict(data, source=path, lines=lines)


def check_bounds(data: Any, what: str) -> None:
    """That a policy given as parsed data (the one a guard state embeds) is held to a policy
    file's bounds: at most MAX_POLICY_VALUES values (keys included), MAX_POLICY_BYTES
    characters of text, lists and mappings nested at most MAX_POLICY_DEPTH deep and at most
    MAX_PHASES phases. A PolicyError naming ``what`` else, found before any of it is compiled
    (the walk stops at the first bound crossed, and a collection is counted before its items
    are visited)."""
    values, chars, stack = 1, 0, [(data, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            chars += len(item)
            if chars > MAX_POLICY_BYTES:
                raise PolicyError(f"{what} holds more than {MAX_POLICY_BYTES // 2 ** 20} MiB of "
                                  f"text, the most a policy file may: {BOUNDS_WHY}")
        elif isinstance(item, (Mapping, list, tuple)):
            if depth >= MAX_POLICY_DEPTH:
                raise PolicyError(f"{what}: lists or mappings nest deeper than "
                                  f"{MAX_POLICY_DEPTH} levels; a policy needs a few.")
            values += 2 * len(item) if isinstance(item, Mapping) else len(item)
            if values > MAX_POLICY_VALUES:
                raise PolicyError(f"{what} holds more than {MAX_POLICY_VALUES} values (scalars, "
                                  f"lists, mappings), the most a policy may: {BOUNDS_WHY}")
            children = [x for kv in item.items() for x in kv] if isinstance(item, Mapping) \
                else item
            stack.extend((x, depth + 1) for x in children)
    phases = data.get("phases") if isinstance(data, Mapping) else None
    if isinstance(phases, (list, tuple)) and len(phases) > MAX_PHASES:
        raise PolicyError(f"{what}: `phases` lists {len(phases)} phases; a policy may have at "
                          f"most {MAX_PHASES}.")

