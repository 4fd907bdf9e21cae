"""First-order estimates of every layer x format's sensitivity, from the FP32 reference pass.

The exact measurement (:mod:`autoprec.measure.sensitivity`) runs one whole forward+backward per
layer x format x batch, so its cost per layer grows with the model's depth. This module gets
the same numbers for *all* layers from the one FP32 reference forward+backward, a fixed number
of curvature probes (:data:`PROBES` FP32 forward+backwards per batch) and work local to each
layer, whose cost does not depend on depth:

```
probes, before each batch's reference:      FP32 reference forward, hooks on every listed layer
  parameters moved by step * z (z random)     record each call's inputs (refs, not copies)
  record each layer's inputs and output   --> backward: when the gradient g_y of a layer's
  gradients (a backward only as far as        output arrives, re-run that layer alone on its
  the layers' outputs)                        recorded inputs: in FP32, in each format, in FP32
                                              with its weights rounded as the format does, and
                                              at each probe's point (its parameter gradients)
```

With only one layer switched, everything upstream of it computes exactly as in the reference,
so its inputs are the recorded ones and the change of its output, ``dy = y_fmt - y_fp32``, is
exact. The loss change is its Taylor expansion in ``dy`` (the Fisher/Taylor score of
ModelOpt's AutoQuantize, here with the sign kept, since the budget is on the signed loss):

    dL ~= <g_y, dy> + 1/2 N sum_n <g_y[n], dy[n]>^2

the second term being the empirical Fisher (over the N samples of the batch, dim 0) standing
in for the Hessian. Divided by |loss_fp32| and averaged over batches, like the exact
``loss_rel_change``. The output SQNR and the layer's own weight-gradient error are exact (the
same local computation the whole run would do).

The whole-model gradient error is where a local computation is not enough: the error a layer
makes reaches every parameter, upstream through the gradient it sends back and downstream
through the activations it changes, and the residual stream of a transformer attenuates it
by an amount no local number shows (carrying the input gradient's relative error upstream
unattenuated, as this estimate once did, ranked GPT-2's layers backwards: Spearman -0.70 on
the example, the error growing with depth while the measured one falls). What it costs is
the curvature of the loss, measured by the probes:

- most of it (on the GPT-2 example over half of the squared error in bf16, ~95% in FP8)
  is the rounding of the layer's *weights*: a perturbation ``e`` of parameters the whole forward and
  backward then use, so the gradient moves by ``H e`` (H the loss's Hessian). Rounding errors
  are independent from element to element, so ``E ||H e||^2 = sum_i e_i^2 (H^2)_ii``, and a
  probe's finite difference of the gradient, ``t = (g(theta + step z) - g(theta)) / step = H z``
  with ``z ~ N(0, I)``, has ``E t_i^2 = (H^2)_ii``: one probe weighs every weight of every layer.
  ``e`` is the rounding the format's kernels apply (:class:`_Rounding`, read from the format's
  numerics and the call registry, as the FP8 router and autocast do);
- the rest (rounded activations, outputs and gradients) is what the format's local run differs
  from the weights-only one by: at the layer's outputs (``dy_r``) and at the gradients it sends
  to its inputs (``dg_r``), weighed element by element by the same probe's change of the output
  gradient (``u``, how the whole gradient responds to a change of that output) and of the
  inputs (``v``, how it responds to a change of the gradient sent there);
- plus the layer's own parameter-gradient error, exact.

``grad_rel_error^2 ~= (sum e^2 t^2 + sum dy_r^2 u^2 + sum dg_r^2 v^2 + own) / ||g||^2``, the
probe terms averaged over the probes. ``benchmarks/bench_estimate.py`` (every metric, four
models) and ``tests/test_estimate_ranks.py`` (tiny GPT-2 and Llama, per format) hold it: on
GPT-2, a Llama-style model and MiniLM its per-format Spearman against the measurement is
0.96-0.99 and a layer's value 0.6-1.25x the measured one (median 0.95-1.04), except a
parameter-free attention module (its error is all activations, weighed at its boundary:
0.3-0.6x). Blind spots: a
frozen weight has no gradient to probe, so its rounding is weighed at the boundary too (low);
a network whose rounding flips ReLU/max-pool decisions (the example CNN: its fp16 gradient
error is only 2.5x below bf16's, for 8x finer rounding) is outside first order, read 0.1-0.5x
low there, ranked at 0.88-0.93. The probes' directions come from the measurement's seed, so
the numbers are reproducible; another seed moves the Spearman by under 0.02.

Memory: the recorded inputs are the tensors autograd saves anyway for a matmul, and each
layer's local runs happen inside the backward as soon as its gradient arrives, so nothing per
layer is kept beyond the numbers, except the probes': per probe until its layer's turn, copies
of the layers' inputs and output gradients at the probe point (about what a training step
saves). The parameters' values, which the probes move and put back bit for bit, wait
outside the device's memory meanwhile (a temporary file on CPU, host memory beside a GPU),
each read back as it is moved: no copy of the parameters is held. No probe keeps a parameter
gradient: each layer recomputes its own parameters' gradients at each probe point (on the
probe's recorded inputs and output gradients, its parameters moved by the same draw, drawn
again from the generator state the probe saved) and at the reference. Once the layer's last
call of the batch is re-run, the differences, summed over its calls, are squared and folded
into one number per layer and format; only the local sum of the reference gradient waits for
the parameter's reference gradient, which checks it (it must be the whole one; if not, the
parameter is doubtful and the fold is void). Probe passes copy a tensor several layers read
once. A parameter also used outside the
layers that hold it (a weight tied to a layer not listed: GPT-2's embedding and head), seen by
the first probe pass of each batch, has its probe gradients taken whole from the probe's
backward instead; a use that pass misses fails the check, and the layers that round the
parameter get no weight term (nan: doubtful, measured exactly in ``auto``). Cost: the local
runs (FP32, each format, each format's weights-only run, each probe) and :data:`PROBES`
forward+backwards per batch, flat in depth per layer.

:func:`needs_exact` says which estimates are close enough to the budget, or doubtful enough
(non-finite, values beyond the format's range), to be measured exactly instead.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoprec._util import Spilled, floating, own_class
from autoprec.formats import Format, Gemm
from autoprec.measure import shards
from autoprec.measure.checkpointing import recomputing, refuse_reentrant
from autoprec.measure.deviation import DeviationMeter, all_finite, writable
from autoprec.policy import Budget, LossScaling, Policy
from autoprec.runtime import calls, rewrite
from autoprec.runtime.fp8 import emulating, round_operand
from autoprec.scaling import dequantize, quantize, shape_multiple

__all__ = ["Estimate", "estimate_during_reference", "needs_exact"]

# An estimated |loss change| in [low, high] x the budget is measured exactly: below, the
# estimate's second-order error cannot matter; above, the layer is out of budget by itself.
EXACT_BAND = (0.1, 10.0)
# Curvature probes per batch, each one FP32 forward+backward: two keep a layer's estimated
# gradient error within a few percent of its expectation (one probe: about twice the spread).
PROBES = 2
# A probe moves the parameters by this times their RMS along its direction: small enough that
# the gradient responds linearly, large enough that FP32 rounding of the gradients stays far
# below the response (the estimate is the same from 1e-4 to 1e-2 on the examples).
PROBE_STEP = 1e-3
# Elements reduced at a time where a whole tensor's float64 copy (twice its size) or a few
# temporaries of a parameter's size would be the profile's peak (a 32k-vocabulary head's).
_CHUNK = 1 << 20

# Layers whose output is linear in each parameter, so no parameter gradient reads a
# parameter's value (a weight's is the output gradient times the input): a probe's is taken at
# the parameters as they are, the same bits as at the moved ones. Exactly these classes, or
# FSDP2's of them (a subclass, e.g. a parametrized one, may compute anything).
_LINEAR_IN_PARAMS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)

# In ``_Estimator.delta``: a parameter's probe differences already folded (its only layer's
# calls of the batch were all re-run before its reference gradient arrived)
_FOLDED: Any = object()


@dataclass
class Estimate:
    """Accumulated local numbers of one layer in one format, over calls and batches."""

    # per batch: first-order and Fisher second-order loss change (absolute)
    first: dict[int, float] = field(default_factory=dict)
    second: dict[int, float] = field(default_factory=dict)
    # output signal and noise energy (float64 sums)
    signal: float = 0.0
    noise: float = 0.0
    # squared norms of gradient errors, over batches: the subtree's parameters (local, exact),
    # and its own parameters with their reference
    sub_diff: float = 0.0
    own_diff: float = 0.0
    own_ref: float = 0.0
    # the probe-weighted squared error the layer causes in the whole gradient: the rest of its
    # rounding (activations, outputs, gradients), and its weights' rounding (set at the end)
    resid: float = 0.0
    weight: float = 0.0
    finite: bool = True

    def loss_rel_change(self, losses: Sequence[float]) -> float:
        if not self.finite:
            return math.nan
        rel = [(self.first.get(b, 0.0) + self.second.get(b, 0.0)) / (abs(r) or 1.0)
               for b, r in enumerate(losses)]
        return math.fsum(rel) / len(rel)

    def grad_rel_error(self, total_sq: float) -> float:
        """``total_sq``: the squared norm of the whole reference gradient, all batches."""
        if not self.finite:
            return math.nan
        diff = self.sub_diff + self.resid + self.weight
        if math.isnan(diff):
            return math.nan
        return math.sqrt(diff / total_sq) if total_sq > 0 else (0.0 if diff == 0 else math.inf)

    def layer_grad_rel_error(self) -> float | None:
        if self.own_ref == 0.0 and self.own_diff == 0.0:
            return None
        if not self.finite:
            return math.nan
        return math.sqrt(self.own_diff / self.own_ref) if self.own_ref > 0 else math.inf

    def sqnr_db(self) -> float:
        if not self.finite or math.isnan(self.noise):
            return math.nan
        if self.noise == 0.0:
            return math.inf
        if self.signal == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.noise)


# ------------------------------------------------------------------------------ rounding
@dataclass(frozen=True)
class _Rounding:
    """How a format's kernels round one parameter operand: a cast to ``dtype`` (autocast's),
    or, for the ``operand`` of a scaled forward ``gemm``, that GEMM's own rounding along
    ``dim`` (the contracted dimension, in the parameter's own layout: one scale per tensor or
    per row, MX or NVFP4 blocks)."""

    dtype: torch.dtype
    dim: int = -1
    gemm: Gemm | None = None
    operand: int = 0

    def apply(self, w: torch.Tensor) -> torch.Tensor:
        """The FP32 values the kernel multiplies in place of ``w`` (no autograd)."""
        x = w.detach().to(torch.float32)
        if self.gemm is None:
            return x.to(self.dtype).to(torch.float32)
        # the scaled kernels' own rounding (autoprec.runtime.fp8.round_operand), contraction last
        rounded = round_operand(x.movedim(self.dim, -1), self.gemm, self.operand)
        return rounded.movedim(-1, self.dim)

    def weighed_error_sq(self, w: torch.Tensor, weight: torch.Tensor) -> float:
        """``sum((apply(w) - w)^2 * weight)`` summed in float64, a chunk at a time: where each
        element is rounded alone given its tensor's or row's scale (a cast, FP8 per tensor or
        per row), the chunk's rows are rounded with the whole's scales, the same values as
        :meth:`apply`'s; otherwise (blocks, NVFP4's tensor scale) the rounded ``w`` is held."""
        x, t = w.detach().reshape(-1), weight.reshape(-1)
        rows = self._rows(w)
        rounded = self.apply(w).reshape(-1) if rows is None else None
        cols = w.shape[-1] if w.dim() else 1
        total = 0.0
        for start in range(0, x.numel(), _CHUNK):
            end = min(start + _CHUNK, x.numel())
            xs = x[start:end].to(torch.float32)
            if rounded is not None:
                r = rounded[start:end]
            else:  # the rows the chunk lies in, rounded, then the chunk of them
                first = start // cols
                r = rows(first, -(-end // cols)).reshape(-1)[start - first * cols:
                                                             end - first * cols]
            e = (r - xs).square_()
            total += float((e * t[start:end]).sum(dtype=torch.float64))
        return total

    def _rows(self, w: torch.Tensor) -> Callable[[int, int], torch.Tensor] | None:
        """``rows(a, b)``: rows ``a:b`` of ``w`` (as ``[-1, w.shape[-1]]``) rounded as
        :meth:`apply` rounds them, where each element's rounding needs only its tensor's or
        its row's scale (the contraction along ``w``'s last dimension, or one scale for the
        tensor); None where it needs more of the tensor."""
        x = w.detach().to(torch.float32)
        flat = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
        if self.gemm is None:
            return lambda a, b: flat[a:b].to(self.dtype).to(torch.float32)
        scaling = self.gemm.scaling
        along_rows = self.dim in (-1, x.dim() - 1)
        if not scaling.rounds_by_scale or not (along_rows or scaling.one_scale):
            return None
        dtype = self.gemm.a if self.operand == 0 else self.gemm.b
        s = scaling.scale(flat if along_rows else x, dtype, -1)
        if s.numel() > 1:
            s = s.reshape(-1, 1)

        def rows(a: int, b: int) -> torch.Tensor:
            part = s if s.numel() == 1 else s[a:b]
            return dequantize(quantize(flat[a:b], part, dtype), part)

        return rows


def _rounding_of(fmt: Format, call: calls.Call, args: tuple, kwargs: dict,
                 operand: str) -> _Rounding | None:
    """How ``fmt`` rounds the ``operand`` (a parameter name of ``call``) of this call, None
    where it computes it in FP32. The FP8 router takes the calls :func:`calls.matmul_form`
    gives and the kernel's shape rule admits (forward GEMM operands ``a`` and ``b``; F.linear's
    weight is ``b`` transposed); autocast casts every other rounded call's operands."""
    num = fmt.numerics
    if not call.rounded or num.autocast is None:
        return None
    form = calls.matmul_form(call, args, kwargs) if num.is_scaled else None
    if form is not None:
        p = calls.product_of(form[0].shape, form[1].shape)
        if calls.fp8_shape_supported(p.m, p.k, p.n, shape_multiple(num))[0]:
            first = operand == call.multiplied[0]
            dim = -1 if first or call.name == "linear" else -2
            return _Rounding(num.fwd.a if first else num.fwd.b, dim, gemm=num.fwd,
                             operand=0 if first else 1)
    return _Rounding(num.autocast)


