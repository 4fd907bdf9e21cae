"""Memory as an objective: the peak memory of one training step under a policy, measured and
predicted.

**Measured** (:func:`measure_step_memory`): one training step (forward, backward, optimizer
step, ``zero_grad``) of a private model under the policy, after a first step has created the
optimizer's state. On CUDA, ``torch.cuda.max_memory_allocated`` (the caching allocator's
statistics) over each phase. Elsewhere, a ``torch.profiler`` trace with
``profile_memory=True``: the allocation and free events of the step summed in time order give
the bytes allocated at each instant, plus the bytes live when the step began (parameters and
optimizer state, counted from their storages, since the trace sees only what is allocated
while it runs). The step is split into two phases at a ``record_function`` marker: forward +
backward (activations) and the optimizer step (gradients, state and its temporaries).
On a host without 16-bit matmul units (:func:`autoprec.host.slow_16bit_dtypes`: a Zen 3
takes minutes per BF16 step at a Llama-3-8B layer's width) the step's 16-bit GEMMs are emulated
in FP32 (:func:`autoprec.runtime.fp8.emulating`), which keeps for backward the 16-bit copies
autocast's kernels keep; only the emulation's FP32 temporaries, one GEMM's at a time, differ
(``benchmarks/bench_memory.py`` measures the gap against the kernels).

**Predicted** (:class:`MemoryModel`): what a search can afford to ask of every trial.
A pure formula over the captured layers cannot see everything a step allocates (the
elementwise ops between layers, dropout masks, the loss, the allocator's temporaries), so the
model is *calibrated*: it measures the all-fp32 step once, and predicts a policy as the fp32
peak of forward + backward plus, per layer, the change in what that layer keeps for backward
in the policy's format (each product's operands, from the layer's captured ``(batch, M, K,
N)``):

- fp32: the FP32 input (``4*b*M*K`` bytes) and, for products of two activations, both
  operands; a weight is the parameter itself (no copy);
- bf16 / fp16 (autocast): a 2-byte copy of the input *and of the weight* (autocast caches the
  weight's cast for the forward and ``mm`` saves it); fp8 a kernel does not take: the same;
- fp8 tensorwise on autoprec's engine: the E4M3 input and weight (1 byte each; the FP32
  input is freed); rowwise recipes on autoprec's engine: the operands as they came (it casts
  them to FP32 again in backward), so an FP32 input stays and the weight is the parameter,
  while an input that arrives in 16 bits keeps 2 bytes an element: a layer whose producers
  (the captured edges) are all layers computing in a 16-bit or FP8 format, as an MLP's down
  projection after its up projection, or attention after its projections; anything else (a
  norm, an embedding, no edge) is taken to hand over FP32. On torchao's ``Float8Linear``:
  the BF16 input (the weight is the parameter);
- layers reading one tensor (q/k/v after one norm) share its FP32 copy, while each
  low-precision layer makes its own.

What the formula does not see changes too: the elementwise work after a layer whose output
stays in 16 bits (its parent region is not fp32) saves 16-bit tensors. That part is calibrated
by a second measurement, the all-bf16 forward + backward: what it adds above the bytes live when
it began, against what the fp32 step's forward + backward adds, minus the formula's change, is
spread over the layers in proportion to their output elements, and a policy gets each layer's
share when that layer's output stays low precision. That measurement runs without an optimizer
(``measure_step_memory(compute_only=True)``): forward + backward add the same above the state
as without it, and the calibration then never holds more than the fp32 training step it
measures first (a bf16 step beside the optimizer's state held its 16-bit weight copies on
top). Nor does the fp32 step hold the optimizer's whole state: its forward + backward are
measured the same way, and its optimizer phase is priced (:func:`price_optimizer`: the
optimizer built and stepped over a part of the parameters at a time, its state summed, its
temporaries combined as the step holds them). The optimizer phase does not depend on the
policy (gradients and state are FP32, the autocast cache is gone): the predicted peak is the
larger of the two phases. Predictions are
for the batch the steps run on (the task's first calibration batch), on the task's device.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from autoprec.costmodel import produced_elements
from autoprec.formats import Format
from autoprec.graph import Layer
from autoprec.policy import Policy
from autoprec.scaling import shape_multiple

__all__ = ["StepMemory", "OptimizerPrice", "MemoryModel", "measure_step_memory", "price_optimizer",
           "parse_size", "format_size"]

_FP32 = Policy(default=Format.FP32)
_BF16 = Policy(default=Format.BF16)
# kinds whose second operand is a parameter (no copy in fp32); the others multiply activations
_WEIGHT_KINDS = ("linear", "conv")
_MARK = "autoprec::optimizer_step"


# ============================================================================ sizes
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from ``"2GiB"``, ``"512MB"``, ``"1.5 gb"`` or ``"1048576"``; a ValueError that
    names the text and the accepted units otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{text!r} is not a size; give bytes or a number with a unit "
                             "(KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 2GiB or 512MB.")
        value, unit = float(m.group(1)), m.group(2).lower()
    size = value * _UNITS[unit]
    if not (math.isfinite(size) and size >= 1):
        raise ValueError(f"{text!r} is not a positive size; give at least 1 byte, e.g. 2GiB.")
    return int(size)


def format_size(n: float) -> str:
    """``n`` bytes in binary units: ``21.0 MiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


