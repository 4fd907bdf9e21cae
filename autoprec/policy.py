"""The precision policy: which format each layer computes in, as a YAML file (schema 2).

```yaml
autoprec: 2                     # schema version (version 1 files read unchanged)
model: {name: GPT2LMHeadModel, fingerprint: "sha256:..."}
default: bf16                   # every layer not matched below
layers:                         # fqn or glob -> format; the most specific match wins
  lm_head: fp32
  "transformer.h.*.mlp.*": fp8              # the default recipe below
  "model.layers.*.self_attn.k_proj": fp8:rowwise
fp8: {recipe: tensorwise, engine: auto}     # what bare `fp8` means; who runs nn.Linear
loss_scaling: {init_scale: 65536, growth_interval: 2000}
tuned: {...}                    # provenance written by `tune`; informational
```

Patterns: ``*`` matches within one dotted component, ``**`` across components, ``?`` one
character. A module's format is its own best match (an exact fqn beats any glob; among
globs, more literal characters win, then fewer wildcards), else its nearest matched
ancestor's, else ``default``.

This module is on the production path: it imports neither Optuna nor SciPy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import yaml
from torch import nn

from autoprec._util import atomic_write
from autoprec.formats import FP8_RECIPES, Format

__all__ = [
    "Policy",
    "Budget",
    "Interval",
    "Provenance",
    "LossScaling",
    "PolicyError",
    "SCHEMA_VERSION",
    "load_policy",
    "model_fingerprint",
]

# Version 2 added FP8 recipes per layer (`fp8:rowwise`) and `fp8: {engine: ...}`; version 1
# files read unchanged (their `fp8` is tensorwise, the only recipe version 1 had).
SCHEMA_VERSION = 2
_READABLE_VERSIONS = (1, 2)
FP8_ENGINES = ("auto", "torchao", "autoprec")

_TOP_KEYS = ("autoprec", "model", "default", "layers", "fp8", "loss_scaling", "tuned")
_MODEL_KEYS = ("name", "fingerprint")
_FP8_KEYS = ("recipe", "engine")
_LOSS_SCALING_KEYS = ("init_scale", "growth_interval")


class _NoAliasDumper(yaml.SafeDumper):
    """Writes repeated values out in full: policy files have no anchors or aliases."""

    def ignore_aliases(self, data):
        return True


class PolicyError(ValueError):
    """A policy file or Policy that cannot be used as written; the message says the fix."""


@dataclass(frozen=True)
class LossScaling:
    """GradScaler settings, used when any layer computes in fp16."""

    # First loss scale; 2**16 is torch.amp.GradScaler's default.
    init_scale: float = 65536.0
    # Steps without overflow before the scale doubles.
    growth_interval: int = 2000

    def __post_init__(self):
        scale = self.init_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not 0 < scale < math.inf:
            raise PolicyError(f"loss_scaling.init_scale must be a positive finite number, "
                              f"got {scale!r}.")
        growth = self.growth_interval
        if isinstance(growth, bool) or not isinstance(growth, (int, float)) \
                or int(growth) != growth or growth < 1:
            raise PolicyError(f"loss_scaling.growth_interval must be a positive integer, "
                              f"got {growth!r}.")


@dataclass(frozen=True)
class Budget:
    """How far a policy may move training from FP32: the constraints a tune searches under
    and the tolerance validation judges with."""

    # Relative loss change vs FP32 allowed on held-out batches (0.01 = 1%).
    max_loss_increase: float = 0.01
    # Relative L2 error of all parameter gradients vs FP32 allowed; None: no limit.
    max_grad_error: float | None = 0.25

    def __post_init__(self):
        for name in ("max_loss_increase", "max_grad_error"):
            value = getattr(self, name)
            if value is None and name == "max_grad_error":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not (0 <= value < math.inf):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
            object.__setattr__(self, name, float(value))

    def allows(self, loss_increase: float, grad_error: float) -> bool:
        """Whether a policy with these measured numbers is within the budget."""
        return (math.isfinite(loss_increase) and math.isfinite(grad_error)
                and loss_increase <= self.max_loss_increase
                and (self.max_grad_error is None or grad_error <= self.max_grad_error))

    def to_dict(self) -> dict[str, Any]:
        return {"max_loss_increase": self.max_loss_increase,
                "max_grad_error": self.max_grad_error}


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
    def from_value(cls, value: Any) -> Interval | None:
        """From a file: a mapping as to_dict writes it, or a bare number (older files)."""
        if value is None:
            return None
        if isinstance(value, Mapping):
            v = float(value["value"])
            return cls(v, float(value.get("low", v)), float(value.get("high", v)),
                       int(value.get("rounds", 0)))
        v = float(value)
        return cls(v, v, v, 0)


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
    # Everything else (study, fp8_runs_bf16, validation, guard, ...) as written.
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Provenance:
        data = dict(data)
        budget = data.pop("budget", None) or data.pop("objective", None)
        metrics = dict(data.pop("metrics", None) or {})
        speedup = data.pop("speedup_vs_fp32", None)
        if speedup is None:
            speedup = metrics.pop("speedup_vs_fp32", None)
        loss = data.pop("loss_increase", metrics.pop("loss_increase", None))
        grad = data.pop("grad_error", metrics.pop("grad_error", None))
        if metrics:
            data["metrics"] = metrics
        verdict = data.pop("verdict", None) or ()
        return cls(device=data.pop("device", None), torch=data.pop("torch", None),
                   task=data.pop("task", None),
                   budget=Budget(**budget) if isinstance(budget, Mapping) else None,
                   speedup=Interval.from_value(speedup),
                   loss_increase=None if loss is None else float(loss),
                   grad_error=None if grad is None else float(grad),
                   verdict=tuple(verdict if isinstance(verdict, (list, tuple)) else [verdict]),
                   extra=data)

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
        out.update(self.extra)
        return out


def _glob_regex(pattern: str) -> re.Pattern:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^.]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^.]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?")


def _specificity(pattern: str) -> tuple[int, int, int]:
    wild = pattern.count("*") + pattern.count("?")
    literal = len(pattern) - wild
    return (0 if _is_glob(pattern) else 1, literal, -wild)


@dataclass(frozen=True)
class Policy:
    """A per-layer precision assignment. Build by hand, load with :func:`load_policy`, or get
    one from ``tune``."""

    # Format of every module no pattern matches (applied as a region around the root).
    default: Format = Format.BF16
    # fqn or glob -> format, in file order; see the module docstring for matching.
    layers: Mapping[str, Format] = field(default_factory=dict)
    # Class name of the model the policy was made for (informational, shown in errors).
    model_name: str | None = None
    # "sha256:<hex>" of the model's layer list, see model_fingerprint(); None = not checked.
    fingerprint: str | None = None
    # The FP8 recipe a bare `fp8` means (torchao's names: tensorwise, rowwise,
    # rowwise_with_gw_hp); a layer may name its own (`fp8:rowwise`).
    fp8_recipe: str = "tensorwise"
    # Who runs fp8 nn.Linear layers: torchao's Float8Linear ("torchao"), autoprec's own FP8
    # matmul ("autoprec"), or torchao where it is installed ("auto"). The same numbers either
    # way; everything that is not an nn.Linear always runs on autoprec's.
    fp8_engine: str = "auto"
    # GradScaler settings for policies with fp16 layers.
    loss_scaling: LossScaling = field(default_factory=LossScaling)
    # Provenance written by tune (device, torch version, objective, metrics); free-form.
    tuned: Mapping[str, Any] | None = None
    # Where the policy was read from, for error messages; not part of equality.
    source: str | None = field(default=None, compare=False)
    # YAML line of each layer pattern (and top-level key), for error messages.
    lines: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.fp8_recipe not in FP8_RECIPES:
            raise PolicyError(f"Unknown fp8 recipe {self.fp8_recipe!r}{self._where('fp8')}; "
                              f"expected one of {', '.join(FP8_RECIPES)}.")
        if self.fp8_engine not in FP8_ENGINES:
            raise PolicyError(f"Unknown fp8 engine {self.fp8_engine!r}{self._where('fp8')}; "
                              f"expected one of {', '.join(FP8_ENGINES)}.")
        recipe = self.fp8_recipe
        object.__setattr__(self, "default", Format.parse(
            self.default, where=f"for `default`{self._where('default')}", fp8_recipe=recipe))
        layers = {}
        for pattern, fmt in dict(self.layers).items():
            if not isinstance(pattern, str) or not pattern.strip():
                raise PolicyError(f"Layer pattern {pattern!r}{self._where(pattern)} must be a "
                                  "non-empty string (a module fqn such as `lm_head` or a glob "
                                  "such as `transformer.h.*.mlp.*`).")
            layers[pattern] = Format.parse(fmt, fp8_recipe=recipe,
                                           where=f"for layer `{pattern}`{self._where(pattern)}")
        object.__setattr__(self, "layers", layers)
        if isinstance(self.loss_scaling, Mapping):
            object.__setattr__(self, "loss_scaling", LossScaling(**self.loss_scaling))
        if self.fingerprint is not None and not str(self.fingerprint).startswith("sha256:"):
            raise PolicyError(f"model.fingerprint {self.fingerprint!r}{self._where('model')} "
                              "must look like `sha256:<hex>`; delete the key to skip the check.")
        compiled = {p: _glob_regex(p) for p in layers}
        object.__setattr__(self, "_compiled", compiled)

    # ---------------------------------------------------------------- queries
    def _where(self, key: str | None = None) -> str:
        if self.source is None:
            return ""
        line = self.lines.get(key) if key is not None else None
        return f" in {self.source}" + (f" line {line}" if line else "")

    def match(self, fqn: str) -> str | None:
        """The pattern that names ``fqn`` itself (most specific wins), or None."""
        hits = [p for p, rx in self._compiled.items() if rx.fullmatch(fqn)]
        if not hits:
            return None
        return max(hits, key=_specificity)

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
        return {self.default, *self.layers.values()}

    def uses(self, fmt: Format | str) -> bool:
        return Format.parse(fmt, fp8_recipe=self.fp8_recipe) in self.formats_used()

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
                    f"`{fqn}` and `{by[name]}` are the same module, and the policy"
                    f"{self._where(pattern)} gives them {fmt} and {assigned[name]}: give a "
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
                f"Layer pattern `{pattern}`{self._where(pattern)} matches no module of "
                f"{type(model).__name__} (module names look like {', '.join(names)}, …).",
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
            enabled=self.uses(Format.FP16))

    def module_filter_fn(self, recipe: str | None = None) -> Callable[[nn.Module, str], bool]:
        """A torchao-style ``(module, fqn) -> bool`` that selects exactly this policy's fp8
        ``nn.Linear`` layers, or those of one ``recipe`` (for
        ``convert_to_float8_training(module_filter_fn=..., config=Float8LinearConfig
        .from_recipe_name(recipe))``): the layers ``apply`` gives torchao. A Linear whose
        in/out features are not multiples of 16 is left out: the FP8 kernel cannot take it
        (torchao's own auto filter skips it too), so it runs in bf16."""
        def keep(module: nn.Module, fqn: str) -> bool:
            if not isinstance(module, nn.Linear) or module.in_features % 16 or \
                    module.out_features % 16:
                return False
            fmt = self.format_for(fqn)
            return fmt.is_fp8 and (recipe is None or fmt.recipe == recipe)
        return keep

    def with_layers(self, updates: Mapping[str, Format | str], **changes) -> Policy:
        """A copy with ``updates`` added to (or overriding) the layer map."""
        layers = dict(self.layers)
        layers.update({k: Format.parse(v, fp8_recipe=self.fp8_recipe) for k, v in updates.items()})
        return dataclasses.replace(self, layers=layers, **changes)

    # ---------------------------------------------------------------- YAML
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"autoprec": SCHEMA_VERSION}
        if self.model_name is not None or self.fingerprint is not None:
            model = {}
            if self.model_name is not None:
                model["name"] = self.model_name
            if self.fingerprint is not None:
                model["fingerprint"] = self.fingerprint
            out["model"] = model
        out["default"] = self._spell(self.default)
        out["layers"] = {p: self._spell(f) for p, f in self.layers.items()}
        out["fp8"] = {"recipe": self.fp8_recipe, "engine": self.fp8_engine}
        ls = self.loss_scaling
        out["loss_scaling"] = {"init_scale": ls.init_scale,
                               "growth_interval": int(ls.growth_interval)}
        if self.tuned is not None:
            out["tuned"] = _plain(self.tuned)
        return out

    def _spell(self, fmt: Format) -> str:
        """How the file writes ``fmt``: ``fp8`` for the policy's default recipe, ``fp8:<recipe>``
        for the others, so the file reads back the same whatever its default recipe."""
        if fmt.is_fp8:
            return "fp8" if fmt.recipe == self.fp8_recipe else f"fp8:{fmt.recipe}"
        return fmt.value

    def to_yaml(self) -> str:
        header = (f"# autoprec precision policy (schema {SCHEMA_VERSION}): `autoprec show` prints "
                  "it as a table\n")
        return header + yaml.dump(self.to_dict(), Dumper=_NoAliasDumper, sort_keys=False,
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
        """Validate a parsed YAML mapping (schema 1 or 2) and build the Policy."""
        lines = dict(lines or {})
        src = f" in {source}" if source else ""

        def where(key):
            line = lines.get(key)
            return src + (f" line {line}" if line else "")

        if not isinstance(data, Mapping):
            raise PolicyError(f"A policy{src} must be a YAML mapping with keys "
                              f"{', '.join(_TOP_KEYS)}; got {type(data).__name__}.")
        if "autoprec" not in data:
            raise PolicyError(f"Missing schema key `autoprec: {SCHEMA_VERSION}`{src}; a policy "
                              "file starts with it.")
        version = data["autoprec"]
        if isinstance(version, bool) or not isinstance(version, int):
            raise PolicyError(f"Schema version `autoprec: {version!r}`{where('autoprec')} must be "
                              f"the integer {SCHEMA_VERSION} (write `autoprec: {SCHEMA_VERSION}`, "
                              "no quotes).")
        if version not in _READABLE_VERSIONS:
            raise PolicyError(f"Unknown policy schema version {version!r}{where('autoprec')}; "
                              f"this autoprec reads versions "
                              f"{', '.join(map(str, _READABLE_VERSIONS))}. Upgrade autoprec or "
                              "regenerate the policy.")
        _reject_unknown(data, _TOP_KEYS, "top level", where)
        model = data.get("model") or {}
        _require_mapping(model, "model", where)
        _reject_unknown(model, _MODEL_KEYS, "`model`", where, "model")
        fp8 = data.get("fp8") or {}
        _require_mapping(fp8, "fp8", where)
        _reject_unknown(fp8, _FP8_KEYS, "`fp8`", where, "fp8")
        ls = data.get("loss_scaling") or {}
        _require_mapping(ls, "loss_scaling", where)
        _reject_unknown(ls, _LOSS_SCALING_KEYS, "`loss_scaling`", where, "loss_scaling")
        layers = data.get("layers") or {}
        _require_mapping(layers, "layers", where)
        tuned = data.get("tuned")
        if tuned is not None:
            _require_mapping(tuned, "tuned", where)
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
                       fp8_engine=fp8.get("engine", "auto"), loss_scaling=loss_scaling,
                       tuned=tuned, source=source, lines=lines)
        except ValueError as e:
            raise PolicyError(str(e)) from None


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
        raise PolicyError(f"`{key}`{where(key)} must be a mapping, got "
                          f"{type(value).__name__} {value!r}.")


