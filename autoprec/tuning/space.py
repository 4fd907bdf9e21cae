"""The search space: search units (layers or same-role groups), the formats each unit is
offered, and the policy an assignment of formats to units stands for."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from autoprec.formats import FORMAT_ORDER, Format
from autoprec.policy import Policy
from autoprec.profiling import Profile
from autoprec.tuning.config import Grouping

__all__ = ["group_layers", "SearchSpace", "assignment_policy", "expand"]


def group_layers(fqns: Sequence[str], grouping: Grouping | str | Mapping[str, Sequence[str]]
                 = Grouping.AUTO, *, max_units: int = 16,
                 couple: Sequence[Sequence[str]] = ()) -> dict[str, list[str]]:
    """Search units: unit name -> the layer fqns it sets.

    ``Grouping.LAYER``: one unit per layer. ``Grouping.ROLE``: same-role layers share one
    unit, named by their glob (numeric path components become ``*``:
    ``transformer.h.*.mlp.c_fc``). ``Grouping.AUTO``: per layer while there are at most
    ``max_units`` layers, grouped beyond. A mapping (unit name -> fqns) is used as given.

    ``couple``: sets of sibling names that must share one choice, because the model fuses
    them (``("q_proj", "k_proj", "v_proj")``: the projections of one attention, fused into one
    GEMM by a QKV kernel). Units whose last name is in one set and whose parent is the same
    merge into one unit, named ``parent.{q_proj,k_proj,v_proj}``. All experts of an MoE layer
    are coupled by role grouping (``experts.*.w1`` is one unit) or an explicit mapping.
    """
    if isinstance(grouping, Mapping):
        return {k: list(v) for k, v in grouping.items()}
    grouping = Grouping(grouping)
    by_role = grouping is Grouping.ROLE or (grouping is Grouping.AUTO and len(fqns) > max_units)
    if not by_role:
        return _couple({f: [f] for f in fqns}, couple)
    out: dict[str, list[str]] = {}
    for f in fqns:
        key = ".".join("*" if part.isdigit() else part for part in f.split("."))
        out.setdefault(key, []).append(f)
    return _couple(out, couple)


def _couple(units: dict[str, list[str]], couple: Sequence[Sequence[str]]) -> dict[str, list[str]]:
    """Merge units that are coupled siblings (see :func:`group_layers`), in first-seen order."""
    sets = [tuple(dict.fromkeys(names)) for names in couple]
    out: dict[str, list[str]] = {}
    for unit, fqns in units.items():
        parent, _, leaf = unit.rpartition(".")
        names = next((s for s in sets if leaf in s), None)
        key = unit if names is None else \
            (f"{parent}." if parent else "") + "{" + ",".join(names) + "}"
        out.setdefault(key, []).extend(fqns)
    return out


@dataclass
class SearchSpace:
    """Units and the formats offered for each, from the profile."""

    units: dict[str, list[str]]
    # unit -> format values offered (fp32 always)
    choices: dict[str, list[str]]
    # format value -> "unit: why" for each unit it was not offered for
    pruned: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def build(cls, prof: Profile, fmts: Sequence[Format],
              grouping: Grouping | Mapping[str, Sequence[str]],
              couple: Sequence[Sequence[str]] = ()) -> SearchSpace:
        """A format is offered for a unit when its numerics stayed finite, its matmuls can
        really run in it, and it is faster than fp32 on the unit's layers as profiled: a format
        slower than fp32 is dominated (fp32 has zero error), so offering it would only spend
        trials (fp16 on CPUs without FP16 matmul units, emulated fp8)."""
        units = group_layers([lp.fqn for lp in prof.layers], grouping, couple=couple)
        space = cls(units=units, choices={})
        for unit, fqns in units.items():
            allowed = [Format.FP32.value]
            t32 = sum(prof.seconds(f, Format.FP32) for f in fqns)
            for fmt in fmts:
                if fmt is Format.FP32:
                    continue
                why = _not_offered(prof, fqns, fmt, t32)
                if why:
                    space.pruned.setdefault(fmt.value, []).append(f"{unit}: {why}")
                else:
                    allowed.append(fmt.value)
            space.choices[unit] = allowed
        return space

    def pruned_summary(self) -> list[str]:
        """One line per format that some units were not offered, with the reasons counted."""
        out = []
        for fmt, entries in self.pruned.items():
            reasons: dict[str, int] = {}
            for entry in entries:
                why = entry.split(": ", 1)[1]
                reasons[why] = reasons.get(why, 0) + 1
            detail = "; ".join(f"{why} ({n})" for why, n in reasons.items())
            out.append(f"not offered: {fmt} on {len(entries)} of {len(self.units)} units: {detail}")
        return out

    @property
    def size(self) -> int:
        return math.prod(len(c) for c in self.choices.values())

    def uniform(self, fmt: Format) -> dict[str, str]:
        """Every unit in ``fmt`` where it is offered, else fp32."""
        return {u: fmt.value if fmt.value in c else Format.FP32.value
                for u, c in self.choices.items()}


def _not_offered(prof: Profile, fqns: Sequence[str], fmt: Format, t32: float) -> str:
    """Why ``fmt`` is not offered for a unit of these layers ("" when it is)."""
    lps = [prof.layer(f) for f in fqns]
    if any(fmt in lp.skipped for lp in lps):
        return "cannot win here (numerics not measured)"
    if fmt.is_fp8 and any(lp.fp8_blocker for lp in lps):
        return "FP8 does not take its matmuls"
    if not all(prof.allows(f, fmt) for f in fqns):
        return "non-finite"
    t = sum(prof.seconds(f, fmt) for f in fqns)
    if not (math.isfinite(t) and t < t32):
        return "not faster than fp32 in the profile"
    return ""


def assignment_policy(units: Mapping[str, Sequence[str]], choice: Mapping[str, str], *,
                      model_name: str | None = None, fingerprint: str | None = None) -> Policy:
    """The policy for one assignment: the most common format (by layers) becomes the default
    (fewer regions, fewer casts), every unit that differs is listed."""
    counts: dict[str, int] = {}
    for unit, fmt in choice.items():
        counts[fmt] = counts.get(fmt, 0) + len(units[unit])
    order = {f.value: i for i, f in enumerate(FORMAT_ORDER)}
    default = max(counts, key=lambda f: (counts[f], -order[f]))
    layers = {unit: fmt for unit, fmt in choice.items() if fmt != default}
    # A unit left at the default must still be listed when an enclosing unit (an attention
    # module around its projections) is listed with another format: regions nest.
    nested = Policy(default=default, layers=layers)
    for unit, fmt in choice.items():
        if fmt == default and any(nested.format_for(f).value != fmt for f in units[unit]):
            layers[unit] = fmt
    layers = {u: layers[u] for u in choice if u in layers}
    return Policy(default=default, layers=layers, model_name=model_name, fingerprint=fingerprint)


def expand(policy: Policy, prof: Profile) -> dict[str, Format]:
    """The format ``policy`` gives each profiled layer."""
    return {lp.fqn: policy.format_for(lp.fqn) for lp in prof.layers}