# ============================================================================ measuring
@dataclass(frozen=True)
class StepMemory:
    """Peak bytes of one training step, by phase."""

    # live when the step began: parameters, optimizer state (and on CUDA all else allocated)
    persistent: int
    # peak during forward + backward (activations saved for backward, gradients)
    compute_peak: int
    # peak during the optimizer step and zero_grad
    optimizer_peak: int

    @property
    def peak(self) -> int:
        return max(self.compute_peak, self.optimizer_peak)

    def to_dict(self) -> dict:
        return {"persistent": self.persistent, "compute_peak": self.compute_peak,
                "optimizer_peak": self.optimizer_peak}


def _live_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the distinct storages of parameters, buffers and optimizer state."""
    state = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()]
    return _distinct_bytes([*model.parameters(), *model.buffers(), *state])


def measure_step_memory(model: nn.Module, batch: Any, policy: Policy,
                        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                        make_optimizer: Callable[[Any], torch.optim.Optimizer], *,
                        emulate: bool | None = None, compute_only: bool = False,
                        priced_optimizer: bool = False) -> StepMemory:
    """The peak memory of one training step of ``model`` on ``batch`` under ``policy`` (at
    learning rate 0, but a user's optimizer may still move weights: a caller that keeps the
    model puts them back); see the module docstring.

    ``emulate``: compute the 16-bit GEMMs the device has no units for
    (:func:`autoprec.host.slow_16bit_dtypes`) by FP32 emulation, which saves the bytes
    autocast's kernels save (a Zen 3 takes minutes per full-width BF16 step otherwise);
    None: where the device lacks them.

    ``compute_only``: measure forward + backward alone, after one unmeasured, with no
    optimizer and so no optimizer state alive (``persistent`` is the parameters and buffers,
    ``optimizer_peak`` 0): what forward + backward add above what is live is the same as in a
    whole step, where the state waits untouched, and the measurement holds less than the step
    it describes. ``make_optimizer`` is not called.

    ``priced_optimizer``: forward + backward measured as ``compute_only`` measures them, and the
    optimizer's phase priced rather than held: the optimizer stepped over the parameters a part
    at a time (:func:`price_optimizer`), so no more than a part's state is ever alive; what it
    returns describes the whole step, state included."""
    from autoprec.host import slow_16bit_dtypes
    from autoprec.runtime import rewrite
    from autoprec.runtime.fp8 import emulating

    optimizer = None if compute_only or priced_optimizer else make_optimizer(model.parameters())
    for group in optimizer.param_groups if optimizer is not None else ():
        group["lr"] = 0.0
    scaler = None
    device = next(model.parameters()).device
    if policy.needs_loss_scaling:
        scaler = policy.grad_scaler(device)
    slow = frozenset((torch.bfloat16, torch.float16)) if emulate else \
        slow_16bit_dtypes(device) if emulate is None else frozenset()
    rewrite.apply(model, policy, strict=False)
    try:
        with emulating(slow):
            # the first step creates the optimizer's state, which every later step keeps
            _backward(loss_fn(model, batch), scaler)
            # priced on the gradients of that first backward, before the measured one
            price = price_optimizer(model.parameters(), make_optimizer) \
                if priced_optimizer else None
            _opt_step(model, optimizer, scaler)
            if device.type == "cuda":
                step = _cuda_step(model, batch, loss_fn, optimizer, scaler, device)
            else:
                step = _traced_step(model, batch, loss_fn, optimizer, scaler)
    finally:
        rewrite.remove(model)
    if price is None:
        return step
    return StepMemory(step.persistent + price.state, step.compute_peak + price.state,
                      step.persistent + price.state + price.gradients + price.temporaries)


def _backward(loss: torch.Tensor, scaler) -> None:
    (scaler.scale(loss) if scaler is not None else loss).backward()


def _opt_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, scaler) -> None:
    """The optimizer's step and ``zero_grad``; without an optimizer (``compute_only``), the
    gradients set to None alone."""
    if optimizer is None:
        model.zero_grad(set_to_none=True)
        return
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _cuda_step(model, batch, loss_fn, optimizer, scaler, device) -> StepMemory:
    torch.cuda.synchronize(device)
    persistent = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _backward(loss_fn(model, batch), scaler)
    torch.cuda.synchronize(device)
    compute = torch.cuda.max_memory_allocated(device)
    if optimizer is None:
        _opt_step(model, optimizer, scaler)
        return StepMemory(persistent, compute, 0)
    torch.cuda.reset_peak_memory_stats(device)
    _opt_step(model, optimizer, scaler)
    torch.cuda.synchronize(device)
    return StepMemory(persistent, compute, torch.cuda.max_memory_allocated(device))


@contextlib.contextmanager
def _quiet_kineto() -> Iterator[None]:
    """The profiler's C++ side (kineto) prints ``USDT: ... profiler_start/stop`` on stderr at
    every trace, at a level above its errors, so nothing short of its level 6 hides them;
    kineto reads ``KINETO_LOG_LEVEL`` once, when the process's first trace starts. Set for
    that start where the user has not set it, then taken out of the environment again (child
    processes are not affected); a user's own earlier trace keeps its setting."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


