"""The one comparison of a candidate policy against the FP32 reference.

Used by the profile (a policy that switches one layer, :mod:`autoprec.measure.sensitivity`)
and by every trial of the search (a whole policy), so "loss change" and "gradient error" mean
the same everywhere:

- ``loss_rel_change``: mean over the batches of ``(loss - loss_fp32) / |loss_fp32|``;
- ``grad_rel_error``: ``||g - g_fp32|| / ||g_fp32||`` over every trainable parameter's
  gradient, all batches concatenated (not the error of the summed gradients, which lets errors
  of opposite sign on two batches cancel);
- ``grad_bias``: the error of the summed gradients, ``||sum_b (g_b - g_fp32,b)|| /
  ||sum_b g_fp32,b||``: the part of the error training does not average away, the quantity
  :mod:`autoprec.runtime.bias` defines and the bias budget judges (with one batch it is the
  gradient error);
- gradients come from ``torch.autograd.grad`` (no ``.grad`` is written, no weight moves);
- a policy with fp16 layers back-propagates ``loss * scale`` with the policy's
  ``loss_scaling.init_scale`` and divides the gradients by it, halving the scale while the
  scaled gradients are not finite (GradScaler's back-off), down to 1;
- ``torch.manual_seed(seed + batch_index)`` before every forward, the model in the state
  :func:`prepare_for_measurement` puts it in (train mode, dropout 0, BatchNorm statistics
  frozen), so two runs of the same policy give the same numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from autoprec._util import Spilled, free_memory, quoted, spilled
from autoprec.formats import Format
from autoprec.host import slow_16bit_dtypes
from autoprec.measure import shards
from autoprec.measure.checkpointing import refuse_reentrant
from autoprec.policy import Policy
from autoprec.runtime import rewrite
from autoprec.runtime.fp8 import emulating

__all__ = ["Reference", "Deviation", "DeviationMeter", "prepare_for_measurement", "prepared",
           "writable", "REFERENCE_GRADIENTS", "check_reference_gradients", "reference_gradients",
           "reference_keywords"]

# How a meter's comparisons get the FP32 reference's gradients (a tune's held-out batches', a
# profile's calibration batches'): see reference_gradients
REFERENCE_GRADIENTS = ("auto", "kept", "recomputed", "spilled")


def check_reference_gradients(choice: str, name: str = "reference_gradients") -> None:
    """A way not in :data:`REFERENCE_GRADIENTS` is a ValueError that lists them."""
    if choice not in REFERENCE_GRADIENTS:
        raise ValueError(f"{name} must be one of {', '.join(REFERENCE_GRADIENTS)}; got "
                         f"{quoted(str(choice))}.")


def reference_gradients(choice: str, model: nn.Module, n_batches: int,
                        device: torch.device | str) -> tuple[str, tuple[int, int] | None]:
    """How the comparisons get the FP32 reference's gradients: ``choice`` ("kept": computed
    once, every batch's held, ``n_batches`` x the parameters' bytes; "recomputed": each batch's
    computed again beside each comparison's and dropped, one more FP32 forward and backward per
    batch per comparison; "spilled": computed once and held outside the device's memory, read
    back as the comparison's gradients arrive), or for "auto", "kept" unless holding them would
    take over a quarter of the memory free on ``device`` now, then "recomputed". Returns the
    way, and when "auto" chose to recompute, the bytes they would take and the bytes free."""
    check_reference_gradients(choice)
    if choice != "auto":
        return choice, None
    kept = n_batches * sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    free = free_memory(device)
    if free is None or kept <= free / 4:
        return "kept", None
    return "recomputed", (kept, free)


def reference_keywords(how: str, *, keep: bool = True) -> dict[str, bool]:
    """The :class:`DeviationMeter` keywords for a way :func:`reference_gradients` gave
    (``keep``: whether "kept" holds them from the first reference pass, or computes them
    again on the first comparison)."""
    return {"kept": {"keep_grads": keep}, "recomputed": {"per_batch": True},
            "spilled": {"spill": True}}[how]


def prepare_for_measurement(model: nn.Module) -> nn.Module:
    """Put ``model`` (a private copy) in the state measurements need, in place: train mode
    with every dropout at 0 and BatchNorm running statistics frozen (``momentum=0``; the
    forward still normalises with batch statistics, as training does). Returns ``model``.

    Dropout is off because its masks would differ between a candidate and the reference only
    through RNG use, and their noise would swamp a format's error. Besides every
    ``nn.Dropout``, float ``*dropout*``/``*pdrop*`` attributes of modules and HF configs are
    zeroed: HF attention reads ``attention_dropout`` at call time and passes it to SDPA."""
    model.train()
    for obj, key, value in _measurement_settings(model):
        setattr(obj, key, value)
    return model


@contextlib.contextmanager
def prepared(model: nn.Module):
    """:func:`prepare_for_measurement` on ``model`` itself for the ``with`` block, and every
    field it sets (train/eval mode, dropout probabilities, BatchNorm momenta) as it was
    afterwards: a measurement on the caller's model instead of a copy of it."""
    modes = [(m, m.training) for m in model.modules()]
    saved = [(obj, key, getattr(obj, key)) for obj, key, _ in _measurement_settings(model)]
    prepare_for_measurement(model)
    try:
        yield model
    finally:
        for obj, key, value in saved:
            setattr(obj, key, value)
        for m, training in modes:
            m.training = training