class _Uses(TorchFunctionMode):
    """Inside (a probe pass's forward): notes each watched parameter used outside the calls of
    the layers that recompute its gradient (``_Estimator.owners``), e.g. a weight tied to a
    layer not watched."""

    def __init__(self, est: _Estimator):
        super().__init__()
        self.est = est

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _differentiable(out):
            # not a use the gradient flows through: a property read, requires_grad_, or
            # FSDP2 gathering the parameter (under no_grad) before its layer runs
            return out
        est = self.est
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                i = est.index.get(id(t)) if isinstance(t, torch.Tensor) else None
                if i is not None and i in est.all_owners and \
                        not any(w.active for w in est.all_owners[i]):
                    est.outside.add(i)
        return out


def _differentiable(out: Any) -> bool:
    """Whether a call's result carries a gradient back to its inputs."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.grad_fn is not None for t in tree_flatten(out)[0])


class _RoundWeights(TorchFunctionMode):
    """Inside: the layer's parameters, where a rounded call multiplies them, replaced by their
    rounding in ``fmt`` (values only: no gradient reaches the parameter); everything else
    computes as it is (FP32). ``found``: parameter index -> its rounding. Calls inside
    ``pinned`` descendants (kept FP32 while the layer is measured) are left alone."""

    def __init__(self, fmt: Format, index: Mapping[int, int], pinned: Sequence[nn.Module]):
        super().__init__()
        self.fmt, self.index = fmt, index
        self.found: dict[int, _Rounding] = {}
        self.inside = 0
        self.handles = [h for m in pinned for h in (
            m.register_forward_pre_hook(lambda *_: self._step(1)),
            m.register_forward_hook(lambda *_: self._step(-1)))]

    def _step(self, d: int) -> None:
        self.inside += d

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = calls.lookup(func) if not self.inside else None
        if call is None:
            return func(*args, **kwargs)
        bound = call.bind(args, kwargs)
        swap = {}
        for name in call.multiplied:
            t = bound.get(name)
            i = self.index.get(id(t)) if isinstance(t, torch.Tensor) else None
            r = None if i is None else self.found.get(i) or \
                _rounding_of(self.fmt, call, args, kwargs, name)
            if r is not None:
                self.found.setdefault(i, r)
                # the rounded values alone (t + (r - t) is r bit for bit): the runs inside
                # take only the inputs' gradients, so no copy of t carries one to it
                swap[name] = r.apply(t).requires_grad_(t.requires_grad)
        if swap:
            args = tuple(swap.get(call.params[i], a) if i < len(call.params) else a
                         for i, a in enumerate(args))
            kwargs = {k: swap.get(k, v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


# ------------------------------------------------------------------------------ hooks
class _Call:
    """One call of a watched layer in the reference forward, waiting for its output grads."""

    def __init__(self, batch: int, index: int, args: tuple, kwargs: dict):
        self.batch, self.index, self.args, self.kwargs = batch, index, args, kwargs
        self.n_out = 0
        self.grads: dict[int, torch.Tensor] = {}
        self.exited = False
        self.done = False


class _ProbeCall:
    """One call of a watched layer in a probe pass: its floating inputs and output grads."""

    def __init__(self, xs: list[torch.Tensor]):
        self.xs = xs
        self.grads: dict[int, torch.Tensor] = {}
        self.exited = False


def _grad_inputs(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The floating inputs of a call that require grad, in flattening order."""
    return [t for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]