def _reject_unknown(data, known, what, where, line_key=None):
    unknown = [k for k in data if k not in known]
    if unknown:
        key = line_key or unknown[0]
        raise PolicyError(f"Unknown key(s) {', '.join(map(repr, unknown))} at {what}"
                          f"{where(key)}; valid keys are {', '.join(known)}.")


def _line_map(text: str) -> dict[str, int]:
    """1-based line of each top-level key and each `layers` pattern (safe composer only)."""
    lines: dict[str, int] = {}
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return lines
    if not isinstance(root, yaml.MappingNode):
        return lines
    for key_node, value_node in root.value:
        key = key_node.value
        lines[key] = key_node.start_mark.line + 1
        if key == "layers" and isinstance(value_node, yaml.MappingNode):
            for k, _ in value_node.value:
                lines[k.value] = k.start_mark.line + 1
    return lines


class _PolicyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys (YAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise PolicyError(f"Duplicate key {key!r} at lines {seen[key]} and {line}: a "
                                  "policy names each key once; delete one of them.")
            seen[key] = line
        return super().construct_mapping(node, deep)


def _check_no_aliases(text: str, path: str) -> None:
    """Policy files need no YAML anchors or aliases; refusing them (before anything is built)
    keeps a small file from expanding into gigabytes (an alias bomb)."""
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                line = event.start_mark.line + 1
                raise PolicyError(f"{path} line {line} uses a YAML anchor or alias (& or *); "
                                  "policy files do not: write the values out.")
    except yaml.YAMLError:
        return  # safe_load reports the syntax error with its line


def load_policy(path: str | os.PathLike) -> Policy:
    """Read a policy file (``yaml.safe_load`` only, no anchors or aliases, no duplicate keys)
    and validate it against the policy schema (version 1 or 2)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise PolicyError(f"Policy file {path} does not exist; `autoprec tune TASK -o {path}` "
                          "writes one.") from None
    except IsADirectoryError:
        raise PolicyError(f"{path} is a directory, not a policy file.") from None
    except UnicodeDecodeError as e:
        raise PolicyError(f"{path} is not a policy file: byte {e.start} is not UTF-8 text (a "
                          "policy is a YAML text file).") from None
    _check_no_aliases(text, path)
    try:
        data = yaml.load(text, Loader=_PolicyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise PolicyError(f"Malformed YAML in {path}{line}: {problem}. Fix the syntax "
                          "(indentation, quotes around globs with `*`).") from None
    except PolicyError as e:
        raise PolicyError(f"{path}: {e}") from None
    return Policy.from_dict(data, source=path, lines=_line_map(text))


def model_fingerprint(model: nn.Module) -> str:
    """``sha256:<hex>`` of the model's layer list: fqn, class name and parameter shapes of every
    module that owns parameters. Same architecture and sizes -> same fingerprint; weights and
    dtypes do not enter it."""
    h = hashlib.sha256()
    for fqn, module in model.named_modules():
        params = [(n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False)]
        if not params:
            continue
        h.update(f"{fqn}|{_class_name(module)}|{params}\n".encode())
    return f"sha256:{h.hexdigest()}"


def _class_name(module: nn.Module) -> str:
    """The module's own class name: past the subclass ``fully_shard`` (FSDP2) makes of a module
    it shards (``FSDPLinear``), so that sharding leaves the fingerprint as it was."""
    for cls in type(module).__mro__:
        if not (cls.__name__.startswith("FSDP") and cls.__module__.startswith("torch.distributed")):
            return cls.__name__
    return type(module).__name__
