"""The recorder: the per-step checks of the watched layers, made by hooks and kept on the
device, read with one host sync per step.

Eagerly each hook folds its check into :attr:`Recorder.records` as it is made, and the order in
which layers ran is learned. While ``torch.compile`` traces, Python state cannot change without
a graph break, so a watched output goes through :class:`SinkReport` instead, whose backward
hands the checks to a leaf tensor of the watch (its *sink*) as its gradient.

With ``predict`` on, the outputs (and, unless a GradScaler scales them, the gradients at the
output) of every watched layer also get a forecast summary (:func:`forecast_stat`: the amax,
and a sample's kurtosis and underflow share), kept on the device beside the checks and read
with the same host sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoprec._util import tensors
from autoprec.formats import Format
from autoprec.runtime.guard.terms import BF16_MAX, limit

__all__ = ["Checks", "Recorder", "Watch"]

# What the hooks record per watched layer: outputs, inputs (suspects only), the gradient at the
# output, the gradient its backward sends to its input (suspects only), the gradients of the
# layer's own parameters.
KINDS = ("out", "in", "grad", "ingrad", "wgrad")
# Layout of a compiled step's record of one watched layer (its sink's gradient): the failure
# number of stat() and the count of values it covers, for outputs, gradients at the output,
# inputs and gradients sent to the input.
SLOTS = {"out": 0, "grad": 2, "in": 4, "ingrad": 6}
# Then, with ``predict`` on, the forecast summaries (forecast_stat, WIDTH numbers each) of the
# outputs and of the gradients at the output.
FORECAST = {"out": 8, "grad": 12}
WIDTH = 4
ROW = 16
# Values per tensor the kurtosis and underflow share are estimated on (a strided sample: one
# pass over 4096 values, not over every value; the amax sees every value).
SAMPLE = 4096


def first_tensor(obj: Any) -> torch.Tensor | None:
    found = tensors(obj)
    return found[0] if found else None


def replace_first(obj: Any, new: torch.Tensor) -> Any:
    """``obj`` (a tensor, or a tuple/list/dict of them, as modules return) with its first
    tensor replaced by ``new``."""
    leaves, spec = tree_flatten(obj)
    i = next(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
    return tree_unflatten([new if j == i else leaf for j, leaf in enumerate(leaves)], spec)


def stat(t: torch.Tensor, count: bool, bound: float) -> torch.Tensor:
    """One FP32 number on ``t``'s device that sums over calls and says whether ``t`` failed.

    ``count``: how many values are NaN or above ``bound`` in magnitude (infinite ``bound``: how
    many are non-finite); exact, and gives the share of failing values; used for fp16 layers,
    whose limit 65504 a finite FP32 value can exceed, and for suspects. Otherwise ``t.sum()``,
    about half the cost: non-finite exactly when some value is (or when the values are so large
    that their sum overflows FP32, an overflow of BF16's range too).
    """
    t = t.detach()
    if count:
        ok = torch.isfinite(t) if math.isinf(bound) else t.abs() <= bound  # NaN is never ok
        return (~ok).sum(dtype=torch.float32)
    return t.sum().float()


def forecast_stat(t: torch.Tensor, tiny: float | None) -> torch.Tensor:
    """WIDTH FP32 numbers on ``t``'s device that sum over calls: ``t``'s amax (one reduction
    over every value), the kurtosis about zero (E[x^4] / E[x^2]^2) of a strided sample of
    SAMPLE values, the share of the sample's nonzero values below ``tiny`` (the format's
    smallest normal; None: 0, not measured), and 1 (the calls, to average by). Few ops: on a
    CPU each costs a dispatch whatever its size."""
    t = t.detach()
    # aminmax: one pass, ~15x faster on a CPU than vector_norm(t, inf); NaN propagates
    low, high = torch.aminmax(t)
    flat = t.reshape(-1)
    n = flat.numel()
    # an odd stride walks through every channel of a power-of-two width; FP64 so that x^4
    # of values up to BF16's max cannot overflow
    s = (flat[::(n // SAMPLE) | 1] if n > SAMPLE else flat).double()
    s2 = s * s
    kurtosis = torch.dot(s2, s2) * s.numel() / s2.sum().square()
    if tiny is None:
        under = torch.zeros((), dtype=torch.float64, device=t.device)
    else:
        nonzero = s != 0
        under = ((s.abs() < tiny) & nonzero).sum() / nonzero.sum().clamp_min(1)
    return torch.stack([torch.maximum(high, -low).double(), kurtosis, under.double(),
                        torch.ones((), dtype=torch.float64, device=t.device)]).float()


def read_host(values: list[torch.Tensor]) -> list[list[float]]:
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


class SinkReport(torch.autograd.Function):
    """How a watched layer reports under ``torch.compile``: without Python side effects.

    Identity on ``t`` (a copy: a view returned by a custom Function may not be modified in
    place, and a layer's output often is); its backward hands ``sink`` (a leaf of the watch)
    the gradient ``row`` (what the forward measured) plus, at ``slot``, the check of the
    gradient reaching ``t``. The numbers arrive in ``sink.grad``, summed over calls and
    micro-batches, and :meth:`Recorder.collect` reads them. Forward and backward stay one
    graph (no dict writes, no tensor hooks), inside activation checkpointing too.
    """

    @staticmethod
    def forward(ctx, t, sink, row, slot, count, bound, ahead=None):
        # ahead: None, no forecast summary of the gradient; else the underflow threshold of
        # forecast_stat (0.0: none measured)
        ctx.save_for_backward(row)
        ctx.slot, ctx.count, ctx.bound, ctx.ahead = slot, count, bound, ahead
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        (row,) = ctx.saved_tensors
        if ctx.slot is not None:
            found = torch.stack([stat(grad, ctx.count, ctx.bound),
                                 row.new_ones(()) * grad.numel()])
            row = torch.cat([row[:ctx.slot], found, row[ctx.slot + 2:]])
        if ctx.ahead is not None:
            at = FORECAST["grad"]
            row = torch.cat([row[:at], forecast_stat(grad, ctx.ahead or None), row[at + WIDTH:]])
        return grad, row, None, None, None, None, None


@dataclass
class Checks:
    """One step's checks, read back: per kind (KINDS), fqn -> level (non-finite, or above the
    layer's limit, when it failed) and, where values were counted, fqn -> share of failing
    values; each in the order the layers ran (forward for outputs and inputs, backward for
    gradients, as recorded for own weight gradients). ``forecast``: per kind of FORECAST,
    fqn -> (amax, kurtosis, underflow share or None), each the mean over the step's calls."""

    level: dict[str, dict[str, float]] = field(default_factory=lambda: {k: {} for k in KINDS})
    share: dict[str, dict[str, float]] = field(default_factory=lambda: {k: {} for k in KINDS})
    forecast: dict[str, dict[str, tuple]] = field(
        default_factory=lambda: {k: {} for k in FORECAST})

    def trained(self) -> bool:
        """Whether anything was recorded: a training step ran since the last read."""
        return bool(self.level["out"] or self.level["grad"] or self.level["wgrad"])


class Watch:
    """The hooks of one watched module. Bound methods rather than closures, so that
    ``copy.deepcopy(model)`` gives the copy hooks that report to the copy's recorder."""

    def __init__(self, recorder: Recorder, fqn: str, fmt: Format, device: torch.device):
        self.recorder = recorder
        self.fqn = fqn
        self.format = fmt
        self.limit = limit(fmt)
        self.exact = self.limit < BF16_MAX  # fp16: a finite FP32 value can exceed the limit
        # the smallest normal of the format's outputs, for the underflow share (fp16 only: an
        # fp8 layer's outputs are BF16, its FP8 operands rescaled per tensor)
        self.tiny = float(torch.finfo(torch.float16).smallest_normal) \
            if fmt.output_dtype is torch.float16 else None
        self.device = device
        # made eagerly: a module found to compute during a compiled first forward gets its
        # sink at the next step() (a tensor made with requires_grad is a graph break)
        self.sink = None if torch.compiler.is_compiling() else self.new_sink()

    def new_sink(self) -> torch.Tensor:
        return torch.zeros(ROW, device=self.device, requires_grad=True)

    def counts_values(self, kind: str) -> bool:
        """Whether checks of ``kind`` count failing values (see stat) rather than sum."""
        if kind == "in":
            return True
        if kind == "ingrad":
            return False
        return (self.exact and kind != "wgrad") or self.fqn in self.recorder.suspects

    def check(self, kind: str, t: torch.Tensor) -> torch.Tensor:
        bound = self.limit if kind in ("out", "grad") else math.inf
        return stat(t, self.counts_values(kind), bound)

    def record(self, kind: str, t: torch.Tensor) -> None:
        if t.numel():
            rec = self.recorder
            rec.record(kind, self.fqn, self.check(kind, t), t.numel())
            if rec.forecasting(kind):
                rec.record_forecast(kind, self.fqn, forecast_stat(t, self.tiny))

    def pre_hook(self, module, args, kwargs):
        """Compiled, for suspects (only they have this hook): route the input through a sink
        report of the gradient this layer's backward sends upstream (eagerly a tensor hook
        does, in forward_hook)."""
        rec = self.recorder
        if not (torch.compiler.is_compiling() and torch.is_grad_enabled() and self.sink is not None
                and rec.check_gradients and self.fqn in rec.suspects):
            return None
        x = first_tensor((args, kwargs))
        if x is None or not x.is_floating_point() or not x.requires_grad or not x.numel():
            return None
        reported = SinkReport.apply(x, self.sink.to(x.device),
                                    x.new_zeros(ROW, dtype=torch.float32), SLOTS["ingrad"],
                                    False, math.inf)
        return replace_first((args, kwargs), reported)

    def forward_hook(self, module, args, kwargs, output):
        if not torch.is_grad_enabled():
            return None  # evaluation: not watched
        out = first_tensor(output)
        if out is None or not out.is_floating_point() or not out.numel():
            return None
        rec = self.recorder
        x = None
        if self.fqn in rec.suspects:
            x = first_tensor((args, kwargs))
            x = x if x is not None and x.is_floating_point() and x.numel() else None
        if torch.compiler.is_compiling():
            return None if self.sink is None else replace_first(output, self.compiled(out, x))
        rec.seen_forward(self.fqn)
        self.record("out", out)
        if x is not None:
            self.record("in", x)
            if rec.check_gradients and x.requires_grad:
                # the gradient this layer's backward sends upstream (plus what other readers
                # of x add): finite means its backward did not make it non-finite
                x.register_hook(self.input_grad_hook)
        if rec.check_gradients and out.requires_grad:
            out.register_hook(self.grad_hook)
        return None

    def compiled(self, out: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
        """``out`` through a SinkReport of this call's checks (the compiled path)."""
        rec = self.recorder
        zero = out.new_zeros((), dtype=torch.float32)
        seen_in = [self.check("in", x), zero + x.numel()] if x is not None else [zero, zero]
        row = torch.stack([self.check("out", out), zero + out.numel(), zero, zero, *seen_in,
                           zero, zero])
        ahead = forecast_stat(out, self.tiny) if rec.forecasting("out") else zero.expand(WIDTH)
        row = torch.cat([row, ahead, zero.expand(WIDTH)])
        slot = SLOTS["grad"] if rec.check_gradients else None
        return SinkReport.apply(out, self.sink.to(out.device), row, slot,
                                self.counts_values("grad"), self.limit,
                                (self.tiny or 0.0) if slot is not None and rec.forecasting("grad")
                                else None)

    def grad_hook(self, grad):
        self.recorder.seen_backward(self.fqn)
        self.record("grad", grad)
        return None

    def input_grad_hook(self, grad):
        self.record("ingrad", grad)
        return None

    def weight_grad_hook(self, grad):
        self.record("wgrad", grad)
        return None


def finish_order(model: nn.Module) -> dict[str, int]:
    """fqn -> rank in the order modules finish their forward when each runs its children in
    definition order (children before their parent): where a forward order is needed before
    the recorder has seen one eagerly."""
    order: dict[str, int] = {}

    def visit(module: nn.Module, fqn: str) -> None:
        for name, child in module.named_children():
            visit(child, f"{fqn}.{name}" if fqn else name)
        order.setdefault(fqn, len(order))

    visit(model, "")
    return order


def owners(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> how many modules hold it (a tied weight: more than one)."""
    found: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            found[id(p)] = found.get(id(p), 0) + 1
    return found


class Recorder:
    """The watches of one model, the checks they record, and the order layers ran in."""

    def __init__(self, check_gradients: bool, predict: bool = False):
        self.check_gradients = check_gradients
        # Record the forecast summaries (forecast_stat) of outputs and, while
        # ``forecast_grads``, of gradients at the output (the guard turns that off while a
        # GradScaler is enabled: scaled gradients sit near the range by design).
        self.predict = predict
        self.forecast_grads = True
        # fqn -> the watch (hooks, format, sink) of every layer being watched now
        self.watches: dict[str, Watch] = {}
        # Layers under closer watch (their inputs checked, failing values counted); set by
        # the guard from the blame of the last step.
        self.suspects: set[str] = set()
        # The order in which watched layers ran, forward and backward, as first seen eagerly;
        # layers not seen yet fall back to the order modules finish (finish_order).
        self.forward_order: dict[str, int] = {}
        self.backward_order: dict[str, int] = {}
        self.finish: dict[str, int] = {}
        self.handles: list = []
        # suspect fqn -> its input-reporting pre-hook (Watch.pre_hook)
        self.input_hooks: dict[str, Any] = {}
        self.reset()

    @property
    def formats(self) -> dict[str, Format]:
        """fqn -> format of every layer being watched now."""
        return {fqn: watch.format for fqn, watch in self.watches.items()}

    def start(self, model: nn.Module, *, forget_order: bool) -> None:
        """Drop every hook and watch, to watch ``model`` afresh."""
        self.remove_hooks()
        self.watches = {}
        if forget_order:
            self.forward_order, self.backward_order = {}, {}
        self.finish = finish_order(model)

    def watch(self, fqn: str, module: nn.Module, fmt: Format, device: torch.device,
              owned: Callable[[], Mapping[int, int]]) -> Watch:
        """Hook ``module`` (computing in ``fmt``); ``owned``: owners() of the model, asked
        only when weight gradients are watched."""
        watch = self.watches[fqn] = Watch(self, fqn, fmt, device)
        self.handles.append(module.register_forward_hook(watch.forward_hook, with_kwargs=True))
        # Weight gradients of fp16 layers only: their FP16 products (a sum over every token)
        # can overflow where the gradient at the output does not. A bf16 product has FP32's
        # range, and fp8's gradients are rescaled into E5M2 and come back FP32.
        if self.check_gradients and fmt.compute_dtype is torch.float16:
            counts = owned()
            for p in module.parameters(recurse=False):
                # a tied weight (GPT-2's lm_head and wte) also gets gradients from its other
                # owners: its gradient says nothing about this module's backward
                if p.requires_grad and counts.get(id(p)) == 1:
                    self.handles.append(p.register_hook(watch.weight_grad_hook))
        return watch

    def set_suspects(self, suspects: set[str], model: nn.Module | None) -> None:
        """Watch ``suspects`` closely from the next forward on. Only they get the pre-hook
        that reports their inputs' gradient under torch.compile (a hook costs every call)."""
        self.suspects = set(suspects)
        for fqn in [f for f in self.input_hooks if f not in self.suspects]:
            self.input_hooks.pop(fqn).remove()
        missing = [f for f in self.suspects if f in self.watches and f not in self.input_hooks]
        if not missing or model is None:
            return  # the common step: no module lookup
        modules = dict(model.named_modules())
        for fqn in missing:
            if fqn in modules:
                self.input_hooks[fqn] = modules[fqn].register_forward_pre_hook(
                    self.watches[fqn].pre_hook, with_kwargs=True)

    def remove_hooks(self) -> None:
        for h in [*self.handles, *self.input_hooks.values()]:
            h.remove()
        self.handles, self.input_hooks = [], {}

    def forget_handles(self, done: list) -> None:
        """Drop ``done`` (handles their owner removed) from the handles to remove."""
        self.handles = [h for h in self.handles if h not in done]

    def reset(self) -> None:
        # kind -> fqn -> [check, count of values checked], the check a 0-d tensor on the
        # device (see stat), folded over the eager calls of one step; in the order recorded.
        # Compiled calls report through each watch's sink instead (see SinkReport).
        self.records: dict[str, dict[str, list]] = {k: {} for k in KINDS}
        # kind of FORECAST -> fqn -> forecast_stat summed over the eager calls of one step
        self.forecasts: dict[str, dict[str, torch.Tensor]] = {k: {} for k in FORECAST}
        for watch in self.watches.values():
            if watch.sink is None:
                watch.sink = watch.new_sink()
            watch.sink.grad = None

    def record(self, kind: str, fqn: str, check: torch.Tensor, numel: int) -> None:
        prev = self.records[kind].get(fqn)
        self.records[kind][fqn] = [check, numel] if prev is None else \
            [prev[0] + check, prev[1] + numel]

    def forecasting(self, kind: str) -> bool:
        """Whether checks of ``kind`` get a forecast summary."""
        return self.predict and (kind == "out" or (kind == "grad" and self.forecast_grads))

    def record_forecast(self, kind: str, fqn: str, row: torch.Tensor) -> None:
        prev = self.forecasts[kind].get(fqn)
        self.forecasts[kind][fqn] = row if prev is None else prev + row

    def seen_forward(self, fqn: str) -> None:
        if fqn not in self.forward_order:
            self.forward_order[fqn] = len(self.forward_order)

    def seen_backward(self, fqn: str) -> None:
        if fqn not in self.backward_order:
            self.backward_order[fqn] = len(self.backward_order)

    def collect(self) -> Checks:
        """This step's checks and forecast summaries, eager records and compiled sinks
        together, read with one host sync; the records start afresh for the next step."""
        records, forecasts = self.records, self.forecasts
        sinks = [(fqn, w.sink.grad) for fqn, w in self.watches.items()
                 if w.sink is not None and w.sink.grad is not None]
        self.reset()
        entries = [(k, fqn, n) for k in KINDS for fqn, (_, n) in records[k].items()]
        ahead = [(k, fqn) for k in FORECAST for fqn in forecasts[k]]
        values = read_host([records[k][fqn][0] for k, fqn, _ in entries]
                           + [forecasts[k][fqn] for k, fqn in ahead] + [g for _, g in sinks])
        rows = values[len(entries) + len(ahead):]
        totals: dict[str, dict[str, list[float]]] = {k: {} for k in KINDS}
        found = [(k, fqn, v[0], n) for (k, fqn, n), v in zip(entries, values)]
        found += [(k, fqn, row[s], row[s + 1]) for (fqn, _), row in zip(sinks, rows)
                  for k, s in SLOTS.items() if row[s + 1] > 0]
        for k, fqn, v, n in found:
            prev = totals[k].setdefault(fqn, [0.0, 0])
            prev[0], prev[1] = prev[0] + v, prev[1] + n
        checks = Checks()
        for k in KINDS:
            for fqn in sorted(totals[k], key=self.order_key(k)):
                v, n = totals[k][fqn]
                watch = self.watches.get(fqn)
                if watch is not None and watch.counts_values(k):
                    checks.level[k][fqn] = math.inf if v > 0 else 0.0
                    checks.share[k][fqn] = v / n if n else 0.0
                else:
                    checks.level[k][fqn] = v
        summed = list(zip(ahead, values[len(entries):len(entries) + len(ahead)]))
        summed += [((k, fqn), row[at:at + WIDTH]) for (fqn, _), row in zip(sinks, rows)
                   for k, at in FORECAST.items() if row[at + WIDTH - 1] > 0]
        checks.forecast = self.means(summed)
        return checks

    def means(self, summed: list[tuple[tuple[str, str], list[float]]]) -> dict[str, dict]:
        """kind -> fqn -> (amax, kurtosis, underflow share or None), each the mean over the
        calls of forecast_stat rows ``summed`` (per (kind, fqn), eager and compiled alike)."""
        totals: dict[tuple[str, str], list[float]] = {}
        for key, row in summed:
            prev = totals.setdefault(key, [0.0] * WIDTH)
            totals[key] = [a + b for a, b in zip(prev, row)]
        out: dict[str, dict[str, tuple]] = {k: {} for k in FORECAST}
        for (k, fqn), (amax, kurtosis, under, calls) in totals.items():
            watch = self.watches.get(fqn)
            measured = watch is not None and watch.tiny is not None
            out[k][fqn] = (amax / calls, kurtosis / calls, under / calls if measured else None)
        return out

    def order_key(self, kind: str) -> Callable[[str], tuple]:
        """Sort key of layers in the order they ran: as seen eagerly, else as modules finish;
        gradients backward (as seen, else the forward order reversed); own weight gradients
        as recorded (their hooks always run eagerly)."""
        fwd, finish, bwd = self.forward_order, self.finish, self.backward_order

        def forward(fqn: str) -> tuple:
            return (0, fwd[fqn]) if fqn in fwd else (1, finish.get(fqn, 0))

        def backward(fqn: str) -> tuple:
            if fqn in bwd:
                return (0, bwd[fqn], 0)
            seen, rank = forward(fqn)
            return (1, -seen, -rank)  # the forward order reversed

        if kind in ("out", "in"):
            return forward
        if kind == "wgrad":
            return lambda fqn: ()  # a stable sort keeps the recorded order
        return backward
