"""Runtime guard: watch the layers a policy runs in low precision, demote the ones that keep failing.

    autoprec.apply(model, policy, guard=True)         # or guard=GuardConfig(patience=3, save_to=...)
    guard = autoprec.get_guard(model)
    for batch in batches:
        loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        guard.step(scaler=scaler)                     # one host sync per training step
    guard.save("policies/my_model.amended.yaml")      # the policy with the demotions written in

What is watched: every module that computes (``autoprec.runtime.calls.layer_kind``, the rule
capture uses too: ``nn.Linear``, HF ``Conv1D``, convolutions, and any module whose own forward
runs a matmul-like call of the registry, such as an attention core running ``q @ k.T``) whose
format under the policy is one of ``GuardConfig.formats`` (fp16, fp8 and bf16 by default).
Modules that compute by their class are known at once; the others are found on the first
training forward, by watching which module runs which registered call (their outputs are
checked from that forward on). Norms and embeddings are not watched: autocast runs them in FP32
in every format.

What counts as a failure, per step and per watched layer:

- its output holds a non-finite value, or a value above what the layer's format holds
  (fp16: 65504; bf16 and fp8: BF16's max, which fp8 layers output; their FP8 operands are
  rescaled per tensor into E4M3/E5M2 range, so a finite operand never overflows FP8 itself);
- the gradient reaching its output (dL/d output, what its backward consumes) is non-finite or
  above that limit, or (fp16 layers) the gradient of its own weights is non-finite (a tied
  weight, such as GPT-2's ``lm_head``/``wte``, is not its own). With an enabled ``GradScaler`` these are
  first the scaler's to handle (it skips the step and halves the scale): they count only once
  its scale is at or below ``GuardConfig.min_loss_scale`` (1.0: the gradient overflows
  unscaled).

Attribution: a non-finite value propagates, so in one step many layers fail because of one.
The guard blames the *first* failing layer in execution order: forward order for outputs (a
step with a failing output is judged on its outputs only), then for gradients a layer whose
own weight gradient fails while the gradient at its output is finite (its backward
overflowed), else the first in backward order whose output gradient fails. A blamed layer
becomes a suspect: from the next step on its inputs are checked as well, and a layer whose
inputs were already non-finite is cleared (the fault lies upstream, perhaps in an unwatched
layer) and the blame moves to the next failing layer. Suspects also get the share of failing
values measured, for the log. A layer blamed ``patience`` steps in a row is demoted one step
(``Format.demoted()``: fp8 -> bf16 -> fp32, fp16 -> fp32) for the rest of the run, by
re-applying the policy amended with ``{fqn: new_format}`` (the module tree, parameters and
``state_dict`` are untouched; a parent's children that inherited its format are pinned to it,
so only the parent's own computation changes).

Under torch.distributed (DDP, FSDP) each ``step()`` combines the ranks' verdicts with one
all_reduce(MAX) of a flag per watched layer, so every rank demotes the same layers at the same
step and holds the same events and amended policy (``save_to`` is written by rank 0). Every
rank must call ``step()``. ``state_dict()``/``load_state_dict()`` carry the demotions through
a checkpoint (see ``autoprec.runtime.integrations`` for the Trainer and Accelerate).

Cost: one fused reduction per watched output, output gradient and own weight gradient, kept on
the device: ``torch.aminmax`` for fp16 layers (a finite FP32 value can exceed 65504), a plain
``sum`` elsewhere (non-finite exactly when a value is; about twice as fast). ``step()`` reads
them all with one host sync per device. Nothing is watched while autograd is off (evaluation).
Measured on GPT-2 4x256, batch 16x128, 20 layers watched: about 1-2% of a CPU training step
(``benchmarks/bench_guard.py``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from autoprec._util import atomic_write, tensors
from autoprec.formats import FP8_FORMATS, Format
from autoprec.policy import Policy, PolicyError
from autoprec.runtime import calls, rewrite

__all__ = ["GuardConfig", "GuardEvent", "Guard", "get_guard"]

logger = logging.getLogger(__name__)

_GUARD_ATTR = "_autoprec_guard"
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)
# What the hooks record per watched layer: outputs, inputs (suspects only), the gradient at the
# output, the gradients of the layer's own parameters.
_KINDS = ("out", "in", "grad", "ingrad", "wgrad")
# Version of Guard.state_dict()'s layout.
_STATE_VERSION = 1


@dataclass(frozen=True)
class GuardConfig:
    """How the runtime guard judges and demotes layers."""

    # Consecutive steps a layer must be blamed before it is demoted (>= 2: see __post_init__).
    patience: int = 2
    # Watch dL/d(output) of each watched layer as well as its outputs.
    check_gradients: bool = True
    # Layers whose policy format is one of these are watched.
    formats: tuple[Format, ...] = (Format.FP16, *FP8_FORMATS, Format.BF16)
    # With an enabled GradScaler, non-finite gradients count against a layer only once the
    # scaler's scale is at or below this (above it, backing off the scale is the remedy).
    min_loss_scale: float = 1.0
    # Write the amended policy here after every demotion (None: only on guard.save()). Under
    # torch.distributed only rank 0 writes it (every rank holds the same amended policy).
    save_to: str | None = None
    # Under an initialized torch.distributed, every rank demotes the same layers at the same
    # step (one small all_reduce per step). False: each rank decides for itself (ranks that hold
    # different parts of the model, e.g. pipeline stages).
    distributed: bool = True

    def __post_init__(self):
        if int(self.patience) != self.patience or self.patience < 2:
            raise ValueError(
                f"GuardConfig.patience must be an integer >= 2, got {self.patience!r}: a "
                "layer's first failing step makes it a suspect, and only the next one checks "
                "whether its inputs were already non-finite (the fault upstream, not its own).")
        # a bare "fp8" means every FP8 recipe
        formats = tuple(dict.fromkeys(
            g for f in self.formats
            for g in (FP8_FORMATS if isinstance(f, str) and f.strip().lower() == "fp8"
                      else (Format.parse(f, where="in GuardConfig.formats"),))))
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
    # What was measured, e.g. "26% of outputs overflow fp16 max 65504 (amax inf); 2 steps in
    # a row".
    reason: str
    # "outputs", "gradients" (at the layer's output, beyond its format's range), "weight
    # gradients", or "backward" (it sent non-finite gradients upstream).
    where: str

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "layer": self.fqn, "from": self.old.value,
                "to": self.new.value, "reason": self.reason}

    def __str__(self) -> str:
        return f"step {self.step}: {self.fqn} {self.old} -> {self.new} ({self.reason})"


def get_guard(model: nn.Module) -> Guard | None:
    """The guard ``autoprec.apply(model, policy, guard=...)`` attached to ``model``, or None."""
    return model.__dict__.get(_GUARD_ATTR)


def _limit(fmt: Format) -> float:
    """Largest magnitude a layer of ``fmt`` can hand on: the range of its output dtype."""
    return float(torch.finfo(torch.float16).max) if fmt is Format.FP16 else _BF16_MAX


def _first_tensor(obj: Any) -> torch.Tensor | None:
    found = tensors(obj)
    return found[0] if found else None


def _record(store: dict, fqn: str, t: torch.Tensor, exact: bool = False) -> None:
    """Fold a check of ``t`` into ``store[fqn]``, on t's device; NaN and inf propagate.

    ``exact``: the (min, max) of ``t`` (``torch.aminmax``), for layers whose limit is below
    FP32's range (fp16: 65504). Otherwise ``t.sum()``, twice as fast, stands for both: it is
    non-finite exactly when some value is (or when the values are so large that their sum
    overflows FP32 - an overflow of BF16's range too).
    """
    if t.numel() == 0:
        return
    if exact:
        mn, mx = torch.aminmax(t)
    else:
        mn = mx = t.sum()
    prev = store.get(fqn)
    store[fqn] = (mn, mx) if prev is None else (torch.minimum(prev[0], mn),
                                                torch.maximum(prev[1], mx))


def _record_fraction(store: dict, fqn: str, t: torch.Tensor, limit: float) -> None:
    """Fraction of ``t``'s values that are NaN or above ``limit`` in magnitude (suspects only)."""
    if t.numel() == 0:
        return
    bad = ~torch.isfinite(t) if math.isinf(limit) else (t.abs() > limit) | t.isnan()
    frac = bad.float().mean()
    prev = store.get(fqn)
    store[fqn] = frac if prev is None else torch.maximum(prev, frac)


def _read(tensors: list[torch.Tensor]) -> list[float]:
    """Host values of many 0-d tensors: one stack per (device, dtype), one transfer (one sync)
    per device."""
    out: list[float] = [0.0] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    by_device: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
    for (device, _), idx in groups.items():
        stacked = torch.stack([tensors[i] for i in idx]).float()
        by_device.setdefault(device, []).append((idx, stacked))
    for parts in by_device.values():
        values = torch.cat([t for _, t in parts]).tolist()
        for i, v in zip((i for idx, _ in parts for i in idx), values):
            out[i] = v
    return out


def _is_ancestor(a: str, b: str) -> bool:
    """Whether module ``a`` contains module ``b`` (fqns)."""
    return a == "" or b.startswith(a + ".")


def _amax(mn: float, mx: float) -> float:
    if math.isnan(mn) or math.isnan(mx):
        return math.nan
    return max(abs(mn), abs(mx))


def _bad(amax: float, limit: float) -> bool:
    return not math.isfinite(amax) or amax > limit


class _Watch:
    """The hooks of one watched module. Bound methods rather than closures, so that
    ``copy.deepcopy(model)`` gives the copy hooks that report to the copy's guard."""

    def __init__(self, guard: Guard, fqn: str, limit: float):
        self.guard = guard
        self.fqn = fqn
        self.limit = limit
        self.exact = limit < _BF16_MAX  # fp16: a finite FP32 value can exceed the limit

    def forward_hook(self, module, args, kwargs, output):
        if not torch.is_grad_enabled():
            return None  # evaluation: not watched
        out = _first_tensor(output)
        if out is None or not out.is_floating_point():
            return None
        g = self.guard
        d = out.detach()
        _record(g._amax["out"], self.fqn, d, self.exact)
        if self.fqn in g._suspects:
            x = _first_tensor(args)
            if x is None:
                x = _first_tensor(kwargs)
            if x is not None and x.is_floating_point():
                _record(g._amax["in"], self.fqn, x.detach())
                if g.config.check_gradients and x.requires_grad:
                    # the gradient this layer's backward sends upstream (plus what other
                    # readers of x add): finite means its backward did not make it non-finite
                    x.register_hook(self.input_grad_hook)
            _record_fraction(g._frac["out"], self.fqn, d, self.limit)
        if g.config.check_gradients and out.requires_grad:
            out.register_hook(self.grad_hook)
        return None

    def grad_hook(self, grad):
        g = self.guard
        _record(g._amax["grad"], self.fqn, grad, self.exact)
        if self.fqn in g._suspects:
            _record_fraction(g._frac["grad"], self.fqn, grad, self.limit)
        return None

    def input_grad_hook(self, grad):
        _record(self.guard._amax["ingrad"], self.fqn, grad)
        return None

    def weight_grad_hook(self, grad):
        g = self.guard
        _record(g._amax["wgrad"], self.fqn, grad)
        if self.fqn in g._suspects:
            _record_fraction(g._frac["wgrad"], self.fqn, grad, math.inf)
        return None


class _Diagnosis:
    """For one training forward, every module's first input and output, reduced on the device:
    the first module (in the order modules finish) whose output is non-finite while its input
    was finite is where non-finite values start."""

    def __init__(self, model: nn.Module, *, under: str | None = None,
                 skip: frozenset[str] = frozenset()):
        """Every module, or (``under``) the strict descendants of one, less ``skip``."""
        self.records: list[tuple[str, torch.Tensor | None, torch.Tensor]] = []
        prefix = None if under is None else (f"{under}." if under else "")
        self.handles = [m.register_forward_hook(partial(self.hook, fqn), with_kwargs=True)
                        for fqn, m in model.named_modules()
                        if fqn not in skip and (prefix is None or (fqn.startswith(prefix)
                                                                   and fqn != under))]

    def hook(self, fqn: str, module, args, kwargs, output):
        if not torch.is_grad_enabled():
            return None
        out = _first_tensor(output)
        if out is None or not out.is_floating_point() or out.numel() == 0:
            return None
        x = _first_tensor(args) if _first_tensor(args) is not None else _first_tensor(kwargs)
        x_sum = x.detach().float().sum() if x is not None and x.is_floating_point() else None
        self.records.append((fqn, x_sum, out.detach().float().sum()))
        return None

    def culprit(self) -> str | None:
        values = _read([t for _, x, o in self.records for t in (o, x) if t is not None])
        it = iter(values)
        for fqn, x, _ in self.records:
            out_ok = math.isfinite(next(it))
            in_ok = True if x is None else math.isfinite(next(it))
            if not out_ok and in_ok:
                return fqn
        return None

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


@dataclass
class _Failure:
    fqn: str
    where: str  # "outputs" | "gradients" | "weight gradients" | "backward"
    amax: float
    fraction: float | None
    scale: float | None = None


class _Discovery(TorchFunctionMode):
    """Finds, on the first training forward, the modules that compute by what they run: each
    registered call (``autoprec.runtime.calls``) is attributed to the innermost module running
    it, and :func:`~autoprec.runtime.calls.layer_kind` judges each module by its own calls.
    Then it hands the finds to the guard and removes its hooks."""

    def __init__(self, guard: Guard, modules: dict[str, nn.Module]):
        super().__init__()
        self.guard = guard
        self.stack: list[str] = []
        self.calls: dict[str, set[str]] = {}
        self.active = False
        self.handles = []
        root = modules[""]
        self.handles.append(root.register_forward_pre_hook(self._start))
        # Bound methods (in partials), not closures: copy.deepcopy(model) rebinds them to the
        # copy's guard, as _Watch's hooks. Every module is on the stack (a call belongs to the
        # innermost one); only those not yet known to compute are judged.
        for fqn, module in modules.items():
            self.handles.append(module.register_forward_pre_hook(partial(self._pre, fqn)))
            self.handles.append(module.register_forward_hook(partial(self._post, fqn),
                                                             with_kwargs=True, always_call=True))
        self.handles.append(root.register_forward_hook(self._finish, always_call=True))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        call = calls.lookup(func)
        if call is not None and self.stack:
            self.calls.setdefault(self.stack[-1], set()).add(call.name)
        return func(*args, **(kwargs or {}))

    def _start(self, module, args):
        if torch.is_grad_enabled() and not self.active:
            self.active = True
            self.__enter__()

    def _pre(self, fqn: str, module, args):
        if self.active:
            self.stack.append(fqn)

    def _post(self, fqn: str, module, args, kwargs, output):
        if not self.active:
            return None
        self.stack.pop()
        own = self.calls.get(fqn, set())
        if fqn not in self.guard._layers and \
                calls.layer_kind(module, own) in calls.COMPUTING_KINDS:
            watch = self.guard._discovered(fqn, module, own)
            if watch is not None:
                watch.forward_hook(module, args, kwargs, output)
        return None

    def _finish(self, module, args, output):
        if not self.active:
            return None
        self.__exit__(None, None, None)
        self.active = False
        self.guard._discovery_done = True
        for h in self.handles:
            h.remove()
        self.guard._handles = [h for h in self.guard._handles if h not in self.handles]
        return None


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
        # GradScaler consulted by step() when none is passed (set by autoprec.runtime.integrations).
        self.scaler: torch.amp.GradScaler | None = None
        self._watched: dict[str, Format] = {}
        # fqn -> kind of every module of the model that computes (None: not attached yet).
        self._layers: dict[str, str] | None = None
        self._discovery_done = False
        self._handles: list = []
        self._step = 0
        self._counts: dict[str, int] = {}
        self._suspects: set[str] = set()
        # the one-step watch of every module after an unexplained failure, and who was named
        self._diagnosis: _Diagnosis | None = None
        self._warned: set[str | None] = set()
        # suspect -> probe of its unwatched descendants; this step's finds; the origin named
        self._probes: dict[str, _Diagnosis] = {}
        self._child_faults: dict[str, str] = {}
        self._origin: str | None = None
        # The policy first attached (before any demotion): what a saved state is checked
        # against; a state loaded before attach waits here; _reapply's attach keeps _base.
        self._base: Policy | None = None
        self._pending: dict[str, Any] | None = None
        self._reapplying = False
        self._reset_records()

    # ---------------------------------------------------------------- attach / detach
    @classmethod
    def coerce(cls, guard: Any) -> Guard:
        """A guard from what ``apply(..., guard=...)`` accepts: True, a GuardConfig, a Guard."""
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
            self._layers, self._discovery_done = None, False
        self._remove_hooks()
        self.model = model
        self.policy = policy
        if not self._reapplying:
            self._base = policy
        self._watched = {}
        modules = dict(model.named_modules())
        if self._layers is None:
            # By class now; the modules that compute by what they run, on the first forward.
            self._layers = {fqn: kind for fqn, m in modules.items()
                            if (kind := calls.class_kind(m)) in calls.COMPUTING_KINDS}
        if not self._discovery_done:
            self._handles.extend(_Discovery(self, modules).handles)
        owners: dict[int, int] = {}
        for module in modules.values():
            for p in module.parameters(recurse=False):
                owners[id(p)] = owners.get(id(p), 0) + 1
        for fqn in self._layers:
            self._watch(fqn, modules[fqn], owners)
        model.__dict__[_GUARD_ATTR] = self
        if self._pending is not None and not self._reapplying:
            state, self._pending = self._pending, None
            self._restore(state)
        return self

    def _watch(self, fqn: str, module: nn.Module, owners: dict[int, int]) -> _Watch | None:
        fmt = self.policy.format_for(fqn)
        if fmt not in self.config.formats:
            return None
        self._watched[fqn] = fmt
        watch = _Watch(self, fqn, _limit(fmt))
        self._handles.append(module.register_forward_hook(watch.forward_hook, with_kwargs=True))
        # Weight gradients of fp16 layers only: their FP16 products (a sum over every token)
        # can overflow where the gradient at the output does not. A bf16 product has FP32's
        # range, and fp8's gradients are rescaled into E5M2 and come back FP32.
        if self.config.check_gradients and fmt is Format.FP16:
            for p in module.parameters(recurse=False):
                # a tied weight (GPT-2's lm_head and wte) also gets gradients from its other
                # owners: its gradient says nothing about this module's backward
                if p.requires_grad and owners.get(id(p)) == 1:
                    self._handles.append(p.register_hook(watch.weight_grad_hook))
        return watch

    def _discovered(self, fqn: str, module: nn.Module, own_calls: set[str]) -> _Watch | None:
        """The first training forward found that ``module`` computes by what it runs: watch
        it from now on (the caller checks this forward's output with the watch returned)."""
        self._layers[fqn] = calls.layer_kind(module, own_calls)
        owners: dict[int, int] = {}
        for m in self.model.modules():
            for p in m.parameters(recurse=False):
                owners[id(p)] = owners.get(id(p), 0) + 1
        return self._watch(fqn, module, owners)

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
        if self._diagnosis is not None:
            self._diagnosis.close()
            self._diagnosis = None
        for probe in self._probes.values():
            probe.close()
        self._probes = {}

    def _reset_records(self) -> None:
        # fqn -> (min, max), or (sum, sum), as 0-d tensors on the device (see _record), folded
        # over the calls of one step, of: outputs, inputs (suspects only), gradients at the
        # output, gradients of own parameters.
        self._amax: dict[str, dict[str, tuple]] = {k: {} for k in _KINDS}
        # fqn -> share of failing values (suspects only), for the log
        self._frac: dict[str, dict[str, torch.Tensor]] = {k: {} for k in _KINDS}

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
        if rewrite.applied_policy(model) is None:
            # autoprec.remove(model) ran: nothing left to guard
            self.detach()
            return []
        trained, failure = self._judge(scaler if scaler is not None else self.scaler)
        if self._world() > 1:
            # every rank must reach the same counts, hence the same demotions at the same step
            trained, blamed = self._agree(trained, failure)
        else:
            blamed = [failure.fqn] if failure is not None else []
        if not trained:
            return []  # no training step since the last call (on any rank)
        self._counts = {f: self._counts.get(f, 0) + 1 for f in blamed}
        due = [f for f in blamed if self._counts[f] >= self.config.patience]
        if failure is not None and failure.fqn not in due:
            logger.info("autoprec guard: step %d: %s (%s) failed: %s (%d of %d steps before "
                        "demotion)", self._step, failure.fqn, self._watched.get(failure.fqn),
                        self._describe(failure), self._counts[failure.fqn],
                        self.config.patience)
        if not due:
            return []
        mine = {failure.fqn: (failure.where, self._describe(failure))} \
            if failure is not None else {}
        seen = self._gather(mine) if self._world() > 1 else [mine]
        return [self._demote(f, seen) for f in due]

    def _judge(self, scaler) -> tuple[bool, _Failure | None]:
        """This rank's verdict on the step: whether it trained (anything recorded since the
        last call) and the layer it blames; updates the suspects and warnings."""
        recorded, fractions = self._amax, self._frac
        diagnosis, self._diagnosis = self._diagnosis, None
        self._reset_records()
        if not recorded["out"] and not recorded["grad"] and not recorded["wgrad"]:
            if diagnosis is not None:
                diagnosis.close()
            return False, None

        # one host sync for everything recorded in this step
        tensors = [t for k in _KINDS for pair in recorded[k].values() for t in pair]
        tensors += [t for k in _KINDS for t in fractions[k].values()]
        values = iter(_read(tensors))
        amax = {k: {fqn: _amax(next(values), next(values)) for fqn in recorded[k]}
                for k in _KINDS}
        frac = {k: {fqn: next(values) for fqn in fractions[k]} for k in _KINDS}

        self._child_faults = {fqn: c for fqn, p in self._probes.items()
                              if (c := p.culprit()) is not None}
        self._origin = None
        failure, cleared = self._blame(amax, frac, scaler)
        self._suspects = cleared | ({failure.fqn} if failure is not None else set())
        self._probe_suspects()
        self._explain(diagnosis, failed=failure is None and bool(cleared))
        return True, failure

    # ---------------------------------------------------------------- agreement across ranks
    def _world(self) -> int:
        """Ranks that decide together: torch.distributed's world, when initialized and asked."""
        if not self.config.distributed or not dist.is_available() or not dist.is_initialized():
            return 1
        return dist.get_world_size()

    def _agree(self, trained: bool, failure: _Failure | None) -> tuple[bool, list[str]]:
        """One all_reduce(MAX) of [trained, digest, -digest, one flag per watched layer]: every
        rank learns whether any rank trained and which layers any rank blamed. The digest of
        the watched list, reduced as its max and its negated min, tells every rank alike when
        the ranks watch different layers (the flags would then not line up)."""
        watched = sorted(self._watched)
        digest = int.from_bytes(hashlib.sha256("\n".join(watched).encode()).digest()[:7], "big")
        flags = [0] * (3 + len(watched))
        flags[0], flags[1], flags[2] = int(trained), digest, -digest
        if failure is not None and failure.fqn in self._watched:
            flags[3 + watched.index(failure.fqn)] = 1
        vec = torch.tensor(flags, dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        out = vec.tolist()
        if out[1] != -out[2]:
            raise RuntimeError(
                f"autoprec guard: the ranks watch different layers (rank {dist.get_rank()} "
                f"watches {len(watched)}), so they cannot agree on demotions; apply the same "
                "policy to the same model on every rank, or set GuardConfig(distributed=False) "
                "when the ranks hold different parts of the model.")
        return bool(out[0]), [f for f, flag in zip(watched, out[3:]) if flag]

    def _collective_device(self) -> torch.device:
        """CPU for gloo; else (NCCL and the like) the device the model trains on."""
        backend = str(dist.get_backend())
        if "gloo" in backend or self.model is None:
            return torch.device("cpu")
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _gather(self, mine: dict[str, tuple[str, str]]) -> list[dict[str, tuple[str, str]]]:
        """Every rank's (where, description) of the layer it blamed, on the steps that demote
        (rare): all ranks write the same events, told by the lowest rank that saw each."""
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, mine)
        return seen

    def _blame(self, amax, frac, scaler) -> tuple[_Failure | None, set[str]]:
        """The layer to blame for this step (or None) and the layers cleared of blame."""
        cleared: set[str] = set()
        limits = {fqn: _limit(fmt) for fqn, fmt in self._watched.items()}

        def bad(kind: str, fqn: str) -> bool:
            a = amax[kind].get(fqn)
            limit = math.inf if kind == "wgrad" else limits.get(fqn)
            return a is not None and limit is not None and _bad(a, limit)

        # Outputs, in the order layers finish: the first failing layer whose inputs were
        # finite. One whose input was already non-finite is cleared, and so is every later
        # failing layer downstream of the same fault, except its ancestors (an attention core
        # computes the input of its own c_proj); a suspect whose unwatched descendant (a
        # child the policy keeps in fp32) made the first non-finite values is cleared too.
        fwd_failed = False
        last_cleared = None
        for fqn, a in amax["out"].items():
            if not bad("out", fqn):
                continue
            fwd_failed = True
            if last_cleared is not None and not _is_ancestor(fqn, last_cleared):
                break
            if fqn in self._child_faults:
                cleared.add(fqn)
                self._origin = self._child_faults[fqn]
                break
            a_in = amax["in"].get(fqn)
            if a_in is not None and not math.isfinite(a_in):
                cleared.add(fqn)  # its input was already non-finite: the fault is upstream
                last_cleared = fqn
                continue
            return _Failure(fqn, "outputs", a, frac["out"].get(fqn)), cleared
        if fwd_failed:
            return None, cleared  # only layers cleared of blame failed; nothing to demote

        # Gradients. A layer whose own weight gradient is non-finite while the gradient at its
        # output is finite overflowed in its own backward: certain. Otherwise, in backward
        # order, the first layer whose output gradient fails: beyond its format's range but
        # finite, its format is too narrow for it (its fault); non-finite, it arrived that way
        # (not its fault): the layer whose backward ran just before, its own output gradient
        # finite, made it so, unless its input gradient was seen finite.
        own = [f for f in amax["wgrad"] if bad("wgrad", f) and not bad("grad", f)]
        if own:
            failure = _Failure(own[0], "weight gradients", amax["wgrad"][own[0]],
                               frac["wgrad"].get(own[0]))
        else:
            failure = self._backward_culprit(amax, frac, bad, cleared)
        if failure is None:
            return None, cleared
        if scaler is not None and scaler.is_enabled():
            failure.scale = float(scaler.get_scale())
            if failure.scale > self.config.min_loss_scale:
                logger.debug("autoprec guard: step %d: non-finite %s at %s left to the "
                             "GradScaler (scale %g)", self._step, failure.where, failure.fqn,
                             failure.scale)
                return None, cleared
        return failure, cleared

    def _backward_culprit(self, amax, frac, bad, cleared: set[str]) -> _Failure | None:
        order = list(amax["grad"])
        for i, fqn in enumerate(order):
            if not bad("grad", fqn):
                continue
            a = amax["grad"][fqn]
            if i == 0 and not math.isfinite(a):
                cleared.add(fqn)
                return None  # non-finite from the loss, or layers the guard does not watch
            if math.isfinite(a) or self._watched.get(fqn) is Format.FP16:
                # beyond its format's range; or an fp16 layer, whose output (so the gradient
                # computed for it) is FP16: overflowed there, after a finite gradient upstream
                return _Failure(fqn, "gradients", a, frac["grad"].get(fqn))
            # non-finite in a layer whose gradients have FP32's range: it arrived that way
            cleared.add(fqn)
            before = order[i - 1]
            ingrad = amax["ingrad"].get(before)
            if ingrad is not None and math.isfinite(ingrad):
                cleared.add(before)
                return None
            return _Failure(before, "backward", amax["grad"][before], frac["grad"].get(before))
        return None

    def _probe_suspects(self) -> None:
        """Watch, next step, the unwatched descendants of each suspect (children the policy
        keeps in fp32): whether its failure is theirs."""
        for probe in self._probes.values():
            probe.close()
        skip = frozenset(self._watched)
        self._probes = {fqn: _Diagnosis(self.model, under=fqn, skip=skip)
                        for fqn in self._suspects if self.model is not None}
        self._probes = {f: p for f, p in self._probes.items() if p.handles}

    def _explain(self, diagnosis: _Diagnosis | None, *, failed: bool) -> None:
        """A step went non-finite and nothing the guard can demote caused it: name where the
        non-finite values start (a WARNING: nothing will fix itself), from the suspects' probes
        or, failing those, by watching every module once on the next step."""
        culprit = self._origin
        if diagnosis is not None:
            culprit = culprit if culprit is not None else diagnosis.culprit()
            diagnosis.close()
        if not failed:
            return
        if culprit is None and diagnosis is None:
            if self.model is not None:
                self._diagnosis = _Diagnosis(self.model)
            return
        if culprit not in self._warned:
            self._warned.add(culprit)
            logger.warning("autoprec guard: step %d: %s", self._step, self._unexplained(culprit))

    def _unexplained(self, culprit: str | None) -> str:
        head = ("the training step is non-finite and no layer the guard can demote made it "
                "so (nothing to demote)")
        if culprit is None:
            return (f"{head}: no module's output was non-finite, so the loss computation or "
                    "the data is; check the batch and the loss function.")
        module = self.model.get_submodule(culprit)
        fmt = self.policy.format_for(culprit) if self.policy is not None else None
        return (f"{head}: the first non-finite values come out of `{culprit or '(root)'}` "
                f"({type(module).__name__}, {fmt} under the policy) while its inputs were "
                "finite; check its weights and inputs.")

    def _describe(self, f: _Failure) -> str:
        """What was measured, e.g. "12% of outputs overflow fp16 max 65504 (amax inf)"."""
        fmt = self._watched.get(f.fqn, Format.FP32)
        if f.where == "backward":
            return ("the gradients its backward sent upstream were non-finite, the gradient "
                    "reaching it was finite" + (f", loss scale {f.scale:g}" if f.scale else ""))
        share = None if f.fraction is None else f"{_pct(f.fraction)} of {f.where}"
        exact = fmt is Format.FP16 and f.where != "weight gradients"  # checked by aminmax
        if exact and math.isnan(f.amax):
            text = f"non-finite {f.where} (NaN" + (f"; {share} NaN or inf)" if share else ")")
        elif exact:
            text = f"{share or f.where} overflow fp16 max {_limit(fmt):g} (amax {f.amax:g})"
        elif fmt is Format.FP16:  # an fp16 layer's own weight gradient went non-finite
            text = f"{share or f.where} overflow fp16 max {_limit(fmt):g} (non-finite)"
        else:
            text = f"non-finite {f.where}" + (f" ({share} NaN or inf)" if share else "")
        if f.scale is not None:
            text += f", loss scale {f.scale:g}"
        return text

    # ---------------------------------------------------------------- demotion
    def _demote(self, fqn: str, seen: list[dict[str, tuple[str, str]]]) -> GuardEvent:
        """Demote ``fqn``; ``seen``: per rank, what it measured at the layers it blamed."""
        ranks = [r for r, d in enumerate(seen) if fqn in d]
        where, described = seen[ranks[0]][fqn]
        count = self._counts[fqn]
        old = self._watched[fqn]
        new = old.demoted()
        reason = f"{described}; {count} steps in a row"
        if len(seen) > 1:
            reason += (f" (seen on rank{'s' if len(ranks) > 1 else ''} "
                       f"{', '.join(map(str, ranks))} of {len(seen)})")
        updates = self._updates(fqn, new)
        event = GuardEvent(step=self._step, fqn=fqn, old=old, new=new, reason=reason,
                           where=where)
        self.events.append(event)
        self._counts.pop(fqn, None)
        self._suspects.discard(fqn)
        self._reapply(self.policy.with_layers(updates))
        logger.warning("autoprec guard: demoted %s", event)
        if self.config.save_to and (len(seen) == 1 or dist.get_rank() == 0):
            self.save(self.config.save_to)  # one writer: every rank holds the same policy
        return event

    def _updates(self, fqn: str, new: Format) -> dict[str, Format]:
        """Layer entries that change ``fqn``'s own computation to ``new`` and nothing else:
        computing descendants that inherited its format are pinned to their current one."""
        updates = {fqn: new}
        amended = self.policy.with_layers(updates)
        prefix = fqn + "."
        for name in self._layers or {}:
            if name.startswith(prefix):
                before = self.policy.format_for(name)
                if amended.format_for(name) is not before:
                    updates[name] = before
        return updates

    def _reapply(self, policy: Policy) -> None:
        model = self.model
        names = {id(m): n for n, m in model.named_modules()}
        # Wrappers installed around a region after apply (Accelerate's autocast and FP32 output
        # cast around the root's forward when its mixed_precision is not "no") would be dropped
        # by re-applying; put them back where the module's format does not change (the root's
        # never does: a demotion only adds entries for named layers).
        foreign = {}
        for region in rewrite.regions(model):
            fwd = region.module.__dict__.get("forward")
            fqn = names.get(id(region.module))
            if fwd is not None and not isinstance(fwd, rewrite.Region) and fqn is not None \
                    and policy.format_for(fqn) is self.policy.format_for(fqn):
                foreign[region.module] = fwd
        with warnings.catch_warnings():
            # the policy was checked when first applied; its warnings need not repeat
            warnings.simplefilter("ignore")
            rewrite.apply(model, policy, strict=False)
        self._reapplying = True
        try:
            self.attach(model, policy)
        finally:
            self._reapplying = False
        for module, fwd in foreign.items():
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
        lines = [f"# amended by the autoprec runtime guard: {e}\n" for e in self.events]
        atomic_write(path, "".join(lines) + self.amended_policy().to_yaml())

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The guard's state as plain data (str, int, float, list, dict; ``json``- and
        ``torch.load(weights_only=True)``-safe): the policy it was attached with (less its
        provenance), its watched formats, the step, the layer entries its demotions added, the
        demotions, and the per-layer counts and suspects of the steps in progress. Put it in
        a checkpoint; :meth:`load_state_dict` in the resumed run puts the demotions back."""
        if self._base is None:
            raise RuntimeError("This guard was never attached; autoprec.apply(model, policy, "
                               "guard=True) attaches one.")
        return {
            "autoprec_guard": _STATE_VERSION,
            "policy": _identity(self._base),
            "formats": [f.value for f in self.config.formats],
            "step": self._step,
            "layers": {k: v.value for k, v in self.policy.layers.items()
                       if self._base.layers.get(k) is not v},
            "events": [dict(e.to_dict(), where=e.where) for e in self.events],
            "counts": dict(self._counts),
            "suspects": sorted(self._suspects),
            "warned": sorted(self._warned, key=lambda w: (w is not None, w or "")),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take up the state :meth:`state_dict` returned: the demoted layers are re-applied to
        the model at once (or, before :meth:`attach`, when it attaches). The state must come
        from a guard attached with the same policy, or this guard's policy must be that
        policy amended by the state's demotions (a run resumed from the amended file), and
        watch the same formats: otherwise a :class:`~autoprec.policy.PolicyError`."""
        if not isinstance(state, Mapping) or "autoprec_guard" not in state:
            raise PolicyError(f"Not an autoprec guard state ({type(state).__name__} without the "
                              "key `autoprec_guard`); pass what Guard.state_dict() returned.")
        if state["autoprec_guard"] != _STATE_VERSION:
            raise PolicyError(f"Guard state version {state['autoprec_guard']!r} is not one this "
                              f"autoprec reads ({_STATE_VERSION}); resume with the autoprec "
                              "version that wrote it.")
        if self.model is None:
            self._pending = dict(state)
            return
        self._restore(state)

    def _restore(self, state: Mapping[str, Any]) -> None:
        formats = [f.value for f in self.config.formats]
        if list(state["formats"]) != formats:
            raise PolicyError(
                f"Guard state watched formats {', '.join(state['formats'])} but this guard "
                f"watches {', '.join(formats)}; use GuardConfig(formats=...) as in the "
                "checkpointed run.")
        saved = Policy.from_dict(state["policy"])
        layers = {k: Format.parse(v) for k, v in state["layers"].items()}
        mine = _identity(self._base)
        if state["policy"] == mine:
            amended = self._base.with_layers(layers) if layers else None
        elif _identity(saved.with_layers(layers)) == mine:
            amended = None  # attached with the amended policy already: nothing to re-apply
        else:
            raise PolicyError(
                f"Guard state was saved for another policy ({_difference(state['policy'], mine)}"
                "); load it into a guard attached with the policy the checkpointed run started "
                "from (or its amended policy), or start the guard afresh.")
        self._step = int(state["step"])
        self.events = [GuardEvent(step=int(e["step"]), fqn=e["layer"],
                                  old=Format.parse(e["from"]), new=Format.parse(e["to"]),
                                  reason=e["reason"], where=e["where"])
                       for e in state["events"]]
        self._counts = {k: int(v) for k, v in state["counts"].items()}
        self._warned = set(state["warned"])
        if amended is not None:
            self._reapply(amended)
        self._suspects = set(state["suspects"])
        self._probe_suspects()

    def __repr__(self) -> str:
        return (f"<autoprec Guard watching {len(self._watched)} layers, "
                f"{len(self.events)} demotion(s)>")


def _identity(policy: Policy) -> dict[str, Any]:
    """What makes two policies the same for a guard: everything but the provenance."""
    out = policy.to_dict()
    out.pop("tuned", None)
    return out


def _difference(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> str:
    """The first difference between two policy identities, in words."""
    for key in ("default", "fp8", "model", "loss_scaling"):
        if saved.get(key) != mine.get(key):
            return f"`{key}` is {saved.get(key)} there, {mine.get(key)} here"
    a, b = saved.get("layers", {}), mine.get("layers", {})
    for name in [*a, *(n for n in b if n not in a)]:
        if a.get(name) != b.get(name):
            return (f"layer `{name}` is {a.get(name, 'not listed')} there, "
                    f"{b.get(name, 'not listed')} here")
    return "layer entries in another order"


def _pct(x: float) -> str:
    """12%, or 0.37% for shares under one percent (a rare overflow must not read as 0%)."""
    return f"{x:.0%}" if x >= 0.01 or x == 0 else f"{x * 100:.2g}%"
