"""Speed of each layer in each format: measured on this device, or priced by a cost model.

Two sources, one result type (:class:`LayerTime`, seconds of forward + backward per layer):

- **Measured** (:func:`measure_layers`): the model runs once with hooks that capture each
  named module's real inputs; then each module is timed *alone* at those shapes, forward +
  backward, inside a precision region of each format (the same ``apply``/``remove`` the
  policy uses), with its floating outputs cast back to FP32 (its neighbour may be FP32, so
  the cast-out is part of the layer's price). Formats are interleaved within each round of
  repetitions so that load from other processes on a shared machine hits every format alike.
  :func:`measure_step` times whole training steps, for a policy applied to the whole model.
- **Modeled** (:func:`estimate_layer`, :func:`estimate_step`): a roofline model of a device
  that is not present (``DEVICES``: h100, h200, a100, cpu-amx), so a CPU machine can tune
  for a GPU. Each matmul is priced at max(compute, memory) for its forward and its two
  backward products (dgrad, wgrad), plus the casts into and out of the format, FP8's amax
  reductions and transposed copies, and a fixed cost per kernel. That is why small layers
  gain nothing from FP8 (torchao measured a 1024x2048x1024 linear at 0.80x of BF16 on H100,
  4096x8192x16384 at 1.39x) and the model reproduces the crossover.

A format the device only emulates (FP8 on CPU and on CUDA below sm_89) is flagged
``emulated`` and is never reported faster than FP32: ``seconds`` (what decisions use) is
max(own time, FP32 time); ``raw_seconds`` keeps what was measured or modeled.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from autoprec.formats import FORMAT_ORDER, Format, Support, supported_formats
from autoprec.fp8 import fp8_shape_supported
from autoprec.policy import Policy
from autoprec.rewrite import applied_formats, apply, remove
from autoprec.task import default_loss, optimizer_step

__all__ = [
    "LayerTime",
    "DeviceSpec",
    "DEVICES",
    "measure_layers",
    "measure_step",
    "estimate_layer",
    "estimate_layers",
    "estimate_step",
]

MEASURED = "measured"
_MODEL_PREFIX = "model:"


# ============================================================================ result type
@dataclass(frozen=True)
class LayerTime:
    """Seconds one layer takes for forward + backward in one format, and how we know."""

    # Module name as in model.named_modules() ('' is the root module).
    fqn: str
    # The format the layer ran (or was priced) in.
    fmt: Format
    # Median seconds of forward + backward (incl. casts in and out) per forward of the model:
    # what search uses. For an emulated format max(raw_seconds, fp32 seconds), so emulation
    # never looks faster than FP32. inf when the layer failed in this format (see `error`).
    seconds: float
    # What was measured or modeled for this format, before the emulation floor.
    raw_seconds: float
    # Interquartile range / median of the repetitions (0 for a model, nan with one repetition):
    # how far to trust a difference between two formats.
    spread: float = 0.0
    # True where the device cannot run this format natively (numerics exact, speed is not).
    emulated: bool = False
    # "measured", or "model:<target>" for a cost-model estimate such as "model:h100".
    source: str = MEASURED
    # Why the number is what it is: emulation, a shape FP8 cannot take, a time budget, ...
    note: str = ""
    # The error text when the layer raised in this format (then seconds is inf); else None.
    error: str | None = None
    # Timed repetitions behind the median (0 for a model or an error).
    repeats: int = 0

    def __post_init__(self):
        object.__setattr__(self, "fmt", Format.parse(self.fmt, where=f"for layer `{self.fqn}`"))
        if self.source != MEASURED and not self.source.startswith(_MODEL_PREFIX):
            raise ValueError(f"LayerTime source {self.source!r} for layer `{self.fqn}` must be "
                             f"'{MEASURED}' or '{_MODEL_PREFIX}<target>' (e.g. 'model:h100').")
        if self.error is None and not (self.seconds >= 0 and math.isfinite(self.seconds)):
            raise ValueError(f"LayerTime for layer `{self.fqn}` in {self.fmt} has seconds="
                             f"{self.seconds!r}; it must be finite and >= 0 unless `error` "
                             "says why the layer could not run.")

    @property
    def ok(self) -> bool:
        """True when the layer ran (or was priced) in this format."""
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types; non-finite floats (inf for errors, nan spread) become None."""
        d = dataclasses.asdict(self)
        d["fmt"] = self.fmt.value
        for key in ("seconds", "raw_seconds", "spread"):
            if not math.isfinite(d[key]):
                d[key] = None
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerTime:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"Unknown keys {unknown} in a LayerTime record; expected {names}.")
        d = dict(d)
        for key, missing in (("seconds", math.inf), ("raw_seconds", math.inf),
                             ("spread", math.nan)):
            if d.get(key) is None:
                d[key] = missing
        return cls(**d)