class _Watch:
    """Hooks on one listed layer: records its calls' inputs and reacts to its output grads.
    A layer another rank estimates (not ``mine``) records nothing: its hooks only see that
    every rank's probe passes run the same backward (FSDP2's collectives) and note its calls
    for :class:`_Uses`."""

    def __init__(self, est: _Estimator, name: str, module: nn.Module, pinned: list[str],
                 fmts: list[Format], own: set[int], mine: bool = True):
        self.est, self.name, self.module, self.fmts = est, name, module, fmts
        self.mine = mine
        self.pinned = pinned
        self.params = [est.meter.leaf(p) for p in module.parameters() if p.requires_grad]
        self.own = [i for i, p in enumerate(self.params) if id(p) in own]
        self.calls: list[_Call] = []
        # (batch, probe) -> that probe pass's calls, in order
        self.probed: dict[tuple[int, int], list[_ProbeCall | None]] = {}
        self.results = {f: Estimate() for f in fmts}
        self.active = 0  # calls running (probe passes)
        # per format, the rounding of each parameter (index among the compared ones)
        self.roundings: dict[Format, dict[int, _Rounding]] = {}
        self.handles = [module.register_forward_pre_hook(self._enter, with_kwargs=True),
                        module.register_forward_hook(self._exit)]

    def _enter(self, module, args, kwargs):
        est = self.est
        if recomputing():  # a checkpoint replaying a forward these hooks saw
            return
        if est.probing is not None:
            self.active += 1
            if not self.mine:
                return
            xs = [est.copy(t) for t in _grad_inputs(args, kwargs)]
            self.probed.setdefault((est.batch, est.probing), []).append(_ProbeCall(xs))
        elif est.capturing and self.mine:
            index = sum(1 for c in self.calls if c.batch == est.batch)
            self.calls.append(_Call(est.batch, index, args, kwargs))

    def _exit(self, module, args, output):
        est = self.est
        if recomputing():
            return
        if est.probing is not None:
            self.active = max(0, self.active - 1)
            if not self.mine:  # the backward goes as far as on the rank that estimates it
                est.reached.extend(t for t in floating(output) if t.requires_grad)
                return
            pending = self.probed.get((est.batch, est.probing), [])
            call = next((c for c in reversed(pending) if c is not None and not c.exited), None)
            if call is not None:
                call.exited = True
                for i, t in enumerate(t for t in floating(output) if t.requires_grad):
                    t.register_hook(partial(_keep_grad, call.grads, i))
                    est.reached.append(t)
            return
        if not est.capturing or not self.calls:
            return
        call = next((c for c in reversed(self.calls) if not c.exited), None)
        if call is None:
            return
        call.exited = True
        outs = [t for t in floating(output) if t.requires_grad]
        call.n_out = len(outs)
        if not outs:  # nothing downstream can feel this call
            call.done, call.args, call.kwargs = True, None, None
        for i, t in enumerate(outs):
            t.register_hook(partial(self._grad, call, i))

    def _grad(self, call: _Call, i: int, g: torch.Tensor):
        call.grads[i] = g
        if len(call.grads) == call.n_out and not call.done:
            self.est.process(self, call)

    def take_probes(self, call: _Call) -> list[_ProbeCall | None]:
        """The probe passes' records of the same call (None where a pass had none); dropped
        here, as the reference's inputs are once the call is done."""
        out = []
        for k in range(self.est.n_probes):
            pending = self.probed.get((call.batch, k), [])
            out.append(pending[call.index] if call.index < len(pending) else None)
            if call.index < len(pending):
                pending[call.index] = None
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _keep_grad(store: dict, i: int, g: torch.Tensor) -> None:
    """A probe pass's output gradient, kept as autograd hands it over: the same tensor the
    pass's ``autograd.grad`` returns for that output (a copy would hold it twice until the
    pass ends), which nothing changes in place (autograd does not change a gradient it has
    handed on, and the re-runs only read it)."""
    store[i] = g.detach()


