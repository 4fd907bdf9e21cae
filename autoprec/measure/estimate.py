"""First-order estimates of every layer x format's sensitivity, from the FP32 reference pass.

The exact measurement (:mod:`autoprec.measure.sensitivity`) runs one whole forward+backward per
layer x format x batch, so its cost per layer grows with the model's depth. This module gets
the same numbers for *all* layers from the one FP32 reference forward+backward plus work local
to each layer, whose cost does not depend on depth:

```
FP32 reference forward, hooks on every listed layer     backward: when the gradient g_y of a
  record each call's inputs (refs, not copies)    --->   layer's output arrives, re-run that
                                                         layer alone on its recorded inputs:
                                                         in FP32 and in each format, forward
                                                         and backward (g_y as output grad)
```

With only one layer switched, everything upstream of it computes exactly as in the reference,
so its inputs are the recorded ones and the change of its output, ``dy = y_fmt - y_fp32``, is
exact. The loss change is its Taylor expansion in ``dy`` (the Fisher/Taylor score of
ModelOpt's AutoQuantize, here with the sign kept, since the budget is on the signed loss):

    dL ~= <g_y, dy> + 1/2 N sum_n <g_y[n], dy[n]>^2

the second term being the empirical Fisher (over the N samples of the batch, dim 0) standing
in for the Hessian. Divided by |loss_fp32| and averaged over batches, like the exact
``loss_rel_change``. The output SQNR and the layer's own weight-gradient error are exact (the
same local computation the whole run would do). The whole-model gradient error is estimated:
the layer's subtree parameters' gradient error, plus the error of the gradient it sends to its
inputs, relative to the whole gradient reaching them (all their consumers), carried to every
parameter used before it. It leans high: in a residual network the stream's unperturbed
gradient dilutes the error further upstream: 0.7-11x the exact value on tiny GPT-2 and Llama
(tests/test_estimate.py bounds the ratio), while the loss change agrees to a few percent.

Memory: the recorded inputs are the tensors autograd saves anyway for a matmul, and each
layer's local runs happen inside the backward as soon as its gradient arrives, so nothing per
layer is kept beyond the numbers (no copy of all activations per format).

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

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoprec._util import floating
from autoprec.formats import Format
from autoprec.measure.numerics import Numerics, all_finite
from autoprec.policy import Budget, LossScaling, Policy
from autoprec.runtime import rewrite

__all__ = ["Estimate", "estimate_during_reference", "needs_exact"]

# An estimated |loss change| in [low, high] x the budget is measured exactly: below, the
# estimate's second-order error cannot matter; above, the layer is out of budget by itself.
EXACT_BAND = (0.1, 10.0)


@dataclass
class Estimate:
    """Accumulated local numbers of one layer in one format, over calls and batches."""

    # per batch: first-order and Fisher second-order loss change (absolute)
    first: dict[int, float] = field(default_factory=dict)
    second: dict[int, float] = field(default_factory=dict)
    # output signal and noise energy (float64 sums)
    signal: float = 0.0
    noise: float = 0.0
    # squared norms of the gradient errors: subtree parameters, own parameters, and per batch
    # the input gradients' error
    sub_diff: dict[int, float] = field(default_factory=dict)
    own_diff: float = 0.0
    own_ref: float = 0.0
    x_diff: dict[int, float] = field(default_factory=dict)
    finite: bool = True

    def loss_rel_change(self, losses: Sequence[float]) -> float:
        if not self.finite:
            return math.nan
        rel = [(self.first.get(b, 0.0) + self.second.get(b, 0.0)) / (abs(r) or 1.0)
               for b, r in enumerate(losses)]
        return math.fsum(rel) / len(rel)

    def grad_rel_error(self, upstream_sq: Sequence[float], total_sq: Sequence[float],
                       x_total: Mapping[int, float]) -> float:
        """``upstream_sq[b]``: squared gradient norm of the parameters used before the layer;
        ``x_total[b]``: that of the whole gradient reaching its inputs (all their consumers),
        whose relative error the upstream gradients are assumed to inherit."""
        if not self.finite:
            return math.nan
        diff = 0.0
        for b, up in enumerate(upstream_sq):
            diff += self.sub_diff.get(b, 0.0)
            xt = x_total.get(b, 0.0)
            if xt > 0:
                diff += self.x_diff.get(b, 0.0) / xt * up
        total = math.fsum(total_sq)
        return math.sqrt(diff / total) if total > 0 else (0.0 if diff == 0 else math.inf)

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


class _Call:
    """One call of a watched layer in the reference forward, waiting for its output grads."""

    def __init__(self, batch: int, args: tuple, kwargs: dict):
        self.batch, self.args, self.kwargs = batch, args, kwargs
        self.n_out = 0
        self.grads: dict[int, torch.Tensor] = {}
        self.exited = False
        self.done = False


class _Watch:
    """Hooks on one listed layer: records its calls' inputs and reacts to its output grads."""

    def __init__(self, est: _Estimator, name: str, module: nn.Module, pinned: list[str],
                 fmts: list[Format], own: set[int]):
        self.est, self.name, self.module, self.pinned, self.fmts = est, name, module, pinned, fmts
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.own = [i for i, p in enumerate(self.params) if id(p) in own]
        self.calls: list[_Call] = []
        self.upstream: list[int] | None = None  # params first used before the first call
        self.results = {f: Estimate() for f in fmts}
        # per batch: squared norm of the whole reference gradient reaching the layer's inputs
        self.x_total: dict[int, float] = {}
        self.handles = [module.register_forward_pre_hook(self._enter, with_kwargs=True),
                        module.register_forward_hook(self._exit)]

    def _enter(self, module, args, kwargs):
        if not self.est.capturing:
            return
        if self.upstream is None:
            mine = {id(p) for p in self.params}
            self.upstream = [i for i in self.est.seen if id(self.est.numerics.params[i]) not in mine]
        self.calls.append(_Call(self.est.batch, args, kwargs))
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                t.register_hook(partial(self._input_grad, self.est.batch))

    def _input_grad(self, b: int, g: torch.Tensor):
        self.x_total[b] = self.x_total.get(b, 0.0) + _sq(g)

    def _exit(self, module, args, output):
        if not self.est.capturing or not self.calls:
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

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class _Estimator:
    """The state the watches share: whether the reference forward is being recorded, which
    batch, the order parameters are first used in, and the local re-runs."""

    def __init__(self, numerics: Numerics, loss_scale: float,
                 progress: Callable[[str], None] | None):
        self.numerics = numerics
        self.loss_scale = loss_scale
        self.progress = progress
        self.capturing = False
        self.batch = 0
        self.seen: list[int] = []
        self.watches: dict[str, _Watch] = {}

    # ------------------------------------------------------------------ first use of params
    def track_first_use(self, model: nn.Module) -> list:
        index = {id(p): i for i, p in enumerate(self.numerics.params)}
        seen: set[int] = set()

        def hook(module, args):
            if self.capturing and self.batch == 0:
                for p in module.parameters(recurse=False):
                    i = index.get(id(p))
                    if i is not None and i not in seen:
                        seen.add(i)
                        self.seen.append(i)
        return [m.register_forward_pre_hook(hook) for m in model.modules()
                if any(True for _ in m.parameters(recurse=False))]

    # ------------------------------------------------------------------ local re-runs
    def process(self, watch: _Watch, call: _Call) -> None:
        call.done = True
        was = self.capturing
        self.capturing = False
        prev = rewrite.applied_policy(self.numerics.model)
        try:
            with torch.enable_grad():
                self._process(watch, call)
        finally:
            if prev is not None:
                rewrite.apply(self.numerics.model, prev, strict=False)
            else:
                rewrite.remove(self.numerics.model)
            self.capturing = was
            call.args = call.kwargs = None  # drop the refs: this call is done
        if self.progress is not None:
            self.progress(watch.name)

    def _process(self, watch: _Watch, call: _Call) -> None:
        model = self.numerics.model
        rewrite.remove(model)
        ref_out, ref_gx, ref_gp = self._run(watch, call, None)
        g_out = [call.grads.get(i, torch.zeros_like(t)) for i, t in enumerate(ref_out)]
        for fmt in watch.fmts:
            est = watch.results[fmt]
            policy = Policy(default=Format.FP32,
                            layers={watch.name: fmt, **{c: Format.FP32 for c in watch.pinned}},
                            loss_scaling=LossScaling(init_scale=self.loss_scale),
                            fp8_engine="autoprec")
            with warnings.catch_warnings():
                # the emulated-fp8 speed warning: numerics are exact, which is all we use
                warnings.filterwarnings("ignore", message=r".*can only emulate.*")
                rewrite.apply(model, policy, strict=False)
            try:
                out, gx, gp = self._run(watch, call, fmt, g_out)
            finally:
                rewrite.remove(model)
            _accumulate(est, call.batch, (ref_out, ref_gx, ref_gp), (out, gx, gp), g_out,
                        watch.own)

    def _run(self, watch: _Watch, call: _Call, fmt: Format | None, g_out=None):
        """The layer alone on the recorded inputs: its floating outputs, and (given output
        grads) the gradients of its floating inputs and of its parameters."""
        flat, spec = tree_flatten((call.args, call.kwargs))
        leaves, xs = [], []
        for t in flat:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                t = t.detach().requires_grad_(True)
                xs.append(t)
            leaves.append(t)
        args, kwargs = tree_unflatten(leaves, spec)
        out = [t for t in floating(watch.module(*args, **kwargs)) if t.requires_grad]
        if g_out is None:  # the FP32 reference: its grads use the true output grads
            g_out = [call.grads.get(i, torch.zeros_like(t)) for i, t in enumerate(out)]
        wrt = [*xs, *watch.params]
        scale = self.loss_scale if fmt is Format.FP16 else 1.0
        grads = _local_grads(out, wrt, g_out, scale) if out and wrt else [None] * len(wrt)
        grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]
        return ([t.detach() for t in out], grads[:len(xs)], grads[len(xs):])


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


