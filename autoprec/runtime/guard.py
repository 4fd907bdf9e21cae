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

Attribution: a non-finite value propagates, so in one step many layers fail because of one. The
guard blames the *first* failing layer in execution order: forward order for outputs (a step
with a failing output is judged on its outputs only), then for gradients a layer whose own
weight gradient fails while the gradient at its output is finite (its backward overflowed),
else the first in backward order whose output gradient fails. A non-finite gradient reaching
the first layer of the backward came from the loss or unwatched layers, except, without an
enabled GradScaler, at an fp16 layer: its output, so the gradient computed for it, is FP16, and
the finite FP32 gradient of the layers after it overflowed there (the forward was finite); it
is blamed (a NaN loss from finite outputs, such as NaN targets, would read the same). A blamed
layer becomes a suspect: from the next step on its inputs are checked as well, and a layer
whose inputs were already non-finite is cleared (the fault lies upstream, perhaps in an
unwatched layer) and the blame moves to the next failing layer. Suspects also get the share of
failing values measured, for the log. A layer blamed ``patience`` steps in a row is demoted one
step (``Format.demoted()``: fp8 -> bf16 -> fp32, fp16 -> fp32) for the rest of the run, by
re-applying the policy amended with ``{fqn: new_format}`` (the module tree, parameters and
``state_dict`` are untouched; a parent's children that inherited its format are pinned to it,
so only the parent's own computation changes).

What cannot be demoted away is a WARNING, once: non-finite values that start in a layer the
policy keeps in fp32, in the loss, or in the input batch (named by watching every module on
the next step), and poisoned parameters. Without a GradScaler one non-finite step sends its
gradients through the optimizer into every weight; from then on every layer's output is
non-finite because its weights are, and blaming the first one would demote innocent layers,
one after the other, on a model already lost. So on a failing step (never on a healthy one)
the guard checks the parameters, one max-abs reduction each: non-finite values in the
parameters of more than one module mean poisoned (an optimizer's state, such as Adam's
moments, goes non-finite with the weights, so the parameters tell; the guard does not know
the optimizer). It then demotes nothing and warns once, naming the step since which the
parameters are non-finite (``guard.poisoned_since``) and where the non-finite values began on
that step (``guard.first_nonfinite``: the layer, or None where the guard cannot tell which
unwatched layer it was), that demoting cannot help, and to restore a checkpoint; it judges
again once the parameters are finite (restored). One module's own non-finite parameter (a
bad checkpoint entry) is that module's failure, judged as any other.

Under torch.distributed (DDP, FSDP) each ``step()`` combines the ranks' verdicts with one
all_reduce(MAX) of a flag per watched layer (and one for poisoned parameters), so every rank
demotes the same layers at the same step and holds the same events and amended policy
(``save_to`` is written by rank 0). Every rank must call ``step()``.
``state_dict()``/``load_state_dict()`` carry the demotions through a checkpoint (see
``autoprec.runtime.integrations`` for the Trainer and Accelerate).

Cost: one fused reduction per watched output, output gradient and own weight gradient, kept on
the device: a count of the values above the limit (or NaN) for fp16 layers (a finite FP32 value
can exceed 65504) and for suspects (it gives the share of failing values), a plain ``sum``
elsewhere (non-finite exactly when a value is; about half the cost). ``step()`` reads them all
with one host sync per device. Nothing is watched while autograd is off (evaluation).
Measured on GPT-2 4x256, batch 16x128, 20 layers watched: about 1-2% of a CPU training step
(``benchmarks/bench_guard.py``).

