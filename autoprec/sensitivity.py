"""Numerical error of each layer in each format, forward and backward.

For every layer x format, the layer alone computes in that format (a policy ``default: fp32,
layers: {fqn: format}``, applied with :func:`autoprec.rewrite.apply`) and everything else in
FP32. One forward + backward per layer x format x calibration batch is compared with an FP32
reference computed once:

```
reference (policy all-fp32), once per batch      switched run, per layer x format x batch
  loss_ref, all parameter grads g_ref               loss, all parameter grads g
  each layer's output  y_ref (forward hook)         the switched layer's output y
  each layer's output gradient (tensor hook)
        │ range statistics: overflow / underflow of activations and output gradients
        ▼                                                    ▼
                          LayerError(loss_rel_change, grad_rel_error, layer_grad_rel_error,
                                     output_sqnr_db, act/grad over/underflow, finite)
```

How the measurement is kept deterministic and faithful to training:

- It works on a fresh copy (``task.build_model()`` or ``copy.deepcopy``): the caller's model is
  never touched, and gradients come from ``torch.autograd.grad``, so no ``.grad`` is written
  and no weight is updated.
- Train mode, because these are the gradients training sees, with dropout switched off: every
  ``nn.Dropout``'s ``p``, float ``*dropout*`` attributes of modules (HF attention reads
  ``attention_dropout`` at call time) and ``*dropout*`` / ``*pdrop*`` fields of an HF config
  are set to 0. Dropout masks would otherwise differ between a switched run and the
  reference only through RNG use, and their noise would swamp the format's error.
- BatchNorm stays in train mode (normalising with batch statistics, as in training) with
  ``momentum=0`` so its running statistics are never updated: every run sees the same model.
- ``torch.manual_seed(seed + batch_index)`` before every forward, inside ``fork_rng`` so the
  caller's RNG state is left as it was.
- fp16 runs back-propagate ``loss * loss_scale`` and divide the gradients by it, as
  ``torch.amp.GradScaler`` does in fp16 training; when the scaled gradients are not finite
  the scale halves and the backward reruns (down to 1), as GradScaler would back off. The
  overflow / underflow *statistics* are of the unscaled values: they say what loss scaling
  has to fix.

Range statistics (fp16 and fp8 only; fp32 and bf16 share FP32's exponent range and report
None) are taken from the FP32 reference, since a layer switched alone sees exactly the
reference's inputs. They count the tensors a format actually rounds: the operands (other than
parameters) and outputs of the layer's matmul-like calls (``F.linear``, ``addmm``, ``mm``,
``bmm``, ``matmul``, ``baddbmm``, convolutions, SDPA: autocast's low-precision ops; for fp8
only the calls the FP8 router quantizes), and the gradients arriving at those outputs. For a
Linear or Conv1D that is its input, its output and its output gradient. A layer measured
without its listed descendants counts only its own calls (see ``_RoundedCallCounter``).

- overflow: ``|x| > max`` of the format (inf counts), before any loss scaling; FP8 scales
  every tensor by ``fp8_max / amax`` (the tensorwise recipe of :mod:`autoprec.fp8`), so it
  cannot overflow and reports 0;
- underflow: non-zero values whose magnitude (after that scaling for fp8) is below the
  format's smallest subnormal: E4M3 for fp8 activations, E5M2 for fp8 gradients. This is the
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
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from autoprec.formats import FP8_E4M3, FP8_E5M2, Format
from autoprec.fp8 import fp8_shape_supported, tensorwise_scale
from autoprec.policy import LossScaling, Policy
from autoprec.rewrite import apply, remove
from autoprec.task import Task, default_loss, move_to

__all__ = [
    "LayerError",
    "measure_sensitivity",
    "prepare_for_measurement",
    "DEFAULT_N_BATCHES",
    "VERDICTS",
]

# One batch keeps the profile of GPT-2 4x256 (17-21 layers x 3 formats) near a minute on
# 2 CPU cores. The comparison is paired (same batch, same seed), so batch-to-batch noise
# does not enter a difference; more batches average over inputs, at a linear cost.
DEFAULT_N_BATCHES = 1

VERDICTS = ("ok", "lossy", "overflow", "non-finite")

# Formats whose exponent range is narrower than FP32's, so range statistics mean something.
_RANGE_FORMATS = (Format.FP16, Format.FP8)

ProgressFn = Callable[[int, int, str], None]


# ------------------------------------------------------------------------------ result
@dataclass(frozen=True)
class LayerError:
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
    # is above the format's max; fp8 scales per tensor, so 0. None for fp32/bf16.
    act_overflow: float | None
    # Fraction of those elements that are non-zero but below the format's smallest subnormal
    # (after per-tensor scaling for fp8). None for fp32/bf16.
    act_underflow: float | None
    # As act_overflow, for the gradients arriving at those outputs, before loss scaling.
    grad_overflow: float | None
    # As act_underflow, for those gradients (E5M2 with its own scale for fp8).
    grad_underflow: float | None
    # True when the loss, every parameter gradient and the layer's output were finite on
    # every batch. Non-finite runs are recorded, never raised.
    finite: bool
    # Calibration batches the numbers average over.
    n_batches: int

    def __post_init__(self):
        object.__setattr__(self, "format",
                           Format.parse(self.format, where=f"for layer `{self.layer}`"))
        for name in ("act_overflow", "act_underflow", "grad_overflow", "grad_underflow"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"LayerError.{name} is a fraction of elements, so it must lie "
                                 f"in [0, 1] or be None; got {value!r} for layer "
                                 f"`{self.layer}` in {self.format}.")
        if int(self.n_batches) != self.n_batches or self.n_batches < 1:
            raise ValueError(f"LayerError.n_batches must be a positive integer, got "
                             f"{self.n_batches!r} for layer `{self.layer}`.")

    # -------------------------------------------------------------- judging
    def judge(self, *, max_loss_change: float = 0.01, max_grad_error: float = 0.25,
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
        return {k: _encode_float(v) for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerError:
        """Inverse of :meth:`to_dict`; unknown or missing keys are errors that name them."""
        names = [f.name for f in fields(cls)]
        unknown = [k for k in data if k not in names]
        missing = [k for k in names if k not in data]
        if unknown or missing:
            parts = []
            if unknown:
                parts.append(f"unknown key(s) {', '.join(map(repr, unknown))}")
            if missing:
                parts.append(f"missing key(s) {', '.join(map(repr, missing))}")
            raise ValueError(f"LayerError.from_dict got {' and '.join(parts)}; the keys are "
                             f"{', '.join(names)} (as LayerError.to_dict writes them).")
        values = {k: _decode_float(v) if k not in ("layer", "format", "finite", "n_batches")
                  else v for k, v in data.items()}
        values["finite"] = bool(values["finite"])
        values["n_batches"] = int(values["n_batches"])
        return cls(**values)


_NONFINITE_NAMES = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _encode_float(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _decode_float(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return _NONFINITE_NAMES[value.strip().lower()]
        except KeyError:
            raise ValueError(f"Expected a number or one of 'inf', '-inf', 'nan' in a "
                             f"LayerError, got the string {value!r}.") from None
    if value is None or isinstance(value, bool):
        return value
    return float(value)


# ------------------------------------------------------------------------------ model prep
def prepare_for_measurement(model: nn.Module) -> nn.Module:
    """Put ``model`` (a private copy) in the state measurements need, in place: train mode
    with every dropout at 0 and BatchNorm running statistics frozen (``momentum=0``; the
    forward still normalises with batch statistics, as training does). Returns ``model``."""
    model.train()
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in list(vars(config).items()):
            if _is_dropout_name(key) and isinstance(value, float):
                setattr(config, key, 0.0)
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        elif isinstance(module, nn.modules.batchnorm._BatchNorm):
            # momentum=None would average with num_batches_tracked; 0.0 keeps the stats put.
            module.momentum = 0.0
        for key, value in list(vars(module).items()):
            # HF attention keeps a float `attention_dropout` and passes it to SDPA itself.
            if _is_dropout_name(key) and isinstance(value, float) and not isinstance(value, bool):
                setattr(module, key, 0.0)
        sub_config = getattr(module, "config", None)
        if sub_config is not None and sub_config is not config and hasattr(sub_config, "__dict__"):
            for key, value in list(vars(sub_config).items()):
                if _is_dropout_name(key) and isinstance(value, float):
                    setattr(sub_config, key, 0.0)
    return model


def _is_dropout_name(key: str) -> bool:
    key = key.lower()
    return "dropout" in key or "pdrop" in key


# ------------------------------------------------------------------------------ range stats
class _RangeCounter:
    """Counts elements beyond a format's range, accumulated as tensors (no device sync)."""

    def __init__(self, fmt: Format, kind: str):
        self.fmt = fmt
        # Which FP8 encoding the recipe uses for this kind of tensor.
        self.fp8_dtype = FP8_E5M2 if kind == "grad" else FP8_E4M3
        self.over: torch.Tensor | int = 0
        self.under: torch.Tensor | int = 0
        self.total = 0

    def add(self, x: torch.Tensor) -> None:
        a = x.detach().abs().to(torch.float32)
        nonzero = a > 0
        if self.fmt is Format.FP8:
            # The recipe's own scale: the same amax, clamp and rounding as autoprec.fp8.
            scaled = a * tensorwise_scale(x, self.fp8_dtype)
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