# ============================================================================ measuring
def _device_of(model: nn.Module, batch: Any) -> torch.device:
    for p in model.parameters():
        return p.device
    for t in _tensors(batch):
        return t.device
    return torch.device("cpu")


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in nested tuples, lists and mappings (HF ModelOutput is a mapping)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _call_model(model: nn.Module, batch: Any, loss_fn: Callable | None) -> Any:
    if loss_fn is not None:
        return loss_fn(model, batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


class _Inputs:
    """What one module was called with during the capture run (first call), and how often."""

    def __init__(self, args: tuple, kwargs: dict):
        self.args = args
        self.kwargs = kwargs
        self.calls = 1

    def leaves(self) -> list[torch.Tensor]:
        """Captured tensors that need a gradient (zeroed between repetitions)."""
        return [t for t in _tensors((self.args, self.kwargs)) if t.requires_grad]


def _clone_input(value: Any) -> Any:
    # A floating tensor gets a gradient iff it had one in the real forward: hidden states do
    # (their dgrad is real work), masks and token ids do not (computing one would be extra).
    if isinstance(value, torch.Tensor):
        clone = value.detach().clone()
        if value.requires_grad and clone.is_floating_point():
            clone.requires_grad_(True)
        return clone
    return value


def _capture_inputs(model: nn.Module, batch: Any, fqns: Sequence[str],
                    loss_fn: Callable | None) -> dict[str, _Inputs]:
    modules = dict(model.named_modules())
    captured: dict[str, _Inputs] = {}
    handles = []

    def hook_for(fqn: str):
        def hook(module, args, kwargs):
            if fqn in captured:
                captured[fqn].calls += 1
            else:
                captured[fqn] = _Inputs(tree_map(_clone_input, args), tree_map(_clone_input, kwargs))
        return hook

    try:
        for fqn in fqns:
            handles.append(modules[fqn].register_forward_pre_hook(hook_for(fqn), with_kwargs=True))
        # Grad mode on, so that `requires_grad` of each captured input says whether the real
        # training step computes its gradient.
        with torch.enable_grad():
            out = _call_model(model, batch, loss_fn)
        del out
    finally:
        for h in handles:
            h.remove()
    return captured


class _MatmulShapes(TorchFunctionMode):
    """Records the (M, K, N) of each matmul-like call and counts convolutions, as the FP8
    router will see them, so an fp8 result can say which products fell back to bf16."""

    def __init__(self):
        super().__init__()
        self.mkn: list[tuple[int, int, int]] = []
        self.convs = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            self._record(func, args, kwargs)
        except Exception:  # noqa: BLE001 - a probe must never break the forward it watches
            pass
        return func(*args, **kwargs)

    def _record(self, func, args, kwargs):
        if func in (F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
                    F.conv_transpose3d):
            self.convs += 1
            return
        if func is F.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            if x.dim() >= 2:
                self.mkn.append((math.prod(x.shape[:-1]), x.shape[-1], w.shape[0]))
        elif func in (torch.addmm, torch.Tensor.addmm):
            a, b = args[1], args[2]
            self.mkn.append((a.shape[0], a.shape[1], b.shape[1]))
        elif func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
                      torch.Tensor.mm, torch.bmm, torch.Tensor.bmm):
            a, b = args[0], args[1]
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
                    and a.dim() >= 2 and b.dim() >= 2:
                # The same M as autoprec.fp8.fp8_matmul: leading dims fold into M only when
                # the second operand is a plain 2-D matrix.
                m = math.prod(a.shape[:-1]) if b.dim() == 2 else a.shape[-2]
                self.mkn.append((m, a.shape[-1], b.shape[-1]))


def _fp8_note(module: nn.Module, inputs: _Inputs) -> str:
    """Why an fp8 measurement of this module is partly bf16 work ('' when it is not)."""
    probe = _MatmulShapes()
    with torch.no_grad(), probe:
        module(*inputs.args, **inputs.kwargs)
    notes = []
    bad = [(m, k, n) for m, k, n in probe.mkn if not fp8_shape_supported(m, k, n)[0]]
    if bad:
        reason = fp8_shape_supported(*bad[0])[1]
        notes.append(f"{len(bad)} of {len(probe.mkn)} matmuls cannot take the fp8 kernel "
                     f"({reason})")
    if probe.convs:
        notes.append(f"{probe.convs} convolution(s) run bf16: PyTorch has no FP8 conv kernels")
    return "; ".join(notes)


def _float_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]


class _Timer:
    """Wall time on CPU; CUDA events on the GPU (kernels are asynchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, started) -> Callable[[], float]:
        """A function giving the elapsed seconds (CUDA: after a synchronize)."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            return lambda: started.elapsed_time(end) / 1e3
        elapsed = time.perf_counter() - started
        return lambda: elapsed

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _quiet_apply(module: nn.Module, fmt: Format) -> None:
    with warnings.catch_warnings():
        # apply() warns that fp8 is emulated here; the LayerTime says so in `emulated`.
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        apply(module, Policy(default=fmt))


def _median_spread(samples: list[float]) -> tuple[float, float]:
    med = statistics.median(samples)
    if len(samples) < 2 or med <= 0:
        return med, math.nan
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return med, (q[2] - q[0]) / med


# A format this many times slower than fp32 on a layer stops being repeated.
_CLEARLY_SLOWER = 8.0


def _time_module(fqn: str, module: nn.Module, inputs: _Inputs, formats: Sequence[Format],
                 timer: _Timer, *, warmup: int, repeats: int, budget_s: float | None,
                 seed: int) -> dict[Format, tuple[list[float], str | None, str]]:
    """Per format: the timed samples, the error text (or None), a note."""
    params = [p for p in module.parameters() if p.requires_grad]
    leaves = inputs.leaves()
    grads: dict[tuple, torch.Tensor] = {}
    gen = torch.Generator(device=timer.device).manual_seed(seed)

    def grad_like(i: int, t: torch.Tensor) -> torch.Tensor:
        # Fixed per output index and shape, so every format sees the same incoming gradient.
        key = (i, tuple(t.shape))
        if key not in grads:
            grads[key] = torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32)
        return grads[key]

    def clear_grads():
        for p in params:
            p.grad = None
        for t in leaves:
            t.grad = None

    samples: dict[Format, list[float]] = {f: [] for f in formats}
    warm: dict[Format, list[float]] = {f: [] for f in formats}
    errors: dict[Format, str | None] = dict.fromkeys(formats)
    notes: dict[Format, str] = dict.fromkeys(formats, "")
    spent: dict[Format, float] = dict.fromkeys(formats, 0.0)
    active = list(formats)
    for rnd in range(warmup + repeats):
        pending = []
        for fmt in active:
            clear_grads()
            _quiet_apply(module, fmt)
            try:
                started = timer.start()
                out = module(*inputs.args, **inputs.kwargs)
                # Cast-out included: the neighbour of this layer may compute in FP32.
                outs = [t.float() for t in _float_outputs(out)]
                if outs:
                    torch.autograd.backward(outs, [grad_like(i, t) for i, t in enumerate(outs)])
                pending.append((fmt, timer.stop(started)))
            except Exception as e:  # noqa: BLE001 - one format failing must not stop the run
                errors[fmt] = f"{type(e).__name__}: {e}".strip()
            finally:
                remove(module)
                out = outs = None
        timer.sync()
        for fmt, elapsed in pending:
            t = elapsed()
            spent[fmt] += t
            (warm if rnd < warmup else samples)[fmt].append(t)
        still = []
        for fmt in active:
            if errors[fmt] is not None:
                continue
            last = (samples[fmt] or warm[fmt])[-1]
            if budget_s is not None and rnd + 1 < warmup + repeats and spent[fmt] + last > budget_s:
                runs = len(samples[fmt]) + len(warm[fmt])
                notes[fmt] = (f"stopped after {runs} run(s): {spent[fmt]:.1f} s spent of a "
                              f"{budget_s:g} s budget")
                if not samples[fmt]:
                    samples[fmt] = [warm[fmt][-1]]
                    notes[fmt] += "; the time is a warm-up run"
                continue
            ref = (samples.get(Format.FP32) or warm.get(Format.FP32) or [None])[-1]
            if (rnd >= 1 and fmt is not Format.FP32 and ref and last > _CLEARLY_SLOWER * ref
                    and rnd + 1 < warmup + repeats):
                # Far slower than fp32 (fp16 on CPUs without FP16 matmul units): more runs
                # would only refine how slow; the search will never pick it for speed.
                if not samples[fmt]:
                    samples[fmt] = [last]
                notes[fmt] = (f"{last / ref:.0f}x slower than fp32 after {rnd + 1} runs; "
                              "not repeated")
                continue
            still.append(fmt)
        active = still
        if not active:
            break
    clear_grads()
    return {f: (samples[f], errors[f], notes[f]) for f in formats}