class _Estimator:
    """The state the watches share: whether the reference forward is being recorded (or a
    probe pass), which batch, the probes' parameter gradients and curvature, and the local
    re-runs."""

    def __init__(self, meter: DeviationMeter, loss_scale: float,
                 progress: Callable[[str], None] | None, n_probes: int):
        self.meter = meter
        self.loss_scale = loss_scale
        self.progress = progress
        self.n_probes = n_probes
        self.capturing = False
        self.backward = False  # the reference's backward of a batch may be running
        self.probing: int | None = None  # the probe pass running, if any
        self.local = False  # a layer's local re-runs are running
        self.batch = 0
        self.watches: dict[str, _Watch] = {}
        params = meter.params
        self.index = {id(p): i for i, p in enumerate(params)}
        stored = meter.shards  # where the values are (each rank's part under FSDP2)
        sq = torch.tensor([_sq(shards.local(p)) for p in stored], dtype=torch.float64,
                          device=shards.local(stored[0]).device)
        total = math.fsum(shards.summed_each(sq, stored).tolist())
        rms = math.sqrt(total / max(1, sum(p.numel() for p in stored)))
        self.step = PROBE_STEP * (rms or 1.0)
        # per probe of the batch running, the generator state each parameter's direction was
        # drawn from (a few KB each): its moved value is drawn again where a layer needs it
        self.z_states: list[list] = []
        self.reached: list[torch.Tensor] = []  # a probe pass's watched outputs
        # a probe pass's copies of the watched calls' inputs, by the tensor and its version:
        # layers that read one input (q, k and v; gate and up) share one copy of it
        self.copies: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # per parameter, until the reference's gradient of it arrives: per probe, the change
        # of its gradient between the probe point and here, and the reference gradient, each
        # summed over its calls in the layers that hold it (recomputed there, locally)
        self.owners: dict[int, list[_Watch]] = {}
        # the same over every rank's layers (their calls decide what counts as outside)
        self.all_owners: dict[int, list[_Watch]] = {}
        self.delta: dict[int, Any] = {}  # a list per parameter, or _FOLDED
        self.local_ref: dict[int, torch.Tensor] = {}
        self.doubtful: set[int] = set()  # parameters whose local gradients missed some use
        # parameters also used outside those layers (a weight tied to one not watched): their
        # probe gradients are taken whole, per probe, until the reference's arrives
        self.outside: set[int] = set()
        self.plus: list[dict[int, torch.Tensor]] = []
        # the curvature (each parameter's squared finite difference, mean over probes) is
        # folded as it arrives into each layer x format's weight term (its rounding error
        # squared, weighed by it): one float per layer and format, not one per parameter.
        # Until a layer's roundings are known (its first local run) it waits in ``pending``.
        self.users: dict[int, list[_Watch]] = {}
        self.pending: dict[int, torch.Tensor] = {}
        self.terms: dict[tuple[str, Format], list[float]] = {}
        self.probes_finite = True

    # ------------------------------------------------------------------ the probes
    def probe(self, b: int) -> None:
        """The probe passes of batch ``b`` (before its reference forward): the parameters
        moved along each probe's direction, then put back bit for bit. A pass records each
        watched call's inputs and output gradients; no parameter gradient is kept: each
        layer recomputes its own where the reference reaches it (:meth:`_probe_grads`)."""
        stored = [shards.local(p) for p in self.meter.shards]
        keep = Spilled(len(stored))  # outside the device's memory, read back as each is moved
        for i, p in enumerate(stored):
            keep.put(i, p)
        self.z_states, self.delta, self.local_ref, self.plus = [], {}, {}, []
        try:
            for k in range(self.n_probes):
                self.z_states.append(self._probe_pass(b, k, keep))
        finally:
            with torch.no_grad():
                for p, w in zip(stored, keep):
                    p.copy_(w)

    def _probe_pass(self, b: int, k: int, keep: Spilled) -> list:
        meter, params = self.meter, self.meter.params
        gens: dict[torch.device, torch.Generator] = {}
        seed = (meter.seed * 1_000_003 + b * 1_009 + k) % 2**63
        states = []
        with torch.no_grad():
            for i, p in enumerate(meter.shards):  # each drawn whole, its shard moved
                gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
                states.append(gen.get_state())
                z = shards.local(shards.like(_direction(p, gen), p))
                # w + step * z, in place: the same values as _moved's, one temporary
                shards.local(p).copy_(keep[i]).add_(z.mul_(self.step))
        self.probing, self.batch, self.reached, self.copies = k, b, [], {}
        self.plus.append({})
        try:
            torch.manual_seed(meter.seed + b)
            with _Uses(self) if k == 0 else contextlib.nullcontext():
                loss = meter.loss_fn(meter.model, meter.batches[b])
            self.copies = {}  # the forward's inputs are the backward's to free
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
                return states  # the reference's forward says what is wrong with it
            # only as far as the watched layers' outputs (their hooks keep the gradients) and
            # the parameters used outside them
            whole = sorted(self.outside)
            wrt = [*self.reached, *(params[i] for i in whole)]
            with refuse_reentrant():
                grads = torch.autograd.grad(loss.reshape(()), wrt, allow_unused=True) \
                    if wrt else ()
        finally:
            self.probing, self.reached, self.copies = None, [], {}
        self.probes_finite = self.probes_finite and math.isfinite(float(loss.detach())) \
            and all_finite([g for g in grads if g is not None])
        # kept for the parameters a layer of this rank holds (the others' ranks keep theirs)
        held = [(i, g) for i, g in zip(whole, grads[len(grads) - len(whole):])
                if i in self.users]
        own = writable([torch.zeros_like(params[i]) if g is None else g.to(torch.float32)
                        for i, g in held])
        self.plus[k] = dict(zip((i for i, _ in held), own))
        return states

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A probe pass's copy of a watched call's input ``t``: one per tensor and version
        (a change in place in between makes another)."""
        key = (id(t), t._version)
        if key not in self.copies:
            self.copies[key] = (t, t.detach().clone())
        return self.copies[key][1]

    def _moved(self, p: torch.Tensor, k: int) -> torch.Tensor:
        """Parameter ``p`` where probe ``k`` of this batch moved it: the same values."""
        gen = torch.Generator(device=p.device)
        gen.set_state(self.z_states[k][self.index[id(p)]])
        # p + step * z in the drawn z's own memory (the same sum, bit for bit): one tensor
        return _direction(p, gen).mul_(self.step).add_(p.detach())

    def param_hooks(self) -> list:
        return [p.register_hook(partial(self._param_grad, i))
                for i, p in enumerate(self.meter.params)]

    def index_users(self) -> None:
        """Which watched layers hold each parameter (only those can round it), and which of
        them recompute its gradient: the innermost (a layer inside another that holds it
        computes part of the outer's; layers side by side, a tied weight, add up)."""
        every: dict[int, list[_Watch]] = {}
        for watch in self.watches.values():
            for p in watch.params:
                if id(p) in self.index:
                    every.setdefault(self.index[id(p)], []).append(watch)
        for i, users in every.items():
            self.all_owners[i] = [w for w in users
                                  if not any(o is not w and _inside(o.module, w.module)
                                             for o in users)]
            if any(w.mine for w in users):
                self.users[i] = [w for w in users if w.mine]
                self.owners[i] = [w for w in self.all_owners[i] if w.mine]

    def _param_grad(self, i: int, g: torch.Tensor) -> None:
        """A reference parameter gradient (all its uses summed): the probes' finite
        differences, which the layers holding it recomputed, folded into the weight terms of
        the layers that round it (:meth:`_curvature`; already there for a parameter whose
        layer's last call came before); first checked against this gradient, whose local sum
        must be it (a use outside those layers would leave part of the curvature out: the
        parameter is then doubtful, and its layers' weight terms nan, folded or not)."""
        if self.local or self.probing is not None:
            return
        deltas, local = self.delta.pop(i, None), self.local_ref.pop(i, None)
        if not self.users.get(i):
            return
        g = g.detach().to(torch.float32)
        if i in self.outside:  # the whole probe gradients, in place (owned: _probe_pass)
            deltas, local = [plus.pop(i, None) for plus in self.plus], g
            deltas = [None if d is None else d.sub_(g) for d in deltas]
        if local is None or (deltas is not _FOLDED and (
                deltas is None or any(d is None for d in deltas))) or not _close(local, g):
            self.doubtful.add(i)
            return
        del local
        if deltas is not _FOLDED:
            self._curvature(i, deltas)

    def _curvature(self, i: int, deltas: list[torch.Tensor]) -> None:
        """Parameter ``i``'s probe differences (each summed over its calls, owned) squared and
        averaged in the first one's memory, then folded into its layers' weight terms (or
        waiting in ``pending`` until their roundings are known)."""
        t2 = None
        for d in deltas:
            d.div_(self.step).square_().div_(self.n_probes)
            t2 = d if t2 is None else t2.add_(d)
        deltas.clear()
        d = None  # the last probe's, added into t2: not held through the fold's rounding
        if i in self.pending:
            t2.add_(self.pending.pop(i))
        if self._ready(i):
            self._fold(i, t2)
        else:
            self.pending[i] = t2

    def _ready(self, i: int) -> bool:
        """Whether every layer that holds parameter ``i`` knows how each format rounds it."""
        return all(fmt in w.roundings for w in self.users[i] for fmt in w.fmts)

    def fold_ready(self) -> None:
        """Fold the waiting curvature whose layers now know their roundings."""
        for i in [i for i in self.pending if self._ready(i)]:
            self._fold(i, self.pending.pop(i))

    def _fold(self, i: int, t2: torch.Tensor) -> None:
        p = self.meter.params[i]
        if p.untyped_storage().size() == 0:  # FSDP2 sharded its unit again: not weighed here
            self.doubtful.add(i)
            return
        for watch in self.users[i]:
            for fmt in watch.fmts:
                r = watch.roundings.get(fmt, {}).get(i)
                if r is not None:
                    self.terms.setdefault((watch.name, fmt), []).append(
                        r.weighed_error_sq(p, t2))

    def finish_weights(self) -> None:
        """Each layer x format's weight term: its parameters' rounding error, squared, weighed
        by the curvature the probes measured."""
        for i in list(self.pending):
            self._fold(i, self.pending.pop(i))
        for watch in self.watches.values():
            sure = self.probes_finite and not any(
                self.index.get(id(p)) in self.doubtful for p in watch.params)
            for fmt, est in watch.results.items():
                est.weight = math.fsum(self.terms.get((watch.name, fmt), ())) \
                    if sure else math.nan

    # ------------------------------------------------------------------ local re-runs
    def process(self, watch: _Watch, call: _Call) -> None:
        call.done = True
        was = self.capturing
        self.capturing, self.local = False, True
        prev = rewrite.applied_policy(self.meter.model)
        try:
            with torch.enable_grad():
                self._process(watch, call)
        finally:
            if prev is not None:
                rewrite.apply(self.meter.model, prev, strict=False)
            else:
                rewrite.remove(self.meter.model)
            self.capturing, self.local = was, False
            call.args = call.kwargs = None  # drop the refs: this call is done
        self.fold_ready()  # this layer's roundings are known now
        if self.progress is not None:
            self.progress(watch.name)

    def _process(self, watch: _Watch, call: _Call) -> None:
        model = self.meter.model
        rewrite.remove(model)
        ref = self._run(watch, call, None)
        g_out = [call.grads.get(i, torch.zeros_like(t)) for i, t in enumerate(ref[0])]
        recs = watch.take_probes(call)
        tangents = self._tangents(call, g_out, recs)
        for fmt in watch.fmts:
            policy = Policy(default=Format.FP32,
                            layers={watch.name: fmt, **{c: Format.FP32 for c in watch.pinned}},
                            loss_scaling=LossScaling(init_scale=self.loss_scale),
                            engine="autoprec")
            with warnings.catch_warnings():
                # the emulated-fp8 speed warning: numerics are exact, which is all we use
                warnings.filterwarnings("ignore", message=r".*can only emulate.*")
                rewrite.apply(model, policy, strict=False)
            try:
                with emulating(self.meter.emulated):  # 16-bit GEMMs the host lacks units for
                    run = self._run(watch, call, fmt, g_out)
            finally:
                rewrite.remove(model)
            # its parameter gradients compared now, and let go before the weights-only run
            compared = _param_diffs(run, ref[2])
            run = run[:2]
            wonly = self._weights_only(watch, call, fmt, g_out, ref)
            _accumulate(watch.results[fmt], call.batch, (ref, run, wonly), compared, g_out,
                        watch.own, tangents, self.step)
            run = wonly = None  # this format's gradients go before the next format's run
        del tangents
        self._probe_grads(watch, call, recs, ref[2])

    def _probe_grads(self, watch: _Watch, call: _Call, recs: list,
                     ref_gp: list[torch.Tensor]) -> None:
        """Add this call's part of the gradient of each parameter the layer recomputes (see
        ``owners``): at the reference (``ref_gp``, from its local FP32 run) and, per probe, its
        change at the probe point (the layer alone on the probe's recorded inputs and output
        gradients, its own parameters moved as the probe moved them)."""
        mine = [(j, self.index[id(p)]) for j, p in enumerate(watch.params)
                if id(p) in self.index and self.index[id(p)] not in self.outside
                and watch in self.owners.get(self.index[id(p)], ())]
        if not mine:
            return
        xs = _grad_inputs(call.args, call.kwargs)
        for k, rec in enumerate(recs):
            grads = self._at_probe(watch, call, rec, k) if _matches(rec, xs) else None
            for j, i in mine:
                deltas = self.delta.setdefault(i, [torch.zeros(0)] * self.n_probes)
                if grads is None or deltas[k] is None:
                    deltas[k] = None  # a probe pass that missed this call: not measured
                elif deltas[k].numel() == 0:
                    deltas[k] = grads[j].sub_(ref_gp[j])
                else:
                    deltas[k].add_(grads[j]).sub_(ref_gp[j])
            del grads
        for j, i in mine:  # added out of place: ref_gp may be a view autograd shares
            g = ref_gp[j]
            self.local_ref[i] = g if i not in self.local_ref else self.local_ref[i] + g
            if self._complete(watch, call, i):
                # folded now, not held until the reference gradient arrives (only the check
                # waits for it): a head's probe differences are the backward's largest tensors
                deltas = self.delta[i]
                self.delta[i] = _FOLDED
                if any(d is None for d in deltas):
                    self.doubtful.add(i)
                else:
                    self._curvature(i, deltas)

    def _complete(self, watch: _Watch, call: _Call, i: int) -> bool:
        """Whether parameter ``i``'s probe differences of this batch are whole once ``call``
        is: ``watch`` is its only layer (on any rank; not a use outside them) and every call of
        the batch has had its re-runs, during the reference's backward (whose gradient of it
        is still to come and checks them)."""
        return self.backward and i not in self.outside \
            and self.all_owners.get(i) == [watch] \
            and all(c.done for c in watch.calls if c.batch == call.batch)

    def _at_probe(self, watch: _Watch, call: _Call, rec: _ProbeCall,
                  k: int) -> list[torch.Tensor]:
        """The layer's parameter gradients (each its own tensor) at probe ``k``'s point."""
        flat, spec = tree_flatten((call.args, call.kwargs))
        given = iter(rec.xs)
        leaves = [next(given) if isinstance(t, torch.Tensor) and t.is_floating_point()
                  and t.requires_grad else t for t in flat]
        args, kwargs = tree_unflatten(leaves, spec)
        named = [(n, p) for n, p in watch.module.named_parameters() if p.requires_grad]
        if own_class(watch.module) in _LINEAR_IN_PARAMS:
            # their gradients do not read their values: the same bits at p as at p + step*z,
            # with no moved copy of the weight
            moved = {n: p.detach().requires_grad_(True) for n, p in named}
        else:
            moved = {n: self._moved(p, k).requires_grad_(True) for n, p in named}
        out = [t for t in floating(torch.func.functional_call(watch.module, moved, args, kwargs))
               if t.requires_grad]
        g_out = [rec.grads.get(i, torch.zeros_like(t)) for i, t in enumerate(out)]
        grads = torch.autograd.grad(out, list(moved.values()), g_out, allow_unused=True) \
            if out else [None] * len(moved)
        return writable([torch.zeros_like(m) if g is None else g.detach().to(torch.float32)
                         for g, m in zip(grads, moved.values())])

    def _weights_only(self, watch: _Watch, call: _Call, fmt: Format, g_out, ref):
        """The layer in FP32 with its weights rounded as ``fmt`` rounds them (the FP32 run
        itself where it multiplies no parameter)."""
        if watch.roundings.get(fmt) == {}:
            return ref
        model = self.meter.model
        mode = _RoundWeights(fmt, self.index, [model.get_submodule(c) for c in watch.pinned])
        out = self._run(watch, call, None, g_out, mode)
        watch.roundings.setdefault(fmt, mode.found)
        return out

    def _tangents(self, call: _Call, g_out: list[torch.Tensor], recs: list):
        """Per probe whose pass saw this call: the finite differences of the layer's output
        gradients (``u``) and of its inputs (``v``) between the probe point and here, as the
        pairs ``(at the probe, here)`` they are taken from (``None`` at the probe: a zero
        gradient there), divided by the step a chunk at a time where they are weighed
        (:func:`_weighed`): a head's are logit-sized, one per probe."""
        xs = [x.detach() for x in _grad_inputs(call.args, call.kwargs)]
        out = []
        for rec in recs:
            if not _matches(rec, xs):
                continue
            u = [(rec.grads.get(i), g) for i, g in enumerate(g_out)]
            if any(a is not None and a.shape != g.shape for a, g in u):
                continue
            out.append((u, list(zip(rec.xs, xs))))
        return out

    def _run(self, watch: _Watch, call: _Call, fmt: Format | None, g_out=None,
             mode: TorchFunctionMode | None = None):
        """The layer alone on the recorded inputs (inside ``mode``, if given): its floating
        outputs, and (given output grads) the gradients of its floating inputs and of its
        parameters (not those inside ``mode``, which only needs the inputs')."""
        flat, spec = tree_flatten((call.args, call.kwargs))
        leaves, xs = [], []
        for t in flat:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                t = t.detach().requires_grad_(True)
                xs.append(t)
            leaves.append(t)
        args, kwargs = tree_unflatten(leaves, spec)
        with mode if mode is not None else contextlib.nullcontext():
            out = [t for t in floating(watch.module(*args, **kwargs)) if t.requires_grad]
        if g_out is None:  # the FP32 reference: its grads use the true output grads
            g_out = [call.grads.get(i, torch.zeros_like(t)) for i, t in enumerate(out)]
        wrt = [*xs, *(watch.params if mode is None else ())]
        scale = self.loss_scale if fmt is not None and fmt.needs_loss_scaling else 1.0
        grads = _local_grads(out, wrt, g_out, scale) if out and wrt else [None] * len(wrt)
        grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]
        return ([t.detach() for t in out], grads[:len(xs)], grads[len(xs):])


