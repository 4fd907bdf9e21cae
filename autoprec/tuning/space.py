"""The search space: search units (layers or same-role groups), the formats each unit is
offered, and the policy an assignment of formats to units stands for.

Groups are a way to search faster, never a constraint the profile contradicts: a member of a
same-role group whose profile differs from its peers' (see :func:`split_outliers`) becomes a
unit of its own, so one fragile layer cannot take its whole group off a format.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from autoprec.formats import Format
from autoprec.policy import Policy
from autoprec.profiling import Profile
from autoprec.tuning.config import Grouping
from autoprec.verdict import unit_can_win

__all__ = ["group_layers", "split_outliers", "SearchSpace", "assignment_policy", "expand"]

# The split rule (split_outliers): a member is "far more sensitive" than its peers when its
# |loss change| (or gradient error) in a format is above SPLIT_RATIO x the median of its
# peers' and above an absolute floor. The floors are a tenth of the default budget (1% loss,
# 0.25 gradient error): below them a member's error is small against any usual budget, and
# values there are measurement noise (bf16 and fp8 layers of the shipped profiles measure 1e-6..1e-3 loss
# and 1e-3..3e-2 gradient error), which must never split a group.
SPLIT_RATIO = 10.0
SPLIT_LOSS_FLOOR = 1e-3
SPLIT_GRAD_FLOOR = 0.025


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
    # one line per member split off its group, and why (see split_outliers)
    split: list[str] = field(default_factory=list)

    @classmethod
    def build(cls, prof: Profile, fmts: Sequence[Format],
              grouping: Grouping | Mapping[str, Sequence[str]],
              couple: Sequence[Sequence[str]] = ()) -> SearchSpace:
        """A format is offered for a unit when its numerics stayed finite, its matmuls can
        really run in it, and it is faster than fp32 on the unit's layers as profiled: a format
        slower than fp32 is dominated (fp32 has zero error), so offering it would only spend
        trials (fp16 on CPUs without FP16 matmul units, emulated fp8).

        Same-role groups first lose the members whose profile contradicts their peers'
        (:func:`split_outliers`); an explicit mapping of units is the caller's word, kept as
        given."""
        units = group_layers([lp.fqn for lp in prof.layers], grouping, couple=couple)
        split: list[str] = []
        if not isinstance(grouping, Mapping):
            units, split = split_outliers(prof, units, fmts)
        space = cls(units=units, choices={}, split=split)
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

    def split_summary(self) -> list[str]:
        """One line per member split off its group, with the measurement that split it."""
        return [f"split off its group: {line}" for line in self.split]

    @property
    def size(self) -> int:
        return math.prod(len(c) for c in self.choices.values())

    def uniform(self, fmt: Format) -> dict[str, str]:
        """Every unit in ``fmt`` where it is offered, else fp32."""
        return {u: fmt.value if fmt.value in c else Format.FP32.value
                for u, c in self.choices.items()}


def split_outliers(prof: Profile, units: Mapping[str, Sequence[str]], fmts: Sequence[Format]
                   ) -> tuple[dict[str, list[str]], list[str]]:
    """Units with every member whose profile contradicts its group's split off, and one line
    per split member saying why.

    A group's *members* are its layers of one instance of the role: the unit's name with its
    first ``*`` filled in (``transformer.h.1.mlp.c_proj``; the experts of one MoE layer,
    ``model.layers.1.mlp.experts.*.w1``, and a coupled ``{q_proj,k_proj,v_proj}`` stay
    together). In some measured format, a member is split off when

    - it is non-finite while its peers are finite (or the reverse, when it is the finite
      minority): whichever side is smaller becomes units of its own (on a tie, the
      non-finite side);
    - or its |loss change| (or gradient error) is above ``SPLIT_RATIO`` x its peers' median and
      above ``SPLIT_LOSS_FLOOR`` (``SPLIT_GRAD_FLOOR``).

    A split member is a unit named by its exact name (or its narrower glob), which the policy
    prefers over the group's glob (the most specific pattern wins). Units without ``*`` (single
    layers) and members that agree stay as they are: groups still shrink the space."""
    out: dict[str, list[str]] = {}
    notes: list[str] = []
    for unit, fqns in units.items():
        members = _members(unit, fqns)
        why = {m: _outlier(prof, members, m, fmts) for m in members} if len(members) > 1 else {}
        why = {m: w for m, w in why.items() if w}
        rest = [f for m, fs in members.items() if m not in why for f in fs]
        if rest:
            out[unit] = rest
        for m, w in why.items():
            out[m] = list(members[m])
            notes.append(f"{m} from {unit}: {w}")
    return out, notes


def _members(unit: str, fqns: Sequence[str]) -> dict[str, list[str]]:
    """Member name -> its layers: the unit's name with its first ``*`` component replaced by
    the layer's own (a unit that is not a role glob is one member)."""
    parts = unit.split(".")
    if "*" not in parts:
        return {unit: list(fqns)}
    i = parts.index("*")
    out: dict[str, list[str]] = {}
    for f in fqns:
        own = f.split(".")
        if len(own) != len(parts):
            return {unit: list(fqns)}
        out.setdefault(".".join([*parts[:i], own[i], *parts[i + 1:]]), []).append(f)
    return out


