"""Runtime guard: watch the layers a policy runs in low precision, demote the ones that keep failing.

    autoprec.apply(model, policy, guard=True)         # or guard=GuardConfig(patience=3, save_to=...)
    guard = autoprec.guard.get_guard(model)
    for batch in batches:
        loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        guard.step(scaler=scaler)                     # one host sync per training step
    guard.save("policies/my_model.amended.yaml")      # the policy with the demotions written in

What is watched: every module that computes matmuls (``nn.Linear``, HF ``Conv1D``, convolutions,
and attention modules, which run ``q @ k.T`` themselves) whose format under the policy is one of
``GuardConfig.formats`` (fp16, fp8 and bf16 by default). Norms and embeddings are not: autocast
runs them in FP32 in every format.

What counts as a failure, per step and per watched layer:

- its output holds a non-finite value, or a value above what the layer's format holds
  (fp16: 65504; bf16 and fp8: BF16's max, which fp8 layers output; their FP8 operands are
  rescaled per tensor into E4M3/E5M2 range, so a finite operand never overflows FP8 itself);
- the gradient reaching its output (dL/d output, what its backward consumes) is non-finite or
  above that limit. With an enabled ``GradScaler`` these are first the scaler's to handle (it
  skips the step and halves the scale): they count only once its scale is at or below
  ``GuardConfig.min_loss_scale`` (1.0: the gradient overflows unscaled).

Attribution: a non-finite value propagates, so in one step many layers fail because of one.
The guard blames the *first* failing layer in execution order (forward order for outputs,
backward order for gradients; a step with a failing output is judged on its outputs only). A
blamed layer becomes a suspect: from the next step on its inputs are checked as well, and a
layer whose inputs were already non-finite is cleared (the fault lies upstream, perhaps in an
unwatched layer) and the blame moves to the next failing layer. Suspects also get the fraction
of failing values measured, for the log. A layer blamed ``patience`` steps in a row is demoted
one step (``Format.demoted()``: fp8 -> bf16 -> fp32, fp16 -> fp32) for the rest of the run, by
re-applying the policy amended with ``{fqn: new_format}`` (the module tree, parameters and
``state_dict`` are untouched; a parent's children that inherited its format are pinned to it,
so only the parent's own computation changes).

Cost: one fused reduction (``torch.aminmax``) per watched output and per watched gradient,
kept on the device; ``step()`` reads them all with a single host sync. Nothing is watched
while autograd is off (evaluation).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoprec.formats import Format
from autoprec.policy import Policy
from autoprec.rewrite import _Region, apply

__all__ = ["GuardConfig", "GuardEvent", "Guard", "get_guard"]

logger = logging.getLogger(__name__)

_GUARD_ATTR = "_autoprec_guard"
_ATTENTION_CLASS_NAME = re.compile(r"atten|attn", re.IGNORECASE)
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


@dataclass(frozen=True)
class GuardConfig:
    """How the runtime guard judges and demotes layers."""

    # Consecutive steps a layer must be blamed before it is demoted.
    patience: int = 2
    # Watch dL/d(output) of each watched layer as well as its outputs.
    check_gradients: bool = True
    # Layers whose policy format is one of these are watched.
    formats: tuple[Format, ...] = (Format.FP16, Format.FP8, Format.BF16)
    # With an enabled GradScaler, non-finite gradients count against a layer only once the
    # scaler's scale is at or below this (above it, backing off the scale is the remedy).
    min_loss_scale: float = 1.0
    # Write the amended policy here after every demotion (None: only on guard.save()).
    save_to: str | None = None

    def __post_init__(self):
        if int(self.patience) != self.patience or self.patience < 1:
            raise ValueError(f"GuardConfig.patience must be a positive integer, got "
                             f"{self.patience!r}.")
        formats = tuple(Format.parse(f, where="in GuardConfig.formats") for f in self.formats)
        if Format.FP32 in formats:
            raise ValueError("GuardConfig.formats cannot include fp32: an fp32 layer has no "
                             "safer format to be demoted to. Use a subset of fp16, fp8, bf16.")
        object.__setattr__(self, "formats", formats)
        if not self.min_loss_scale > 0:
            raise ValueError(f"GuardConfig.min_loss_scale must be positive, got "
                             f"{self.min_loss_scale!r}.")
        if self.save_to is not None:
            object.__setattr__(self, "save_to", os.fspath(self.save_to))


@dataclass(frozen=True)
class GuardEvent:
    """One demotion."""

    # Training step at which the layer was demoted (guard.step() count, or the step passed).
    step: int
    # Module fqn of the demoted layer.
    fqn: str
    old: Format
    new: Format
    # What was measured, e.g. "12% of outputs overflow fp16 max 65504 (2 steps in a row)".
    reason: str
    # "outputs" or "gradients".
    where: str

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "layer": self.fqn, "from": self.old.value,
                "to": self.new.value, "reason": self.reason}

    def __str__(self) -> str:
        return f"step {self.step}: {self.fqn} {self.old} -> {self.new} ({self.reason})"


def get_guard(model: nn.Module) -> Guard | None:
    """The guard ``autoprec.apply(model, policy, guard=...)`` attached to ``model``, or None."""
    return model.__dict__.get(_GUARD_ATTR)


def _computes(module: nn.Module) -> bool:
    """Modules whose own forward runs matmul-like ops: the layers worth watching."""
    if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
        return True
    # HF transformers.pytorch_utils.Conv1D (GPT-2), matched by name: no transformers import.
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return True
    return bool(_ATTENTION_CLASS_NAME.search(type(module).__name__))


def _limit(fmt: Format) -> float:
    """Largest magnitude a layer of ``fmt`` can hand on: the range of its output dtype."""
    return float(torch.finfo(torch.float16).max) if fmt is Format.FP16 else _BF16_MAX


def _first_tensor(obj: Any, depth: int = 0) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if depth > 1:
        return None
    if isinstance(obj, Mapping):
        obj = obj.values()
    if isinstance(obj, (tuple, list)) or isinstance(obj, type({}.values())):
        for item in obj:
            t = _first_tensor(item, depth + 1)
            if t is not None:
                return t
    return None


def _record(store: dict, fqn: str, t: torch.Tensor) -> None:
    """Fold ``t``'s (min, max) into ``store[fqn]`` on t's device; NaN propagates."""
    if t.numel() == 0:
        return
    mn, mx = torch.aminmax(t)
    prev = store.get(fqn)
    store[fqn] = (mn, mx) if prev is None else (torch.minimum(prev[0], mn),
                                                torch.maximum(prev[1], mx))


def _record_fraction(store: dict, fqn: str, t: torch.Tensor, limit: float) -> None:
    """Fraction of ``t``'s values that are NaN or above ``limit`` in magnitude (suspects only)."""
    if t.numel() == 0:
        return
    frac = ((t.abs() > limit) | t.isnan()).float().mean()
    prev = store.get(fqn)
    store[fqn] = frac if prev is None else torch.maximum(prev, frac)