def _traced_step(model, batch, loss_fn, optimizer, scaler) -> StepMemory:
    from torch.profiler import ProfilerActivity, profile, record_function

    persistent = _live_bytes(model, optimizer)
    with _quiet_kineto(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _backward(loss_fn(model, batch), scaler)
        with record_function(_MARK):
            _opt_step(model, optimizer, scaler)
    events = prof.profiler.kineto_results.events()
    split = min(e.start_ns() for e in events if e.name() == _MARK)
    # frees of blocks allocated before the trace carry no size and are not in it; a step
    # frees none that matter (gradients start as None, the state is updated in place)
    now = peak_compute = peak_opt = 0
    for t, nbytes in _allocations(events):
        now += nbytes
        if t < split:
            peak_compute = max(peak_compute, now)
        else:
            peak_opt = max(peak_opt, now)
    return StepMemory(persistent, persistent + peak_compute,
                      0 if optimizer is None else persistent + peak_opt)


# ------------------------------------------------------------------ the optimizer, priced
@dataclass(frozen=True)
class OptimizerPrice:
    """What an optimizer's phase of a training step adds, priced a part at a time."""

    # the optimizer's state over all the parameters (the sum of the parts')
    state: int
    # the gradients it reads (live through the phase)
    gradients: int
    # the most its step allocates above its state and the gradients
    temporaries: int
    # the parts the parameters were stepped in
    parts: int


def price_optimizer(params: Iterable[torch.nn.Parameter],
                    make_optimizer: Callable[[Any], torch.optim.Optimizer], *,
                    parts: int = 8) -> OptimizerPrice:
    """Price the optimizer step over ``params`` (those with a gradient) without holding its
    whole state: ``make_optimizer`` builds an optimizer over one part of them at a time (about
    1/``parts`` of their bytes, a parameter never split), at learning rate 0, which steps once
    to create its state and once measured; then it is dropped. Meanwhile the gradients wait
    outside the device's memory (:class:`autoprec._util.Spilled`), a part's brought back for
    its steps, and all of them are back after. The state adds up over the parts. The step's
    temporaries do not add up the same way for every optimizer: a loop over the tensors
    (torch's default on the CPU) holds one tensor's at a time, the largest part's; a
    ``foreach`` step (the default on CUDA) holds every tensor's at once, the sum of the
    parts'. Which, is measured: the two smallest parts (of at least half the aimed size)
    stepped together hold their larger's temporaries plus some share of the smaller's, and
    that share of the other parts' is added. The caller puts the weights back (an optimizer
    may move them even at learning rate 0)."""
    from autoprec._util import Spilled

    params = [p for p in params if p.grad is not None]
    gradients = _distinct_bytes(p.grad for p in params)
    groups = _parts(params, parts)
    store = Spilled(len(params))
    for i, p in enumerate(params):
        store.put(i, p.grad)
        p.grad = None
    index = {id(p): i for i, p in enumerate(params)}

    def step(group: list[torch.Tensor]) -> tuple[int, int]:
        for p in group:
            p.grad = store[index[id(p)]]
        try:
            return _step_part(group, make_optimizer)
        finally:
            for p in group:
                p.grad = None

    try:
        priced = [step(group) for group in groups]
        temps = [t for _, t in priced]
        share = 1.0
        pair = _pair(groups, temps, parts)
        if pair is not None:
            a, b = pair
            _, both = step(groups[a] + groups[b])
            share = min(1.0, max(0.0, (both - max(temps[a], temps[b])) / min(temps[a], temps[b])))
    finally:
        for i, p in enumerate(params):
            p.grad = store[i]
    temporaries = max(temps, default=0) + share * (sum(temps) - max(temps, default=0))
    return OptimizerPrice(sum(s for s, _ in priced), gradients, int(temporaries), len(groups))


def _pair(groups: list[list[torch.Tensor]], temps: list[int], parts: int) -> tuple[int, int] | None:
    """The two smallest parts of at least half the aimed size (else the two smallest), to see
    how their temporaries add up; None when there are fewer than two, or one has none."""
    size = [sum(p.numel() * p.element_size() for p in g) for g in groups]
    if len(groups) < 2:
        return None
    aimed = sum(size) / max(parts, 1)
    order = sorted(range(len(groups)), key=lambda i: size[i])
    big = [i for i in order if size[i] >= aimed / 2]
    a, b = (big if len(big) >= 2 else order)[:2]
    return None if min(temps[a], temps[b]) <= 0 else (a, b)


def _parts(params: list[torch.Tensor], parts: int) -> list[list[torch.Tensor]]:
    """``params`` in order, cut into runs of about 1/``parts`` of their bytes each."""
    total = sum(p.numel() * p.element_size() for p in params)
    target = total / max(parts, 1)
    out: list[list[torch.Tensor]] = [[]]
    held = 0
    for p in params:
        if out[-1] and held >= target:
            out.append([])
            held = 0
        out[-1].append(p)
        held += p.numel() * p.element_size()
    return [group for group in out if group]


def _step_part(params: list[torch.Tensor],
               make_optimizer: Callable[[Any], torch.optim.Optimizer]) -> tuple[int, int]:
    """(state bytes, peak bytes its second step allocates above what was live) of an
    optimizer over ``params`` alone, dropped after."""
    optimizer = make_optimizer(params)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    state = _distinct_bytes(v for s in optimizer.state.values() for v in s.values())
    return state, _peak_above(optimizer.step, params[0].device)


def _distinct_bytes(tensors: Iterable[Any]) -> int:
    storages: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _peak_above(fn: Callable[[], Any], device: torch.device) -> int:
    """The most ``fn()`` holds allocated at once above what was allocated when it began: the
    caching allocator's statistics on CUDA, a ``torch.profiler`` memory trace elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - start)
    from torch.profiler import ProfilerActivity, profile

    with _quiet_kineto(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    now = peak = 0
    for _, nbytes in _allocations(prof.profiler.kineto_results.events()):
        now += nbytes
        peak = max(peak, now)
    return peak


def _allocations(events: Iterable[Any]) -> list[tuple[int, int]]:
    """A memory trace's allocations (+bytes) and frees (-bytes), as (start ns, bytes) in time
    order."""
    return sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")


# ============================================================================ predicting
def _torchao_runs(layer: Layer, fmt: Format, policy: Policy) -> bool:
    """Whether ``apply`` would run this layer on torchao's Float8Linear: the one rule,
    :func:`autoprec.runtime.engines.torchao_runs`, with the Linear's in and out features read
    off its captured product (K and N)."""
    from autoprec.runtime.engines import torchao_runs

    if not layer.matmuls:
        return False
    p = layer.matmuls[0]
    return torchao_runs(fmt, linear=layer.module_type == "Linear", in_features=p.k,
                        out_features=p.n, engine=policy.engine)


def _product_bytes(layer: Layer, fmt: Format, policy: Policy,
                   low_input: bool = False) -> tuple[int, bool]:
    """(bytes this layer itself keeps for backward beyond its FP32 input, whether it keeps its
    FP32 input alive). For weight layers the input is counted by the caller (it may be shared
    with sibling layers); for products of two activations both operands are counted here.
    ``low_input``: the layer's inputs arrive in 16 bits, which only the recipes whose kernel
    saves its inputs (row scales, on autoprec's engine) keep as they are (the other formats
    copy, cast or are FP32 anyway)."""
    weighted = layer.kind in _WEIGHT_KINDS
    own, keeps_fp32 = 0, False
    num = fmt.numerics
    blockers = layer.fp8_blockers(shape_multiple(num))
    torchao = fmt.is_scaled and weighted and _torchao_runs(layer, fmt, policy)
    for i, p in enumerate(layer.matmuls):
        a, b = p.batch * p.m * p.k, p.batch * p.k * p.n
        fp8 = fmt.is_scaled and not (i < len(blockers) and blockers[i])
        if fmt.autocast_dtype is None:  # fp32: the input itself, no copies
            own, keeps_fp32 = own + (0 if weighted else 4 * (a + b)), True
        elif fmt.is_scaled and torchao:
            own += 2 * a
        elif fp8 and not num.saves_quantized:
            # saves its operands as they came: the weight is the parameter
            if low_input:
                own += 2 * a if weighted else 2 * (a + b)
            else:
                own, keeps_fp32 = own + (0 if weighted else 4 * (a + b)), True
        elif fp8:  # the quantized forward operands
            own += a * num.fwd.a.itemsize + b * num.fwd.b.itemsize
        else:  # bf16, fp16, or fp8 the kernel does not take: autocast's 16-bit copies
            own += 2 * (a + b)
    return own, keeps_fp32


def _input_bytes(layer: Layer) -> int:
    """FP32 bytes of a weight layer's input (its first product's activation operand)."""
    if layer.kind not in _WEIGHT_KINDS or not layer.matmuls:
        return 0
    p = layer.matmuls[0]
    return 4 * p.batch * p.m * p.k


def _shared_inputs(layers: Sequence[Layer], edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Weight layers that read one tensor: the same producer and the same input shape."""
    by_fqn = {lay.fqn: lay for lay in layers}
    producer: dict[str, list[str]] = {}
    for a, b in edges:
        producer.setdefault(b, []).append(a)
    groups: dict[tuple, list[str]] = {}
    for lay in layers:
        if lay.kind not in _WEIGHT_KINDS or not lay.matmuls:
            continue
        p = lay.matmuls[0]
        src = tuple(sorted(producer.get(lay.fqn, ()))) or (f"?{lay.fqn}",)
        groups.setdefault((src, p.batch * p.m, p.k), []).append(lay.fqn)
    return [g for g in groups.values() if all(f in by_fqn for f in g)]


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


