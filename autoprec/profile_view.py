"""A :class:`~autoprec.profiling.Profile` as people read it: the per-layer table of
``autoprec profile``, the one-line sensitivity summary, and the sentences ``autoprec show``
gives for a layer's format. Functions of a profile; the profile itself stays plain data (its
methods ``table()``, ``reason()``, ... call these)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from autoprec._util import shown, text_table
from autoprec.formats import Format
from autoprec.policy import DEFAULT_MAX_LOSS_INCREASE
from autoprec.pricing import CostSource
from autoprec.verdict import CANNOT_WIN_RULES

if TYPE_CHECKING:
    from autoprec.profiling import LayerProfile, Profile

__all__ = [
    "table",
    "sensitivity_summary",
    "reason",
    "fp8_reason",
]

# Verdicts that a layer's record explains itself (any other: the search preferred another
# format overall, described by the layer's numbers).
_EXPLAINED = ("blocked", *CANNOT_WIN_RULES, "non-finite", "over budget")


def source_label(prof: Profile) -> str:
    """Where the profile's seconds come from: ``cost model h100`` or ``measured on ...``."""
    return shown(CostSource(prof.target).label(prof.device), 200)


def table(prof: Profile) -> str:
    """The per-layer table: shape, FLOPs, each format's error and time, and a verdict."""
    fmts = [f for f in Format if f in prof.formats]  # registered formats too
    low = [f for f in fmts if f is not Format.FP32]
    header = ["layer", "kind", "shape (M,K,N)", "GFLOP", *[f"{f} err" for f in low],
              *[f"{f} us" for f in fmts], "verdict"]
    rows = [[*_layer_cells(lp, low, fmts), best_format(lp, fmts)] for lp in prof.layers]
    return (text_table(header, rows) + "\nerr: relative loss change with the layer alone in "
            f"the format (~ first-order estimate, else measured); us: fwd+bwd microseconds "
            f"({source_label(prof)}); * emulated (never counted as fast); skip: not measured, "
            f"the format cannot win here (see `skipped`).\n{sensitivity_summary(prof)}"
            + (f"\n{CostSource.of(prof.target).calibration()}" if prof.target else ""))


def _layer_cells(lp: LayerProfile, low: Sequence[Format], fmts: Sequence[Format]) -> list[str]:
    L = lp.layer
    shape = ",".join(str(x) for x in L.matmuls[0][1:]) if L.matmuls else "-"
    if len(L.matmuls) > 1:
        shape += f" +{len(L.matmuls) - 1}"
    row = [shown(L.fqn, 200), shown(L.kind), shape, f"{L.flops / 1e9:.3f}"]
    for f in low:
        e = lp.sensitivity.get(f)
        mark = "~" if e is not None and e.source == "estimated" else ""
        row.append(("skip" if f in lp.skipped else "-") if e is None else
                   ("NONFINITE" if not e.finite else f"{mark}{e.loss_rel_change:+.1e}"))
    for f in fmts:
        t = lp.times.get(f)
        row.append("-" if t is None else f"{t.seconds * 1e6:.0f}" + ("*" if t.emulated else ""))
    return row


def best_format(lp: LayerProfile, fmts: Sequence[Format],
                max_loss_increase: float = DEFAULT_MAX_LOSS_INCREASE) -> str:
    """The table's verdict: the fastest format that can win on the layer alone within the
    error budget, with any format that went non-finite named."""
    best, best_t = Format.FP32, lp.times.get(Format.FP32)
    for f in fmts:
        if f is Format.FP32 or not lp.verdict(f, max_loss_increase=max_loss_increase).can_win:
            continue
        t = lp.times[f]
        if best_t is None or t.seconds < best_t.seconds:
            best, best_t = f, t
    flags = [f"{f} non-finite" for f, e in lp.sensitivity.items() if not e.finite]
    return f"{best}" + (f" ({'; '.join(flags)})" if flags else "")