Under ``torch.compile`` the checks add no graph break: while dynamo traces, a watched layer's
output goes through a custom autograd function (``_Probe``) whose backward hands the checks,
forward and backward, to a small leaf tensor of the watch as its gradient; ``step()`` reads
those with the eager records. Python state changes only between steps (suspects, demotions:
a recompile then). The order in which layers ran (for blame) is the one seen eagerly, else the
order modules finish. Modules a compiled first training forward finds to compute by what they
run (attention cores) are hooked at the next ``step()`` (registering a hook while dynamo traces
is a graph break), so that one forward does not check them; with activation checkpointing that
first forward still compiles in pieces (the search's records inside the checkpoint).
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
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoprec._util import atomic_write, escape_line, tensors
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
# What the diagnosis names when the non-finite values were in the model's inputs already
# (in Guard._warned: no module is named so, a name holds no "<").
_INPUT = "<input batch>"


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
    # What was measured, e.g. "26% of outputs overflow fp16 max 65504 or are NaN; 2 steps in
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
    """The guard ``autoprec.apply(model, policy, guard=...)`` attached to ``model``, or None;
    ``model`` may be the wrapper (torch.compile, DataParallel, DDP) the policy went through."""
    return rewrite.unwrap(model).__dict__.get(_GUARD_ATTR)


def _limit(fmt: Format) -> float:
    """Largest magnitude a layer of ``fmt`` can hand on: the range of its output dtype."""
    return float(torch.finfo(torch.float16).max) if fmt is Format.FP16 else _BF16_MAX


def _first_tensor(obj: Any) -> torch.Tensor | None:
    found = tensors(obj)
    return found[0] if found else None


def _replace_first(obj: Any, new: torch.Tensor) -> Any:
    """``obj`` (a tensor, or a tuple/list/dict of them, as modules return) with its first
    tensor replaced by ``new``."""
    leaves, spec = tree_flatten(obj)
    i = next(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
    return tree_unflatten([new if j == i else leaf for j, leaf in enumerate(leaves)], spec)


def _stat(t: torch.Tensor, count: bool, limit: float) -> torch.Tensor:
    """One FP32 number on ``t``'s device that sums over calls and says whether ``t`` failed.

    ``count``: how many values are NaN or above ``limit`` in magnitude (infinite ``limit``: how
    many are non-finite); exact, and gives the share of failing values; used for fp16 layers,
    whose limit 65504 a finite FP32 value can exceed, and for suspects. Otherwise ``t.sum()``,
    about half the cost: non-finite exactly when some value is (or when the values are so large
    that their sum overflows FP32, an overflow of BF16's range too).
    """
    t = t.detach()
    if count:
        ok = torch.isfinite(t) if math.isinf(limit) else t.abs() <= limit  # NaN is never ok
        return (~ok).sum(dtype=torch.float32)
    return t.sum().float()


# Layout of a compiled step's record of one watched layer (see _Probe): the failure number of
# _stat and the count of values it covers, for outputs, gradients at the output, inputs and
# gradients sent to the input.
_OUT, _GRAD, _IN, _INGRAD = 0, 2, 4, 6
_ROW = 8
_SLOTS = {"out": _OUT, "grad": _GRAD, "in": _IN, "ingrad": _INGRAD}


class _Probe(torch.autograd.Function):
    """How a watched layer reports under ``torch.compile``: without Python side effects.

    Identity on ``t`` (a copy: a view returned by a custom Function may not be modified in
    place, and a layer's output often is); its backward hands ``sink`` (a leaf of the watch)
    the gradient ``row`` (what the forward measured) plus, at ``slot``, the check of the
    gradient reaching ``t``. The numbers arrive in ``sink.grad``, summed over calls and
    micro-batches, and ``Guard.step`` reads them. Forward and backward stay one graph (no dict
    writes, no tensor hooks), inside activation checkpointing too.
    """

    @staticmethod
    def forward(ctx, t, sink, row, slot, count, limit):
        ctx.save_for_backward(row)
        ctx.slot, ctx.count, ctx.limit = slot, count, limit
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        (row,) = ctx.saved_tensors
        if ctx.slot is not None:
            found = torch.stack([_stat(grad, ctx.count, ctx.limit),
                                 row.new_ones(()) * grad.numel()])
            row = torch.cat([row[:ctx.slot], found, row[ctx.slot + 2:]])
        return grad, row, None, None, None, None


def _read(values: list[torch.Tensor]) -> list[list[float]]:
    """Host values of many small tensors, each flattened: one transfer (one host sync) per
    device."""
    out: list[list[float]] = [[] for _ in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(values):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        flat = torch.cat([values[i].detach().float().reshape(-1) for i in idx]).tolist()
        pos = 0
        for i in idx:
            n = values[i].numel()
            out[i], pos = flat[pos:pos + n], pos + n
    return out


def _is_ancestor(a: str, b: str) -> bool:
    """Whether module ``a`` contains module ``b`` (fqns)."""
    return a == "" or b.startswith(a + ".")


def _bad(level: float, limit: float) -> bool:
    return not math.isfinite(level) or level > limit


def _finish_order(model: nn.Module) -> dict[str, int]:
    """fqn -> rank in the order modules finish their forward when each runs its children in
    definition order (children before their parent): where a forward order is needed before
    the guard has seen one eagerly."""
    order: dict[str, int] = {}

    def visit(module: nn.Module, fqn: str) -> None:
        for name, child in module.named_children():
            visit(child, f"{fqn}.{name}" if fqn else name)
        order.setdefault(fqn, len(order))

    visit(model, "")
    return order


class _Watch:
    """The hooks of one watched module. Bound methods rather than closures, so that
    ``copy.deepcopy(model)`` gives the copy hooks that report to the copy's guard.

    Eagerly, each check is folded into the guard's records as it is made (and the order in
    which layers ran is learned); while ``torch.compile`` traces, the checks travel through
    :class:`_Probe` into ``sink.grad`` instead, so that they add no graph break.
    """

    def __init__(self, guard: Guard, fqn: str, fmt: Format, device: torch.device):
        self.guard = guard
        self.fqn = fqn
        self.format = fmt
        self.limit = _limit(fmt)
        self.exact = self.limit < _BF16_MAX  # fp16: a finite FP32 value can exceed the limit
        self.device = device
        # made eagerly: a module found to compute during a compiled first forward gets its
        # sink at the next step() (a tensor made with requires_grad is a graph break)
        self.sink = None if torch.compiler.is_compiling() else self.new_sink()

    def new_sink(self) -> torch.Tensor:
        return torch.zeros(_ROW, device=self.device, requires_grad=True)

    def _counts(self, kind: str) -> bool:
        """Whether checks of ``kind`` count failing values (see _stat) rather than sum."""
        if kind == "in":
            return True
        if kind == "ingrad":
            return False
        return (self.exact and kind != "wgrad") or self.fqn in self.guard._suspects

    def _check(self, kind: str, t: torch.Tensor) -> torch.Tensor:
        limit = self.limit if kind in ("out", "grad") else math.inf
        return _stat(t, self._counts(kind), limit)

    def _record(self, kind: str, t: torch.Tensor) -> None:
        if t.numel():
            self.guard._record(kind, self.fqn, self._check(kind, t), t.numel())

    def pre_hook(self, module, args, kwargs):
        """Compiled, for suspects (only they have this hook): route the input through a probe
        that reports the gradient this layer's backward sends upstream (eagerly a tensor hook
        does, in forward_hook)."""
        g = self.guard
        if not (torch.compiler.is_compiling() and torch.is_grad_enabled() and self.sink is not None
                and g.config.check_gradients and self.fqn in g._suspects):
            return None
        x = _first_tensor((args, kwargs))
        if x is None or not x.is_floating_point() or not x.requires_grad or not x.numel():
            return None
        probed = _Probe.apply(x, self.sink.to(x.device), x.new_zeros(_ROW, dtype=torch.float32),
                              _INGRAD, False, math.inf)
        return _replace_first((args, kwargs), probed)

    def forward_hook(self, module, args, kwargs, output):
        if not torch.is_grad_enabled():
            return None  # evaluation: not watched
        out = _first_tensor(output)
        if out is None or not out.is_floating_point() or not out.numel():
            return None
        x = None
        if self.fqn in self.guard._suspects:
            x = _first_tensor((args, kwargs))
            x = x if x is not None and x.is_floating_point() and x.numel() else None
        if torch.compiler.is_compiling():
            return None if self.sink is None else _replace_first(output, self._probe(out, x))
        g = self.guard
        g._seen(g._fwd_order, self.fqn)
        self._record("out", out)
        if x is not None:
            self._record("in", x)
            if g.config.check_gradients and x.requires_grad:
                # the gradient this layer's backward sends upstream (plus what other readers
                # of x add): finite means its backward did not make it non-finite
                x.register_hook(self.input_grad_hook)
        if g.config.check_gradients and out.requires_grad:
            out.register_hook(self.grad_hook)
        return None

    def _probe(self, out: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        zero = out.new_zeros((), dtype=torch.float32)
        seen_in = [self._check("in", x), zero + x.numel()] if x is not None else [zero, zero]
        row = torch.stack([self._check("out", out), zero + out.numel(), zero, zero, *seen_in,
                           zero, zero])
        slot = _GRAD if self.guard.config.check_gradients else None
        return _Probe.apply(out, self.sink.to(out.device), row, slot, self._counts("grad"),
                            self.limit)

    def grad_hook(self, grad):
        self.guard._seen(self.guard._bwd_order, self.fqn)
        self._record("grad", grad)
        return None

    def input_grad_hook(self, grad):
        self._record("ingrad", grad)
        return None

    def weight_grad_hook(self, grad):
        self._record("wgrad", grad)
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
        if fqn:
            x = _first_tensor((args, kwargs))
        else:  # the root: its first floating input (the batch's pixels, embeddings, features)
            x = next((t for t in tensors((args, kwargs)) if t.is_floating_point()), None)
        x_sum = x.detach().float().sum() if x is not None and x.is_floating_point() else None
        self.records.append((fqn, x_sum, out.detach().float().sum()))
        return None

    def culprit(self) -> str | None:
        """The first module whose output is non-finite while its input was finite; else
        ``_INPUT`` when the root's input was non-finite (the batch); else None."""
        values = _read([t for _, x, o in self.records for t in (o, x) if t is not None])
        it = (v[0] for v in values)
        batch_ok = True
        for fqn, x, _ in self.records:
            out_ok = math.isfinite(next(it))
            in_ok = True if x is None else math.isfinite(next(it))
            if not out_ok and in_ok:
                return fqn
            if fqn == "":
                batch_ok = in_ok
        return None if batch_ok else _INPUT

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


@dataclass
class _Failure:
    fqn: str
    where: str  # "outputs" | "gradients" | "weight gradients" | "backward"
    level: float  # the check's number: non-finite or above the limit when failing
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
        if call is not None and self.stack and self.stack[-1] not in self.guard._layers:
            # only what is new is written: a write made inside a higher-order op that
            # torch.compile traces (an FP8 autograd function, a checkpointed block) is a graph
            # break; the modules known by their class need no record
            seen = self.calls.get(self.stack[-1])
            if seen is None or call.name not in seen:
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
                return watch.forward_hook(module, args, kwargs, output)
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
        # fqn -> the watch (hooks, format, sink) of every layer being watched now
        self._watches: dict[str, _Watch] = {}
        # The order in which watched layers ran, forward and backward, as first seen eagerly;
        # layers not seen yet fall back to the order modules finish (_finish_order).
        self._fwd_order: dict[str, int] = {}
        self._bwd_order: dict[str, int] = {}
        self._finish: dict[str, int] = {}
        # fqn -> kind of every module of the model that computes (None: not attached yet).
        self._layers: dict[str, str] | None = None
        self._discovery_done = False
        # modules found to compute during a compiled first forward, watched at the next step()
        self._unhooked: list[str] = []
        self._handles: list = []
        # suspect fqn -> its input-probing pre-hook (see _hook_suspects_inputs)
        self._input_hooks: dict[str, Any] = {}
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
        # Parameters found non-finite (see _poisoned): the first step of the failing stretch in
        # which they were, and the layer whose output went non-finite first then (None when
        # the guard cannot tell which); both None while the parameters are finite. The
        # stretch in progress: (its first step, that layer, where it began in words).
        self.poisoned_since: int | None = None
        self.first_nonfinite: str | None = None
        self._stretch: tuple[int, str | None, str] | None = None
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
            self._fwd_order, self._bwd_order = {}, {}
        self._remove_hooks()
        self.model = model
        self.policy = policy
        if not self._reapplying:
            self._base = policy
        self._watches = {}
        modules = dict(model.named_modules())
        self._finish = _finish_order(model)
        if self._layers is None:
            # By class now; the modules that compute by what they run, on the first forward.
            self._layers = {fqn: kind for fqn, m in modules.items()
                            if (kind := calls.class_kind(m)) in calls.COMPUTING_KINDS}
        if not self._discovery_done:
            self._handles.extend(_Discovery(self, modules).handles)
        owners = self._owners()
        for fqn in self._layers:
            self._watch(fqn, modules[fqn], owners)
        model.__dict__[_GUARD_ATTR] = self
        self._hook_suspects_inputs()
        if self._pending is not None and not self._reapplying:
            state, self._pending = self._pending, None
            self._restore(state)
        return self

    def _watch(self, fqn: str, module: nn.Module, owners: dict[int, int]) -> _Watch | None:
        fmt = self.policy.format_for(fqn)
        if fmt not in self.config.formats:
            return None
        param = next(module.parameters(), None)
        param = param if param is not None else next(self.model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        watch = self._watches[fqn] = _Watch(self, fqn, fmt, device)
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
        it from now on (the caller checks this forward's output with the watch returned).
        While torch.compile traces that forward, it is watched from the next ``step()`` on
        (registering a hook there is a graph break; this one forward goes unchecked)."""
        self._layers[fqn] = calls.layer_kind(module, own_calls)
        if torch.compiler.is_compiling():
            self._unhooked.append(fqn)
            return None
        return self._watch(fqn, module, self._owners())

    def _owners(self) -> dict[int, int]:
        """id(parameter) -> how many modules hold it (a tied weight: more than one)."""
        owners: dict[int, int] = {}
        for m in self.model.modules():
            for p in m.parameters(recurse=False):
                owners[id(p)] = owners.get(id(p), 0) + 1
        return owners

    def _hook_unhooked(self) -> None:
        """Watch the modules a compiled first forward found to compute (see _discovered)."""
        found, self._unhooked = self._unhooked, []
        if found and self.model is not None:
            owners, modules = self._owners(), dict(self.model.named_modules())
            for fqn in found:
                if fqn in modules and fqn not in self._watches:
                    self._watch(fqn, modules[fqn], owners)

    def detach(self) -> None:
        """Stop watching (the model keeps its current policy)."""
        self._remove_hooks()
        if self.model is not None and self.model.__dict__.get(_GUARD_ATTR) is self:
            del self.model.__dict__[_GUARD_ATTR]
        self.model = None
        self._reset_records()

    def _hook_suspects_inputs(self) -> None:
        """Suspects, and only they (a hook costs every call), get the pre-hook that probes
        their inputs' gradient under torch.compile (_Watch.pre_hook)."""
        for fqn in [f for f in self._input_hooks if f not in self._suspects]:
            self._input_hooks.pop(fqn).remove()
        missing = [f for f in self._suspects if f in self._watches and f not in self._input_hooks]
        if not missing or self.model is None:
            return  # the common step: no module lookup
        modules = dict(self.model.named_modules())
        for fqn in missing:
            if fqn in modules:
                self._input_hooks[fqn] = modules[fqn].register_forward_pre_hook(
                    self._watches[fqn].pre_hook, with_kwargs=True)

    def _remove_hooks(self) -> None:
        for h in [*self._handles, *self._input_hooks.values()]:
            h.remove()
        self._handles, self._input_hooks = [], {}
        if self._diagnosis is not None:
            self._diagnosis.close()
            self._diagnosis = None
        for probe in self._probes.values():
            probe.close()
        self._probes = {}

    def _reset_records(self) -> None:
        # kind -> fqn -> [check, count of values checked], the check a 0-d tensor on the
        # device (see _stat), folded over the eager calls of one step; in the order recorded.
        # Compiled calls report through each watch's sink instead (see _Probe).
        self._records: dict[str, dict[str, list]] = {k: {} for k in _KINDS}
        for watch in self._watches.values():
            if watch.sink is None:
                watch.sink = watch.new_sink()
            watch.sink.grad = None

    def _record(self, kind: str, fqn: str, check: torch.Tensor, numel: int) -> None:
        prev = self._records[kind].get(fqn)
        self._records[kind][fqn] = [check, numel] if prev is None else \
            [prev[0] + check, prev[1] + numel]

    @staticmethod
    def _seen(order: dict[str, int], fqn: str) -> None:
        if fqn not in order:
            order[fqn] = len(order)

    @property
    def watched(self) -> dict[str, Format]:
        """fqn -> format of every layer being watched now."""
        return {fqn: watch.format for fqn, watch in self._watches.items()}

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
        self._hook_unhooked()
        trained, failure, poisoned = self._judge(scaler if scaler is not None else self.scaler)
        if self._world() > 1:
            # every rank must reach the same counts, hence the same demotions at the same step
            trained, blamed, poisoned = self._agree(trained, failure, poisoned)
        else:
            blamed = [failure.fqn] if failure is not None else []
        if not trained:
            return []  # no training step since the last call (on any rank)
        if poisoned:
            self._counts = {}
            self._warn_poisoned()
            return []
        self.poisoned_since = self.first_nonfinite = None
        self._counts = {f: self._counts.get(f, 0) + 1 for f in blamed}
        due = [f for f in blamed if self._counts[f] >= self.config.patience]
        if failure is not None and failure.fqn not in due:
            logger.info("autoprec guard: step %d: %s (%s) failed: %s (%d of %d steps before "
                        "demotion)", self._step, failure.fqn, self.watched.get(failure.fqn),
                        self._describe(failure), self._counts[failure.fqn],
                        self.config.patience)
        if not due:
            return []
        mine = {failure.fqn: (failure.where, self._describe(failure))} \
            if failure is not None else {}
        seen = self._gather(mine) if self._world() > 1 else [mine]
        return [self._demote(f, seen) for f in due]

    def _judge(self, scaler) -> tuple[bool, _Failure | None, bool]:
        """This rank's verdict on the step: whether it trained (anything recorded since the
        last call), the layer it blames, and whether the model's parameters are poisoned
        (then it blames none); updates the suspects and warnings."""
        diagnosis, self._diagnosis = self._diagnosis, None
        level, frac = self._collect()
        if not level["out"] and not level["grad"] and not level["wgrad"]:
            if diagnosis is not None:
                diagnosis.close()
            return False, None, False

        self._child_faults = {fqn: c for fqn, p in self._probes.items()
                              if (c := p.culprit()) is not None}
        self._origin = None
        failure, cleared = self._blame(level, frac, scaler)
        poisoned = False
        if not self._failing(level):
            self._stretch = None
        else:
            if self._stretch is None:  # the first failing step after a clean one
                self._stretch = (self._step, *self._first_nonfinite(level, failure))
            poisoned = self._poisoned()
        if poisoned:
            # every layer now computes from non-finite weights: no verdict, no suspects, no
            # diagnosis (its culprit would be the first layer with weights, not the cause)
            failure, cleared = None, set()
            if diagnosis is not None:
                diagnosis.close()
            diagnosis = None
        self._suspects = cleared | ({failure.fqn} if failure is not None else set())
        self._hook_suspects_inputs()
        self._probe_suspects()
        if not poisoned:
            self._explain(diagnosis, failed=failure is None and bool(cleared))
        return True, failure, poisoned

    def _failing(self, level) -> bool:
        """Whether any check of this step failed (non-finite, or above its layer's limit)."""
        for kind, found in level.items():
            for fqn, a in found.items():
                watch = self._watches.get(fqn)
                limit = watch.limit if kind in ("out", "grad") and watch is not None else math.inf
                if _bad(a, limit):
                    return True
        return False

    def _poisoned(self) -> bool:
        """Whether non-finite values have spread into the parameters of more than one module:
        what an optimizer step on non-finite gradients does (into every weight it updates; the
        optimizer's state, such as Adam's moments, goes non-finite with them, so the
        parameters tell). One non-finite parameter of one module (a bad checkpoint entry, a
        planted fault) is that module's failure, judged as any other. One max-abs reduction
        per parameter and one host sync per device, made on failing steps only."""
        if self.model is None:
            return False
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
        seen: set[int] = set()
        for fqn, module in self.model.named_modules():
            for p in module.parameters(recurse=False):
                if id(p) in seen:
                    continue  # a tied weight counts once, for its first owner
                seen.add(id(p))
                t = p.detach()
                t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2: this rank's shard
                if t.is_floating_point() and t.element_size() < 2:
                    t = t.float()  # FP8 storage: no norm kernel of its own
                if t.is_floating_point() and t.numel() and t.device.type != "meta":
                    groups.setdefault((t.device, t.dtype), []).append((fqn, t))
        owners = [fqn for group in groups.values() for fqn, _ in group]
        norms = [n for group in groups.values()
                 for n in torch._foreach_norm([t for _, t in group], math.inf)]
        bad = {fqn for fqn, v in zip(owners, _read(norms)) if not math.isfinite(v[0])}
        return len(bad) > 1

    def _first_nonfinite(self, level, failure: _Failure | None) -> tuple[str | None, str]:
        """Where this step's non-finite values began, as far as the guard saw: the layer (None
        when it cannot tell one) and the place in words. Layers it does not watch are placed
        by the order modules finish (_finish_order)."""
        rank = self._finish
        outs = list(level["out"])
        unwatched = [f for f in self._layers or {} if f not in self._watches]

        def names(fqns: list[str]) -> str:
            shown = ", ".join(f"`{f}`" for f in fqns[:3])
            return shown + (f" and {len(fqns) - 3} more" if len(fqns) > 3 else "")

        def between(lo: float, hi: float) -> list[str]:
            return sorted((f for f in unwatched if lo < rank.get(f, -1) < hi), key=rank.get)

        bad = [f for f in outs if f in self._watches
               and _bad(level["out"][f], self._watches[f].limit)]
        if bad:
            i = outs.index(bad[0])
            before = between(rank.get(outs[i - 1], -1) if i else -1, rank.get(bad[0], -1))
            if not before:
                return bad[0], f"the first non-finite values came out of `{bad[0]}`"
            return None, (f"the first non-finite outputs the guard saw were `{bad[0]}`'s, or "
                          f"came from {names(before)} before it, which it does not watch")
        if failure is not None:
            return failure.fqn, (f"the first non-finite values came out of `{failure.fqn}`'s "
                                 f"backward ({self._describe(failure)})")
        last = max((rank.get(f, -1) for f in outs), default=-1)
        after = between(last, math.inf)
        if len(after) == 1:
            fmt = self.policy.format_for(after[0]) if self.policy is not None else None
            return after[0], (f"the first non-finite values came out of `{after[0]}` ({fmt} "
                              "under the policy, after every layer the guard watches) or the "
                              "loss")
        if after:
            return None, (f"the first non-finite values came after every layer the guard "
                          f"watches: out of {names(after)}, which it does not watch, or the loss")
        return None, "the first non-finite values came out of the loss, after every layer"

    def _warn_poisoned(self) -> None:
        """Once per stretch of poisoned parameters: since when, where it began, what to do."""
        if self.poisoned_since is not None:
            return
        since, self.first_nonfinite, where = self._stretch or (
            self._step, None, "on another rank: see its log")
        self.poisoned_since = since
        fmt = self.watched.get(self.first_nonfinite)
        hint = "" if fmt is None else (
            f" (if `{self.first_nonfinite}`'s {fmt} is at fault, run it in {fmt.demoted()}: "
            "amend the policy, or use a GradScaler for fp16)")
        logger.warning(
            "autoprec guard: step %d: the model's parameters are non-finite since step %d (an "
            "optimizer step took in non-finite gradients; %s), so every layer now computes "
            "from non-finite weights and demoting a layer cannot help: restore a checkpoint "
            "(model and optimizer) from before step %d and see what made that step "
            "non-finite%s; nothing is demoted until the parameters are finite again.",
            self._step, since, where, since, hint)

    def _collect(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """This step's checks, eager records and compiled probes' sinks together, read with one
        host sync: per kind, fqn -> level (non-finite, or above the layer's limit, when it
        failed) and fqn -> share of failing values (where values were counted), each in the
        order the layers ran (forward for outputs and inputs, backward for gradients)."""
        records = self._records
        sinks = [(fqn, w.sink.grad) for fqn, w in self._watches.items()
                 if w.sink is not None and w.sink.grad is not None]
        self._reset_records()
        entries = [(k, fqn, n) for k in _KINDS for fqn, (_, n) in records[k].items()]
        values = _read([records[k][fqn][0] for k, fqn, _ in entries] + [g for _, g in sinks])
        totals: dict[str, dict[str, list[float]]] = {k: {} for k in _KINDS}
        found = [(k, fqn, v[0], n) for (k, fqn, n), v in zip(entries, values)]
        found += [(k, fqn, row[s], row[s + 1]) for (fqn, _), row in zip(sinks, values[len(entries):])
                  for k, s in _SLOTS.items() if row[s + 1] > 0]
        for k, fqn, v, n in found:
            prev = totals[k].setdefault(fqn, [0.0, 0])
            prev[0], prev[1] = prev[0] + v, prev[1] + n
        level: dict[str, dict[str, float]] = {}
        frac: dict[str, dict[str, float]] = {}
        for k in _KINDS:
            level[k], frac[k] = {}, {}
            for fqn in sorted(totals[k], key=self._order_key(k)):
                v, n = totals[k][fqn]
                watch = self._watches.get(fqn)
                if watch is not None and watch._counts(k):
                    level[k][fqn] = math.inf if v > 0 else 0.0
                    frac[k][fqn] = v / n if n else 0.0
                else:
                    level[k][fqn] = v
        return level, frac

    def _order_key(self, kind: str):
        """Sort key of layers in the order they ran: as seen eagerly, else as modules finish;
        gradients backward (as seen, else the forward order reversed); own weight gradients
        as recorded (their hooks always run eagerly)."""
        fwd = self._fwd_order
        finish = self._finish

        def forward(fqn: str):
            return (0, fwd[fqn]) if fqn in fwd else (1, finish.get(fqn, 0))

        if kind in ("out", "in"):
            return forward
        if kind == "wgrad":
            return lambda fqn: 0  # a stable sort keeps the recorded order
        bwd = self._bwd_order

        def backward(fqn: str):
            if fqn in bwd:
                return (0, bwd[fqn], 0)
            seen, rank = forward(fqn)
            return (1, -seen, -rank)  # the forward order reversed

        return backward

    # ---------------------------------------------------------------- agreement across ranks
    def _world(self) -> int:
        """Ranks that decide together: torch.distributed's world, when initialized and asked."""
        if not self.config.distributed or not dist.is_available() or not dist.is_initialized():
            return 1
        return dist.get_world_size()

    def _agree(self, trained: bool, failure: _Failure | None,
               poisoned: bool) -> tuple[bool, list[str], bool]:
        """One all_reduce(MAX) of [trained, digest, -digest, poisoned, one flag per watched
        layer]: every rank learns whether any rank trained, whether any rank found the
        parameters poisoned (then none demotes), and which layers any rank blamed. The digest
        of the watched list, reduced as its max and its negated min, tells every rank alike
        when the ranks watch different layers (the flags would then not line up)."""
        watched = sorted(self._watches)
        digest = int.from_bytes(hashlib.sha256("\n".join(watched).encode()).digest()[:7], "big")
        flags = [0] * (4 + len(watched))
        flags[0], flags[1], flags[2], flags[3] = int(trained), digest, -digest, int(poisoned)
        if failure is not None and failure.fqn in self._watches:
            flags[4 + watched.index(failure.fqn)] = 1
        vec = torch.tensor(flags, dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        out = vec.tolist()
        if out[1] != -out[2]:
            raise RuntimeError(
                f"autoprec guard: the ranks watch different layers (rank {dist.get_rank()} "
                f"watches {len(watched)}), so they cannot agree on demotions; apply the same "
                "policy to the same model on every rank, or set GuardConfig(distributed=False) "
                "when the ranks hold different parts of the model.")
        return bool(out[0]), [f for f, flag in zip(watched, out[4:]) if flag], bool(out[3])

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

    def _blame(self, level, frac, scaler) -> tuple[_Failure | None, set[str]]:
        """The layer to blame for this step (or None) and the layers cleared of blame."""
        cleared: set[str] = set()
        limits = {fqn: watch.limit for fqn, watch in self._watches.items()}

        def bad(kind: str, fqn: str) -> bool:
            a = level[kind].get(fqn)
            limit = math.inf if kind == "wgrad" else limits.get(fqn)
            return a is not None and limit is not None and _bad(a, limit)

        # Outputs, in the order layers finish: the first failing layer whose inputs were
        # finite. One whose input was already non-finite is cleared, and so is every later
        # failing layer downstream of the same fault, except its ancestors (an attention core
        # computes the input of its own c_proj); a suspect whose unwatched descendant (a
        # child the policy keeps in fp32) made the first non-finite values is cleared too.
        fwd_failed = False
        last_cleared = None
        for fqn, a in level["out"].items():
            if not bad("out", fqn):
                continue
            fwd_failed = True
            if last_cleared is not None and not _is_ancestor(fqn, last_cleared):
                break
            if fqn in self._child_faults:
                cleared.add(fqn)
                self._origin = self._child_faults[fqn]
                break
            a_in = level["in"].get(fqn)
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
        own = [f for f in level["wgrad"] if bad("wgrad", f) and not bad("grad", f)]
        if own:
            failure = _Failure(own[0], "weight gradients", level["wgrad"][own[0]],
                               frac["wgrad"].get(own[0]))
        else:
            scaled = scaler is not None and scaler.is_enabled()
            failure = self._backward_culprit(level, frac, bad, cleared, scaled=scaled)
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

    def _backward_culprit(self, level, frac, bad, cleared: set[str], *,
                          scaled: bool) -> _Failure | None:
        order = list(level["grad"])
        for i, fqn in enumerate(order):
            if not bad("grad", fqn):
                continue
            a = level["grad"][fqn]
            if i == 0 and not math.isfinite(a):
                if not scaled and self.watched.get(fqn) is Format.FP16:
                    # Without a GradScaler nothing scales the gradient back into FP16's range:
                    # the FP32 gradient the layers after it (or the loss) send into an fp16
                    # layer is cast to FP16 at its output, and overflows there. The forward
                    # was finite (outputs are judged first), so this is its format's fault. (A
                    # NaN loss from finite outputs, e.g. NaN targets, reads the same.)
                    return _Failure(fqn, "gradients", a, frac["grad"].get(fqn))
                cleared.add(fqn)
                return None  # non-finite from the loss, or layers the guard does not watch
            if math.isfinite(a) or self.watched.get(fqn) is Format.FP16:
                # beyond its format's range; or an fp16 layer, whose output (so the gradient
                # computed for it) is FP16: overflowed there, after a finite gradient upstream
                return _Failure(fqn, "gradients", a, frac["grad"].get(fqn))
            # non-finite in a layer whose gradients have FP32's range: it arrived that way
            cleared.add(fqn)
            before = order[i - 1]
            ingrad = level["ingrad"].get(before)
            if ingrad is not None and math.isfinite(ingrad):
                cleared.add(before)
                return None
            return _Failure(before, "backward", level["grad"][before], frac["grad"].get(before))
        return None

    def _probe_suspects(self) -> None:
        """Watch, next step, the unwatched descendants of each suspect (children the policy
        keeps in fp32): whether its failure is theirs."""
        for probe in self._probes.values():
            probe.close()
        skip = frozenset(self._watches)
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
        if culprit == _INPUT:
            return (f"{head}: the input batch held non-finite values (the model's first "
                    "floating input), so every layer computing from it is; check the data and "
                    "how the batch is made.")
        module = self.model.get_submodule(culprit)
        fmt = self.policy.format_for(culprit) if self.policy is not None else None
        return (f"{head}: the first non-finite values come out of `{culprit or '(root)'}` "
                f"({type(module).__name__}, {fmt} under the policy) while its inputs were "
                "finite; check its weights and inputs.")

    def _describe(self, f: _Failure) -> str:
        """What was measured, e.g. "12% of outputs overflow fp16 max 65504 or are NaN"."""
        fmt = self.watched.get(f.fqn, Format.FP32)
        if f.where == "backward":
            return ("the gradients its backward sent upstream were non-finite, the gradient "
                    "reaching it was finite" + (f", loss scale {f.scale:g}" if f.scale else ""))
        share = None if f.fraction is None else f"{_pct(f.fraction)} of {f.where}"
        if fmt is Format.FP16 and f.where != "weight gradients":  # values counted (_stat)
            text = f"{share or f.where} overflow fp16 max {_limit(fmt):g} or are NaN"
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
        old = self._watches[fqn].format
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
        from autoprec.runtime import engines

        # keeping_sharded_swaps: under FSDP2, torchao's Float8Linear layers swapped in before
        # fully_shard stay (FSDP gathers into them); a demoted one computes as nn.Linear in its
        # new format inside its region, where a plain re-apply would refuse to put it back
        with warnings.catch_warnings(), engines.keeping_sharded_swaps():
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
        # an event names modules of the model: one escaped comment line each
        lines = [f"# amended by the autoprec runtime guard: {escape_line(e)}\n"
                 for e in self.events]
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
        watch the same formats: otherwise a :class:`~autoprec.policy.PolicyError`. So is a
        state not as :meth:`state_dict` writes it (a missing key, a wrong type, an unknown
        format, a layer run in a format that is no demotion of its policy's) or naming a
        module the model lacks; all of it is checked before anything changes."""
        if not isinstance(state, Mapping) or "autoprec_guard" not in state:
            raise PolicyError(f"Not an autoprec guard state ({type(state).__name__} without the "
                              "key `autoprec_guard`); pass what Guard.state_dict() returned.")
        if state["autoprec_guard"] != _STATE_VERSION:
            raise PolicyError(f"Guard state version {state['autoprec_guard']!r} is not one this "
                              f"autoprec reads ({_STATE_VERSION}); resume with the autoprec "
                              "version that wrote it.")
        _check_state(state)  # its layout and types now; its names once the model is known
        if self.model is None:
            self._pending = dict(state)
            return
        self._restore(state)

    def _restore(self, state: Mapping[str, Any]) -> None:
        # Everything is checked before anything changes: a state that names what this model
        # lacks (hand-edited, or another model's) would otherwise run a demoted layer in its
        # old format again without a word.
        _check_state(state, modules={fqn for fqn, _ in self.model.named_modules()})
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
        for name, fmt in layers.items():
            # a demotion only ever makes a layer safer than the policy it started from
            start = self._base.format_for(name)
            if fmt not in (start, start.demoted(), start.demoted().demoted()):
                raise PolicyError(
                    f"Guard state `layers` runs `{name}` in {fmt}, which is no demotion of its "
                    f"{start} under the policy (fp8 -> bf16 -> fp32, fp16 -> fp32); load the "
                    "state the checkpointed run saved, or start the guard afresh.")
        self._step = int(state["step"])
        self.events = [GuardEvent(step=int(e["step"]), fqn=e["layer"],
                                  old=Format.parse(e["from"]), new=Format.parse(e["to"]),
                                  reason=e["reason"], where=e["where"])
                       for e in state["events"]]
        self._counts = {k: int(v) for k, v in state["counts"].items()}
        self._warned = set(state["warned"])
        self.poisoned_since = self.first_nonfinite = self._stretch = None
        if amended is not None:
            self._reapply(amended)
        self._suspects = set(state["suspects"])
        self._probe_suspects()

    def __repr__(self) -> str:
        return (f"<autoprec Guard watching {len(self._watches)} layers, "
                f"{len(self.events)} demotion(s)>")


_EVENT_KEYS = ("step", "layer", "from", "to", "reason", "where")
_WHERE = ("outputs", "gradients", "weight gradients", "backward")


def _check_state(state: Mapping[str, Any], modules: set[str] | None = None) -> None:
    """A one-line PolicyError naming the key of ``state`` (a guard state) that is not as
    :meth:`Guard.state_dict` writes it: a missing key, a wrong type, an unknown format, and
    (``modules``: the model's module fqns) a layer the model does not have."""

    def fail(key: str, what: str) -> None:
        raise PolicyError(f"Guard state `{key}` {what}; load what Guard.state_dict() returned "
                          "for this model and policy, or start the guard afresh.")

    for key in ("policy", "formats", "step", "layers", "events", "counts", "suspects", "warned"):
        if key not in state:
            fail(key, "is missing")

    def integer(key: str, v: Any) -> None:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            fail(key, f"is {v!r}, not a count (an integer >= 0)")

    def fmt(key: str, v: Any) -> Format:
        if isinstance(v, str):
            try:
                return Format.parse(v)
            except ValueError:
                pass
        fail(key, f"is {v!r}, not a format (one of {', '.join(f.value for f in Format)})")

    def layer(key: str, v: Any, *, none_ok: bool = False) -> None:
        if v is None and none_ok:
            return
        if not isinstance(v, str):
            fail(key, f"holds {v!r}, not a module name")
        if modules is not None and v not in modules and not (none_ok and v == _INPUT):
            fail(key, f"names `{v}`, which is not a module of this model")

    def listed(key: str, v: Any, kind: type) -> None:
        if not isinstance(v, kind):
            fail(key, f"is {type(v).__name__}, not a {kind.__name__}")

    integer("step", state["step"])
    listed("policy", state["policy"], Mapping)
    listed("formats", state["formats"], list)
    for v in state["formats"]:
        fmt("formats", v)
    listed("layers", state["layers"], Mapping)
    for k, v in state["layers"].items():
        layer("layers", k)
        fmt(f"layers.{k}", v)
    listed("events", state["events"], list)
    for i, e in enumerate(state["events"]):
        key = f"events[{i}]"
        listed(key, e, Mapping)
        for k in _EVENT_KEYS:
            if k not in e:
                fail(f"{key}.{k}", "is missing")
        integer(f"{key}.step", e["step"])
        layer(f"{key}.layer", e["layer"])
        old = fmt(f"{key}.from", e["from"])
        if fmt(f"{key}.to", e["to"]) is not old.demoted() or old is Format.FP32:
            fail(key, f"demotes {e['from']} to {e['to']}, which the guard never does")
        if not isinstance(e["reason"], str):
            fail(f"{key}.reason", f"is {e['reason']!r}, not text")
        if e["where"] not in _WHERE:
            fail(f"{key}.where", f"is {e['where']!r}, not one of {', '.join(_WHERE)}")
    listed("counts", state["counts"], Mapping)
    for k, v in state["counts"].items():
        layer("counts", k)
        integer(f"counts.{k}", v)
    listed("suspects", state["suspects"], list)
    for v in state["suspects"]:
        layer("suspects", v)
    listed("warned", state["warned"], list)
    for v in state["warned"]:
        layer("warned", v, none_ok=True)


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