def _floating(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _flat_output(output: Any) -> torch.Tensor | None:
    """All floating outputs of a call as one fresh FP32 vector (a copy, so later in-place
    edits downstream cannot change it)."""
    tensors = _floating(output)
    if not tensors:
        return None
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


# The calls a region rounds, and whether the FP8 router quantizes them (the rest of an fp8
# region runs as bf16: convolutions, SDPA, baddbmm). Mirrors torch.autocast's
# lower-precision list and autoprec.rewrite's FP8 routes.
_F = torch.nn.functional
_ROUNDED_CALLS: dict[Callable, bool] = {
    _F.linear: True,
    torch.addmm: True, torch.Tensor.addmm: True,
    torch.matmul: True, torch.Tensor.matmul: True, torch.Tensor.__matmul__: True,
    torch.mm: True, torch.Tensor.mm: True,
    torch.bmm: True, torch.Tensor.bmm: True,
    torch.baddbmm: False, torch.Tensor.baddbmm: False,
    _F.conv1d: False, _F.conv2d: False, _F.conv3d: False,
    _F.conv_transpose1d: False, _F.conv_transpose2d: False, _F.conv_transpose3d: False,
    _F.scaled_dot_product_attention: False,
}


def _operands(func: Callable, args: tuple, kwargs: dict) -> list[Any]:
    """The multiplied operands of a rounded call: not the additive term of addmm/baddbmm (a
    bias, an ALiBi or mask term) nor SDPA's attn_mask, whose -inf or finfo.min entries are
    meant to saturate and would read as overflow."""
    if func is _F.scaled_dot_product_attention:
        return [args[i] if len(args) > i else kwargs.get(k)
                for i, k in enumerate(("query", "key", "value"))]
    if func in (torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm):
        return list(args[1:3]) + [kwargs.get(k) for k in ("mat1", "mat2", "batch1", "batch2")]
    if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
                torch.Tensor.mm, torch.bmm, torch.Tensor.bmm):
        return list(args[:2]) + [kwargs.get("other"), kwargs.get("mat2")]
    # F.linear and convolutions: input and weight (a parameter, dropped by the caller).
    return list(args[:2]) + [kwargs.get("input"), kwargs.get("weight")]


