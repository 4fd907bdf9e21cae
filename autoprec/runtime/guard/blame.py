"""Blame: which watched layer made a step fail, as a pure function of the step's checks.

Nothing here reads or changes state: :func:`blame` takes the recorded checks (in the order the
layers ran), the watched layers' formats and what the suspects' descendants showed, and
returns a :class:`Blame`. The rules are the module docstring's of ``autoprec.runtime.guard``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from autoprec.formats import Format
from autoprec.runtime.guard.record import Checks
from autoprec.runtime.guard.terms import limit

__all__ = ["Failure", "Blame", "blame", "describe"]


@dataclass
class Failure:
    """What a blamed layer did on one step."""

    fqn: str
    where: str  # one of terms.WHERE
    level: float  # the check's number: non-finite or above the limit when failing
    fraction: float | None  # share of failing values, where they were counted
    scale: float | None = None  # the GradScaler's scale, when one is enabled


@dataclass
class Blame:
    """The blame for one step. ``failure``: the layer to count against (None: none);
    ``cleared``: layers that failed but are not at fault (the fault upstream of them), which
    stay under close watch; ``origin``: an unwatched descendant of a suspect that made the
    first non-finite values (named in the warning); ``deferred``: the failure a GradScaler
    above ``min_loss_scale`` is left to handle (not counted)."""

    failure: Failure | None = None
    cleared: set[str] = field(default_factory=set)
    origin: str | None = None
    deferred: Failure | None = None


def is_ancestor(a: str, b: str) -> bool:
    """Whether module ``a`` contains module ``b`` (fqns)."""
    return a == "" or b.startswith(a + ".")


def over(level: float, bound: float) -> bool:
    return not math.isfinite(level) or level > bound


def _judge(checks: Checks, formats: Mapping[str, Format]) -> Callable[[str, str], bool]:
    """``bad(kind, fqn)``: whether that check failed (watched layers only)."""

    def bad(kind: str, fqn: str) -> bool:
        a = checks.level[kind].get(fqn)
        if a is None:
            return False
        if kind == "wgrad":
            return over(a, math.inf)
        fmt = formats.get(fqn)
        return fmt is not None and over(a, limit(fmt))

    return bad


def blame(checks: Checks, formats: Mapping[str, Format], *,
          subtree_faults: Mapping[str, str] | None = None,
          scale: float | Callable[[], float] | None = None,
          min_loss_scale: float = 1.0) -> Blame:
    """The blame for one step.

    ``formats``: fqn -> format of every watched layer; ``subtree_faults``: suspect -> the
    unwatched descendant whose output went non-finite first while its input was finite;
    ``scale``: the enabled GradScaler's scale, or a function reading it, called only when a
    gradient fails (reading a GPU scaler's scale is a host sync); None: no enabled scaler.
    """
    bad = _judge(checks, formats)
    found = _forward(checks, bad, subtree_faults or {})
    if found is not None:
        return found
    found = Blame()
    own = [f for f in checks.level["wgrad"] if bad("wgrad", f) and not bad("grad", f)]
    if own:
        # its own weight gradient non-finite while the gradient at its output is finite: it
        # overflowed in its own backward, certainly
        failure = Failure(own[0], "weight gradients", checks.level["wgrad"][own[0]],
                          checks.share["wgrad"].get(own[0]))
    else:
        failure = backward_culprit(checks, formats, bad, found.cleared,
                                   scaled=scale is not None)
    if failure is not None and scale is not None:
        failure.scale = float(scale() if callable(scale) else scale)
        if failure.scale > min_loss_scale:
            found.deferred = failure
            return found
    found.failure = failure
    return found


def _forward(checks: Checks, bad: Callable[[str, str], bool],
             subtree_faults: Mapping[str, str]) -> Blame | None:
    """The verdict from outputs, in the order layers ran (None: no output failed, judge the
    gradients). The first failing layer whose inputs were finite is blamed. One whose input
    was already non-finite is cleared, and so is every later failing layer downstream of the
    same fault, except its ancestors (an attention core computes the input of its own
    c_proj); a suspect whose unwatched descendant (a child the policy keeps in fp32) made the
    first non-finite values is cleared too."""
    found = Blame()
    failed = False
    last_cleared = None
    for fqn, a in checks.level["out"].items():
        if not bad("out", fqn):
            continue
        failed = True
        if last_cleared is not None and not is_ancestor(fqn, last_cleared):
            break
        if fqn in subtree_faults:
            found.cleared.add(fqn)
            found.origin = subtree_faults[fqn]
            break
        a_in = checks.level["in"].get(fqn)
        if a_in is not None and not math.isfinite(a_in):
            found.cleared.add(fqn)  # its input was already non-finite: the fault is upstream
            last_cleared = fqn
            continue
        found.failure = Failure(fqn, "outputs", a, checks.share["out"].get(fqn))
        return found
    return found if failed else None  # only layers cleared of blame failed: none to count


def backward_culprit(checks: Checks, formats: Mapping[str, Format],
                     bad: Callable[[str, str], bool], cleared: set[str], *,
                     scaled: bool) -> Failure | None:
    """In backward order, the first layer whose output gradient fails: beyond its format's
    range but finite, its format is too narrow for it (its fault); non-finite, it arrived
    that way (not its fault): the layer whose backward ran just before, its own output
    gradient finite, made it so, unless its input gradient was seen finite. Layers cleared
    are added to ``cleared``."""
    grads = checks.level["grad"]
    order = list(grads)
    for i, fqn in enumerate(order):
        if not bad("grad", fqn):
            continue
        a = grads[fqn]
        fp16 = fqn in formats and formats[fqn].needs_loss_scaling
        if i == 0 and not math.isfinite(a):
            if not scaled and fp16:
                # Without a GradScaler nothing scales the gradient back into FP16's range:
                # the FP32 gradient the layers after it (or the loss) send into an fp16
                # layer is cast to FP16 at its output, and overflows there. The forward was
                # finite (outputs are judged first), so this is its format's fault. (A NaN
                # loss from finite outputs, e.g. NaN targets, reads the same.)
                return Failure(fqn, "gradients", a, checks.share["grad"].get(fqn))
            cleared.add(fqn)
            return None  # non-finite from the loss, or layers the guard does not watch
        if math.isfinite(a) or fp16:
            # beyond its format's range; or an fp16 layer, whose output (so the gradient
            # computed for it) is FP16: overflowed there, after a finite gradient upstream
            return Failure(fqn, "gradients", a, checks.share["grad"].get(fqn))
        # non-finite in a layer whose gradients have FP32's range: it arrived that way
        cleared.add(fqn)
        before = order[i - 1]
        ingrad = checks.level["ingrad"].get(before)
        if ingrad is not None and math.isfinite(ingrad):
            cleared.add(before)
            return None
        return Failure(before, "backward", grads[before], checks.share["grad"].get(before))
    return None


def failing(checks: Checks, formats: Mapping[str, Format]) -> bool:
    """Whether any check of the step failed (non-finite, or above its layer's limit)."""
    for kind, found in checks.level.items():
        for fqn, a in found.items():
            fmt = formats.get(fqn)
            bound = limit(fmt) if kind in ("out", "grad") and fmt is not None else math.inf
            if over(a, bound):
                return True
    return False


def pct(x: float) -> str:
    """12%, or 0.37% for shares under one percent (a rare overflow must not read as 0%)."""
    percent = x * 100
    return f"{x:.0%}" if percent >= 1 or x == 0 else f"{percent:.2g}%"


def describe(f: Failure, fmt: Format | None) -> str:
    """What was measured, e.g. "12% of outputs overflow fp16 max 65504 or are NaN"; ``fmt``:
    the blamed layer's format."""
    if f.where == "backward":
        return ("the gradients its backward sent upstream were non-finite, the gradient "
                "reaching it was finite" + (f", loss scale {f.scale:g}" if f.scale else ""))
    share = None if f.fraction is None else f"{pct(f.fraction)} of {f.where}"
    fp16 = fmt is not None and fmt.output_dtype is torch.float16
    if fp16 and f.where != "weight gradients":  # values counted (stat)
        text = f"{share or f.where} overflow fp16 max {limit(fmt):g} or are NaN"
    elif fp16:  # an fp16 layer's own weight gradient went non-finite
        text = f"{share or f.where} overflow fp16 max {limit(fmt):g} (non-finite)"
    else:
        text = f"non-finite {f.where}" + (f" ({share} NaN or inf)" if share else "")
    if f.scale is not None:
        text += f", loss scale {f.scale:g}"
    return text


def _names(fqns: list[str]) -> str:
    shown = ", ".join(f"`{f}`" for f in fqns[:3])
    return shown + (f" and {len(fqns) - 3} more" if len(fqns) > 3 else "")


def first_nonfinite(checks: Checks, failure: Failure | None, formats: Mapping[str, Format],
                    finish: Mapping[str, int], unwatched: list[str],
                    format_of: Callable[[str], Format | None]) -> tuple[str | None, str]:
    """Where a failing step's non-finite values began, as far as the checks show: the layer
    (None when they cannot tell one) and the place in words. ``unwatched``: the computing
    layers not watched, placed by ``finish`` (the order modules finish); ``format_of``: a
    layer's format under the policy."""
    outs = list(checks.level["out"])

    def between(lo: float, hi: float) -> list[str]:
        return sorted((f for f in unwatched if lo < finish.get(f, -1) < hi), key=finish.get)

    bad = [f for f in outs if f in formats and over(checks.level["out"][f], limit(formats[f]))]
    if bad:
        i = outs.index(bad[0])
        before = between(finish.get(outs[i - 1], -1) if i else -1, finish.get(bad[0], -1))
        if not before:
            return bad[0], f"the first non-finite values came out of `{bad[0]}`"
        return None, (f"the first non-finite outputs the guard saw were `{bad[0]}`'s, or "
                      f"came from {_names(before)} before it, which it does not watch")
    if failure is not None:
        return failure.fqn, (f"the first non-finite values came out of `{failure.fqn}`'s "
                             f"backward ({describe(failure, formats.get(failure.fqn))})")
    last = max((finish.get(f, -1) for f in outs), default=-1)
    after = between(last, math.inf)
    if len(after) == 1:
        return after[0], (f"the first non-finite values came out of `{after[0]}` "
                          f"({format_of(after[0])} under the policy, after every layer the "
                          "guard watches) or the loss")
    if after:
        return None, (f"the first non-finite values came after every layer the guard "
                      f"watches: out of {_names(after)}, which it does not watch, or the loss")
    return None, "the first non-finite values came out of the loss, after every layer"