def sensitivity_summary(prof: Profile) -> str:
    """One line: how many layer x format numbers were estimated and how many measured,
    and why the measured ones were (for ``autoprec show``)."""
    est = sum(1 for lp in prof.layers for e in lp.sensitivity.values()
              if e.source == "estimated")
    meas = sum(1 for lp in prof.layers for e in lp.sensitivity.values()
               if e.source == "measured")
    skipped = sum(len(lp.skipped) for lp in prof.layers)
    why: dict[str, int] = {}
    for lp in prof.layers:
        for r in lp.exact_why.values():
            why[shown(r)] = why.get(shown(r), 0) + 1
    detail = f" ({'; '.join(f'{r}: {n}' for r, n in why.items())})" if why else ""
    return (f"sensitivity ({shown(prof.sensitivity_mode)}): {est} layer x format pairs estimated "
            f"to first order, {meas} measured exactly{detail}, {skipped} not measured "
            "(cannot win here)")


def reason(prof: Profile, fqn: str, fmt: Format, *,
           max_loss_change: float = DEFAULT_MAX_LOSS_INCREASE) -> str:
    """Why this layer is not in ``fmt`` (for ``autoprec show``): the rule that rules ``fmt``
    out (:func:`autoprec.verdict.can_win`), or when none does, its numbers in ``fmt``."""
    lp = prof.layer(fqn)
    verdict = lp.verdict(fmt, max_loss_increase=max_loss_change)
    if verdict.rule in _EXPLAINED:
        return shown(verdict.why, 400)
    parts = []
    lc = prof.loss_change(fqn, fmt)
    if math.isfinite(lc):
        parts.append(f"loss {lc:+.3%}")
    ge = prof.grad_error(fqn, fmt)
    if math.isfinite(ge):
        parts.append(f"grad err {ge:.3g}")
    t = lp.times.get(fmt)
    if t is not None:
        parts.append(f"{t.seconds * 1e6:.0f} us")
    return f"{fmt.label}: " + ", ".join(parts) + " (the search preferred another format overall)"


def fp8_reason(prof: Profile, fqn: str, chosen: Format, *,
               max_loss_change: float = DEFAULT_MAX_LOSS_INCREASE) -> str:
    """For ``autoprec show``: why this layer is in ``chosen`` and, for a layer not in fp8,
    why not in its fastest profiled FP8 recipe; for an fp8 layer, each profiled recipe's
    speed against bf16 and its loss change, the chosen one first."""
    recipes = [f for f in prof.formats if f.is_scaled]
    if not recipes:
        return "fp8 not profiled"
    if not chosen.is_scaled:
        fastest = min(recipes, key=lambda f: _or_inf(prof.seconds(fqn, f)))
        return reason(prof, fqn, fastest, max_loss_change=max_loss_change)
    order = [chosen, *(f for f in recipes if f is not chosen)]
    return "; ".join(("chosen: " if f is chosen else "") + _recipe_summary(prof, fqn, f)
                     for f in order)


def _recipe_summary(prof: Profile, fqn: str, fmt: Format) -> str:
    lp = prof.layer(fqn)
    verdict = lp.verdict(fmt)
    if verdict.rule in ("blocked", *CANNOT_WIN_RULES):
        return (f"{fmt.recipe or fmt.label} skipped "
                f"({shown(verdict.why.removeprefix(fmt.label + ' '), 400)})")
    t, t16 = lp.times.get(fmt), lp.times.get(Format.BF16)
    speed = (f"{t16.seconds / t.seconds:.2f}x bf16" if t is not None and t16 is not None
             and t.seconds > 0 else "speed ?")
    lc = prof.loss_change(fqn, fmt)
    loss = "non-finite" if math.isinf(lc) else f"loss {lc:+.3%}"
    return f"{fmt.recipe or fmt.label} {speed}, {loss}"


def _or_inf(x: float) -> float:
    return x if math.isfinite(x) else math.inf