def _fp8_quantizes(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether the FP8 router would quantize this call (else it runs in bf16): the same
    conditions as autoprec.rewrite's routes and autoprec.fp8's shape rule."""
    if not _ROUNDED_CALLS.get(func, False):
        return False
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if func is _F.linear:
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if weight is None or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            return False
        a, b = args[0], weight.t()
    elif func in (torch.addmm, torch.Tensor.addmm):
        if "out" in kwargs or kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
            return False
        if len(tensors) < 3:
            return False
        a, b = tensors[1], tensors[2]
    else:
        if kwargs or len(tensors) != 2:
            return False
        a, b = tensors
    if a.dim() < 2 or b.dim() < 2 or not (a.is_floating_point() and b.is_floating_point()):
        return False
    m = math.prod(a.shape[:-1]) if b.dim() == 2 else a.shape[-2]
    return fp8_shape_supported(m, a.shape[-1], b.shape[-1])[0]


class _ReferenceProbe:
    """Hooks on one layer during the FP32 reference: its outputs, and range statistics of the
    activations its rounded calls take and give and of the gradients arriving at them."""

    def __init__(self, module: nn.Module, range_formats: Sequence[Format],
                 active: list[_ReferenceProbe]):
        self.outputs: list[torch.Tensor] = []  # this batch's outputs, one entry per call
        self.batches: list[torch.Tensor | None] = []  # concatenated outputs per batch
        self.act = {f: _RangeCounter(f, "act") for f in range_formats}
        self.grad = {f: _RangeCounter(f, "grad") for f in range_formats}
        # Listed layers currently running, innermost last (shared by all probes).
        self.active = active
        self.handles = [module.register_forward_pre_hook(self._enter),
                        module.register_forward_hook(self._exit)]

    def _enter(self, module, args):
        self.active.append(self)

    def _exit(self, module, args, output):
        if self.active and self.active[-1] is self:
            self.active.pop()
        flat = _flat_output(output)
        if flat is not None:
            self.outputs.append(flat)

    def count_call(self, operands: list[torch.Tensor], out: torch.Tensor,
                   fp8: bool) -> None:
        for fmt, counter in self.act.items():
            if fmt is Format.FP8 and not fp8:
                continue  # the router leaves it in bf16: nothing is rounded to FP8
            for t in (*operands, out):
                counter.add(t)
        if self.grad and out.requires_grad:
            out.register_hook(lambda g, fp8=fp8: self._grad_hook(g, fp8))

    def _grad_hook(self, grad, fp8: bool):
        for fmt, counter in self.grad.items():
            if fmt is Format.FP8 and not fp8:
                continue
            counter.add(grad)

    def end_batch(self) -> None:
        self.batches.append(torch.cat(self.outputs) if self.outputs else None)
        self.outputs = []

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class _RoundedCallCounter(TorchFunctionMode):
    """Feeds each rounded call (see ``_ROUNDED_CALLS``) to the listed layer running it: the
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
        if self.active and func in _ROUNDED_CALLS and isinstance(out, torch.Tensor) \
                and out.is_floating_point():
            operands = [t for t in _operands(func, args, kwargs)
                        if isinstance(t, torch.Tensor) and t.is_floating_point()
                        and not self._is_param(t)]
            fp8 = _fp8_quantizes(func, args, kwargs)
            for probe in (self.active if self.subtree else self.active[-1:]):
                probe.count_call(operands, out, fp8)
        return out


class _OutputProbe:
    """Hook on the switched layer: its outputs in the current batch."""

    def __init__(self, module: nn.Module):
        self.outputs: list[torch.Tensor] = []
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        flat = _flat_output(output)
        if flat is not None:
            self.outputs.append(flat)

    def take(self) -> torch.Tensor | None:
        out = torch.cat(self.outputs) if self.outputs else None
        self.outputs = []
        return out


# ------------------------------------------------------------------------------ measurement
@dataclass(frozen=True)
class _Reference:
    # Reference loss per batch.
    losses: list[float]
    # Per batch, the FP32 gradient of every trainable parameter (zeros where unused).
    grads: list[list[torch.Tensor]]
    # Per batch, float64 squared norm of each parameter's gradient, shape [n_params].
    grad_sq: list[torch.Tensor]
    # Per layer, per batch, the concatenated FP32 outputs (None if it has no floating output).
    outputs: dict[str, list[torch.Tensor | None]]
    # Per layer, per range format: (act_overflow, act_underflow, grad_overflow, grad_underflow).
    ranges: dict[str, dict[Format, tuple[float, float, float, float]]]


def measure_sensitivity(
    task_or_model: Task | nn.Module,
    layers: Sequence[str],
    formats: Sequence[Format | str] = (Format.BF16, Format.FP16, Format.FP8),
    *,
    batches: Sequence[Any] | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    n_batches: int | None = None,
    loss_scale: float = LossScaling().init_scale,
    include_children: bool = False,
    seed: int | None = None,
    progress: ProgressFn | None = None,
) -> dict[str, dict[Format, LayerError]]:
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
    (``done=1``) and after each layer x format.

    Nested layers: when ``layers`` holds a module and some of its descendants (an attention
    module and its projections), the descendants stay FP32 while the parent is measured, so
    each number covers only what that layer computes itself (the attention's own matmuls) and
    per-layer errors add up without counting a child twice; its ``layer_grad_rel_error`` then
    covers only parameters no listed descendant owns. ``include_children=True`` switches the
    whole subtree instead. A descendant that is not in ``layers`` always follows its parent.

    Returns ``{layer: {format: LayerError}}`` in the order given. Costs one forward+backward
    per batch for the reference plus one per layer x format x batch.
    """
    fmts = _unique([Format.parse(f, where="in measure_sensitivity(formats=...)")
                    for f in formats])
    if not fmts:
        raise ValueError("measure_sensitivity(formats=...) is empty; pass e.g. "
                         "('bf16', 'fp16', 'fp8').")
    if not (loss_scale >= 1.0 and math.isfinite(loss_scale)):
        raise ValueError(f"loss_scale must be a finite number >= 1 (GradScaler starts at "
                         f"65536), got {loss_scale!r}.")
    model, calib, fn, base_seed, device = _setup(task_or_model, batches, loss_fn, n_batches)
    if seed is not None:
        base_seed = seed
    names = _check_layers(model, layers)
    prepare_for_measurement(model)
    _check_fp32(model)

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameter with requires_grad=True, so "
                         "there are no gradients to compare; unfreeze the parameters to "
                         "measure.")
    index = {id(p): i for i, p in enumerate(params)}
    pinned = {name: [] if include_children else _listed_descendants(name, names)
              for name in names}
    own = {}
    for name in names:
        theirs = {id(p) for child in pinned[name]
                  for p in model.get_submodule(child).parameters()}
        own[name] = [index[id(p)] for p in model.get_submodule(name).parameters()
                     if id(p) in index and id(p) not in theirs]

    total = 1 + len(names) * len(fmts)
    range_fmts = [f for f in _RANGE_FORMATS if f in fmts]
    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices), warnings.catch_warnings():
        # apply() warns that emulated fp8 is slow; numerics are exact, which is all we use.
        warnings.filterwarnings("ignore", message=r"Policy.*puts layers in fp8")
        ref = _reference(model, names, range_fmts, calib, fn, params, base_seed,
                         include_children)
        if progress is not None:
            progress(1, total, "fp32 reference")
        done = 1
        results: dict[str, dict[Format, LayerError]] = {}
        for name in names:
            results[name] = {}
            for fmt in fmts:
                try:
                    results[name][fmt] = _measure_one(model, name, fmt, pinned[name], ref,
                                                      own[name], calib, fn, params, base_seed,
                                                      loss_scale)
                except Exception as e:
                    raise RuntimeError(f"Measuring layer `{name}` in {fmt} failed: {e}") from e
                done += 1
                if progress is not None:
                    progress(done, total, f"{name or '<model>'} {fmt}")
    return results


def _unique(items: Sequence) -> list:
    seen, out = set(), []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def _setup(task_or_model, batches, loss_fn, n_batches):
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
        model = copy.deepcopy(task_or_model)
        remove(model)  # measure the model's own forwards, not a policy already applied
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
    return model, calib, fn, seed, torch.device(device)


def _check_layers(model: nn.Module, layers: Sequence[str]) -> list[str]:
    if isinstance(layers, str):
        raise TypeError(f"layers= must be a list of module names, got the string {layers!r}; "
                        f"write [{layers!r}].")
    modules = [n for n, _ in model.named_modules()]
    known = set(modules)
    names = _unique(list(layers))
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


def _check_fp32(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(f"Parameter `{name}` is {p.dtype}, but sensitivity is measured "
                             "against an FP32 reference with FP32 master weights (as autoprec "
                             "trains); build the model in FP32 (model.float()).")


def _loss(model, fn, batch) -> torch.Tensor:
    loss = fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor, got {shape}; reduce it "
                         "(e.g. .mean()).")
    if not loss.requires_grad:
        raise ValueError("The loss does not require grad, so there are no gradients to "
                         "compare; do not compute it under torch.no_grad().")
    return loss.reshape(())


def _grads(loss: torch.Tensor, params: list[torch.Tensor], *, scale: float = 1.0,
           retain_graph: bool = False) -> list[torch.Tensor]:
    target = loss * scale if scale != 1.0 else loss
    grads = torch.autograd.grad(target, params, allow_unused=True, retain_graph=retain_graph)
    out = []
    for g, p in zip(grads, params):
        g = torch.zeros_like(p) if g is None else g.to(torch.float32)
        out.append(g / scale if scale != 1.0 else g)
    return out


def _sq_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm of each tensor, float64, shape [len(grads)].

    One fused ``_foreach_norm`` in FP32 rather than a float64 copy of every gradient: the
    copies cost more than the forward and backward on a 22M-parameter model, and a norm's
    relative rounding (~1e-7) is far below any error worth reporting. A norm is exactly 0
    only for an exactly zero tensor, so FP32 against itself still gives exactly 0.
    """
    if not grads:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack(torch._foreach_norm(grads)).to(torch.float64).square()


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    if not tensors:
        return True
    # Fast path: finite norms mean finite tensors. A non-finite norm may also come from FP32
    # overflow of a finite tensor's norm (values ~1e19), so that case is checked exactly.
    if bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors))).all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _reference(model, names, range_fmts, calib, fn, params, base_seed,
               subtree: bool) -> _Reference:
    active: list[_ReferenceProbe] = []
    probes = {n: _ReferenceProbe(model.get_submodule(n), range_fmts, active) for n in names}
    counter = _RoundedCallCounter(active, {id(p) for p in model.parameters()}, subtree) \
        if range_fmts else contextlib.nullcontext()
    apply(model, Policy(default=Format.FP32))
    losses, grads, grad_sq = [], [], []
    try:
        for b, batch in enumerate(calib):
            torch.manual_seed(base_seed + b)
            with counter:
                loss = _loss(model, fn, batch)
            g = _grads(loss, params)
            value = float(loss.detach())
            if not math.isfinite(value) or not _all_finite(g):
                what = f"loss is {value}" if not math.isfinite(value) else "gradients are not finite"
                raise ValueError(f"The FP32 reference {what} on calibration batch {b}; every "
                                 "error is measured against a finite FP32 run, so fix the model "
                                 "or the batch first.")
            losses.append(value)
            grads.append(g)
            grad_sq.append(_sq_norms(g))
            for probe in probes.values():
                probe.end_batch()
    finally:
        remove(model)
        for probe in probes.values():
            probe.close()
    ranges = {}
    for n, probe in probes.items():
        ranges[n] = {}
        for f in range_fmts:
            a_over, a_under = probe.act[f].fractions()
            g_over, g_under = probe.grad[f].fractions()
            ranges[n][f] = (a_over, a_under, g_over, g_under)
    return _Reference(losses=losses, grads=grads, grad_sq=grad_sq,
                      outputs={n: probes[n].batches for n in names}, ranges=ranges)