def _read(tensors: list[torch.Tensor]) -> list[float]:
    """Host values of many 0-d tensors: one transfer (one sync) per device."""
    out: list[float] = [0.0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        values = torch.stack([tensors[i].float() for i in idx]).tolist()
        for i, v in zip(idx, values):
            out[i] = v
    return out


def _amax(mn: float, mx: float) -> float:
    if math.isnan(mn) or math.isnan(mx):
        return math.nan
    return max(abs(mn), abs(mx))


def _bad(amax: float, limit: float) -> bool:
    return not (amax <= limit)  # NaN compares False: bad


class _Watch:
    """The hooks of one watched module. Bound methods rather than closures, so that
    ``copy.deepcopy(model)`` gives the copy hooks that report to the copy's guard."""

    def __init__(self, guard: Guard, fqn: str, limit: float):
        self.guard = guard
        self.fqn = fqn
        self.limit = limit

    def forward_hook(self, module, args, kwargs, output):
        if not torch.is_grad_enabled():
            return None  # evaluation: not watched
        out = _first_tensor(output)
        if out is None or not out.is_floating_point():
            return None
        g = self.guard
        d = out.detach()
        _record(g._fwd, self.fqn, d)
        if self.fqn in g._suspects:
            x = _first_tensor(args)
            if x is None:
                x = _first_tensor(kwargs)
            if x is not None and x.is_floating_point():
                _record(g._fwd_in, self.fqn, x.detach())
            _record_fraction(g._fwd_frac, self.fqn, d, self.limit)
        if g.config.check_gradients and out.requires_grad:
            out.register_hook(self.grad_hook)
        return None

    def grad_hook(self, grad):
        g = self.guard
        _record(g._bwd, self.fqn, grad)
        if self.fqn in g._suspects:
            _record_fraction(g._bwd_frac, self.fqn, grad, self.limit)
        return None


@dataclass
class _Failure:
    fqn: str
    where: str  # "outputs" | "gradients"
    amax: float
    fraction: float | None
    scale: float | None = None


class Guard:
    """Watches a policy-applied model in training and demotes layers that keep failing.

    Made by ``autoprec.apply(model, policy, guard=True | GuardConfig(...))``; get it back with
    :func:`get_guard`. Call :meth:`step` once per training step (after the optimizer step); it
    returns the demotions it made. See the module docstring for what is measured.
    """

    def __init__(self, config: GuardConfig | None = None):
        self.config = config or GuardConfig()
        # Demotions so far, in order.
        self.events: list[GuardEvent] = []
        # The policy in force on the model (the original one, amended by each demotion).
        self.policy: Policy | None = None
        self.model: nn.Module | None = None
        # GradScaler consulted by step() when none is passed (set by autoprec.integrations).
        self.scaler: torch.amp.GradScaler | None = None
        self._original: Policy | None = None
        self._watched: dict[str, Format] = {}
        self._handles: list = []
        self._step = 0
        self._counts: dict[str, int] = {}
        self._suspects: set[str] = set()
        self._reset_records()

    # ---------------------------------------------------------------- attach / detach
    @classmethod
    def _coerce(cls, guard: Any) -> Guard:
        if guard is True:
            return cls()
        if isinstance(guard, GuardConfig):
            return cls(guard)
        if isinstance(guard, Guard):
            return guard
        raise TypeError(f"apply(..., guard={guard!r}): expected True, a GuardConfig, a Guard, "
                        "or None/False for no guard.")

    def attach(self, model: nn.Module, policy: Policy) -> Guard:
        """Watch ``model`` (to which ``policy`` is applied). Called by ``autoprec.apply``."""
        if self.model is not None and self.model is not model:
            self.detach()
        self._remove_hooks()
        self.model = model
        self.policy = policy
        if self._original is None:
            self._original = policy
        self._watched = {}
        for fqn, module in model.named_modules():
            if not _computes(module):
                continue
            fmt = policy.format_for(fqn)
            if fmt not in self.config.formats:
                continue
            self._watched[fqn] = fmt
            watch = _Watch(self, fqn, _limit(fmt))
            self._handles.append(module.register_forward_hook(watch.forward_hook,
                                                              with_kwargs=True))
        model.__dict__[_GUARD_ATTR] = self
        return self

    def detach(self) -> None:
        """Stop watching (the model keeps its current policy)."""
        self._remove_hooks()
        if self.model is not None and self.model.__dict__.get(_GUARD_ATTR) is self:
            del self.model.__dict__[_GUARD_ATTR]
        self.model = None
        self._reset_records()

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _reset_records(self) -> None:
        self._fwd: dict[str, tuple] = {}
        self._bwd: dict[str, tuple] = {}
        self._fwd_in: dict[str, tuple] = {}
        self._fwd_frac: dict[str, torch.Tensor] = {}
        self._bwd_frac: dict[str, torch.Tensor] = {}

    @property
    def watched(self) -> dict[str, Format]:
        """fqn -> format of every layer being watched now."""
        return dict(self._watched)

    # ---------------------------------------------------------------- the per-step check
    def step(self, *, scaler: torch.amp.GradScaler | None = None,
             step: int | None = None) -> list[GuardEvent]:
        """Judge the training step that just ran; demote layers that failed ``patience`` steps
        in a row. Call once per optimizer step (after ``scaler.update()``). ``scaler``: the
        GradScaler in use (default: ``self.scaler``); ``step``: the step number to log
        (default: count of calls). Returns the demotions made now."""
        self._step = self._step + 1 if step is None else int(step)
        model = self.model
        if model is None:
            return []
        if model.__dict__.get("_autoprec_policy") is None:
            # autoprec.remove(model) ran: nothing left to guard
            self.detach()
            return []
        fwd, bwd, fwd_in = self._fwd, self._bwd, self._fwd_in
        fwd_frac, bwd_frac = self._fwd_frac, self._bwd_frac
        self._reset_records()
        if not fwd and not bwd:
            return []  # no training forward since the last step

        # one host sync for everything recorded in this step
        tensors: list[torch.Tensor] = []
        for store in (fwd, bwd, fwd_in):
            for mn, mx in store.values():
                tensors += [mn, mx]
        fracs = list(fwd_frac.values()) + list(bwd_frac.values())
        values = iter(_read(tensors + fracs))
        amax = {key: {fqn: _amax(next(values), next(values)) for fqn in store}
                for key, store in (("fwd", fwd), ("bwd", bwd), ("in", fwd_in))}
        frac = {"fwd": {fqn: next(values) for fqn in fwd_frac},
                "bwd": {fqn: next(values) for fqn in bwd_frac}}

        failure, cleared = self._blame(amax, frac, scaler if scaler is not None else self.scaler)
        blamed = failure.fqn if failure is not None else None
        self._counts = {blamed: self._counts.get(blamed, 0) + 1} if blamed else {}
        self._suspects = cleared | ({blamed} if blamed else set())
        if failure is None:
            return []
        count = self._counts[blamed]
        if count < self.config.patience:
            logger.info("autoprec guard: step %d: %s (%s) failed: %s (%d of %d steps before "
                        "demotion)", self._step, blamed, self._watched.get(blamed),
                        self._describe(failure), count, self.config.patience)
            return []
        return [self._demote(failure, count)]

    def _blame(self, amax, frac, scaler) -> tuple[_Failure | None, set[str]]:
        """The layer to blame for this step (or None) and the layers cleared of blame."""
        cleared: set[str] = set()
        limits = {fqn: _limit(fmt) for fqn, fmt in self._watched.items()}
        fwd_failed = False
        for fqn, a in amax["fwd"].items():
            if fqn not in limits or not _bad(a, limits[fqn]):
                continue
            fwd_failed = True
            a_in = amax["in"].get(fqn)
            if a_in is not None and not math.isfinite(a_in):
                cleared.add(fqn)  # its input was already non-finite: the fault is upstream
                continue
            return _Failure(fqn, "outputs", a, frac["fwd"].get(fqn)), cleared
        if fwd_failed:
            return None, cleared  # only layers cleared of blame failed; nothing to demote
        for fqn, a in amax["bwd"].items():
            if fqn not in limits or not _bad(a, limits[fqn]):
                continue
            scale = None
            if scaler is not None and scaler.is_enabled():
                scale = float(scaler.get_scale())
                if scale > self.config.min_loss_scale:
                    logger.debug("autoprec guard: step %d: non-finite gradient at %s left to "
                                 "the GradScaler (scale %g)", self._step, fqn, scale)
                    return None, cleared
            return _Failure(fqn, "gradients", a, frac["bwd"].get(fqn), scale), cleared
        return None, cleared

    def _describe(self, f: _Failure) -> str:
        fmt = self._watched.get(f.fqn, Format.FP32)
        limit = _limit(fmt)
        what = f.where
        share = f"{f.fraction:.0%} of {what}" if f.fraction is not None else f"{what}"
        limit_name = "fp16" if fmt is Format.FP16 else "bf16"
        if math.isnan(f.amax):
            text = f"non-finite {what} (NaN)" if f.fraction is None else \
                f"non-finite {what} (NaN; {share} NaN or inf)"
        elif math.isinf(f.amax) and fmt is not Format.FP16:
            text = f"non-finite {what} (inf)" if f.fraction is None else \
                f"non-finite {what} ({share} inf)"
        else:
            verb = "overflow" if f.fraction is not None else f"{what} overflow"
            subject = share if f.fraction is not None else ""
            text = f"{subject} {verb} {limit_name} max {limit:g} (amax {f.amax:g})".strip()
        if f.scale is not None:
            text += f", loss scale {f.scale:g}"
        return text

    # ---------------------------------------------------------------- demotion
    def _demote(self, failure: _Failure, count: int) -> GuardEvent:
        fqn = failure.fqn
        old = self._watched[fqn]
        new = old.demoted()
        reason = f"{self._describe(failure)}; {count} steps in a row"
        updates = self._updates(fqn, new)
        event = GuardEvent(step=self._step, fqn=fqn, old=old, new=new, reason=reason,
                           where=failure.where)
        self.events.append(event)
        self._counts.pop(fqn, None)
        self._suspects.discard(fqn)
        self._reapply(self.policy.with_layers(updates))
        logger.warning("autoprec guard: demoted %s", event)
        if self.config.save_to:
            self.save(self.config.save_to)
        return event

    def _updates(self, fqn: str, new: Format) -> dict[str, Format]:
        """Layer entries that change ``fqn``'s own computation to ``new`` and nothing else:
        computing descendants that inherited its format are pinned to their current one."""
        updates = {fqn: new}
        amended = self.policy.with_layers(updates)
        prefix = fqn + "."
        for name, module in self.model.named_modules():
            if name.startswith(prefix) and _computes(module):
                before = self.policy.format_for(name)
                if amended.format_for(name) is not before:
                    updates[name] = before
        return updates

    def _reapply(self, policy: Policy) -> None:
        model = self.model
        names = {id(m): n for n, m in model.named_modules()}
        before = _applied_formats_by_fqn(model)
        # Wrappers installed around a region after apply (Accelerate's autocast around the
        # root's forward when its mixed_precision is not "no") would be dropped by re-applying;
        # put them back where the module's format does not change.
        foreign = {}
        for module, _, _ in model.__dict__.get("_autoprec_applied") or []:
            fwd = module.__dict__.get("forward")
            if fwd is not None and not isinstance(fwd, _Region):
                foreign[module] = fwd
        with warnings.catch_warnings():
            # the policy was checked when first applied; its warnings need not repeat
            warnings.simplefilter("ignore")
            apply(model, policy, strict=False, guard=self)
        after = _applied_formats_by_fqn(model)
        for module, fwd in foreign.items():
            fqn = names.get(id(module))
            if fqn is not None and before.get(fqn) is after.get(fqn):
                module.forward = fwd

    # ---------------------------------------------------------------- the amended policy
    def amended_policy(self) -> Policy:
        """The policy in force now: the original with every demotion written into ``layers``,
        and the demotions listed under ``tuned.guard`` (provenance)."""
        if self.policy is None:
            raise RuntimeError("This guard was never attached; autoprec.apply(model, policy, "
                               "guard=True) attaches one.")
        if not self.events:
            return self.policy
        tuned = dict(self.policy.tuned or {})
        tuned["guard"] = [e.to_dict() for e in self.events]
        return self.policy.with_layers({}, tuned=tuned)

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`amended_policy` as a policy file, with the demotions as comments."""
        path = os.fspath(path)
        text = self.amended_policy().to_yaml()
        lines = [f"# amended by the autoprec runtime guard: {e}\n" for e in self.events]
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(lines) + text)
        os.replace(tmp, path)

    def __repr__(self) -> str:
        return (f"<autoprec Guard watching {len(self._watched)} layers, "
                f"{len(self.events)} demotion(s)>")


def _applied_formats_by_fqn(model: nn.Module) -> dict[str, Format]:
    from autoprec.rewrite import applied_formats

    return applied_formats(model)


def _names(modules: Iterable[tuple[str, nn.Module]]) -> dict[int, str]:  # pragma: no cover
    return {id(m): n for n, m in modules}


_ = dataclasses, field  # re-exported names used by type checkers only