@dataclass
class MemoryModel:
    """Predicts a policy's peak training-step memory from the captured layers, calibrated by
    a measured all-fp32 step and a measured all-bf16 step (see the module docstring)."""

    # the layers that compute, as captured at the batch the steps ran on
    layers: tuple[Layer, ...]
    # the measured all-fp32 step
    fp32: StepMemory
    # bytes per output element that the work after a layer saves less (or more) when the
    # layer's output stays 16-bit: calibrated from the measured all-bf16 step
    residual_per_element: float = 0.0
    # weight layers reading one tensor (q/k/v after one norm)
    groups: list[list[str]] = field(default_factory=list)
    # the layers (or other modules) whose outputs each layer reads, from the captured edges
    producers: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self):
        self.layers = tuple(self.layers)
        self._by_fqn = {lay.fqn: lay for lay in self.layers}
        grouped = {f for g in self.groups for f in g}
        self.groups = [list(g) for g in self.groups] + \
            [[lay.fqn] for lay in self.layers if lay.fqn not in grouped]

    @classmethod
    def calibrate(cls, layers: Sequence[Layer], measure: Callable[[Policy], StepMemory], *,
                  edges: Iterable[tuple[str, str]] = (),
                  measure_compute: Callable[[Policy], StepMemory] | None = None) -> MemoryModel:
        """Measure the all-fp32 step with ``measure(policy)`` and the all-bf16 step's forward +
        backward with ``measure_compute`` (None: ``measure``; only its compute phase is read),
        and fit the residual of the work the formula does not see (see the module docstring):
        compared as what each step's forward + backward adds above what was live when it began,
        so a bf16 step measured without the optimizer's state (``compute_only``) compares with
        the fp32 step that had it."""
        edges = list(edges)
        producers: dict[str, tuple[str, ...]] = {}
        for a, b in edges:
            producers[b] = (*producers.get(b, ()), a)
        fp32 = measure(_FP32)
        model = cls(tuple(layers), fp32, groups=_shared_inputs(layers, edges),
                    producers=producers)
        bf16 = (measure_compute or measure)(_BF16)
        formula = sum(model.layer_change(_BF16).values())
        grown = (bf16.compute_peak - bf16.persistent) - (fp32.compute_peak - fp32.persistent)
        elements = sum(produced_elements(lay) for lay in model.layers)
        if elements:
            model.residual_per_element = (grown - formula) / elements
        return model

    def layer_change(self, policy: Policy) -> dict[str, float]:
        """Per layer (or group of layers sharing an input, keyed by the first), the predicted
        change in bytes kept for backward against all-fp32."""
        out: dict[str, float] = {}
        for group in self.groups:
            fp32_input = _input_bytes(self._by_fqn[group[0]])
            keeps, change = False, 0.0
            for fqn in group:
                lay = self._by_fqn[fqn]
                fmt = policy.format_for(fqn)
                own, keeps_fp32 = _product_bytes(lay, fmt, policy, self._low_input(fqn, policy))
                base, _ = _product_bytes(lay, Format.FP32, policy)
                keeps = keeps or keeps_fp32
                change += own - base
                if fmt is not Format.FP32 and policy.format_for(_parent(fqn)) is not Format.FP32:
                    change += self.residual_per_element * produced_elements(lay)
            out[group[0]] = change + (0 if keeps else -fp32_input)
        return out

    def _low_input(self, fqn: str, policy: Policy) -> bool:
        """Whether layer ``fqn``'s inputs arrive in 16 bits under ``policy``: every producer is
        a layer that computes in a 16-bit or FP8 format (they return BF16/FP16)."""
        producers = self.producers.get(fqn, ())
        return bool(producers) and all(p in self._by_fqn and policy.format_for(p) is not
                                       Format.FP32 for p in producers)

    def compute_peak(self, policy: Policy) -> float:
        """Predicted peak bytes of forward + backward under ``policy``."""
        return self.fp32.compute_peak + sum(self.layer_change(policy).values())

    def predict(self, policy: Policy) -> int:
        """Predicted peak bytes of a training step under ``policy``."""
        return int(max(self.compute_peak(policy), self.fp32.optimizer_peak))

    def lowest(self, choices: Mapping[str, Sequence[str]],
               units: Mapping[str, Sequence[str]]) -> dict[str, str]:
        """The assignment of search units (unit -> offered formats, unit -> layer fqns) that
        this model predicts smallest, unit by unit (the changes add up)."""
        out = {}
        for unit, offered in choices.items():
            def cost(fmt: str, unit: str = unit) -> float:
                # the unit's layers with their surroundings in the same format, as
                # assignment_policy makes the commonest format the default
                change = self.layer_change(Policy(default=fmt))
                return sum(change.get(f, 0.0) for f in units[unit])
            out[unit] = min(offered, key=cost)
        return out