def _sq(t: torch.Tensor) -> float:
    return float(t.detach().to(torch.float64).square().sum())


def _accumulate(est: Estimate, b: int, ref: tuple, run: tuple, g_out: list,
                own: list[int]) -> None:
    """Add batch ``b``'s call to ``est``: ``ref`` and ``run`` are (outputs, input grads,
    parameter grads) of the layer in FP32 and in the estimated format (see ``_run``)."""
    (ref_out, ref_gx, ref_gp), (out, gx, gp) = ref, run
    finite = all_finite(list(out)) and all_finite([g for g in (*gx, *gp)])
    est.finite = est.finite and finite
    if not finite:
        return
    first = second = 0.0
    for r, y, g in zip(ref_out, out, g_out):
        d = (y.to(torch.float64) - r.to(torch.float64))
        g64 = g.to(torch.float64)
        first += float((g64 * d).sum())
        if d.dim() >= 2:
            n = d.shape[0]
            per = (g64 * d).reshape(n, -1).sum(1)
            second += 0.5 * n * float(per.square().sum())
        est.signal += _sq(r)
        est.noise += float(d.square().sum())
    est.first[b] = est.first.get(b, 0.0) + first
    est.second[b] = est.second.get(b, 0.0) + second
    diffs = [_sq(a - c) for a, c in zip(gp, ref_gp)]
    est.sub_diff[b] = est.sub_diff.get(b, 0.0) + math.fsum(diffs)
    est.own_diff += math.fsum(diffs[i] for i in own)
    est.own_ref += math.fsum(_sq(ref_gp[i]) for i in own)
    est.x_diff[b] = est.x_diff.get(b, 0.0) + math.fsum(_sq(a - c) for a, c in zip(gx, ref_gx))



