"""Numerical error of each layer in each format, forward and backward.

For every layer x format, the layer alone computes in that format (a policy ``default: fp32,
layers: {fqn: format}``) and everything else in FP32. One forward + backward per layer x
format x calibration batch is compared with an FP32 reference computed once, by the same
comparison every trial of the search uses (:class:`autoprec.measure.deviation.DeviationMeter`):

```
reference (policy all-fp32), once per batch      switched run, per layer x format x batch
  loss_ref, all parameter grads g_ref               loss, all parameter grads g
  each layer's output  y_ref (forward hook)         the switched layer's output y
  each layer's output gradient (tensor hook)
        │ range statistics: overflow / underflow of activations and output gradients
        ▼                                                    ▼
                    LayerSensitivity(loss_rel_change, grad_rel_error, layer_grad_rel_error,
                                     output_sqnr_db, act/grad over/underflow, finite)
```

How the measurement is kept deterministic and faithful to training: see
:mod:`autoprec.measure.deviation` (a private model copy, gradients by ``torch.autograd.grad``,
train mode with dropout off and BatchNorm statistics frozen, fixed seeds, fp16 loss-scaled as
GradScaler would with back-off). The overflow / underflow *statistics* are of the unscaled
values: they say what loss scaling has to fix.

Range statistics (fp16 and fp8 only; fp32 and bf16 share FP32's exponent range and report
None) are taken from the FP32 reference, since a layer switched alone sees exactly the
reference's inputs. They count the tensors a format actually rounds: the multiplied operands
(other than parameters) and outputs of the layer's matmul-like calls (those of the call
registry, :mod:`autoprec.runtime.calls`, that autocast rounds; for fp8 only the calls the FP8
router quantizes), and the gradients arriving at those outputs. For a
Linear or Conv1D that is its input, its output and its output gradient. A layer measured
without its listed descendants counts only its own calls (see ``_RoundedCallCounter``).

- overflow: ``|x| > max`` of the format (inf counts), before any loss scaling; FP8 scales
  by ``fp8_max / amax`` (per tensor, or per row for the rowwise recipes, as
  :mod:`autoprec.runtime.fp8` does), so it cannot overflow and reports 0;
- underflow: non-zero values whose magnitude (after that scaling for fp8) is below the
  format's smallest subnormal: E4M3 for fp8 activations, and for gradients E5M2 (tensorwise)
  or E4M3 (rowwise recipes). A rowwise scale follows each row's own amax, so a row of small
  values underflows less than under one scale for the whole tensor. This is the
  statistic of "Mixed Precision Training" (Micikevicius et al. 2018), where 67% of SSD's
  activation gradients were below FP16's 2**-24. (Values in [min/2, min) round up to the
  smallest subnormal rather than to zero; they are counted, as in the paper.)

Layers whose numerics a format cannot change under the region rules (embedding lookups, norms:
autocast keeps them in FP32) are measured like any other and show ~zero error.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autoprec._util import check_keys, decode_float, encode_float, floating, move_to
from autoprec.formats import FP8_E4M3, FP8_E5M2, Format
from autoprec.measure.checkpointing import recomputing
from autoprec.measure.deviation import (
    Deviation,
    DeviationMeter,
    check_reference_gradients,
    prepare_for_measurement,
    prepared,
    reference_gradients,
    reference_keywords,
)
from autoprec.measure.estimate import estimate_during_reference, needs_exact
from autoprec.measure.options import SensitivityOptions, with_keywords
from autoprec.policy import DEFAULT_MAX_LOSS_INCREASE, Budget, LossScaling, Policy
from autoprec.runtime import calls, rewrite
from autoprec.scaling import rowwise_scale, tensorwise_scale
from autoprec.task import Task, default_loss

__all__ = [
    "LayerSensitivity",
    "measure_sensitivity",
    "SensitivityResults",
    "DEFAULT_N_BATCHES",
    "SENSITIVITY_MODES",
    "check_sensitivity_mode",
]

# How the profile gets each layer x format's numbers (see measure_sensitivity).
SENSITIVITY_MODES = ("auto", "fast", "exact")

# One batch keeps the profile of GPT-2 4x256 (17-21 layers x 3 formats) near a minute on
# 2 CPU cores. The comparison is paired (same batch, same seed), so batch-to-batch noise
# does not enter a difference; more batches average over inputs, at a linear cost.
DEFAULT_N_BATCHES = 1


def _narrow_range(fmt: Format) -> bool:
    """Formats whose exponent range is narrower than FP32's, so range statistics mean
    something: fp16 and every FP8 format, registered ones included; not the block-scaled ones
    (a power-of-two or FP32-scaled block scale per 16-32 values spans FP32's range)."""
    return fmt.output_dtype is torch.float16 or (fmt.is_scaled and not fmt.numerics.is_block_scaled)

# ------------------------------------------------------------------------------ result
@dataclass(frozen=True)
class LayerSensitivity:
    """How far one layer computing in one format moves the model from its FP32 reference."""

    # fqn of the module that was switched ("" is the whole model); all others ran in fp32.
    layer: str
    # The format the layer computed in.
    format: Format
    # Mean over batches of (loss - loss_fp32) / |loss_fp32|; signed, positive = higher loss.
    loss_rel_change: float
    # ||g - g_fp32|| / ||g_fp32|| over every trainable parameter's gradient, all batches
    # concatenated: how much the training signal of the whole model moves.
    grad_rel_error: float
    # The same over the layer's own parameters (recursively, less those of descendants that
    # were measured as layers of their own); None when it has none.
    layer_grad_rel_error: float | None
    # 10 log10(sum y_ref^2 / sum (y - y_ref)^2) over the layer's floating outputs, in float64;
    # inf when the output is bit-identical, nan or -inf when it is not finite.
    output_sqnr_db: float
    # Fraction of the activation elements the format rounds (non-parameter operands and
    # outputs of the layer's matmul-like calls: a Linear's input and output) whose FP32 value
    # is above the format's max; fp8 scales to its amax, so 0. None for fp32/bf16.
    act_overflow: float | None
    # Fraction of those elements that are non-zero but below the format's smallest subnormal
    # (after the recipe's scaling for fp8: per tensor, or per row along the last dimension for
    # the rowwise recipes). None for fp32/bf16.
    act_underflow: float | None
    # As act_overflow, for the gradients arriving at those outputs, before loss scaling.
    grad_overflow: float | None
    # As act_underflow, for those gradients (fp8: E5M2 with its own scale for tensorwise, E4M3
    # per row for the rowwise recipes).
    grad_underflow: float | None
    # True when the loss, every parameter gradient and the layer's output were finite on
    # every batch. Non-finite runs are recorded, never raised.
    finite: bool
    # Calibration batches the numbers average over.
    n_batches: int
    # "measured": this layer switched alone in a whole forward+backward; "estimated": the
    # first-order estimate from the FP32 reference pass (autoprec.measure.estimate), whose
    # loss and whole-model gradient error are approximations (SQNR and range stats are exact).
    source: str = "measured"

    def __post_init__(self):
        object.__setattr__(self, "format",
                           Format.parse(self.format, where=f"for layer `{self.layer}`"))
        for name in ("act_overflow", "act_underflow", "grad_overflow", "grad_underflow"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"LayerSensitivity.{name} is a fraction of elements, so it must lie "
                                 f"in [0, 1] or be None; got {value!r} for layer "
                                 f"`{self.layer}` in {self.format}.")
        if self.source not in ("measured", "estimated"):
            raise ValueError(f"LayerSensitivity.source must be 'measured' or 'estimated', got "
                             f"{self.source!r} for layer `{self.layer}`.")
        if int(self.n_batches) != self.n_batches or self.n_batches < 1:
            raise ValueError(f"LayerSensitivity.n_batches must be a positive integer, got "
                             f"{self.n_batches!r} for layer `{self.layer}`.")

    # -------------------------------------------------------------- judging
    def judge(self, *, max_loss_change: float = DEFAULT_MAX_LOSS_INCREASE,
              max_grad_error: float = 0.25,
              min_sqnr_db: float = 15.0) -> str:
        """One word for tables: ``non-finite`` (inf/NaN anywhere), ``overflow`` (values beyond
        the format's range, before loss scaling), ``lossy`` (|loss change| above
        ``max_loss_change``, gradient error above ``max_grad_error`` or output SQNR below
        ``min_sqnr_db``), else ``ok``.

        The default thresholds sit well outside what BF16 and FP8 cost a healthy layer (output
        SQNR of a matmul here: BF16 ~50 dB, FP16 ~69 dB, FP8 E4M3 ~28 dB), so ``lossy`` means
        "look at this layer"; the search judges policies by their measured loss, not by this.
        """
        if not self.finite:
            return "non-finite"
        if (self.act_overflow or 0.0) > 0.0 or (self.grad_overflow or 0.0) > 0.0:
            return "overflow"
        if (abs(self.loss_rel_change) > max_loss_change or self.grad_rel_error > max_grad_error
                or self.output_sqnr_db < min_sqnr_db):
            return "lossy"
        return "ok"

    @property
    def verdict(self) -> str:
        """:meth:`judge` with its default thresholds."""
        return self.judge()

    # -------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types; inf and NaN become the strings "inf", "-inf", "nan" (JSON has no
        literal for them, and ``json.dumps(allow_nan=False)`` must accept the result)."""
        out = asdict(self)
        out["format"] = self.format.value
        return {k: encode_float(v) for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerSensitivity:
        """Inverse of :meth:`to_dict`; unknown or missing keys are errors that name them."""
        names = [f.name for f in fields(cls)]
        # `source` is new in this version: older profiles were all measured
        check_keys(data, "LayerSensitivity", known=names,
                   required=[n for n in names if n != "source"])
        plain = ("layer", "format", "finite", "n_batches", "source")
        values = {k: v if k in plain else decode_float(v, "LayerSensitivity")
                  for k, v in data.items()}
        values["finite"] = bool(values["finite"])
        values["n_batches"] = int(values["n_batches"])
        return cls(**values)


# ------------------------------------------------------------------------------ range stats
class _RangeCounter:
    """Counts elements beyond a format's range, accumulated as tensors (no device sync)."""

    def __init__(self, fmt: Format, kind: str):
        self.fmt = fmt
        # How the recipe rounds this kind of tensor: as the first operand of the forward GEMM
        # (activations and weights) or of the input-gradient GEMM (gradients), its element
        # dtype (tensorwise keeps E5M2's range for gradients, the rowwise recipes use E4M3
        # everywhere) and whether it has one scale per tensor. Block scales (MX, NVFP4) are
        # counted per row, and FP4 elements with E4M3's range: the nearest these statistics
        # have.
        gemm = fmt.numerics.dgrad if kind == "grad" else fmt.numerics.fwd
        self.fp8_dtype = gemm.a if gemm.a in (FP8_E4M3, FP8_E5M2) else FP8_E4M3
        self.per_tensor = gemm.scaling.one_scale
        self.over: torch.Tensor | int = 0
        self.under: torch.Tensor | int = 0
        self.total = 0

    def add(self, x: torch.Tensor) -> None:
        a = x.detach().abs().to(torch.float32)
        nonzero = a > 0
        if self.fmt.is_scaled:
            # The recipe's own scale: the same amax, clamp and rounding as autoprec.runtime.fp8
            # (rows along the last dimension: the contracted one of the forward's operands).
            rowwise = not self.per_tensor and x.dim() > 0
            scaled = a * (rowwise_scale(x, self.fp8_dtype, -1) if rowwise
                          else tensorwise_scale(x, self.fp8_dtype))
            fi = torch.finfo(self.fp8_dtype)
            tiny = float(fi.smallest_normal * fi.eps)
            self.under = self.under + ((scaled < tiny) & nonzero).sum()
        else:
            fmt = self.fmt
            self.over = self.over + (a > fmt.max_value).sum()
            self.under = self.under + ((a < fmt.min_subnormal) & nonzero).sum()
        self.total += a.numel()

    def fractions(self) -> tuple[float, float]:
        if self.total == 0:
            return 0.0, 0.0
        return float(self.over) / self.total, float(self.under) / self.total


def _flat_output(output: Any) -> torch.Tensor | None:
    """All floating outputs of a call as one fresh FP32 vector (a copy, so later in-place
    edits downstream cannot change it)."""
    found = floating(output)
    if not found:
        return None
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in found])


def _fp8_quantizes(call: calls.Call, args: tuple, kwargs: dict) -> bool:
    """Whether the FP8 router quantizes this call (else it runs in bf16): the registry's route
    and the kernel's shape rule, exactly as rewrite and fp8 apply them."""
    form = calls.matmul_form(call, args, kwargs)
    if form is None:
        return False
    p = calls.product_of(form[0].shape, form[1].shape)
    return calls.fp8_shape_supported(p.m, p.k, p.n)[0]


class _ReferenceProbe:
    """Hooks on one layer during the FP32 reference: its outputs, and range statistics of the
    activations its rounded calls take and give and of the gradients arriving at them."""

    def __init__(self, module: nn.Module, range_formats: Sequence[Format],
                 active: list[_ReferenceProbe], keep_outputs: bool = True):
        self.keep_outputs = keep_outputs
        self.outputs: list[torch.Tensor] = []  # this batch's outputs, one entry per call
        self.batches: list[torch.Tensor | None] = []  # concatenated outputs per batch
        self.act = {f: _RangeCounter(f, "act") for f in range_formats}
        self.grad = {f: _RangeCounter(f, "grad") for f in range_formats}
        # Listed layers currently running, innermost last (shared by all probes).
        self.active = active
        self.handles = [module.register_forward_pre_hook(self._enter),
                        module.register_forward_hook(self._exit)]

    def _enter(self, module, args):
        if not recomputing():  # a checkpoint's replay of a call already seen
            self.active.append(self)

    def _exit(self, module, args, output):
        if recomputing():
            return
        if self.active and self.active[-1] is self:
            self.active.pop()
        if not self.keep_outputs:
            return
        flat = _flat_output(output)
        if flat is not None:
            self.outputs.append(flat)

    def count_call(self, operands: list[torch.Tensor], out: torch.Tensor,
                   fp8: bool) -> None:
        for fmt, counter in self.act.items():
            if fmt.is_scaled and not fp8:
                continue  # the router leaves it in bf16: nothing is rounded to FP8
            for t in (*operands, out):
                counter.add(t)
        if self.grad and out.requires_grad:
            out.register_hook(lambda g, fp8=fp8: self._grad_hook(g, fp8))

    def _grad_hook(self, grad, fp8: bool):
        for fmt, counter in self.grad.items():
            if fmt.is_scaled and not fp8:
                continue
            counter.add(grad)

    def end_batch(self) -> None:
        self.batches.append(torch.cat(self.outputs) if self.outputs else None)
        self.outputs = []

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class _RoundedCallCounter(TorchFunctionMode):
    """Feeds each rounded call (``Call.rounded`` in the registry) to the listed layer running it: the
    innermost one, or with ``subtree`` every listed layer around it. Its operands that are not
    parameters (nor views of them) count as activations, with its output; the gradient
    arriving at that output counts as an output gradient.

    Why calls and not the layer's boundary: a layer measured without its listed descendants
    (GPT-2's MLP without c_fc and c_proj) may output what a descendant computed, which it
    never rounds; and only these calls round anything (autocast runs elementwise ops, norms
    and softmax in the dtype they get). For a Linear or Conv1D this is exactly its input and
    output.
    """

    def __init__(self, active: list[_ReferenceProbe], param_ids: set[int], subtree: bool):
        super().__init__()
        self.active = active
        self.param_ids = param_ids
        self.subtree = subtree

    def _is_param(self, t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        return id(t) in self.param_ids or id(base) in self.param_ids

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        call = calls.lookup(func) if self.active else None
        if call is not None and call.rounded and isinstance(out, torch.Tensor) \
                and out.is_floating_point():
            operands = [t for t in call.operands(args, kwargs)
                        if isinstance(t, torch.Tensor) and t.is_floating_point()
                        and not self._is_param(t)]
            fp8 = _fp8_quantizes(call, args, kwargs)
            for probe in (self.active if self.subtree else self.active[-1:]):
                probe.count_call(operands, out, fp8)
        return out


class _OutputProbe:
    """Hook on the switched layer: its outputs in the current batch under ``policy`` (not in
    the FP32 reference a meter computes again per batch, beside it)."""

    def __init__(self, module: nn.Module, model: nn.Module, policy: Policy):
        self.outputs: list[torch.Tensor] = []
        self.model, self.policy = model, policy
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if recomputing():  # a checkpoint's replay in the backward, not another call
            return
        flat = _flat_output(output)
        if flat is not None and rewrite.applied_policy(self.model) == self.policy:
            self.outputs.append(flat)

    def take(self) -> torch.Tensor | None:
        out = torch.cat(self.outputs) if self.outputs else None
        self.outputs = []
        return out



# ------------------------------------------------------------------------------ measurement
def measure_sensitivity(
    task_or_model: Task | nn.Module,
    layers: Sequence[str],
    formats: Sequence[Format | str] = (Format.BF16, Format.FP16, Format.FP8),
    *,
    batches: Sequence[Any] | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    options: SensitivityOptions | None = None,
    **keywords: Any,
) -> SensitivityResults:
    """Measure every ``layer`` x ``format`` with only that layer switched; see the module
    docstring for what is measured and how.

    ``task_or_model``: a :class:`~autoprec.task.Task` (its ``build_model()``, batches, loss and
    seed) or an ``nn.Module`` (deep-copied; never modified) with ``batches=`` and optionally
    ``loss_fn=`` (default: the output's ``.loss``). ``batches`` / ``loss_fn`` override the
    task's. ``n_batches`` caps the calibration batches: by default a Task uses its first
    :data:`DEFAULT_N_BATCHES`, explicit ``batches=`` are all used. ``fp32`` in ``formats`` is
    measured for real (a second FP32 run): zero on a deterministic device, the run-to-run noise
    floor on one that is not. ``loss_scale`` is the fixed starting loss scale of fp16 runs
    (GradScaler's default). ``progress(done, total, label)`` is called after the reference
    (``done=1``) and after each layer x format. ``only`` (layer -> formats) restricts the
    formats measured for the layers it names (the profile skips formats that cannot win).

    Nested layers: when ``layers`` holds a module and some of its descendants (an attention
    module and its projections), the descendants stay FP32 while the parent is measured, so
    each number covers only what that layer computes itself (the attention's own matmuls) and
    per-layer errors add up without counting a child twice; its ``layer_grad_rel_error`` then
    covers only parameters no listed descendant owns. ``include_children=True`` switches the
    whole subtree instead. A descendant that is not in ``layers`` always follows its parent.

    ``mode``: ``"exact"`` measures every pair as above; ``"fast"`` estimates every pair from
    the reference pass and two curvature probes per batch (:mod:`autoprec.measure.estimate`,
    cost per layer flat in depth; ``seed`` also picks the probes' directions); ``"auto"``
    also measures exactly those whose estimate is doubtful or near ``budget``; ``exact_why``
    says why, and the estimate replaced. Each result's ``source`` says which it is. The exact
    comparisons need the FP32 reference's gradients of every batch: ``reference_gradients``
    "kept" holds them (the batches x the parameters' bytes), "recomputed" computes each
    batch's again beside each comparison's, "spilled" holds them outside the device's memory
    (a temporary file beside a CPU model, host memory beside an accelerator's), each read back
    as the comparison's gradient of the same parameter arrives; "auto" (default) keeps them
    unless that would take over a quarter of the free memory, then recomputes them. The same
    numbers every way.

    The settings (``n_batches``, ``loss_scale``, ``include_children``, ``seed``, ``progress``,
    ``only``, ``mode``, ``budget``, ``reference_gradients``) are the fields of ``options``, a
    :class:`~autoprec.measure.options.SensitivityOptions`, or keywords of their own (a keyword
    overrides the field). ``exact_why=`` (a dict) is still filled as before, for callers
    that pass one; the reasons are also the result's ``exact_why``.

    Returns ``{layer: {format: LayerSensitivity}}`` in the order given (a
    :class:`SensitivityResults`). Exact mode costs one
    forward+backward per batch for the reference plus one per layer x format x batch.
    """
    legacy_why = keywords.pop("exact_why", None)
    opts = with_keywords(options, SensitivityOptions, keywords, "measure_sensitivity")
    results = _run(task_or_model, layers, formats, batches, loss_fn, opts)
    if legacy_why is not None:
        for name, why in results.exact_why.items():
            legacy_why.setdefault(name, {}).update(why)
    return results


class SensitivityResults(dict):
    """``{layer: {format: LayerSensitivity}}``, and ``exact_why``: ``{layer: {format: (why,
    estimated loss change)}}`` for each pair mode "auto" measured exactly instead of its
    first-order estimate."""

    def __init__(self, results: Mapping[str, dict[Format, LayerSensitivity]],
                 exact_why: dict[str, dict[Format, tuple[str, float]]]):
        super().__init__(results)
        self.exact_why = exact_why


@dataclass(frozen=True)
class _Plan:
    """One measure_sensitivity call: what it compares, on which layers, and how."""

    meter: DeviationMeter
    names: list[str]
    # per layer, its listed descendants (kept FP32 while it is measured) and the indices of
    # the parameters it owns (less theirs)
    pinned: dict[str, list[str]]
    own: dict[str, list[int]]
    # the (layer, format) pairs to measure, and the formats of range statistics
    todo: list[tuple[str, Format]]
    range_fmts: list[Format]
    options: SensitivityOptions

    @classmethod
    def build(cls, meter: DeviationMeter, model: nn.Module, names: list[str], fmts: list[Format],
              opts: SensitivityOptions) -> _Plan:
        pinned = {name: [] if opts.include_children else _listed_descendants(name, names)
                  for name in names}
        own = _own_params(meter, model, names, pinned)
        only = opts.only
        todo = [(name, fmt) for name in names for fmt in fmts
                if only is None or name not in only
                or fmt in {Format.parse(f) for f in only[name]}]
        range_fmts = [f for f in Format if _narrow_range(f) and f in fmts]
        return cls(meter, names, pinned, own, todo, range_fmts, opts)

    def tick(self, done: int, total: int, label: str) -> None:
        if self.options.progress is not None:
            self.options.progress(done, total, label)


def _run(task_or_model, layers, formats, batches, loss_fn,
         opts: SensitivityOptions) -> SensitivityResults:
    fmts = _check_options(formats, opts.loss_scale, opts.mode)
    check_reference_gradients(opts.reference_gradients)
    in_place = opts.in_place and isinstance(task_or_model, nn.Module)
    model, calib, fn, base_seed = _setup(task_or_model, batches, loss_fn, opts.n_batches,
                                         copy_model=not in_place)
    with prepared(model) if in_place else contextlib.nullcontext(prepare_for_measurement(model)):
        return _measure_all(model, layers, fmts, calib, fn,
                            base_seed if opts.seed is None else opts.seed, opts)


def _measure_all(model, layers, fmts, calib, fn, seed: int,
                 opts: SensitivityOptions) -> SensitivityResults:
    # the estimates need the reference's gradient norms only; the exact comparisons (all of
    # them in "exact", those near the budget in "auto") need its gradients: kept (in "auto"
    # computed again on the first), recomputed per comparison or spilled
    how = "kept" if opts.mode == "fast" else reference_gradients(
        opts.reference_gradients, model, len(calib),
        next((p.device for p in model.parameters()), "cpu"))[0]
    meter = DeviationMeter(model, calib, fn, seed=seed,
                           **reference_keywords(how, keep=opts.mode == "exact"))
    plan = _Plan.build(meter, model, _check_layers(model, layers), fmts, opts)
    results: dict[str, dict[Format, LayerSensitivity]] = {name: {} for name in plan.names}
    exact_why: dict[str, dict[Format, tuple[str, float]]] = {}
    if opts.mode != "exact":
        ranges, estimates = _estimate_all(plan)
        for (name, fmt), value in estimates.items():
            results[name][fmt] = value
        todo = _exact_pairs(estimates, ranges, opts.budget or Budget(), exact_why) \
            if opts.mode == "auto" else []
        outputs = {name: None for name in plan.names}
    else:
        todo = plan.todo
        outputs, ranges = _reference(meter, plan.names, plan.range_fmts,
                                     opts.include_children)
        plan.tick(1, 1 + len(todo), "fp32 reference")
    for done, (name, fmt) in enumerate(todo, start=2):
        old = results[name].get(fmt)
        results[name][fmt] = _measure_one(plan, name, fmt, outputs[name],
                                          ranges[name].get(fmt),
                                          sqnr_db=None if old is None else old.output_sqnr_db)
        plan.tick(done, 1 + len(todo), f"{name or '<model>'} {fmt} (exact)")
    return SensitivityResults(results, exact_why)


def _own_params(meter, model, names, pinned) -> dict[str, list[int]]:
    """Per layer, the indices of the parameters it owns (less its listed descendants')."""
    own = {}
    for name in names:
        theirs = {id(p) for child in pinned[name]
                  for p in model.get_submodule(child).parameters()}
        own[name] = meter.index_of(p for p in model.get_submodule(name).parameters()
                                      if id(p) not in theirs)
    return own


def _check_options(formats, loss_scale: float, mode: str) -> list[Format]:
    fmts = list(dict.fromkeys(Format.parse(f, where="in measure_sensitivity(formats=...)")
                              for f in formats))
    if not fmts:
        raise ValueError("measure_sensitivity(formats=...) is empty; pass e.g. "
                         "('bf16', 'fp16', 'fp8').")
    if not (loss_scale >= 1.0 and math.isfinite(loss_scale)):
        raise ValueError(f"loss_scale must be a finite number >= 1 (GradScaler starts at "
                         f"65536), got {loss_scale!r}.")
    check_sensitivity_mode(mode)
    return fmts


def check_sensitivity_mode(mode: str) -> None:
    """A mode not in :data:`SENSITIVITY_MODES` is a ValueError that lists them."""
    if mode not in SENSITIVITY_MODES:
        raise ValueError(f"Unknown sensitivity mode {mode!r}; expected one of "
                         f"{', '.join(SENSITIVITY_MODES)}.")


def _estimate_all(plan: _Plan) -> tuple[dict, dict]:
    """Every pair of the plan estimated to first order during the FP32 reference pass, with
    the range statistics of that pass."""
    meter, names = plan.meter, plan.names
    if any(name == "" for name in names):
        raise ValueError("The first-order estimate is per layer; measure the whole model "
                         "(layer '') with mode='exact'.")
    fmts_for = {name: [f for n, f in plan.todo if n == name] for name in names}
    # each layer is estimated once per calibration batch, as the reference pass reaches it
    n_batches = len(meter.batches)
    total, seen = len(names) * n_batches, dict.fromkeys(names, 0)

    def tick(name: str) -> None:
        seen[name] = seen.get(name, 0) + 1
        plan.tick(min(sum(seen.values()), total), total,
                  f"{name} (first-order estimate, batch {min(seen[name], n_batches)}/{n_batches})")

    with estimate_during_reference(meter, names, fmts_for, plan.pinned, plan.own,
                                   loss_scale=plan.options.loss_scale,
                                   progress=tick) as (around, results):
        _, ranges = _reference(meter, names, plan.range_fmts, plan.options.include_children,
                               keep_outputs=False, extra=around)
        estimates = results()
    ref = meter.reference()
    total_sq = math.fsum(float(g.sum()) for g in ref.grad_sq)
    out = {}
    for name in names:
        for fmt, e in estimates[name].items():
            a_over, a_under, g_over, g_under = ranges[name].get(fmt, (None,) * 4)
            out[(name, fmt)] = LayerSensitivity(
                layer=name, format=fmt, loss_rel_change=e.loss_rel_change(ref.losses),
                grad_rel_error=e.grad_rel_error(total_sq),
                layer_grad_rel_error=e.layer_grad_rel_error(), output_sqnr_db=e.sqnr_db(),
                act_overflow=a_over, act_underflow=a_under, grad_overflow=g_over,
                grad_underflow=g_under, finite=e.finite, n_batches=len(ref.losses),
                source="estimated")
    return ranges, out


def _exact_pairs(estimates: Mapping, ranges: Mapping, budget: Budget,
                 exact_why: dict) -> list[tuple[str, Format]]:
    """The estimated pairs to measure exactly (see :func:`needs_exact`), in order; each one's
    reason and estimated loss change go into ``exact_why`` (the result's record of them)."""
    todo = []
    for (name, fmt), e in estimates.items():
        over = sum(x or 0.0 for x in (e.act_overflow, e.grad_overflow))
        why = needs_exact(e.loss_rel_change, e.grad_rel_error, e.finite, over, budget)
        if why:
            todo.append((name, fmt))
            exact_why.setdefault(name, {})[fmt] = (why, e.loss_rel_change)
    return todo


def _setup(task_or_model, batches, loss_fn, n_batches, *, copy_model: bool = True):
    if isinstance(task_or_model, Task):
        task = task_or_model
        model = task.build_model()
        source = task.batches if batches is None else batches
        limit = DEFAULT_N_BATCHES if n_batches is None and batches is None else n_batches
        fn = loss_fn or task.loss_fn or default_loss
        seed, device = task.seed, task.device
    elif isinstance(task_or_model, nn.Module):
        if batches is None:
            raise ValueError(f"measure_sensitivity got a model ({type(task_or_model).__name__}) "
                             "without batches; pass batches=[...] (and loss_fn= if the model "
                             "does not return .loss), or pass an autoprec.Task.")
        if not copy_model and rewrite.applied_policy(task_or_model) is not None:
            raise ValueError("measure_sensitivity(in_place=True) measures the model's own "
                             "forwards, but a policy is applied to it; remove it first "
                             "(autoprec.remove), or measure a copy (in_place=False).")
        model = copy.deepcopy(task_or_model) if copy_model else task_or_model
        rewrite.remove(model)  # measure the model's own forwards, not a policy already applied
        source, limit = batches, n_batches
        fn = loss_fn or default_loss
        seed = 0
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    else:
        raise TypeError(f"measure_sensitivity needs an autoprec.Task or an nn.Module, got "
                        f"{type(task_or_model).__name__}.")
    if isinstance(source, (torch.Tensor, Mapping)):
        raise ValueError("batches= must be a list of batches (one batch per element), not a "
                         "single tensor or dict; wrap it: batches=[batch].")
    if limit is not None:
        if int(limit) != limit or limit < 1:
            raise ValueError(f"n_batches must be a positive integer, got {limit!r}.")
        source = list(source)[:int(limit)]
    calib = [move_to(b, device) for b in source]
    if not calib:
        raise ValueError("measure_sensitivity needs at least one calibration batch; got none.")
    return model, calib, fn, seed


def _check_layers(model: nn.Module, layers: Sequence[str]) -> list[str]:
    if isinstance(layers, str):
        raise TypeError(f"layers= must be a list of module names, got the string {layers!r}; "
                        f"write [{layers!r}].")
    modules = [n for n, _ in model.named_modules()]
    known = set(modules)
    names = list(dict.fromkeys(layers))
    if not names:
        raise ValueError(f"{type(model).__name__} has no layer to measure: the model has no "
                         "linear, conv, attention or matmul layer to tune.")
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(str(name), modules, n=5, cutoff=0.6)
            hint = (f"similar names: {', '.join(close)}" if close else
                    f"module names look like {', '.join(n for n in modules[1:6])}, …")
            raise ValueError(f"Layer `{name}` is not a module of {type(model).__name__} ({hint}). "
                             "Pass fqns as model.named_modules() spells them.")
    return names


def _listed_descendants(name: str, names: Sequence[str]) -> list[str]:
    prefix = f"{name}." if name else ""
    return [n for n in names if n != name and n.startswith(prefix)]


def _reference(meter: DeviationMeter, names: list[str], range_fmts: list[Format],
               subtree: bool, *, keep_outputs: bool = True,
               extra: Callable[[int], Any] | None = None) -> tuple[dict[str, list], dict[str, dict]]:
    """The FP32 reference, with probes on every listed layer: each layer's outputs per batch
    (unless not ``keep_outputs``), and per layer and range format (act_overflow,
    act_underflow, grad_overflow, grad_underflow). ``extra(b)``: another context around batch
    ``b``'s forward (the first-order estimate's hooks)."""
    model = meter.model
    active: list[_ReferenceProbe] = []
    probes = {n: _ReferenceProbe(model.get_submodule(n), range_fmts, active, keep_outputs)
              for n in names}
    # the parameters as calls see them (under FSDP2 the unsharded ones, not the shards)
    params = {id(p) for p in (*model.parameters(), *meter.params)}
    counter = _RoundedCallCounter(active, params, subtree) if range_fmts else \
        contextlib.nullcontext()

    @contextlib.contextmanager
    def around(b: int):
        # the extra context first: the estimate's curvature probes run as it is entered, and
        # the range statistics must not count their passes
        with (extra(b) if extra is not None else contextlib.nullcontext()), counter:
            yield
        for probe in probes.values():
            probe.end_batch()

    try:
        meter.reference(around=around)
    finally:
        for probe in probes.values():
            probe.close()
    ranges = {n: {f: (*probes[n].act[f].fractions(), *probes[n].grad[f].fractions())
                  for f in range_fmts} for n in names}
    return {n: probes[n].batches for n in names}, ranges


def _measure_one(plan: _Plan, name: str, fmt: Format, ref_outputs: list | None,
                 ranges: tuple | None, *, sqnr_db: float | None = None) -> LayerSensitivity:
    """One pair measured exactly. Without ``ref_outputs`` the output SQNR is ``sqnr_db``
    (the estimate's, which is exact: the layer's inputs are the reference's)."""
    try:
        return _measure(plan, name, fmt, ref_outputs, ranges, sqnr_db)
    except Exception as e:
        raise RuntimeError(f"Measuring layer `{name}` in {fmt} failed: {e}") from e


def _measure(plan: _Plan, name: str, fmt: Format, ref_outputs: list | None,
             ranges: tuple | None, sqnr_db: float | None) -> LayerSensitivity:
    meter, own = plan.meter, plan.own[name]
    loss_scaling = LossScaling(init_scale=plan.options.loss_scale)
    keep_fp32 = {child: Format.FP32 for child in plan.pinned[name]}
    # FP8 numerics on autoprec's own engine whatever is installed: torchao's computes the same
    # recipes to BF16 rounding (tests/test_engines.py), and a profile must not depend on an
    # optional extra (nor swap the module the output probe watches)
    policy = (Policy(default=fmt, layers=keep_fp32, loss_scaling=loss_scaling,
                     engine="autoprec") if name == ""
              else Policy(default=Format.FP32, layers={name: fmt, **keep_fp32},
                          loss_scaling=loss_scaling, engine="autoprec"))
    if ref_outputs is None:
        dev: Deviation = meter.compare(policy)
        sqnr_finite = sqnr_db is None or not math.isnan(sqnr_db)
        db = math.nan if sqnr_db is None else sqnr_db
    else:
        probe = _OutputProbe(meter.model.get_submodule(name), meter.model, policy)
        sqnr = _SQNR(name, fmt, ref_outputs)
        try:
            dev = meter.compare(policy, after_forward=lambda b: sqnr.add(b, probe.take()))
        finally:
            probe.handle.remove()
        sqnr_finite, db = sqnr.finite, sqnr.db()
    a_over, a_under, g_over, g_under = ranges if ranges is not None else (None,) * 4
    return LayerSensitivity(
        layer=name, format=fmt,
        loss_rel_change=dev.loss_rel_change,
        grad_rel_error=dev.grad_rel_error,
        layer_grad_rel_error=dev.grad_error_of(own),
        output_sqnr_db=db,
        act_overflow=a_over, act_underflow=a_under,
        grad_overflow=g_over, grad_underflow=g_under,
        finite=dev.finite and sqnr_finite, n_batches=dev.n_batches)


class _SQNR:
    """Signal-to-quantization-noise ratio of a layer's outputs against the reference's."""

    def __init__(self, name: str, fmt: Format, reference: list):
        self.name, self.fmt, self.reference = name, fmt, reference
        self.signal = self.noise = 0.0
        self.finite = True

    def add(self, b: int, out: torch.Tensor | None) -> None:
        ref = self.reference[b]
        if ref is None or out is None:
            return
        if out.shape != ref.shape:
            raise RuntimeError(f"layer `{self.name}` produced {out.numel()} output values in "
                               f"{self.fmt} but {ref.numel()} in the FP32 reference; its outputs "
                               "must not depend on the format.")
        self.finite = self.finite and bool(torch.isfinite(out).all())
        r64 = ref.to(torch.float64)
        self.signal += float(r64.square().sum())
        self.noise += float((out.to(torch.float64) - r64).square().sum())

    def db(self) -> float:
        """10 log10(signal / noise): inf when identical, nan or -inf when not finite."""
        if math.isnan(self.noise) or math.isnan(self.signal):
            return math.nan
        if self.noise == 0.0:
            return math.inf
        if math.isinf(self.noise) or self.signal == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.noise)