def _measure_one(model, name, fmt, pinned: list[str], ref: _Reference, own: list[int], calib,
                 fn, params, base_seed, loss_scale) -> LayerError:
    keep_fp32 = {child: Format.FP32 for child in pinned}
    policy = Policy(default=fmt, layers=keep_fp32) if name == "" else \
        Policy(default=Format.FP32, layers={name: fmt, **keep_fp32})
    probe = _OutputProbe(model.get_submodule(name))
    apply(model, policy)
    loss_changes: list[float] = []
    diff_sq = torch.zeros(len(params), dtype=torch.float64, device=ref.grad_sq[0].device)
    signal = noise = 0.0
    finite = True
    try:
        for b, batch in enumerate(calib):
            torch.manual_seed(base_seed + b)
            loss = _loss(model, fn, batch)
            out = probe.take()
            value = float(loss.detach())
            g = _scaled_grads(loss, params, loss_scale if fmt.needs_loss_scaling else 1.0)
            ref_loss = ref.losses[b]
            # A zero reference loss has no relative scale: report the absolute change then.
            loss_changes.append((value - ref_loss) / abs(ref_loss) if ref_loss != 0 else
                                value - ref_loss)
            # Out of place: autograd may hand the same tensor to two parameters (a + b).
            diff_sq += _sq_norms(torch._foreach_sub(g, ref.grads[b]))
            finite = finite and math.isfinite(value) and _all_finite(g)
            ref_out = ref.outputs[name][b]
            if ref_out is not None and out is not None:
                if out.shape != ref_out.shape:
                    raise RuntimeError(f"layer `{name}` produced {out.numel()} output values in "
                                       f"{fmt} but {ref_out.numel()} in the FP32 reference; "
                                       "its outputs must not depend on the format.")
                finite = finite and bool(torch.isfinite(out).all())
                r64 = ref_out.to(torch.float64)
                signal += float(r64.square().sum())
                noise += float((out.to(torch.float64) - r64).square().sum())
    finally:
        remove(model)
        probe.handle.remove()

    ref_sq = torch.stack(ref.grad_sq).sum(0)
    diff = diff_sq.tolist()
    ref_norms = ref_sq.tolist()
    grad_err = _rel(sum(diff), sum(ref_norms))
    layer_err = _rel(sum(diff[i] for i in own), sum(ref_norms[i] for i in own)) if own else None
    ranges = ref.ranges[name].get(fmt)
    a_over = a_under = g_over = g_under = None
    if ranges is not None:
        a_over, a_under, g_over, g_under = ranges
    return LayerError(
        layer=name, format=fmt,
        loss_rel_change=_mean(loss_changes),
        grad_rel_error=grad_err,
        layer_grad_rel_error=layer_err,
        output_sqnr_db=_sqnr_db(signal, noise),
        act_overflow=a_over, act_underflow=a_under,
        grad_overflow=g_over, grad_underflow=g_under,
        finite=finite, n_batches=len(calib))


def _scaled_grads(loss, params, scale: float) -> list[torch.Tensor]:
    """Gradients of ``loss``; with ``scale > 1`` back-propagated from ``loss * scale`` and
    unscaled, halving the scale while the scaled gradients overflow (GradScaler's back-off),
    down to 1. A non-finite loss is not retried: no scale can fix it."""
    if scale == 1.0 or not bool(torch.isfinite(loss.detach())):
        return _grads(loss, params)
    while True:
        g = _grads(loss, params, scale=scale, retain_graph=scale > 1.0)
        if scale <= 1.0 or _all_finite(g):
            return g
        scale = max(1.0, scale / 2)


def _rel(diff_sq: float, ref_sq: float) -> float:
    if math.isnan(diff_sq):
        return math.nan
    if diff_sq == 0.0:
        return 0.0
    if ref_sq == 0.0:
        return math.inf
    return math.sqrt(diff_sq / ref_sq)


def _sqnr_db(signal: float, noise: float) -> float:
    if math.isnan(noise) or math.isnan(signal):
        return math.nan
    if noise == 0.0:
        return math.inf
    if math.isinf(noise):
        return -math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan
