"""Re-checks: a policy's layers re-measured on the run's own weights.

A policy is tuned on the weights of one moment (usually step 0); training moves them, and a
layer that was safe in fp16 or fp8 may not stay so (outputs creeping up towards the format's
range, outliers that crush a tensorwise FP8 scale), while a layer kept in higher precision may
have become safe to lower. :func:`recheck` measures, with the first-order estimate (one FP32
reference pass plus work local to each layer: :mod:`autoprec.measure.estimate`, the profile's
``mode="fast"``), each layer that computes:

- a layer the policy runs in a low-precision format (anything but fp32), in that format. It is
  to **demote** (to ``Format.demoted()`` of its format) when on its own it breaks the budget:
  a non-finite loss or gradient, values beyond the format's range (outputs, inputs or output
  gradients of its matmuls, unscaled; in training a non-finite step), a relative loss
  increase above ``budget.max_loss_increase``, or (where the budget has one) a gradient error
  above ``budget.max_grad_error``;
- a layer the policy keeps in a higher precision, in each lower format the policy uses for
  other layers (the candidates). It **may be promoted** to the lowest of them that is *well
  inside* the budget: finite, nothing beyond the range, ``|loss change|`` and gradient error
  both below :data:`PROMOTE_SHARE` (half) of the budget's limits. Half, because per-layer
  errors add up over a policy and the estimate is first order: a layer measured at 0.9 of the
  budget alone would leave nothing for the others. Promotions are only listed; they change a
  policy only on the user's word (``amended_policy(promote=True)``, ``--promote``).

Each layer is measured alone against the all-FP32 reference, as the profile measures it, so a
verdict is about that layer's own error (not the policy's total, which validation judges).

A policy with phases (:mod:`autoprec.phases`) is checked in every phase: each layer is measured
once in each distinct format it computes in over the phases (and in each phase's candidates),
and each row says the phases it belongs to (``RecheckRow.phases``; the report's ``phase``
column). Demotions apply where they were found and hold in every phase:
:meth:`RecheckResult.amended_policy` keeps the phases, and in each the demoted layer computes in
the safer of the phase's format and its demoted one (as the runtime guard keeps a demotion
across phase switches), written so that no later phase's ``formats`` or ``layers`` puts it
back into a less precise format. A promotion applies in the phases where it was found. In
training, :class:`Rechecker` checks the phase in force only.

The budget is the one the policy was tuned under (its provenance, ``tuned.budget``), else
:class:`~autoprec.policy.Budget`'s default.

``autoprec recheck TASK --policy P --checkpoint C -o REPORT.yaml`` (:mod:`autoprec.cli`) runs
it on a checkpoint (:func:`autoprec.checkpoint.load_checkpoint`: a ``.safetensors`` file, a
torch ``.pt``/``.bin`` state dict or a training checkpoint holding one under ``"model"``, an HF
checkpoint folder); with ``--amended POLICY_OUT`` it writes the report and the amended policy
both or neither (:func:`autoprec._util.atomic_write_all`: a failed second write leaves no
first). In training, :class:`Rechecker` runs it
every N steps on the current batch and hands the demotions to the runtime guard
(``Guard.request_demotion``), which applies them at its next ``step()`` on every rank together.

What it costs and what it touches: the model is never modified. :func:`recheck` measures a
private copy (``copy.deepcopy`` without the guard's hooks, the policy's regions removed);
a :class:`Rechecker` makes that copy once and, at each re-check, copies the live weights into
it (one copy of the parameters and buffers, no gradients or optimizer state: about a quarter
of an AdamW run's state stays allocated). The measurement runs with gradients on, the RNG
state forked (the run's random stream is as if no re-check ran), and writes no ``.grad``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec._util import brief, device_of, encode_float, move_to, quoted, shown, text_table
from autoprec.formats import Format
from autoprec.measure.sensitivity import LayerSensitivity, measure_sensitivity
from autoprec.policy import Budget, Policy
from autoprec.runtime import calls, rewrite
from autoprec.runtime.attribution import CallAttribution
from autoprec.runtime.guard import get_guard
from autoprec.runtime.guard.demote import amend_phases, safer
from autoprec.task import Task, default_loss

__all__ = [
    "PROMOTE_SHARE",
    "RecheckRow",
    "RecheckResult",
    "recheck",
    "recheck_in_place",
    "judge",
    "Rechecker",
]

logger = logging.getLogger(__name__)

# "Well inside" the budget, where a layer may be promoted: every measured error below this
# share of the budget's limit (per-layer errors add up over a policy; see the docstring).
PROMOTE_SHARE = 0.5
# The verdicts of a row: a low-precision layer keeps its format or is to be demoted; a
# higher-precision layer measured in a lower format may be promoted to it, or stays.
VERDICTS = ("keep", "demote", "may promote", "stay")
# Rechecker.state_dict: its layout version, and the requests it keeps (the newest).
_STATE_VERSION = 1
_MAX_KEPT = 64
# The module attributes that hold hooks: left out of the private copy (the guard's watches
# must not see the re-check's passes, nor be copied with the model).
_HOOK_ATTRS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks")


# ------------------------------------------------------------------------------ result
@dataclass(frozen=True)
class RecheckRow:
    """One layer measured in one format."""

    # the module's fqn, as named_modules() spells it
    fqn: str
    # the format the policy gives it, and the format it was measured in (the same for a
    # low-precision layer; a lower candidate for a higher-precision one)
    format: Format
    measured: Format
    # the estimate's relative loss change (signed: positive is a higher loss), whole-model
    # gradient error, and the layer's output SQNR (dB)
    loss_change: float
    grad_error: float
    sqnr_db: float
    # share of the rounded values (activations or output gradients, the larger) beyond the
    # measured format's range; 0 for fp32/bf16, and for fp8 (scaled to its amax)
    overflow: float
    finite: bool
    # one of VERDICTS, and why, in words
    verdict: str
    reason: str
    # the phases of the policy in which the layer computes in ``format`` (0: the first; a
    # policy without phases has only that one)
    phases: tuple[int, ...] = (0,)

    def to_dict(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "format": self.format.value, "measured": self.measured.value,
                "phases": list(self.phases),
                "loss_change": encode_float(self.loss_change),
                "grad_error": encode_float(self.grad_error),
                "sqnr_db": encode_float(self.sqnr_db), "overflow": encode_float(self.overflow),
                "finite": self.finite, "verdict": self.verdict, "reason": self.reason}


@dataclass(frozen=True)
class RecheckResult:
    """What a re-check found; :attr:`demote` and :attr:`promote` are its decisions."""

    # the policy re-checked and the budget it was judged against
    policy: Policy
    budget: Budget
    rows: tuple[RecheckRow, ...]
    # every module that computes (the demotion's amendment pins their formats)
    layers: tuple[str, ...]
    n_batches: int
    seconds: float
    # the training step it ran at (Rechecker), else None
    step: int | None = None
    # where the weights came from (the CLI's checkpoint), for the report
    source: str | None = None

    @property
    def demote(self) -> dict[str, Format]:
        """fqn -> the format to demote it to: one step safer than the policy's (with phases,
        the safest such step over the phases' formats it was found to break the budget in)."""
        out: dict[str, Format] = {}
        for r in self.rows:
            if r.verdict == "demote":
                out[r.fqn] = safer(out.get(r.fqn, r.format.demoted()), r.format.demoted())
        return out

    @property
    def promote(self) -> dict[str, Format]:
        """fqn -> the lowest-precision candidate well inside the budget (only listed)."""
        return _lowest(r for r in self.rows if r.verdict == "may promote")

    def reason(self, fqn: str) -> str:
        """Why ``fqn`` is to be demoted (or may be promoted), as the report says it."""
        target = self.demote.get(fqn) or self.promote.get(fqn)
        for r in self.rows:
            if r.fqn == fqn and (r.verdict == "demote" or r.measured is target):
                return r.reason
        raise KeyError(f"{shown(fqn)} is neither to demote nor to promote in this re-check.")

    def amended_policy(self, *, promote: bool = False) -> Policy:
        """The policy with the demotions written in (and the promotions, with ``promote``),
        each changing only that layer's own computation, and the re-check in its
        provenance (``tuned.recheck``). A policy with phases keeps them: a promotion applies
        in the phases it was found in; a demotion holds in every phase, the layer computing
        in the safer of the phase's format and its demoted one (as the runtime guard keeps a
        demotion across phase switches), so no later phase's ``formats`` or ``layers`` puts
        it back into a less precise format."""
        phases = range(len(self.policy.phases) + 1)
        wanted: list[dict[str, Format]] = [{} for _ in phases]
        if promote:
            for i in phases:
                wanted[i].update(_lowest(r for r in self.rows
                                         if r.verdict == "may promote" and i in r.phases))
        for i in phases:
            flat = self.policy.phase(i)
            for fqn, fmt in self.demote.items():
                wanted[i][fqn] = safer(wanted[i].get(fqn, flat.format_for(fqn)), fmt)
        amended = amend_phases(self.policy, wanted, self.layers)
        tuned = dict(self.policy.tuned or {})
        tuned["recheck"] = {"demoted": {f: v.value for f, v in self.demote.items()},
                            "promoted": {f: v.value for f, v in self.promote.items()}
                            if promote else {},
                            "listed_promotions": {f: v.value for f, v in self.promote.items()},
                            "step": self.step, "source": self.source}
        return dataclasses.replace(amended, tuned=tuned)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the CLI's YAML report); non-finite numbers as "inf"/"nan" strings."""
        return {"autoprec_recheck": 1, "source": self.source, "policy": self.policy.source,
                "phases": self._phases(), "step": self.step, "budget": self.budget.to_dict(),
                "promote_share": PROMOTE_SHARE, "n_batches": self.n_batches,
                "seconds": round(self.seconds, 3),
                "demote": {f: v.value for f, v in self.demote.items()},
                "promote": {f: v.value for f, v in self.promote.items()},
                "rows": [r.to_dict() for r in self.rows]}

    def _phases(self) -> list[str]:
        """Each phase of the policy, where it starts (the first: from step 0)."""
        return ["from step 0"] + [p.describe() for p in self.policy.phases]

    def format(self) -> str:
        """A text table of every row, then the decisions, for the CLI. Every name from a file
        (layers, the policy's path, its phases' names) is shown bounded and escaped."""
        phased = bool(self.policy.phases)
        rows = [[shown(r.fqn), *([_which(r.phases)] if phased else []), r.format.label,
                 r.measured.label, _pct(r.loss_change), _num(r.grad_error, ".3f"),
                 _num(r.sqnr_db, ".1f"), _pct(r.overflow, ".2f"), r.verdict] for r in self.rows]
        head = ["layer", *(["phase"] if phased else []), "policy", "measured", "loss change",
                "grad error", "SQNR dB", "overflow", "verdict"]
        right = tuple(i + phased for i in (3, 4, 5, 6))
        lines = [text_table(head, rows, right=right)]
        lines.append("")
        if phased:
            source = f" {shown(self.policy.source)}" if self.policy.source else ""
            lines.append(f"the policy{source} has {len(self.policy.phases) + 1} phases, each "
                         "checked: " + "; ".join(f"{i} {shown(d)}"
                                                 for i, d in enumerate(self._phases())))
        b = self.budget
        grad = "no limit" if b.max_grad_error is None else f"{b.max_grad_error:g}"
        lines.append(f"budget: loss change {b.max_loss_increase:.2%}, gradient error {grad}; "
                     f"'may promote' below {PROMOTE_SHARE:g}x of each; {self.n_batches} "
                     f"batch(es), {self.seconds:.1f} s")
        for fqn, fmt in self.demote.items():
            # the row that decided the format (with phases, the one demoted furthest)
            row = next(r for r in self.rows if r.fqn == fqn and r.verdict == "demote"
                       and r.format.demoted() is fmt)
            where = f"; found in {_phases_text(row.phases)}, kept in every phase" if phased \
                else ""
            lines.append(f"demote {shown(fqn)}: {row.format} -> {fmt} ({row.reason}{where})")
        for fqn, fmt in self.promote.items():
            row = next(r for r in self.rows if r.fqn == fqn and r.measured is fmt
                       and r.verdict == "may promote")
            where = f"; in {_phases_text(row.phases)}" if phased else ""
            lines.append(f"may promote {shown(fqn)}: {row.format} -> {fmt} ({row.reason}"
                         f"{where}; applied only on request)")
        if not self.demote and not self.promote:
            lines.append("nothing to demote or promote")
        return "\n".join(lines)