def measure_layers(model: nn.Module, example_batch: Any, fqns: Iterable[str],
                   formats: Iterable[Format | str] = FORMAT_ORDER, *, warmup: int = 2,
                   repeats: int = 7, loss_fn: Callable[[nn.Module, Any], Any] | None = None,
                   train: bool = True, budget_s: float | None = 30.0,
                   seed: int = 0) -> dict[str, dict[Format, LayerTime]]:
    """Time each module in ``fqns`` alone, forward + backward, in each format, at the shapes it
    sees when ``model`` runs on ``example_batch``.

    ``example_batch`` is what the model takes: a dict (``model(**b)``), a tuple or list
    (``model(*b)``) or a tensor; ``loss_fn(model, batch)``, when given, is called instead for
    the one capture run. Each (module, format) gets ``warmup`` untimed and ``repeats`` timed
    runs, formats interleaved in every round; the result is the median and IQR/median.
    ``train`` runs the model in training mode (dropout as in a training step). ``budget_s``
    caps the seconds spent on one (module, format): a format the device runs very slowly
    (FP16 on a CPU without FP16 kernels) stops early with a note. ``seed`` fixes the random
    output gradients.

    A module called several times per forward is timed on its first call and its time
    multiplied by the number of calls. A format a module raises in gives a LayerTime with the
    error text and ``seconds=inf``. The model is left as it was: no regions or hooks, the same
    parameters, buffers, gradients and training flags, and the caller's RNG state.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"measure_layers(model, ...) needs an nn.Module, got {type(model).__name__}.")
    fqns = list(dict.fromkeys(fqns))
    fmts = list(dict.fromkeys(Format.parse(f) for f in formats))
    if not fqns or not fmts:
        raise ValueError("measure_layers needs at least one fqn and one format; got "
                         f"fqns={fqns!r}, formats={fmts!r}.")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"measure_layers needs warmup >= 0 and repeats >= 1, got "
                         f"warmup={warmup}, repeats={repeats}.")
    modules = dict(model.named_modules())
    missing = [f for f in fqns if f not in modules]
    if missing:
        close = difflib.get_close_matches(missing[0], list(modules), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"{type(model).__name__} has no module {missing[0]!r}"
                         f"{' (and ' + str(len(missing) - 1) + ' more)' if len(missing) > 1 else ''}"
                         f".{hint} Names are as in model.named_modules().")
    # Regions of a policy already applied would nest inside or around the format being timed
    # (the innermost wins), so every format would measure as that policy's.
    applied = [n or "(root)" for n, m in modules.items() if applied_formats(m)]
    if applied:
        raise ValueError(f"{type(model).__name__} has an autoprec policy applied (at "
                         f"{applied[0]}); measure_layers times each format itself. Call "
                         "autoprec.remove(model) first, or time the applied policy as a whole "
                         "with measure_step.")
    device = _device_of(model, example_batch)
    support = supported_formats(device)
    emulated = {f for f in fmts if support[f] is Support.EMULATED}
    # The emulation floor needs FP32's time even where the caller did not ask for it.
    timed = ([Format.FP32] if emulated and Format.FP32 not in fmts else []) + fmts
    timer = _Timer(device)

    flags = {m: m.training for m in model.modules()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    old_grads = {p: p.grad for p in model.parameters()}
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    results: dict[str, dict[Format, LayerTime]] = {}
    try:
        for p in model.parameters():
            p.grad = None
        model.train(train)
        with torch.random.fork_rng(devices=rng_devices):
            torch.manual_seed(seed)
            captured = _capture_inputs(model, example_batch, fqns, loss_fn)
            for fqn in fqns:
                results[fqn] = _measure_one(fqn, modules[fqn], captured.get(fqn), fmts, timed,
                                            emulated, support, timer, device, warmup=warmup,
                                            repeats=repeats, budget_s=budget_s, seed=seed)
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for p, g in old_grads.items():
            p.grad = g
        for m, flag in flags.items():
            m.training = flag
    return results


def _measure_one(fqn, module, inputs, fmts, timed, emulated, support, timer, device, *,
                 warmup, repeats, budget_s, seed) -> dict[Format, LayerTime]:
    if inputs is None:
        msg = (f"module `{fqn}` was not called when the model ran on the example batch, so "
               "it has no inputs to time it with")
        return {f: LayerTime(fqn, f, math.inf, math.inf, math.nan, f in emulated, MEASURED,
                             "", msg) for f in fmts}
    fp8_note = ""
    if Format.FP8 in fmts:
        try:
            fp8_note = _fp8_note(module, inputs)
        except Exception:  # noqa: BLE001 - the fp8 run itself will report the error
            fp8_note = ""
    unsupported = {f for f in timed if support[f] is Support.UNSUPPORTED}
    raw = _time_module(fqn, module, inputs, [f for f in timed if f not in unsupported], timer,
                       warmup=warmup, repeats=repeats, budget_s=budget_s, seed=seed)
    for f in unsupported:
        raw[f] = ([], f"{device} cannot run {f}", "")
    fp32_samples, fp32_error, _ = raw[Format.FP32] if Format.FP32 in raw else ([], "n/a", "")
    fp32_median = statistics.median(fp32_samples) * inputs.calls \
        if fp32_samples and fp32_error is None else None
    out: dict[Format, LayerTime] = {}
    for fmt in fmts:
        samples, error, note = raw[fmt]
        notes = [note] if note else []
        if inputs.calls > 1:
            notes.append(f"called {inputs.calls}x per forward: one call timed, times "
                         f"{inputs.calls}")
        if fmt is Format.FP8 and fp8_note:
            notes.append(fp8_note)
        is_emulated = fmt in emulated
        if is_emulated:
            notes.append(f"{fmt} emulated on {device.type}: not representative")
        if error is not None or not samples:
            out[fmt] = LayerTime(fqn, fmt, math.inf, math.inf, math.nan, is_emulated, MEASURED,
                                 "; ".join(notes), error or "no successful run", 0)
            continue
        med, spread = _median_spread(samples)
        med *= inputs.calls
        seconds = med
        if is_emulated:
            if fp32_median is not None:
                seconds = max(med, fp32_median)
                notes[-1] += "; reported as max(own, fp32) time"
            else:
                notes[-1] += "; fp32 failed, so no floor could be applied"
        out[fmt] = LayerTime(fqn, fmt, seconds, med, spread, is_emulated, MEASURED,
                             "; ".join(notes), None, len(samples))
    return out


def measure_step(model: nn.Module, batches: Sequence[Any] | Any,
                 loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None, *,
                 optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer]
                 | None = None, grad_scaler: torch.amp.GradScaler | None = None,
                 warmup: int = 2, repeats: int = 5, seed: int = 0) -> float:
    """Median seconds of one whole training step: forward, backward, optimizer step, zero_grad.

    Times ``model`` as it is (apply a policy first to time that policy). ``batches`` is one
    batch or a sequence of them, used in turn; ``loss_fn(model, batch)`` returns the scalar
    loss (default: the output's ``.loss``). ``optimizer`` is an optimizer over the model's
    parameters, a factory ``params -> optimizer``, or None for AdamW (as Task's default).
    ``grad_scaler`` (e.g. ``policy.grad_scaler(device)``) is used as in fp16 training; the
    caller's scaler is not modified. The model's weights, buffers, gradients, training flags,
    the optimizer's state and the RNG state are restored afterwards.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"measure_step needs warmup >= 0 and repeats >= 1, got "
                         f"warmup={warmup}, repeats={repeats}.")
    if isinstance(batches, (torch.Tensor, Mapping)) or not isinstance(batches, Sequence) \
            or len(batches) == 0:
        batches = [batches]
    loss_fn = loss_fn or default_loss
    params = [p for p in model.parameters() if p.requires_grad]
    if isinstance(optimizer, torch.optim.Optimizer):
        opt, opt_state = optimizer, copy.deepcopy(optimizer.state_dict())
    else:
        opt = optimizer(params) if optimizer is not None else torch.optim.AdamW(params, lr=1e-3)
        opt_state = None
    scaler = copy.deepcopy(grad_scaler) if grad_scaler is not None else None
    device = _device_of(model, batches[0])
    timer = _Timer(device)
    saved = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    old_grads = {p: p.grad for p in model.parameters()}
    flags = {m: m.training for m in model.modules()}
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    times: list[Callable[[], float]] = []
    try:
        model.train()
        opt.zero_grad(set_to_none=True)
        with torch.random.fork_rng(devices=rng_devices):
            torch.manual_seed(seed)
            for i in range(warmup + repeats):
                batch = batches[i % len(batches)]
                started = timer.start()
                loss = loss_fn(model, batch)
                optimizer_step(loss, opt, scaler)
                elapsed = timer.stop(started)
                if i >= warmup:
                    times.append(elapsed)
                loss = None
            timer.sync()
    finally:
        with torch.no_grad():
            for k, v in model.state_dict(keep_vars=True).items():
                v.copy_(saved[k])
        for p, g in old_grads.items():
            p.grad = g
        for m, flag in flags.items():
            m.training = flag
        if opt_state is not None:
            opt.load_state_dict(opt_state)
    return statistics.median(t() for t in times)


# ============================================================================ cost model
@dataclass(frozen=True)
class DeviceSpec:
    """What the roofline model needs to know about a device."""

    # Human-readable name, shown in notes and reports.
    name: str
    # Dense peak matmul FLOP/s per format the device runs natively (no sparsity).
    matmul_flops: Mapping[Format, float]
    # Peak memory bandwidth in bytes/s.
    bandwidth: float
    # How each format runs: NATIVE needs an entry in matmul_flops; EMULATED formats are priced
    # as their emulation (FP32 matmuls plus quantization) and never faster than FP32.
    support: Mapping[Format, Support]
    # Fraction of peak FLOP/s a large GEMM sustains.
    efficiency: float = 0.7
    # Fraction of peak bandwidth a large copy sustains.
    bandwidth_efficiency: float = 0.8
    # Fixed seconds per kernel (launch, prologue, tail): what makes small layers gain nothing.
    launch_s: float = 3e-6

    def __post_init__(self):
        flops = {Format.parse(k, where=f"in DeviceSpec {self.name!r}"): float(v)
                 for k, v in dict(self.matmul_flops).items()}
        support = {Format.parse(k, where=f"in DeviceSpec {self.name!r}"): Support(v)
                   for k, v in dict(self.support).items()}
        object.__setattr__(self, "matmul_flops", flops)
        object.__setattr__(self, "support", support)
        missing = [f.value for f in Format if f not in support]
        if missing:
            raise ValueError(f"DeviceSpec {self.name!r} does not say how it runs "
                             f"{', '.join(missing)}; give support for every format "
                             f"({', '.join(f.value for f in Format)}).")
        if support[Format.FP32] is not Support.NATIVE:
            raise ValueError(f"DeviceSpec {self.name!r} must run fp32 natively: it is the "
                             "reference emulated formats are priced against.")
        for f, s in support.items():
            if s is Support.NATIVE and not flops.get(f, 0) > 0:
                raise ValueError(f"DeviceSpec {self.name!r} runs {f} natively but gives no "
                                 f"positive matmul_flops for it (got {flops.get(f)!r}).")
        for key in ("efficiency", "bandwidth_efficiency"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ValueError(f"DeviceSpec {self.name!r} has {key}={value!r}; it must be in "
                                 "(0, 1].")
        if not self.bandwidth > 0 or self.launch_s < 0:
            raise ValueError(f"DeviceSpec {self.name!r} needs bandwidth > 0 and launch_s >= 0, "
                             f"got bandwidth={self.bandwidth!r}, launch_s={self.launch_s!r}.")


_ALL_NATIVE = {f: Support.NATIVE for f in Format}

DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec(
        name="NVIDIA H100 SXM5 80GB",
        matmul_flops={
            # NVIDIA H100 datasheet: FP32 67 TFLOP/s (CUDA cores). PyTorch leaves TF32 off for
            # matmuls by default (torch.backends.cuda.matmul.allow_tf32 = False).
            Format.FP32: 67e12,
            # Datasheet: BF16 / FP16 Tensor Core 1979 TFLOP/s *with sparsity*, 989 dense.
            Format.BF16: 989e12,
            Format.FP16: 989e12,
            # Datasheet: FP8 Tensor Core 3958 TFLOP/s with sparsity, 1979 dense.
            Format.FP8: 1979e12,
        },
        # Datasheet: HBM3, 3.35 TB/s.
        bandwidth=3.35e12,
        support=_ALL_NATIVE,
        # Measured on an H200 (same SMs): BF16 GEMM 790 of 989 TFLOP/s, copy 4.3 of 4.8 TB/s
        # (docs FIELD.md).
        efficiency=0.8, bandwidth_efficiency=0.9, launch_s=3e-6,
    ),
    "h200": DeviceSpec(
        name="NVIDIA H200 SXM 141GB",
        # NVIDIA H200 datasheet: the H100's compute (FP32 67, BF16/FP16 989, FP8 1979 TFLOP/s
        # dense).
        matmul_flops={Format.FP32: 67e12, Format.BF16: 989e12, Format.FP16: 989e12,
                      Format.FP8: 1979e12},
        # Datasheet: HBM3e, 4.8 TB/s.
        bandwidth=4.8e12,
        support=_ALL_NATIVE,
        # Measured here: BF16 GEMM 790 TFLOP/s (0.80 of peak), copy 4.3 TB/s (0.90).
        efficiency=0.8, bandwidth_efficiency=0.9, launch_s=3e-6,
    ),
    "a100": DeviceSpec(
        name="NVIDIA A100 SXM4 80GB",
        matmul_flops={
            # NVIDIA A100 datasheet: FP32 19.5 TFLOP/s (TF32 off, PyTorch's matmul default).
            Format.FP32: 19.5e12,
            # Datasheet: BF16 / FP16 Tensor Core 312 TFLOP/s dense (624 with sparsity).
            Format.BF16: 312e12,
            Format.FP16: 312e12,
        },
        # Datasheet (80GB SXM): HBM2e, 2,039 GB/s.
        bandwidth=2.039e12,
        # Ampere (sm_80) has no FP8 tensor cores: torch._scaled_mm needs sm_89+.
        support={Format.FP32: Support.NATIVE, Format.BF16: Support.NATIVE,
                 Format.FP16: Support.NATIVE, Format.FP8: Support.EMULATED},
        # Assumed like Hopper: large BF16 GEMMs reach ~0.8 of peak in cuBLAS.
        efficiency=0.8, bandwidth_efficiency=0.9, launch_s=3e-6,
    ),
    "cpu-amx": DeviceSpec(
        name="Intel Xeon, 2 cores, AMX-BF16 (the machine in docs DESIGN.md)",
        matmul_flops={
            # Measured there: 2048x2048 matmul, 2 threads.
            Format.FP32: 0.34e12,
            Format.BF16: 2.0e12,   # AMX tiles
            Format.FP16: 0.30e12,  # AVX512-FP16: slower than FP32
        },
        # An estimate, not a measurement: ~10 GB/s of sustained DRAM bandwidth per core.
        bandwidth=20e9,
        support={Format.FP32: Support.NATIVE, Format.BF16: Support.NATIVE,
                 Format.FP16: Support.NATIVE, Format.FP8: Support.EMULATED},
        # The FLOP/s above are already sustained (measured), not datasheet peaks.
        efficiency=1.0, bandwidth_efficiency=1.0,
        # PyTorch eager dispatch + oneDNN primitive lookup per op on CPU.
        launch_s=10e-6,
    ),
}

# Bytes per element of a matmul operand and of its output, per (natively run) format.
_OPERAND_BYTES = {Format.FP32: 4, Format.BF16: 2, Format.FP16: 2, Format.FP8: 1}
_OUTPUT_BYTES = {Format.FP32: 4, Format.BF16: 2, Format.FP16: 2, Format.FP8: 2}  # fp8 -> bf16
# The dtype activations leave a layer in, per format (fp8 layers output bf16).
_ACTIVATION = {Format.FP32: "fp32", Format.BF16: "bf16", Format.FP16: "fp16", Format.FP8: "bf16"}
_ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_FP32 = 4
# Cast kernels per matmul around a low-precision product: forward A, B in and C out; backward
# grad in, dgrad and wgrad out.
_CASTS_PER_MATMUL = 6


def _spec(target: str | DeviceSpec) -> tuple[str, DeviceSpec]:
    if isinstance(target, DeviceSpec):
        return target.name, target
    key = str(target).strip().lower()
    if key not in DEVICES:
        raise ValueError(f"Unknown cost-model target {target!r}; expected one of "
                         f"{', '.join(DEVICES)} (or pass a DeviceSpec).")
    return key, DEVICES[key]


def _weight_operand(layer: Any, batch: int) -> bool:
    """Whether the second operand of a matmul of this layer is a weight (cast once per step
    from the FP32 master) rather than an activation (only matters with graph edges)."""
    kind = getattr(layer, "kind", "")
    if kind in ("linear", "conv"):
        return True
    return batch == 1 and getattr(layer, "params", 0) > 0


def _matmul_time(b: int, m: int, k: int, n: int, fmt: Format, spec: DeviceSpec) -> float:
    """Forward + dgrad + wgrad of one (batch, M, K, N) product in a native format, roofline."""
    flops = 2.0 * b * m * k * n
    ob, cb = _OPERAND_BYTES[fmt], _OUTPUT_BYTES[fmt]
    # The three products move about the same bytes: two operands in, one result out.
    moved = b * (m * k + k * n) * ob + b * m * n * cb
    one = max(flops / (spec.matmul_flops[fmt] * spec.efficiency),
              moved / (spec.bandwidth * spec.bandwidth_efficiency))
    # torch._scaled_mm takes 2-D operands only: autoprec.fp8 runs one kernel per matrix of a
    # batched (attention) product.
    kernels = 3 * (b if fmt is Format.FP8 and b > 1 else 1)
    return 3 * one + kernels * spec.launch_s


def _cast_time(a: int, w: int, c: int, fmt: Format, spec: DeviceSpec, *,
               quantize: bool) -> float:
    """Casts around one product: operands in (A activation elements, W second-operand
    elements) and result out (C), forward and backward; FP8 also reads each tensor for its
    amax (the dynamic scale) and writes transposed copies for the backward's layouts."""
    bw = spec.bandwidth * spec.bandwidth_efficiency
    if fmt is Format.FP32:
        return 0.0
    elems = a + w + c
    ob = _OPERAND_BYTES[fmt]
    seconds = 2 * elems * (_FP32 + ob) / bw + _CASTS_PER_MATMUL * spec.launch_s
    if quantize:
        # amax of A, W and the incoming gradient (read at FP32), then transposed FP8 copies.
        seconds += (elems * _FP32 + 2 * elems * ob) / bw + 6 * spec.launch_s
    return seconds


def _price(layer: Any, fmt: Format, spec: DeviceSpec, *,
           boundary_casts: bool = True) -> tuple[float, bool, list[str]]:
    """(seconds, emulated, notes) for one layer in one format on ``spec``."""
    bw = spec.bandwidth * spec.bandwidth_efficiency
    matmuls = tuple(getattr(layer, "matmuls", ()) or ())
    kind = getattr(layer, "kind", "")
    notes: list[str] = []
    emulated = False
    total = 0.0
    fallback = 0
    matmul_fp32_bytes = 0
    for b, m, k, n in matmuls:
        matmul_fp32_bytes += _FP32 * b * (m * k + k * n + m * n)
        run = fmt
        if fmt is Format.FP8:
            if kind == "conv":
                run = Format.BF16  # autoprec runs convolutions of an fp8 region in bf16
            elif not fp8_shape_supported(m, k, n)[0]:
                run, fallback = Format.BF16, fallback + 1
        weight = _weight_operand(layer, b)
        a_el, w_el, c_el = b * m * k, b * k * n, b * m * n
        if not boundary_casts:
            # Activations arrive and leave in the layer's dtype; the graph edges price the
            # casts between layers. Weights are still cast from their FP32 masters.
            a_el = c_el = 0
            if not weight:
                w_el = 0
        if run is Format.FP8 and spec.support[Format.FP8] is Support.EMULATED:
            # Emulation: quantize -> dequantize (read FP32, write FP8, read FP8, write FP32 per
            # element of A, W, grad) around FP32 matmuls.
            emulated = True
            q_el = b * (m * k + k * n + m * n)
            total += _matmul_time(b, m, k, n, Format.FP32, spec)
            total += (q_el * (_FP32 + 2 * (_FP32 + 1))) / bw + 9 * spec.launch_s
        else:
            total += _matmul_time(b, m, k, n, run, spec)
            total += _cast_time(a_el, w_el, c_el, run, spec, quantize=run is Format.FP8)
    if fmt is Format.FP8 and kind == "conv" and matmuls:
        notes.append("convolutions run bf16 in an fp8 region: PyTorch has no FP8 conv kernels")
    if fallback:
        bad = next(s for s in matmuls if not fp8_shape_supported(*s[1:])[0])
        notes.append(f"{fallback} of {len(matmuls)} matmuls priced as bf16: "
                     f"{fp8_shape_supported(*bad[1:])[1]}")
    # Elementwise work (softmax, masks, norms, lookups): memory-bound, and autocast keeps it
    # in FP32 in every format, so the format changes little. Backward moves about twice the
    # forward's bytes.
    rest = max(0, int(getattr(layer, "bytes", 0)) - matmul_fp32_bytes)
    if rest or not matmuls:
        total += 3 * rest / bw + 3 * spec.launch_s
    if not matmuls:
        notes.append(f"memory-bound {kind or 'layer'}: the format changes little")
    return total, emulated, notes


def estimate_layer(layer: Any, fmt: Format | str, target: str | DeviceSpec) -> LayerTime:
    """Roofline estimate of forward + backward seconds of ``layer`` in ``fmt`` on ``target``.

    ``layer`` is an :class:`autoprec.graph.Layer` or anything with ``fqn``, ``kind``,
    ``matmuls`` ((batch, M, K, N) per forward), ``bytes`` (read + written per forward at FP32)
    and ``params``. ``target`` is a key of ``DEVICES`` (h100, h200, a100, cpu-amx) or a
    :class:`DeviceSpec`. Each matmul costs 3x its forward (dgrad, wgrad) at max(compute,
    memory), plus casts in and out of the format (and FP8's amax reductions and transposed
    copies) and a fixed cost per kernel. FP8 products the kernel cannot take run, and are
    priced, as bf16 (see ``note``). An emulated format costs its emulation and never less than
    fp32 or bf16.
    """
    fmt = Format.parse(fmt, where=f"for layer `{getattr(layer, 'fqn', '?')}`")
    key, spec = _spec(target)
    fqn = getattr(layer, "fqn", "")
    if spec.support[fmt] is Support.UNSUPPORTED:
        return LayerTime(fqn=fqn, fmt=fmt, seconds=math.inf, raw_seconds=math.inf, spread=0.0,
                         source=f"{_MODEL_PREFIX}{key}", error=f"{key} cannot run {fmt}")
    (raw, seconds), emulated, notes = _estimate(layer, fmt, spec, key)
    return LayerTime(fqn=fqn, fmt=fmt, seconds=seconds, raw_seconds=raw, spread=0.0,
                     emulated=emulated, source=f"{_MODEL_PREFIX}{key}", note="; ".join(notes))


def _estimate(layer: Any, fmt: Format, spec: DeviceSpec, key: str, *,
              boundary_casts: bool = True) -> tuple[tuple[float, float], bool, list[str]]:
    """((raw, floored) seconds, emulated, notes)."""
    raw, emulated, notes = _price(layer, fmt, spec, boundary_casts=boundary_casts)
    seconds = raw
    if emulated:
        # Emulated FP8 is bf16-or-fp32 work plus quantization: it cannot beat either.
        floor = max(_price(layer, f, spec, boundary_casts=boundary_casts)[0]
                    for f in (Format.FP32, Format.BF16) if spec.support[f] is Support.NATIVE)
        seconds = max(raw, floor)
        notes.append(f"{fmt} emulated on {key}: not representative; priced as never faster "
                     "than fp32 or bf16")
    return (raw, seconds), emulated, notes


def estimate_layers(layers: Iterable[Any], formats: Iterable[Format | str],
                    target: str | DeviceSpec) -> dict[str, dict[Format, LayerTime]]:
    """:func:`estimate_layer` for every layer and format, shaped like :func:`measure_layers`."""
    fmts = [Format.parse(f) for f in formats]
    return {layer.fqn: {f: estimate_layer(layer, f, target) for f in fmts} for layer in layers}


def _output_elements(layer: Any) -> int:
    """Elements of the tensor a layer passes on: its last product's result, or for a layer
    without matmuls half its FP32 traffic (input and output of equal size)."""
    matmuls = tuple(getattr(layer, "matmuls", ()) or ())
    if matmuls:
        b, m, _, n = matmuls[-1]
        return b * m * n
    return int(getattr(layer, "bytes", 0)) // (2 * _FP32)


def estimate_step(layers: Iterable[Any], assignment: Mapping[str, Format | str],
                  target: str | DeviceSpec, *,
                  edges: Iterable[tuple[str, str]] | None = None,
                  default: Format | str | None = None) -> float:
    """Modeled seconds of forward + backward of the whole set of ``layers`` under
    ``assignment`` (fqn -> format) on ``target``.

    Without ``edges``, the sum of :func:`estimate_layer` (each layer pays its own casts in and
    out, as :func:`measure_layers` measures it: an upper bound). With ``edges`` ((producer,
    consumer) fqn pairs, e.g. ``LayerGraph.edges``), layers keep their activations in their own
    dtype and each edge between layers of different activation dtypes pays one cast, forward
    and backward; an fp8 layer outputs bf16, so fp8 -> bf16 costs nothing. ``default`` is the
    format of layers the assignment does not name; None makes a missing layer an error.
    """
    key, spec = _spec(target)
    layers = list(layers)
    default_fmt = Format.parse(default, where="for `default`") if default is not None else None
    fmts: dict[str, Format] = {}
    for layer in layers:
        if layer.fqn in assignment:
            fmts[layer.fqn] = Format.parse(assignment[layer.fqn], where=f"for layer `{layer.fqn}`")
        elif default_fmt is not None:
            fmts[layer.fqn] = default_fmt
    missing = [layer.fqn for layer in layers if layer.fqn not in fmts]
    if missing:
        raise ValueError(f"The assignment gives no format for {len(missing)} layer(s), e.g. "
                         f"{', '.join(map(repr, missing[:3]))}; add them or pass default=.")
    by_fqn = {layer.fqn: layer for layer in layers}
    unknown = [f for f in assignment if f not in by_fqn]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(by_fqn), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"The assignment names {unknown[0]!r}, which is not one of the layers."
                         f"{hint}")
    boundary = edges is None
    total = sum(_estimate(layer, fmts[layer.fqn], spec, key, boundary_casts=boundary)[0][1]
                for layer in layers)
    if edges is not None:
        bw = spec.bandwidth * spec.bandwidth_efficiency
        for src, dst in edges:
            if src not in by_fqn or dst not in by_fqn:
                bad = src if src not in by_fqn else dst
                raise ValueError(f"Edge ({src!r}, {dst!r}) names {bad!r}, which is not one of "
                                 "the layers.")
            a, b = _ACTIVATION[fmts[src]], _ACTIVATION[fmts[dst]]
            if a == b:
                continue
            elems = _output_elements(by_fqn[src])
            # Forward cast of the activation, backward cast of its gradient.
            per = elems * (_ACTIVATION_BYTES[a] + _ACTIVATION_BYTES[b])
            total += 2 * per / bw + 2 * spec.launch_s
    return total