def _measurement_settings(model: nn.Module) -> list[tuple[Any, str, float]]:
    """(object, attribute, value) for every field :func:`prepare_for_measurement` sets besides
    the train mode: the one list it applies and :func:`prepared` restores."""
    out: list[tuple[Any, str, float]] = []
    configs = [getattr(model, "config", None)]
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            out.append((module, "p", 0.0))
        elif isinstance(module, nn.modules.batchnorm._BatchNorm):
            # momentum=None would average with num_batches_tracked; 0.0 keeps the stats put.
            out.append((module, "momentum", 0.0))
        out += _dropout_fields(module)
        configs.append(getattr(module, "config", None))
    for config in {id(c): c for c in configs if c is not None and hasattr(c, "__dict__")}.values():
        out += _dropout_fields(config)
    return out


def _dropout_fields(obj: Any) -> list[tuple[Any, str, float]]:
    """The float ``*dropout*`` / ``*pdrop*`` attributes of ``obj``, each to be set to 0."""
    return [(obj, key, 0.0) for key, value in vars(obj).items()
            if ("dropout" in key.lower() or "pdrop" in key.lower()) and isinstance(value, float)]


@dataclass(frozen=True)
class Reference:
    """The FP32 run every candidate is compared with."""

    # Loss per batch.
    losses: list[float]
    # Per batch, the FP32 gradient of every trainable parameter (zeros where unused); empty
    # when they were not kept (DeviationMeter(keep_grads=False)).
    grads: list[list[torch.Tensor]]
    # Per batch, float64 squared norm of each parameter's gradient, shape [n_params].
    grad_sq: list[torch.Tensor]


@dataclass(frozen=True)
class Deviation:
    """How far a candidate moved the loss and the gradients from the reference."""

    # Mean over batches of (loss - loss_fp32) / |loss_fp32| (the absolute change where the
    # reference loss is 0). Signed: positive is a higher loss.
    loss_rel_change: float
    # ||g - g_fp32|| / ||g_fp32|| over every trainable parameter, all batches concatenated.
    grad_rel_error: float
    # True when every loss and gradient was finite.
    finite: bool
    # Per parameter, summed over batches: squared norm of the difference, and of the reference
    # (so a subset of the parameters, e.g. one layer's own, gets its error too).
    diff_sq: tuple[float, ...]
    ref_sq: tuple[float, ...]
    # Batches compared.
    n_batches: int
    # ||sum_b (g - g_fp32)|| / ||sum_b g_fp32|| over every trainable parameter (nan: not
    # measured), and per parameter the squared norms of both sums.
    grad_bias: float = math.nan
    bias_sq: tuple[float, ...] = ()
    ref_sum_sq: tuple[float, ...] = ()

    def grad_error_of(self, indices: Sequence[int]) -> float | None:
        """The gradient error over the parameters at ``indices`` (None when there are none)."""
        if not indices:
            return None
        return relative(math.fsum(self.diff_sq[i] for i in indices),
                        math.fsum(self.ref_sq[i] for i in indices))

    def grad_bias_of(self, indices: Sequence[int]) -> float | None:
        """The gradient bias over the parameters at ``indices`` (None when there are none or
        the bias was not measured)."""
        if not indices or not self.bias_sq:
            return None
        return relative(math.fsum(self.bias_sq[i] for i in indices),
                        math.fsum(self.ref_sum_sq[i] for i in indices))


class DeviationMeter:
    """Measures candidates against FP32 on fixed batches, on one private model.

    ``model`` must be a private copy in FP32 (see :func:`prepare_for_measurement`), ``batches``
    already on its device; ``loss_fn(model, batch)`` returns a scalar tensor. The FP32
    reference is computed once, on first use.

    ``keep_grads=False``: the reference keeps its losses and gradient norms but not the
    gradients themselves (one model's worth per batch) until a comparison needs them, when
    they are computed again (the same seeds, so the same values): a profile whose estimates
    never lead to an exact comparison never holds them.

    ``per_batch=True`` (implies ``keep_grads=False``): no comparison holds the reference's
    gradients of every batch either; each batch's are computed beside the candidate's and
    dropped after it, so one batch's are alive at a time instead of all of them, at the cost
    of one more FP32 forward and backward per batch per comparison. An fp16 candidate's part
    of the bias sum is then read in a second backward, once the first has shown the scale does
    not overflow, rather than held while an overflow may still void it. The same numbers.

    ``spill=True`` (implies ``keep_grads``): the reference's gradients are kept, but outside the
    device's memory (:class:`autoprec._util.Spilled`: a temporary file beside a CPU model, host
    memory beside an accelerator's), each written as autograd finishes it and read back when
    the candidate's gradient of the same parameter arrives: no set of them is held, and none
    is computed again. The bias's denominator is summed as they arrive, as ``per_batch`` sums
    it, and a comparison's bias sum is kept outside memory the same way (an fp16 candidate's
    part of it read in a second backward at the scale that did not overflow, every batch's).
    The same numbers.
    """

    def __init__(self, model: nn.Module, batches: Sequence[Any],
                 loss_fn: Callable[[nn.Module, Any], torch.Tensor], *, seed: int = 0,
                 keep_grads: bool = True, per_batch: bool = False, spill: bool = False):
        if per_batch and spill:
            raise ValueError("DeviationMeter: per_batch computes the reference's gradients again "
                             "per comparison, spill keeps them outside memory; pick one.")
        self.model = model
        self.keep_grads = (keep_grads or spill) and not per_batch
        self.per_batch, self.spill = per_batch, spill
        self.batches = list(batches)
        if not self.batches:
            raise ValueError("Measuring numerics needs at least one batch; got none.")
        self.loss_fn = loss_fn
        self.seed = seed
        for name, p in model.named_parameters():
            if p.is_floating_point() and p.dtype != torch.float32:
                raise ValueError(f"Parameter `{name}` is {p.dtype}, but candidates are compared "
                                 "with an FP32 reference with FP32 master weights (as autoprec "
                                 "trains); build the model in FP32 (model.float()).")
        # FSDP2: the shards hold the values; autograd sees the unsharded parameters
        self._leaf = shards.unsharded(model) if shards.is_sharded(model) else {}
        self.shards = [p for p in model.parameters() if p.requires_grad]
        self.params = [self._leaf.get(id(p), p) for p in self.shards]
        # under FSDP2, each rank keeps its shards' part of the reference's gradients and of
        # the bias sums (None: one process keeps them whole)
        self._parts = self.shards if self._leaf else None
        if not self.params:
            raise ValueError(f"{type(model).__name__} has no parameter with requires_grad=True, "
                             "so there are no gradients to compare; unfreeze the parameters.")
        self._reference: Reference | None = None
        # per parameter, the squared norm of the reference gradients summed over the batches
        # (the bias's denominator; computed on the first comparison that measures the bias)
        self._ref_sum_sq: list[float] | None = None
        # 16-bit GEMMs the device has no units for compute by FP32 emulation: the same values
        # (runtime.fp8.emulating), at FP32's speed rather than ~120x slower on a Zen 3
        device = next((p.device for p in self.params), torch.device("cpu"))
        self.emulated = slow_16bit_dtypes(device)

    def index_of(self, params) -> list[int]:
        """Positions of ``params`` among the compared parameters (for Deviation.grad_error_of)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        leaves = (self.leaf(p) for p in params)
        return [index[id(p)] for p in leaves if id(p) in index]

    def leaf(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor autograd sees for parameter ``p`` (its unsharded one under FSDP2)."""
        return self._leaf.get(id(p), p)

    # ---------------------------------------------------------------- the reference
    def reference(self, *, around: Callable[[int], Any] | None = None) -> Reference:
        """The FP32 run (computed on the first call; later calls return it). ``around(b)``
        gives a context manager to run batch ``b``'s forward in (probes watching it)."""
        if self._reference is None:
            self._reference = self._run_reference(around, self.keep_grads)
        return self._reference

    def _reference_grads(self) -> Reference:
        """The reference with its gradients (run again when they were not kept)."""
        ref = self.reference()
        if not ref.grads:
            self._reference = ref = self._run_reference(None, keep=True)
        return ref

    def _batch_grads(self, b: int) -> list[torch.Tensor]:
        """The reference's gradients on batch ``b`` alone, computed again (per_batch); on a
        model FSDP2 shards, this rank's part of each, kept as autograd finishes it."""
        with _fp32(self.model), torch.random.fork_rng(devices=_rng_devices(self.model)):
            torch.manual_seed(self.seed + b)
            loss = self._loss(self.batches[b])
            if self._parts is None:
                return _grads(loss, self.params)
            out: list = [None] * len(self.params)

            def keep(i: int, g: torch.Tensor) -> None:
                out[i] = shards.part(g, self._parts[i])

            _as_they_arrive(loss, self.params, keep)
            return [torch.zeros_like(shards.local(s), dtype=torch.float32) if g is None else g
                    for g, s in zip(out, self._parts)]

    def _summed_reference_sq(self, ref: Reference) -> list[float]:
        if self._ref_sum_sq is None:
            total = None
            for g in ref.grads:
                total = _accumulate(total, g)  # this rank's part, as kept
            self._ref_sum_sq = self._across(_sq_norms(total)).tolist()
        return self._ref_sum_sq

    def _run_reference(self, around: Callable[[int], Any] | None, keep: bool) -> Reference:
        losses, grads, grad_sq = [], [], []
        # per_batch: the bias's denominator is summed now, as the gradients arrive (later no
        # comparison has every batch's gradients to sum)
        summed: Any = Spilled(len(self.params)) if self.spill else [] if self.per_batch else None
        with _fp32(self.model):
            for b, batch in enumerate(self.batches):
                ctx = around(b) if around is not None else contextlib.nullcontext()
                with torch.random.fork_rng(devices=_rng_devices(self.model)), ctx:
                    torch.manual_seed(self.seed + b)
                    loss = self._loss(batch)
                if keep and self.spill:  # each written out as it arrives
                    kept = Spilled(len(self.params))
                    sq, finite, summed = _differences(loss, self.params, None, total=summed,
                                                      parts=self._parts, keep=kept.put)
                    grads.append(kept)
                elif keep:
                    g = _grads(loss, self.params)
                    sq, finite = _sq_norms(g), all_finite(g)
                    grads.append(self._kept(g))
                    del g
                else:  # only their norms: each gradient dropped as soon as it is read
                    sq, finite, summed = _differences(loss, self.params, None, total=summed,
                                                      parts=self._parts)
                value = float(loss.detach())
                if not math.isfinite(value) or not finite:
                    what = f"loss is {value}" if not math.isfinite(value) else \
                        "gradients are not finite"
                    raise ValueError(f"The FP32 reference {what} on calibration batch {b}; every "
                                     "error is measured against a finite FP32 run, so fix the "
                                     "model or the batch first.")
                losses.append(value)
                grad_sq.append(sq)
        if summed:
            self._ref_sum_sq = self._across(_sq_norms(summed)).tolist()
        return Reference(losses=losses, grads=grads, grad_sq=grad_sq)

    @contextlib.contextmanager
    def kept_outside(self) -> Iterator[None]:
        """The reference's kept gradients wait outside device memory meanwhile (a training step
        timed on the same model needs the room), and are back after with the same values."""
        ref = self._reference
        if ref is None or not ref.grads or self.spill:
            yield
            return
        with spilled(ref.grads):
            yield

    # ---------------------------------------------------------------- a candidate
    def compare(self, policy: Policy, *, after_forward: Callable[[int], None] | None = None,
                bias: bool = False) -> Deviation:
        """Run every batch under ``policy`` and compare with the reference.
        ``after_forward(b)`` is called after batch ``b``'s forward (to read probes); ``bias``
        also measures the gradient bias (one more gradient-sized buffer while it runs)."""
        ref = self.reference() if self.per_batch else self._reference_grads()
        scale = policy.loss_scaling.init_scale if policy.needs_loss_scaling else 1.0
        changes: list[float] = []
        diff_sq = torch.zeros(len(self.params), dtype=torch.float64,
                              device=ref.grad_sq[0].device)
        finite = True
        # the bias sum: kept outside memory beside a spilled reference
        total: Any = Spilled(len(self.params)) if self.spill and bias else None
        # holding every batch's reference, the policy stays on for the whole run; per batch,
        # it comes off while each batch's reference is computed again
        with self._under(policy) if ref.grads else contextlib.nullcontext():
            for b, batch in enumerate(self.batches):
                grads = ref.grads[b] if ref.grads else self._batch_grads(b)
                with contextlib.nullcontext() if ref.grads else self._under(policy):
                    with torch.random.fork_rng(devices=_rng_devices(self.model)):
                        torch.manual_seed(self.seed + b)
                        loss = self._loss(batch)
                    if after_forward is not None:
                        after_forward(b)
                    value = float(loss.detach())
                    summing = total if total or not bias or isinstance(total, Spilled) else []
                    sq, ok, total = _differences(loss, self.params, grads, scale=scale,
                                                 total=summing,
                                                 hold=not (self.per_batch or self.spill),
                                                 parts=self._parts)
                    sq = self._across(sq)  # the differences of this rank's parts
                del grads, loss
                r = ref.losses[b]
                changes.append((value - r) / abs(r) if r != 0 else value - r)
                finite = finite and math.isfinite(value) and ok
                diff_sq += sq
        ref_sq = torch.stack(ref.grad_sq).sum(0).tolist()
        diff = diff_sq.tolist()
        dev = Deviation(loss_rel_change=math.fsum(changes) / len(changes),
                        grad_rel_error=relative(math.fsum(diff), math.fsum(ref_sq)),
                        finite=finite, diff_sq=tuple(diff), ref_sq=tuple(ref_sq),
                        n_batches=len(self.batches))
        if not bias:
            return dev
        bias_sq = self._across(_sq_norms(total)).tolist()
        ref_sum_sq = self._summed_reference_sq(ref)
        return dataclasses.replace(
            dev, grad_bias=relative(math.fsum(bias_sq), math.fsum(ref_sum_sq)),
            bias_sq=tuple(bias_sq), ref_sum_sq=tuple(ref_sum_sq))

    def _kept(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """What this rank keeps of whole ``grads`` (a reference's, a sum): its shards' part."""
        if self._parts is None:
            return grads
        return [shards.part(g, s) for g, s in zip(grads, self._parts)]

    def _across(self, sq: torch.Tensor) -> torch.Tensor:
        """Squared norms of this rank's part of each summed gradient -> of the whole."""
        return sq if self._parts is None else shards.summed_each(sq, self._parts)

    @contextlib.contextmanager
    def _under(self, policy: Policy):
        """The model computing as ``policy`` says (emulating the 16-bit GEMMs the device is
        slow at), and as it was afterwards."""
        with warnings.catch_warnings():
            # apply() warns that emulated fp8 is slow; numerics are exact, which is all we use.
            warnings.filterwarnings("ignore", message=r".*can only emulate.*")
            rewrite.apply(self.model, policy, strict=False)
        try:
            with emulating(self.emulated):
                yield
        finally:
            rewrite.remove(self.model)

    def _loss(self, batch: Any) -> torch.Tensor:
        loss = self.loss_fn(self.model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor, got {shape}; reduce it "
                             "(e.g. .mean()).")
        if not loss.requires_grad:
            raise ValueError("The loss does not require grad, so there are no gradients to "
                             "compare; do not compute it under torch.no_grad().")
        return loss.reshape(())


@contextlib.contextmanager
def _fp32(model: nn.Module):
    rewrite.apply(model, Policy(default=Format.FP32), strict=False)
    try:
        yield
    finally:
        rewrite.remove(model)


def _rng_devices(model: nn.Module) -> list:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def _grads(loss: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """FP32 gradients of ``loss`` (zeros where unused), all at once."""
    with refuse_reentrant():
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.to(torch.float32)
            for g, p in zip(grads, params)]


def writable(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``grads``, each a tensor of its own that can be changed in place: autograd may hand one
    tensor to several parameters (``a + b``: changing it for one would change what the others
    read), a view of a tensor used elsewhere, or an expanded one (stride 0: no element of its
    own to write); those are copied, the rest returned as they are (a copy of a
    billion-parameter model's gradients costs seconds in page faults)."""
    seen: set[int] = set()
    out = []
    for g in grads:
        if g.data_ptr() in seen or g._base is not None or not g.is_contiguous():
            g = g.clone(memory_format=torch.contiguous_format)
        seen.add(g.data_ptr())
        out.append(g)
    return out


def _differences(loss: torch.Tensor, params: list[torch.Tensor],
                 ref: list[torch.Tensor] | None, *, scale: float = 1.0,
                 total: list | None = None, hold: bool = True,
                 parts: Sequence[torch.Tensor] | None = None,
                 keep: Callable[[int, torch.Tensor], None] | None = None
                 ) -> tuple[torch.Tensor, bool, list | None]:
    """This batch's gradients of ``loss`` minus the reference's ``ref`` (None: the gradients
    themselves): each difference's squared norm (float64, per parameter), whether the
    gradients were finite, and ``total`` with the differences added (``[]``: the first batch,
    the sum starts; None: no sum).

    Each gradient is read as autograd finishes it and dropped (or kept as its part of the
    sum): no whole set of this batch's gradients is held (``autograd.grad`` returns them all
    at once, at the end of the backward). ``scale > 1`` (fp16) back-propagates ``loss *
    scale`` and unscales each gradient, halving the scale and reading again while a gradient
    is not finite (GradScaler's back-off), down to 1; a non-finite loss is not retried: no
    scale can fix it. A later batch's part of a sum is then held until the backward is known
    finite (an overflow voids it); ``hold=False`` reads it in a second backward at the scale
    that did not overflow instead (the same gradients: a backward is deterministic here).
    ``parts``: the shards of a model FSDP2 shards, one per parameter: the sum keeps only this
    rank's part of each difference (:func:`autoprec.measure.shards.part`), and ``ref`` is this
    rank's part of the reference's gradients, so the differences and their norms are of this
    rank's parts (the caller sums the squares over the ranks). ``keep(i, g)``: with no ``ref``
    (a reference's own backward), each gradient as it is read (this rank's part of it, in the
    whole gradient's memory: to write out, not to hold), before the sum adds to it; the scale
    is 1 there, so each is read once."""
    if scale != 1.0 and not bool(torch.isfinite(loss.detach())):
        scale = 1.0
    while True:
        # a spilled sum is added to as the gradients arrive: even the first batch's part is
        # read again once the scale is known not to overflow (an overflow would void it)
        again = not hold and scale != 1.0 and (bool(total) or isinstance(total, Spilled))
        reading = _Reading(params, ref, scale, None if again else total, parts=parts,
                           keep=keep)
        scaled = loss * scale if scale != 1.0 else loss
        _as_they_arrive(scaled, params, reading.read, retain_graph=reading.may_retry)
        if not reading.overflowed:
            break
        del reading  # an overflowed reading is not kept while the next one runs
        scale = max(1.0, scale / 2)
    sq, finite, summed = reading.finish()
    if again:  # this scale does not overflow: the sum read as the gradients arrive
        adding = _Reading(params, ref, scale, total, retry=False, parts=parts)
        _as_they_arrive(scaled, params, adding.read)
        summed = adding.finish()[2]
    return sq, finite, summed


class _Reading:
    """One backward's gradients, read as they arrive (see :func:`_differences`)."""

    def __init__(self, params: list[torch.Tensor], ref: list[torch.Tensor] | None,
                 scale: float, total: list | None, *, retry: bool = True,
                 parts: Sequence[torch.Tensor] | None = None,
                 keep: Callable[[int, torch.Tensor], None] | None = None):
        self.params, self.ref, self.scale, self.parts = params, ref, scale, parts
        self.keep = keep
        # a sharded model's reference is kept in parts: so is each difference
        self.may_retry = retry and scale > 1.0  # a gradient that overflows voids this reading
        self.overflowed = False
        self.finite = True
        self.norms: list[torch.Tensor | None] = [None] * len(params)
        self.summed = None if total is None else total if isinstance(total, Spilled) else \
            (total or [None] * len(params))
        # a later batch's part of the sum waits while an overflow may still void the reading
        self.held = self.may_retry and bool(total)
        self.waiting: dict[int, torch.Tensor] = {}

    def read(self, i: int, g: torch.Tensor) -> None:
        if self.overflowed:
            return
        ok = all_finite([g])
        if self.may_retry and not ok:
            self.overflowed = True
            self.waiting.clear()
            return
        self.finite = self.finite and ok
        if self.scale != 1.0:
            g = g.div_(self.scale)  # the parameter's own .grad: in place (it obeys its layout)
        if self.parts is not None and self.ref is not None:
            # in the whole gradient's memory (ours to change): copied where it is kept
            g = shards.part_view(g, self.parts[i])
        d = g if self.ref is None else g.sub_(self.ref[i])
        self.norms[i] = torch._foreach_norm([d])[0]
        if self.keep is not None:
            self.keep(i, d if self.parts is None else shards.part_view(d, self.parts[i]))
        if self.summed is None:
            return
        if self.parts is not None and self.ref is None:
            d = shards.part_view(d, self.parts[i])
        if self.held:
            self.waiting[i] = self._own(d)
        else:
            self._add(i, d)

    def _own(self, d: torch.Tensor) -> torch.Tensor:
        """``d`` to keep: a sharded model's part copied out of the whole gradient's memory,
        which would otherwise stay with it (a sum written out as it comes needs no copy)."""
        return d if self.parts is None else shards.own(d)

    def _add(self, i: int, d: torch.Tensor) -> None:
        if isinstance(self.summed, Spilled):
            self.summed.add(i, d)
        elif self.summed[i] is None:
            self.summed[i] = self._own(d)
        else:
            self.summed[i].add_(d)

    def finish(self) -> tuple[torch.Tensor, bool, list | None]:
        for i, n in enumerate(self.norms):
            if n is None:  # unused by this loss: its gradient is zero
                self.read(i, torch.zeros_like(self.params[i], dtype=torch.float32))
        for i, d in self.waiting.items():
            self._add(i, d)
        return torch.stack(self.norms).to(torch.float64).square(), self.finite, self.summed


def _as_they_arrive(loss: torch.Tensor, params: list[torch.Tensor],
                    read: Callable[[int, torch.Tensor], None], *,
                    retain_graph: bool = False) -> None:
    """Back-propagate ``loss``, handing ``read(i, g)`` each parameter's FP32 gradient as
    autograd finishes it (its own tensor, to change or keep), holding none of them after."""
    def take(i: int, p: torch.Tensor) -> None:
        g, p.grad = p.grad, None
        read(i, g.to(torch.float32))

    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    hooks = [p.register_post_accumulate_grad_hook(partial(take, i))
             for i, p in enumerate(params)]
    try:
        with refuse_reentrant():
            torch.autograd.backward(loss, inputs=params, retain_graph=retain_graph)
    finally:
        for h in hooks:
            h.remove()
        for p, g in zip(params, saved):
            p.grad = g


def _accumulate(total: list[torch.Tensor] | None,
                grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``total + grads`` element by element: a copy of ``grads`` the first time (they may be
    kept, or changed in place later), in place after: one extra set of gradient-sized tensors
    for a sum over the batches (what the bias needs)."""
    if total is None:
        return [g.clone() for g in grads]
    torch._foreach_add_(total, grads)
    return total


def _sq_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm of each tensor, float64, shape [len(grads)].

    One fused ``_foreach_norm`` in FP32 rather than a float64 copy of every gradient: the
    copies cost more than the forward and backward on a 22M-parameter model, and a norm's
    relative rounding (~1e-7) is far below any error worth reporting. A norm is exactly 0
    only for an exactly zero tensor, so FP32 against itself still gives exactly 0.
    """
    if not grads:
        return torch.zeros(0, dtype=torch.float64)
    if isinstance(grads, Spilled):  # read back one at a time
        return torch.stack([torch._foreach_norm([g])[0] for g in grads]).to(torch.float64).square()
    return torch.stack(torch._foreach_norm(grads)).to(torch.float64).square()


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every value of every tensor is finite (one fused norm in the common case)."""
    if not tensors:
        return True
    # Finite norms mean finite tensors. A non-finite norm may also come from FP32 overflow of
    # a finite tensor's norm (values ~1e19), so that case is checked exactly.
    if bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors))).all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def relative(diff_sq: float, ref_sq: float) -> float:
    """sqrt(diff_sq / ref_sq): 0 for no difference, inf against a zero reference, nan for a
    non-finite difference."""
    if math.isnan(diff_sq):
        return math.nan
    if diff_sq == 0.0:
        return 0.0
    if ref_sq == 0.0:
        return math.inf
    return math.sqrt(diff_sq / ref_sq)