def _outlier(prof: Profile, members: Mapping[str, Sequence[str]], name: str,
             fmts: Sequence[Format]) -> str:
    """Why member ``name`` leaves its group ("" when it stays): the first format, in
    ``fmts`` order, in which its profile contradicts its peers' (see :func:`split_outliers`)."""
    peers = [m for m in members if m != name]
    for fmt in fmts:
        if fmt is Format.FP32:
            continue
        own = _member_error(prof, members[name], fmt, loss=True)
        others = [_member_error(prof, members[m], fmt, loss=True) for m in peers]
        bad = sum(math.isinf(x) for x in others)
        good = sum(math.isfinite(x) for x in others)
        if math.isinf(own) and good and bad + 1 <= good:
            return f"{fmt} non-finite, {good} of its {len(peers)} peers finite"
        if math.isfinite(own) and bad and good + 1 < bad:
            return f"{fmt} finite, {bad} of its {len(peers)} peers non-finite"
        for loss, floor, what in ((True, SPLIT_LOSS_FLOOR, "|loss change|"),
                                  (False, SPLIT_GRAD_FLOOR, "gradient error")):
            own = _member_error(prof, members[name], fmt, loss=loss)
            finite = [x for x in (_member_error(prof, members[m], fmt, loss=loss)
                                  for m in peers) if math.isfinite(x)]
            if not finite or not math.isfinite(own):
                continue
            median = statistics.median(finite)
            if own > floor and own > SPLIT_RATIO * median:
                return (f"{fmt} {what} {own:.2g} > {SPLIT_RATIO:g}x its peers' median "
                        f"{median:.2g}")
    return ""


def _member_error(prof: Profile, fqns: Sequence[str], fmt: Format, *, loss: bool) -> float:
    """A member's error in ``fmt``: the sum of its layers' |loss change| (the integer
    program's additive reading) or their largest gradient error; inf when one of them was
    non-finite, nan when one was not measured."""
    vals = [abs(prof.loss_change(f, fmt) if loss else prof.grad_error(f, fmt)) for f in fqns]
    if any(math.isinf(v) for v in vals):
        return math.inf
    if any(math.isnan(v) for v in vals):
        return math.nan
    return math.fsum(vals) if loss else max(vals)


def _not_offered(prof: Profile, fqns: Sequence[str], fmt: Format, t32: float) -> str:
    """Why ``fmt`` is not offered for a unit of these layers ("" when it is): the one
    can-win rule (:mod:`autoprec.verdict`) on each layer, then on the unit's summed time."""
    verdicts = [prof.verdict(f, fmt) for f in fqns]
    return unit_can_win(verdicts, sum(prof.seconds(f, fmt) for f in fqns), t32)


def assignment_policy(units: Mapping[str, Sequence[str]], choice: Mapping[str, str], *,
                      model_name: str | None = None, fingerprint: str | None = None) -> Policy:
    """The policy for one assignment: the most common format (by layers) becomes the default
    (fewer regions, fewer casts), every unit that differs is listed, by its name as a pattern
    (a coupled ``parent.{q_proj,k_proj,v_proj}`` as one pattern per name)."""
    counts: dict[str, int] = {}
    for unit, fmt in choice.items():
        counts[fmt] = counts.get(fmt, 0) + len(units[unit])
    order = {f.value: i for i, f in enumerate(Format)}  # registered formats too
    default = max(counts, key=lambda f: (counts[f], -order[f]))
    listed = {unit for unit, fmt in choice.items() if fmt != default}
    # A unit left at the default must still be listed when a pattern of another unit reaches
    # its layers: an enclosing unit (an attention module around its projections; regions
    # nest), or the glob of the group a member was split off (its own name is more specific
    # and wins).
    nested = _policy(default, listed, choice)
    listed |= {unit for unit, fmt in choice.items()
               if fmt == default and any(nested.format_for(f).value != fmt for f in units[unit])}
    return _policy(default, listed, choice, model_name=model_name, fingerprint=fingerprint)


def _policy(default: str, listed: set[str], choice: Mapping[str, str], **model: str | None
            ) -> Policy:
    layers = {p: choice[u] for u in choice if u in listed for p in _patterns(u)}
    return Policy(default=default, layers=layers, **model)


def _patterns(unit: str) -> list[str]:
    """The policy patterns of a unit name: itself, or for a coupled unit
    ``parent.{a,b}`` (a name patterns cannot spell) ``parent.a`` and ``parent.b``."""
    parent, _, leaf = unit.rpartition(".")
    if not (leaf.startswith("{") and leaf.endswith("}")):
        return [unit]
    return [(f"{parent}." if parent else "") + name for name in leaf[1:-1].split(",")]


def expand(policy: Policy, prof: Profile) -> dict[str, Format]:
    """The format ``policy`` gives each profiled layer."""
    return {lp.fqn: policy.format_for(lp.fqn) for lp in prof.layers}