def _direction(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A probe's direction for parameter ``p``: standard normal, drawn from ``gen``."""
    return torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype)


def _inside(m: nn.Module, outer: nn.Module) -> bool:
    """Whether ``m`` is a module inside ``outer`` (not ``outer`` itself)."""
    return m is not outer and any(c is m for c in outer.modules())


def _matches(rec: _ProbeCall | None, xs: list[torch.Tensor]) -> bool:
    """Whether a probe pass's record of a call has the reference call's inputs' shapes."""
    return rec is not None and len(rec.xs) == len(xs) and all(
        a.shape == x.shape for a, x in zip(rec.xs, xs))


def _close(local: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether a parameter's gradient summed from its layers' local runs is the whole one
    (to FP32 rounding: the same products, perhaps in another order)."""
    return _sq(local, g) <= 1e-8 * _sq(g)


def _local_grads(out, wrt, g_out, scale: float):
    """Gradients of ``sum <out, g_out>``; an fp16 run back-propagates ``g_out * scale`` and
    halves the scale while the result overflows, as GradScaler would (see numerics.py)."""
    while True:
        gs = [g * scale for g in g_out] if scale != 1.0 else g_out
        grads = torch.autograd.grad(out, wrt, gs, allow_unused=True, retain_graph=scale > 1.0)
        grads = [None if g is None else (g.float() / scale if scale != 1.0 else g.float())
                 for g in grads]
        if scale <= 1.0 or all_finite([g for g in grads if g is not None]):
            return grads
        scale = max(1.0, scale / 2)


def _sq(t: torch.Tensor, minus: torch.Tensor | None = None) -> float:
    """``sum (t - minus)^2`` (``minus`` absent: ``sum t^2``) in float64, a chunk at a time."""
    total = 0.0
    for start in range(0, t.numel(), _CHUNK):
        c = _flat_part(t, start, start + _CHUNK).to(torch.float64)
        if minus is not None:
            c = c - _flat_part(minus, start, start + _CHUNK).to(torch.float64)
        total += float(c.square().sum())
    return total


def _flat_part(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Elements ``start:end`` of ``t`` flattened in row-major order, copying no more than
    about three times ``end - start`` elements: ``t.reshape(-1)`` copies all of a
    non-contiguous ``t`` (a gradient autograd hands back transposed, a permuted activation),
    a head's worth of memory for a chunk of it. The part is taken along the first dimension:
    the rows it spans, copied, where it spans three or more (a row is then at most the part's
    size); within a row, from that row alone, and so on down the dimensions."""
    t = t.detach()
    if t.is_contiguous() or t.dim() < 2 or t.numel() == 0:
        return t.reshape(-1)[start:end]
    cols = t[0].numel()
    first, last = start // cols, min(t.shape[0], -(-end // cols))
    if last - first >= 3:
        return t[first:last].reshape(-1)[start - first * cols:end - first * cols]
    parts = [_flat_part(t[i], max(start - i * cols, 0), min(end - i * cols, cols))
             for i in range(first, last)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _weighed(y: torch.Tensor, w: torch.Tensor, tangent: tuple, step: float) -> float:
    """``sum ((y - w) * t)^2`` with ``t = (at - here) / step`` (``tangent = (at, here)``;
    ``at`` None: ``t = -here / step``), in FP32 element by element and summed in float64, a
    chunk at a time: an error weighed by a probe, holding no output-sized tensor."""
    at, here = tangent
    total = 0.0
    for start in range(0, y.numel(), _CHUNK):
        end = start + _CHUNK
        g = _flat_part(here, start, end)
        t = -g / step if at is None else (_flat_part(at, start, end) - g) / step
        d = _flat_part(y, start, end).to(torch.float32) - _flat_part(w, start, end).to(
            torch.float32)
        total += float((d * t.to(torch.float32)).square().sum(dtype=torch.float64))
    return total


def _output_terms(r: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> tuple[float, ...]:
    """For one output of a layer's FP32 run ``r`` and format run ``y`` with output gradient
    ``g``, in float64: ``<g, d>`` with ``d = y - r``, ``1/2 n sum_k <g[k], d[k]>^2`` over the
    ``n`` samples along the first dimension (0 for a vector), ``sum r^2`` and ``sum d^2``.
    A chunk at a time, as many whole samples as fit in one (a sample bigger than a chunk in
    parts): no float64 copy of an output (a head's logits) is held, and a layer whose output
    lists thousands of tokens along its first dimension takes a few chunks, not a loop per
    token."""
    r2, y2, g2 = (t.reshape(1, -1) if r.dim() < 2 else t for t in (r, y, g))
    n = r2.shape[0]
    cols = r2[0].numel() if n else 0
    per, signal, noise = [], 0.0, 0.0
    rows = max(1, _CHUNK // max(cols, 1))
    for a in range(0, n, rows):
        b = min(n, a + rows)
        dots = None
        for rc, yc, gc in _sample_chunks((r2, y2, g2), a, b, cols):
            d = yc - rc
            dot = (gc * d).sum(1)
            dots = dot if dots is None else dots + dot
            signal += float(rc.square().sum())
            noise += float(d.square().sum())
        per.extend(dots.tolist())
    first = math.fsum(per)
    second = 0.5 * n * math.fsum(p * p for p in per) if r.dim() >= 2 else 0.0
    return first, second, signal, noise


def _sample_chunks(ts: tuple, a: int, b: int, cols: int):
    """Samples ``a:b`` of each of ``ts`` (``cols`` elements each) in float64, one chunk at a
    time, each ``(samples, elements)``: the samples whole where they fit in a chunk (a slice
    copies at most that), else sample ``a`` alone (``b == a + 1``) in parts."""
    if cols <= _CHUNK:
        yield tuple(t[a:b].reshape(b - a, -1).to(torch.float64) for t in ts)
        return
    for i in range(0, cols, _CHUNK):
        yield tuple(_flat_part(t[a], i, i + _CHUNK).to(torch.float64).reshape(1, -1)
                    for t in ts)


def _param_diffs(run: tuple, ref_gp: list[torch.Tensor]) -> tuple[bool, list[float]]:
    """Whether a format's run (outputs, input grads, parameter grads) is finite, and if so
    each parameter gradient's squared difference from the FP32 run's (``ref_gp``)."""
    out, gx, gp = run
    finite = all_finite(list(out)) and all_finite([g for g in (*gx, *gp)])
    return finite, [_sq(a, c) for a, c in zip(gp, ref_gp)] if finite else []


def _accumulate(est: Estimate, b: int, runs: tuple, compared: tuple[bool, list[float]],
                g_out: list, own: list[int], tangents: list, step: float) -> None:
    """Add batch ``b``'s call to ``est``: ``runs`` are the (outputs, input grads) of the layer
    in FP32 (with its parameter grads), in the estimated format and in FP32 with the format's
    rounded weights (see ``_Estimator._run``); ``compared`` the format's :func:`_param_diffs`;
    ``tangents`` the probes' (u, v) as :meth:`_Estimator._tangents` gives them, over ``step``."""
    (ref_out, ref_gx, ref_gp), (out, gx), (w_out, w_gx, _) = runs
    finite, diffs = compared
    est.finite = est.finite and finite
    if not finite:
        return
    first = second = 0.0
    for r, y, g in zip(ref_out, out, g_out):
        f, s, signal, noise = _output_terms(r, y, g)
        first, second = first + f, second + s
        est.signal += signal
        est.noise += noise
    est.first[b] = est.first.get(b, 0.0) + first
    est.second[b] = est.second.get(b, 0.0) + second
    est.sub_diff += math.fsum(diffs)
    est.own_diff += math.fsum(diffs[i] for i in own)
    est.own_ref += math.fsum(_sq(ref_gp[i]) for i in own)
    # what the weights' rounding does not explain, weighed by each probe's response to it
    resid = [math.fsum([*(_weighed(y, w, t, step) for y, w, t in zip(out, w_out, u)),
                        *(_weighed(a, w, t, step) for a, w, t in zip(gx, w_gx, v))])
             for u, v in tangents]
    est.resid += math.fsum(resid) / len(resid) if resid else math.nan


@contextlib.contextmanager
def estimate_during_reference(meter: DeviationMeter, names: Sequence[str],
                              formats: Mapping[str, Sequence[Format]],
                              pinned: Mapping[str, list[str]], own: Mapping[str, list[int]],
                              *, loss_scale: float = LossScaling().init_scale,
                              progress: Callable[[str], None] | None = None,
                              probes: int = PROBES):
    """Hooks that estimate each ``names`` layer in its ``formats`` while ``numerics`` computes
    its FP32 reference inside the ``with`` block. Yields ``(around, results)``: pass ``around``
    to :meth:`DeviationMeter.reference` (it runs the ``probes`` curvature probes of each batch
    before the batch's forward); after the block, ``results()`` gives ``{layer: {format:
    Estimate}}``."""
    if probes < 1:
        raise ValueError(f"The gradient-error estimate needs at least one curvature probe, got "
                         f"probes={probes!r}.")
    model = meter.model
    est = _Estimator(meter, loss_scale, progress, probes)
    rank, n_ranks = shards.ranks(model)
    mine = set(names)
    if n_ranks > 1:  # under FSDP2 every rank runs the passes; each re-runs its share of layers
        cost = {x: (sum(p.numel() for p in model.get_submodule(x).parameters()) + 1)
                * len(formats[x]) for x in names}
        mine = set(shards.divide(_sharing(model, names), cost, n_ranks)[rank])
    for name in names:
        ids = {id(meter.params[i]) for i in own[name]}
        est.watches[name] = _Watch(est, name, model.get_submodule(name), list(pinned[name]),
                                   list(formats[name]), ids, mine=name in mine)
    est.index_users()
    handles = est.param_hooks()

    @contextlib.contextmanager
    def around(b: int):
        est.probe(b)
        est.batch = b
        est.capturing, est.backward = True, False
        try:
            yield
        finally:
            est.capturing, est.backward = False, True

    def results():
        # calls whose outputs got no gradient for some output (unused): finish them with zeros
        est.backward = False
        for watch in est.watches.values():
            for call in watch.calls:
                if not call.done and call.args is not None:
                    est.process(watch, call)
        est.finish_weights()
        return shards.gathered({n: w.results for n, w in est.watches.items() if w.mine}, model)

    try:
        yield around, results
    finally:
        for watch in est.watches.values():
            watch.close()
        for h in handles:
            h.remove()


def _sharing(model: nn.Module, names: Sequence[str]) -> list[list[str]]:
    """``names`` in groups whose layers share no parameter with another group's (a layer
    inside another, a tied weight), each in the given order: a group is estimated by one
    rank, as one process would."""
    parent = list(range(len(names)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = i = parent[parent[i]]
        return i

    holder: dict[int, int] = {}  # parameter -> the first layer holding it
    for i, name in enumerate(names):
        for p in model.get_submodule(name).parameters():
            parent[root(i)] = root(holder.setdefault(id(p), i))
    groups: dict[int, list[str]] = {}
    for i, name in enumerate(names):
        groups.setdefault(root(i), []).append(name)
    return list(groups.values())


def needs_exact(loss_rel_change: float, grad_rel_error: float, finite: bool,
                overflow: float, budget: Budget) -> str:
    """Why an estimate should be measured exactly ("" when the estimate is enough): it is not
    finite, values exceed the format's range (loss scaling or overflow decide the outcome), or
    it lies near the budget, where an error of the estimate could change a decision."""
    if not finite or not (math.isfinite(loss_rel_change) and math.isfinite(grad_rel_error)):
        return "the estimate is not finite"
    if overflow > 0:
        return "values beyond the format's range"
    low, high = EXACT_BAND
    if low * budget.max_loss_increase <= abs(loss_rel_change) <= high * budget.max_loss_increase:
        return "loss change near the budget"
    # The estimated whole-model gradient error is within ~0.7-1.2x of the measured one on the
    # examples (see the module docstring) and only informs: the trials measure every
    # policy's. One that alone claims to break the budget is checked, so a profile never
    # blames a layer on an estimate.
    if budget.max_grad_error is not None and grad_rel_error >= budget.max_grad_error:
        return "gradient error at or above the budget"
    return ""