@contextlib.contextmanager
def estimate_during_reference(numerics: Numerics, names: Sequence[str],
                              formats: Mapping[str, Sequence[Format]],
                              pinned: Mapping[str, list[str]], own: Mapping[str, list[int]],
                              *, loss_scale: float = LossScaling().init_scale,
                              progress: Callable[[str], None] | None = None):
    """Hooks that estimate each ``names`` layer in its ``formats`` while ``numerics`` computes
    its FP32 reference inside the ``with`` block. Yields ``(around, results)``: pass ``around``
    to :meth:`Numerics.reference`; after the block, ``results()`` gives ``{layer: {format:
    Estimate}}`` and the per-batch upstream and total squared gradient norms to finish them."""
    model = numerics.model
    est = _Estimator(numerics, loss_scale, progress)
    for name in names:
        ids = {id(numerics.params[i]) for i in own[name]}
        est.watches[name] = _Watch(est, name, model.get_submodule(name), list(pinned[name]),
                                   list(formats[name]), ids)
    handles = est.track_first_use(model)

    @contextlib.contextmanager
    def around(b: int):
        est.batch = b
        est.capturing = True
        try:
            yield
        finally:
            est.capturing = False

    def results():
        # calls whose outputs got no gradient for some output (unused): finish them with zeros
        for watch in est.watches.values():
            for call in watch.calls:
                if not call.done and call.args is not None:
                    est.process(watch, call)
        return {n: w.results for n, w in est.watches.items()}, \
            {n: (w.upstream or [], w.x_total) for n, w in est.watches.items()}

    try:
        yield around, results
    finally:
        for watch in est.watches.values():
            watch.close()
        for h in handles:
            h.remove()


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
    # The estimated whole-model gradient error leans high (see the module docstring) and only
    # informs: the trials measure every policy's. One that alone claims to break the budget
    # is checked, so a profile never blames a layer on an estimate.
    if budget.max_grad_error is not None and grad_rel_error >= budget.max_grad_error:
        return "gradient error at or above the budget"
    return ""