def memory_model(task: Any, prof: Any = None, model: nn.Module | None = None) -> MemoryModel:
    """A :class:`MemoryModel` of ``task`` at its first calibration batch: the layers of
    ``prof`` when they were captured there (no ``shape_batch``), else captured again; steps
    measured on ``model`` itself (a build of the task's model prepared for measurement, e.g.
    the tune's own; None: a new build), its weights, buffers and gradients put back after
    each (a user's optimizer may move weights even at learning rate 0) from a copy that
    waits outside its device's memory: the calibration holds the model once, as training does
    (the capture, when one is needed, runs on it too and leaves it as it was), and the
    optimizer's state a part at a time (``priced_optimizer``): it holds less than the training
    step it predicts."""
    from autoprec._util import model_state
    from autoprec.measure.capture import capture
    from autoprec.measure.deviation import prepare_for_measurement
    from autoprec.task import default_loss

    model = model if model is not None else prepare_for_measurement(task.build_model())
    batch = task.example_batch()
    if prof is not None and task.shape_batch is None:
        layers, edges = [lp.layer for lp in prof.layers], prof.edges
    else:
        graph = capture(model, batch)
        layers, edges = [lay for lay in graph.layers if lay.matmuls], graph.edges

    def measure(policy: Policy, compute_only: bool = False) -> StepMemory:
        with model_state(model, spill=True):
            return measure_step_memory(model, batch, policy, task.loss_fn or default_loss,
                                       task.make_optimizer, compute_only=compute_only,
                                       priced_optimizer=not compute_only)

    return MemoryModel.calibrate(layers, measure, edges=edges,
                                 measure_compute=partial(measure, compute_only=True))