def _lowest(rows: Iterable[RecheckRow]) -> dict[str, Format]:
    """fqn -> the lowest-precision format measured among ``rows``."""
    best: dict[str, Format] = {}
    for r in rows:
        if r.fqn not in best or (r.measured.numerics.precision_rank
                                 > best[r.fqn].numerics.precision_rank):
            best[r.fqn] = r.measured
    return best


def _which(phases: Sequence[int]) -> str:
    return ",".join(map(str, phases))


def _phases_text(phases: Sequence[int]) -> str:
    return f"phase{'s' if len(phases) > 1 else ''} {', '.join(map(str, phases))}"


def _num(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else str(value)


def _pct(value: float, spec: str = "+.3f") -> str:
    return f"{format(100 * value, spec)}%" if math.isfinite(value) else str(value)


# ------------------------------------------------------------------------------ verdicts
def judge(sens: LayerSensitivity, budget: Budget, *, candidate: bool) -> tuple[str, str]:
    """The verdict on one measurement and why: for the policy's own format (``candidate``
    False) "demote" or "keep"; for a lower candidate format "may promote" or "stay". A pure
    function of the numbers (see the module docstring for the rule)."""
    fmt = sens.format
    over = max(sens.act_overflow or 0.0, sens.grad_overflow or 0.0)
    loss, grad = sens.loss_rel_change, sens.grad_rel_error
    limit_grad = budget.max_grad_error
    finite = sens.finite and math.isfinite(loss) and math.isfinite(grad)
    problem = None if finite else f"non-finite loss, gradients or outputs in {fmt}"
    if over > 0.0:  # the cause, where values went beyond the range: say it first
        which = "activations" if (sens.act_overflow or 0.0) >= over else "output gradients"
        problem = (f"{over:.2%} of its {which} beyond {fmt}'s range "
                   f"({fmt.max_value:g}, before loss scaling)"
                   + ("" if finite else ": its loss and gradients are not finite"))
    if not candidate:
        if problem is None and loss > budget.max_loss_increase:
            problem = (f"loss change {loss:+.2%} in {fmt} alone exceeds the budget's "
                       f"{budget.max_loss_increase:.2%}")
        elif problem is None and limit_grad is not None and grad > limit_grad:
            problem = (f"gradient error {grad:.3f} in {fmt} alone exceeds the budget's "
                       f"{limit_grad:g}")
        if problem is not None:
            return "demote", problem
        return "keep", f"within the budget in {fmt} (loss change {loss:+.2%}, gradient error {grad:.3f})"
    share = PROMOTE_SHARE
    if problem is None and abs(loss) >= share * budget.max_loss_increase:
        problem = f"|loss change| {abs(loss):.2%} in {fmt} is not below {share:g}x the budget"
    elif problem is None and limit_grad is not None and grad >= share * limit_grad:
        problem = f"gradient error {grad:.3f} in {fmt} is not below {share:g}x the budget"
    if problem is not None:
        return "stay", problem
    return "may promote", (f"well inside the budget in {fmt} (loss change {loss:+.2%}, "
                           f"gradient error {grad:.3f})")


def _row(fqn: str, fmt: Format, sens: LayerSensitivity, budget: Budget,
         phases: tuple[int, ...] = (0,)) -> RecheckRow:
    verdict, reason = judge(sens, budget, candidate=sens.format is not fmt)
    over = max(sens.act_overflow or 0.0, sens.grad_overflow or 0.0)
    return RecheckRow(fqn=fqn, format=fmt, measured=sens.format,
                      loss_change=sens.loss_rel_change, grad_error=sens.grad_rel_error,
                      sqnr_db=sens.output_sqnr_db, overflow=over, finite=sens.finite,
                      verdict=verdict, reason=reason, phases=phases)


# ------------------------------------------------------------------------------ measuring
def recheck(model: nn.Module, policy: Policy, batches: Sequence[Any], *,
            budget: Budget | None = None,
            loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
            formats: Sequence[Format | str] | None = None,
            progress: Callable[[int, int, str], None] | None = None) -> RecheckResult:
    """Re-measure ``policy``'s layers on ``model``'s current weights with the first-order
    estimate, on ``batches``; see the module docstring for what is measured and judged.

    ``model``: the module (a policy may be applied, a guard attached, torch.compile or DDP
    around it); it is not modified (a private copy is measured). ``budget``: default the
    policy's tuned budget, else ``Budget()``. ``loss_fn(model, batch)``: default the output's
    ``.loss``. ``formats``: the lower formats higher-precision layers are measured in (default,
    in each phase of the policy, the low-precision formats that phase gives the model's
    computing layers).
    ``progress(done, total, label)`` as :func:`~autoprec.measure.measure_sensitivity`'s."""
    return recheck_in_place(_private_copy(model), policy, list(batches), budget=budget,
                         loss_fn=loss_fn, formats=formats, progress=progress)


def recheck_in_place(private: nn.Module, policy: Policy, batches: list, *, budget=None,
                     loss_fn=None, formats=None, progress=None, layers=None) -> RecheckResult:
    """:func:`recheck` on a model the caller owns (measured in place; its hooks, dropout and
    regions may be changed): the command's freshly loaded model, a Rechecker's private copy.
    ``layers``: its computing modules, if already known."""
    t0 = time.perf_counter()
    if not batches:
        raise ValueError("recheck needs at least one batch to measure on; got none.")
    device = device_of(private)
    batches = [move_to(b, device) for b in batches]
    budget = budget or policy.provenance.budget or Budget()
    layers = list(layers) if layers is not None else computing_layers(
        private, batches[0], loss_fn or default_loss)
    plan = _plan(policy, layers, formats)
    # each layer is measured once in each format, whatever the phases it serves
    only = {n: list(dict.fromkeys(m for _, m in pairs)) for n, pairs in plan.items()}
    rows: list[RecheckRow] = []
    if any(only.values()):
        # a factory handing over the private copy: measure_sensitivity would deep-copy a
        # module (a second copy of the weights, each re-check); this one is ours to change
        task = Task(model=lambda: private, batches=batches, loss_fn=loss_fn, device=device,
                    name="recheck")
        fmts = list(dict.fromkeys(f for fs in only.values() for f in fs))
        with _isolated(device):
            found = measure_sensitivity(task, layers, fmts, batches=batches, mode="fast",
                                        only=only, budget=budget, progress=progress)
        for fqn in layers:
            for (own, measured), phases in plan[fqn].items():
                rows.append(_row(fqn, own, found[fqn][measured], budget, tuple(phases)))
    return RecheckResult(policy=policy, budget=budget, rows=tuple(rows), layers=tuple(layers),
                         n_batches=len(batches), seconds=time.perf_counter() - t0)


def _plan(policy: Policy, layers: Sequence[str], formats: Sequence[Format | str] | None
          ) -> dict[str, dict[tuple[Format, Format], list[int]]]:
    """Per computing layer, what to measure, over every phase of the policy: (its format in a
    phase, a format to measure it in) -> the phases where that pair applies. In a phase, a
    layer is measured in its own format when low-precision, then in the phase's lower
    candidates, lowest precision last."""
    fixed = None if formats is None else [
        Format.parse(f, where="in recheck(formats=...)", fp8_recipe=policy.fp8_recipe)
        for f in formats]
    plan: dict[str, dict[tuple[Format, Format], list[int]]] = {fqn: {} for fqn in layers}
    for i in range(len(policy.phases) + 1):
        flat = policy.phase(i)
        for fqn, measured in _phase_plan(flat, layers, fixed).items():
            for fmt in measured:
                plan[fqn].setdefault((flat.format_for(fqn), fmt), []).append(i)
    return plan


def _phase_plan(policy: Policy, layers: Sequence[str],
                formats: Sequence[Format] | None) -> dict[str, list[Format]]:
    """:func:`_plan` for one phase (``policy`` without phases): per computing layer, the
    formats to measure it in. The candidates: ``formats``, else the low-precision formats
    the phase gives the computing layers."""
    lower = {policy.format_for(n) for n in layers} if formats is None else set(formats)
    lower = sorted((f for f in lower if f.numerics.precision_rank > 0),
                   key=lambda f: (f.numerics.precision_rank, f.value))
    plan = {}
    for fqn in layers:
        own = policy.format_for(fqn)
        rank = own.numerics.precision_rank
        plan[fqn] = ([own] if rank > 0 else []) + [
            f for f in lower if f.numerics.precision_rank > rank]
    return plan


@contextlib.contextmanager
def _isolated(device: torch.device):
    """Run a measurement with no effect the training run could see: the RNG state of the CPU
    (and the model's CUDA device) forked, gradients enabled whatever the caller had."""
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.enable_grad():
        yield


def _private_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` to measure: the module under torch.compile/DDP, deep-copied without
    any module's hooks (the guard's watches, others' probes) nor the guard, and with the
    policy's regions removed. Parameters copy their values only (no ``.grad``, no hooks)."""
    live = rewrite.unwrap(model)
    memo: dict[int, Any] = {}
    for m in live.modules():
        for attr in _HOOK_ATTRS:
            hooks = m.__dict__.get(attr)
            if hooks:
                memo[id(hooks)] = type(hooks)()
    guard = get_guard(live)
    keys = [k for k, v in live.__dict__.items() if guard is not None and v is guard]
    if guard is not None:
        memo[id(guard)] = None
    private = copy.deepcopy(live, memo)
    for k in keys:
        private.__dict__.pop(k, None)
    rewrite.remove(private)
    return private


def _copy_weights(live: nn.Module, private: nn.Module) -> None:
    """Copy ``live``'s current parameters and buffers into ``private`` (same names)."""
    mine = dict(private.named_parameters())
    mine.update(private.named_buffers())
    with torch.no_grad():
        for name, t in [*live.named_parameters(), *live.named_buffers()]:
            target = mine.get(name)
            if target is None:
                raise RuntimeError(f"The model gained {quoted(name)} since the re-check copied "
                                   "it; make a new Rechecker after changing the model's modules.")
            if type(t.data) is not torch.Tensor and type(t.data).__name__ == "DTensor":
                raise NotImplementedError(
                    f"{quoted(name)} is sharded (FSDP2 DTensor); the re-check measures a "
                    "whole model on one rank and cannot gather it yet: run it on a checkpoint "
                    "with `autoprec recheck` instead.")
            target.copy_(t.detach())


class _CallFinder(CallAttribution):
    """Which module's own forward makes which registered call (one forward)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, set[str]] = {}

    def attribute(self, call, func, args, kwargs):
        self.calls.setdefault(self.owner(), set()).add(call.name)
        return func(*args, **kwargs)


def computing_layers(model: nn.Module, batch: Any,
                     loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> list[str]:
    """The fqns of ``model``'s modules that compute (``calls.layer_kind``: by class, or by the
    matmul-like calls their own forward runs, found by one no-grad forward on ``batch``), in
    ``named_modules()`` order: the rule the guard and capture use."""
    modules = dict(model.named_modules())
    finder = _CallFinder()
    handles = finder.track(modules.items())
    try:
        with _isolated(device_of(model)), torch.no_grad(), finder:
            loss_fn(model, batch)
    finally:
        for h in handles:
            h.remove()
    return [fqn for fqn, m in modules.items() if fqn and calls.layer_kind(
        m, finder.calls.get(fqn, ())) in calls.COMPUTING_KINDS]


# ------------------------------------------------------------------------------ in training
class Rechecker:
    """Re-checks a guarded model every ``every`` steps of training on the batch at hand, and
    asks the runtime guard to demote what it finds (applied at the guard's next ``step()``,
    on every rank together: a layer any rank asks for is demoted on all)::

        model, scaler, guard = training_kit(model, policy, guard=True)
        rechecker = Rechecker(policy, every=200)
        for step, batch in enumerate(batches, start=1):
            ...forward, backward, optimizer step...
            rechecker.maybe(model, batch, step)     # before guard.step(): applied there
            guard.step()

    Promotions are logged at INFO, never applied. Under torch.distributed each rank
    re-checks its own batch (every rank must call :meth:`maybe` with the same steps);
    FSDP-sharded parameters are not supported (re-check a checkpoint with ``autoprec
    recheck``).

    The model and the training run see nothing of it: a private copy of the model (made on
    the first re-check, then refreshed with the live weights each time) is measured, with the
    RNG state forked.

    Args:
        policy: the policy applied (the guard's policy in force, demotions and phase switches
            included, is what is re-checked).
        every: steps between re-checks, an integer >= 1.
        budget: default the policy's tuned budget, else ``Budget()``.
        loss_fn: ``loss_fn(model, batch)``; default the output's ``.loss``.

    Raises:
        ValueError: ``every`` is not an integer >= 1.
        TypeError: ``policy`` is not a :class:`~autoprec.policy.Policy`.
    """

    def __init__(self, policy: Policy, *, every: int, budget: Budget | None = None,
                 loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Rechecker(every=...) is the number of steps between re-checks, "
                             f"an integer >= 1; got {every!r}.")
        if not isinstance(policy, Policy):
            raise TypeError(f"Rechecker(policy=...) needs a Policy (autoprec.load_policy(path)), "
                            f"got {type(policy).__name__}.")
        self.policy, self.every, self.loss_fn = policy, every, loss_fn
        self.budget = budget or policy.provenance.budget or Budget()
        # re-checks run, the step of the last one, and the demotions asked for (newest last)
        self.runs = 0
        self.last_step: int | None = None
        self.requested: list[dict[str, Any]] = []
        self._live: nn.Module | None = None
        self._private: nn.Module | None = None
        self._layers: list[str] | None = None

    def maybe(self, model: nn.Module, batch: Any, step: int) -> RecheckResult | None:
        """Re-check at every step that is a positive multiple of ``every``; else None."""
        if step <= 0 or step % self.every:
            return None
        return self.check(model, batch, step)

    def check(self, model: nn.Module, batch: Any, step: int) -> RecheckResult:
        """Re-check now on ``batch``; request each demotion from the model's guard."""
        guard = get_guard(model)
        if guard is None:
            raise RuntimeError("Rechecker needs the runtime guard to apply its demotions: apply "
                               "the policy with autoprec.apply(model, policy, guard=True) (or "
                               "training_kit(..., guard=True)).")
        private = self._refresh(model)
        if self._layers is None:
            self._layers = computing_layers(private, move_to(batch, device_of(private)),
                                            self.loss_fn or default_loss)
        policy = guard.policy or self.policy
        if policy.phases:
            # the guard holds a policy with phases only before the first switch: the first
            # phase is in force (a switch hands it one phase); only that one is re-checked
            policy = policy.phase(0)
        result = recheck_in_place(private, policy, [batch], budget=self.budget,
                               loss_fn=self.loss_fn, layers=self._layers)
        result = dataclasses.replace(result, step=step)
        for fqn, fmt in result.demote.items():
            reason = f"re-check at step {step}: {result.reason(fqn)}"
            guard.request_demotion(fqn, reason, where="recheck")
            self.requested = [*self.requested, {"step": step, "fqn": fqn, "to": fmt.value,
                                                "reason": reason}][-_MAX_KEPT:]
            logger.info("autoprec recheck: step %d: asked the guard to demote %s to %s (%s)",
                        step, shown(fqn), fmt, result.reason(fqn))
        for fqn, fmt in result.promote.items():
            logger.info("autoprec recheck: step %d: %s could be promoted from %s to %s (%s); "
                        "not applied: write it into the policy yourself if you want it",
                        step, shown(fqn), policy.format_for(fqn), fmt, result.reason(fqn))
        self.runs, self.last_step = self.runs + 1, step
        return result

    def _refresh(self, model: nn.Module) -> nn.Module:
        """The private copy, holding ``model``'s current weights."""
        live = rewrite.unwrap(model)
        if self._private is None or self._live is not live:
            self._private, self._live, self._layers = _private_copy(model), live, None
        else:
            _copy_weights(live, self._private)
        return self._private

    def state_dict(self) -> dict[str, Any]:
        """Plain data (``torch.load(weights_only=True)``- and JSON-safe): the re-checks run and
        the demotions asked for. The demotions themselves are the guard's state."""
        return {"version": _STATE_VERSION, "every": self.every, "runs": self.runs,
                "last_step": self.last_step, "requested": [dict(r) for r in self.requested]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take up :meth:`state_dict`'s output; a state of another layout is a ValueError."""
        ok = (isinstance(state, Mapping) and state.get("version") == _STATE_VERSION
              and _is_int(state.get("runs")) and state["runs"] >= 0
              and (state.get("last_step") is None or _is_int(state["last_step"]))
              and isinstance(state.get("requested"), list)
              and all(isinstance(r, Mapping) and _is_int(r.get("step"))
                      and all(isinstance(r.get(k), str) for k in ("fqn", "to", "reason"))
                      for r in state["requested"]))
        if not ok:
            raise ValueError(f"Rechecker.load_state_dict: expected what state_dict() returns "
                             f"(version {_STATE_VERSION}: runs, last_step, requested), got "
                             f"{brief(state)}.")
        self.runs, self.last_step = state["runs"], state["last_step"]
        self.requested = [dict(r) for r in state["requested"]][-_MAX_KEPT:]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
