"""Speed of each layer in each format, measured on this device.

:func:`measure_layers` runs the model once with hooks that capture each named module's real
inputs; then each module is timed *alone* at those shapes, forward + backward, inside a
precision region of each format (the same regions a policy installs), with its floating
outputs cast back to FP32 (its neighbour may be FP32, so the cast-out is part of the layer's
price). The formats of a module are the candidates of one timing :class:`Comparison`
(:mod:`autoprec.measure.timer`): interleaved rounds, the minimum of short repeats per round,
the 20% quantile over rounds, and each format's ratio to fp32 with its interval.

The result type, :class:`LayerTime`, is shared with the cost model
(:mod:`autoprec.costmodel`), which prices layers for a device that is not present.

A format the device only emulates (FP8 on CPU and on CUDA below sm_89) is flagged
``emulated`` and is never reported faster than FP32: ``seconds`` (what decisions use) is
max(own time, FP32 time); ``raw_seconds`` keeps what was measured or modeled.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from autoprec._util import call_model, check_keys, device_of, model_state, tensors
from autoprec.formats import FORMAT_ORDER, Format, Support
from autoprec.host import supported_formats
from autoprec.measure.options import TimingOptions, with_keywords
from autoprec.measure.timer import Clock, Comparison
from autoprec.policy import Interval, Policy
from autoprec.runtime import calls, rewrite

__all__ = ["LayerTime", "measure_layers", "MEASURED", "MODEL_PREFIX"]

MEASURED = "measured"
MODEL_PREFIX = "model:"
# A format this many times slower than fp32 on a layer stops being timed: more rounds would
# only refine how slow (fp16 on CPUs without FP16 matmul units); it is never chosen for speed.
_CLEARLY_SLOWER = 8.0


# ============================================================================ result type
@dataclass(frozen=True)
class LayerTime:
    """Seconds one layer takes for forward + backward in one format, and how we know."""

    # Module name as in model.named_modules() ('' is the root module).
    fqn: str
    # The format the layer ran (or was priced) in.
    format: Format
    # Seconds of forward + backward (incl. casts in and out) per forward of the model: the
    # timer's robust estimate (20% quantile of per-round minima), what search uses. For an
    # emulated format max(raw_seconds, fp32 seconds), so emulation never looks faster than
    # FP32. inf when the layer failed in this format (see `error`).
    seconds: float
    # What was measured or modeled for this format, before the emulation floor.
    raw_seconds: float
    # Interquartile range / median of the per-round minima (0 for a model, nan with one
    # round): how noisy the measurement was.
    spread: float = 0.0
    # True where the device cannot run this format natively (numerics exact, speed is not).
    emulated: bool = False
    # "measured", or "model:<target>" for a cost-model estimate such as "model:h100".
    source: str = MEASURED
    # Why the number is what it is: emulation, a shape FP8 cannot take, a time budget, ...
    note: str = ""
    # The error text when the layer raised in this format (then seconds is inf); else None.
    error: str | None = None
    # Timing rounds behind the estimate (0 for a model or an error).
    repeats: int = 0
    # This format's time / fp32's on this layer, with its 95% interval (None for a model).
    vs_fp32: Interval | None = None

    def __post_init__(self):
        object.__setattr__(self, "format",
                           Format.parse(self.format, where=f"for layer `{self.fqn}`"))
        if self.source != MEASURED and not self.source.startswith(MODEL_PREFIX):
            raise ValueError(f"LayerTime source {self.source!r} for layer `{self.fqn}` must be "
                             f"'{MEASURED}' or '{MODEL_PREFIX}<target>' (e.g. 'model:h100').")
        if self.error is None and not (self.seconds >= 0 and math.isfinite(self.seconds)):
            raise ValueError(f"LayerTime for layer `{self.fqn}` in {self.format} has seconds="
                             f"{self.seconds!r}; it must be finite and >= 0 unless `error` "
                             "says why the layer could not run.")

    @property
    def ok(self) -> bool:
        """True when the layer ran (or was priced) in this format."""
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types; non-finite floats (inf for errors, nan spread) become None."""
        d = dataclasses.asdict(self)
        d["format"] = self.format.value
        for key in ("seconds", "raw_seconds", "spread"):
            if not math.isfinite(d[key]):
                d[key] = None
        d["vs_fp32"] = None if self.vs_fp32 is None else self.vs_fp32.to_dict()
        if d["vs_fp32"] is not None and not math.isfinite(self.vs_fp32.high):
            d["vs_fp32"]["high"] = None
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerTime:
        d = dict(d)
        if "fmt" in d:  # profiles written before the rename
            d["format"] = d.pop("fmt")
        names = [f.name for f in dataclasses.fields(cls)]
        check_keys(d, "LayerTime", known=names, required=("fqn", "format", "seconds"))
        for key, missing in (("seconds", math.inf), ("raw_seconds", math.inf),
                             ("spread", math.nan)):
            if d.get(key) is None:
                d[key] = missing
        vs = d.get("vs_fp32")
        if vs is not None:
            d["vs_fp32"] = Interval.from_value({**vs, "high": vs.get("high") or math.inf})
        return cls(**d)



# ============================================================================ measuring
class _Inputs:
    """What one module was called with during the capture run (first call), and how often."""

    def __init__(self, args: tuple, kwargs: dict):
        self.args = args
        self.kwargs = kwargs
        self.calls = 1

    def leaves(self) -> list[torch.Tensor]:
        """Captured tensors that need a gradient (zeroed between repetitions)."""
        return [t for t in tensors((self.args, self.kwargs)) if t.requires_grad]


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

    def hook(fqn: str, module, args, kwargs):
        if fqn in captured:
            captured[fqn].calls += 1
        else:
            captured[fqn] = _Inputs(tree_map(_clone_input, args), tree_map(_clone_input, kwargs))

    handles = [modules[f].register_forward_pre_hook(
        lambda m, a, k, f=f: hook(f, m, a, k), with_kwargs=True) for f in fqns]
    try:
        # Grad mode on, so that `requires_grad` of each captured input says whether the real
        # training step computes its gradient.
        with torch.enable_grad():
            out = loss_fn(model, batch) if loss_fn is not None else call_model(model, batch)
        del out
    finally:
        for h in handles:
            h.remove()
    return captured


class _FP8Probe(TorchFunctionMode):
    """Which of a module's matmul-like calls FP8 would not take, and why (the registry's
    answer, as the router applies it)."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.blocked: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        call = calls.lookup(func)
        if call is not None:
            try:
                form = calls.matmul_form(call, args, kwargs)
                for product in call.products(args, kwargs, out):
                    self.total += 1
                    p = calls.product_of(form[0].shape, form[1].shape) if form else product
                    reason = calls.fp8_blocker(call, p, routable=form is not None)
                    if reason:
                        self.blocked.append(reason)
            except Exception:  # noqa: BLE001 - a probe must never break the forward it watches
                pass
        return out


def _fp8_note(module: nn.Module, inputs: _Inputs) -> str:
    """Why an fp8 measurement of this module is partly bf16 work ('' when it is not)."""
    probe = _FP8Probe()
    with torch.no_grad(), probe:
        module(*inputs.args, **inputs.kwargs)
    if not probe.blocked:
        return ""
    return (f"{len(probe.blocked)} of {probe.total} matmuls do not run in fp8 "
            f"({probe.blocked[0]})")


class _Holder(nn.Module):
    """A module with the timed layer as its only child, ``layer``."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        return self.layer(*args, **kwargs)


class _FormatRun:
    """One repetition of a module's forward + backward in one format, as a timer candidate:
    the region installed, the gradients cleared, the time taken, the region removed. A format
    the module raises in records the error and reports an infinite time."""

    def __init__(self, module: nn.Module, inputs: _Inputs, fmt: Format, clock: Clock,
                 grads: Callable[[int, torch.Tensor], torch.Tensor]):
        # timed as the child of a holder, so that an engine that swaps the module (torchao's
        # Float8Linear for an fp8 nn.Linear) is what gets timed, and the module is put back
        self.module = _Holder(module)
        self.inputs, self.fmt, self.clock = inputs, fmt, clock
        self.grads = grads
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.leaves = inputs.leaves()
        self.error: str | None = None

    def _step(self) -> None:
        out = self.module(*self.inputs.args, **self.inputs.kwargs)
        # Cast-out included: the neighbour of this layer may compute in FP32.
        outs = [t.float() for t in tensors(out) if t.is_floating_point() and t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [self.grads(i, t) for i, t in enumerate(outs)])

    def __call__(self) -> float:
        if self.error is not None:
            return math.inf
        for t in (*self.params, *self.leaves):
            t.grad = None
        with warnings.catch_warnings():
            # apply() warns that fp8 is emulated here; the LayerTime says so in `emulated`.
            warnings.filterwarnings("ignore", message=".*can only emulate.*")
            rewrite.apply(self.module, Policy(default=self.fmt), strict=False)
        try:
            return self.clock.time(self._step)
        except Exception as e:  # noqa: BLE001 - one format failing must not stop the others
            self.error = f"{type(e).__name__}: {e}".strip()
            return math.inf
        finally:
            rewrite.remove(self.module)


def _time_module(module: nn.Module, inputs: _Inputs, formats: Sequence[Format], clock: Clock,
                 options: TimingOptions) -> tuple[Comparison, dict[Format, _FormatRun],
                                                  dict[Format, str], dict[Format, float]]:
    """Time ``formats`` of one module against fp32 in interleaved rounds; drop a format that
    fails, is far slower than fp32, or exceeds its time budget (with a note why). A format
    already far slower in its warm-up run is not timed further: its warm-up time (the last
    returned dict) is its time, an answer more rounds would not change."""
    warmup, rounds, budget_s, seed = options.warmup, options.repeats, options.budget_s, \
        options.seed
    gen = torch.Generator(device=clock.device).manual_seed(seed)
    fixed: dict[tuple, torch.Tensor] = {}

    def grads(i: int, t: torch.Tensor) -> torch.Tensor:
        # Fixed per output index and shape, so every format sees the same incoming gradient.
        key = (i, tuple(t.shape))
        if key not in fixed:
            fixed[key] = torch.randn(t.shape, generator=gen, device=t.device,
                                     dtype=torch.float32)
        return fixed[key]

    runs = {f: _FormatRun(module, inputs, f, clock, grads) for f in formats}
    timing = Comparison(runs, Format.FP32, repeats=2, seed=seed)
    notes: dict[Format, str] = dict.fromkeys(formats, "")
    warm: dict[Format, float] = {}
    for _ in range(warmup):
        warm = {f: run() for f, run in runs.items()}
    slow = _slow_in_warmup(warm, runs)
    for fmt, ratio in slow.items():
        notes[fmt] = f"{ratio:.0f}x slower than fp32 in its warm-up run; not timed further"
        timing.drop(fmt)
    for r in range(rounds):
        timing.run(1)
        for fmt in [f for f in timing.active if f is not Format.FP32]:
            if runs[fmt].error is not None:
                timing.drop(fmt)
                continue
            slower = timing.seconds(fmt) / timing.seconds(Format.FP32)
            if r + 1 < rounds and slower > _CLEARLY_SLOWER:
                notes[fmt] = f"{slower:.0f}x slower than fp32 after {r + 1} round(s); not repeated"
                timing.drop(fmt)
            elif r + 1 < rounds and budget_s is not None and timing.spent[fmt] > budget_s:
                notes[fmt] = (f"stopped after {r + 1} round(s): {timing.spent[fmt]:.1f} s spent "
                              f"of a {budget_s:g} s budget")
                timing.drop(fmt)
        if runs[Format.FP32].error is not None:
            break
        if r + 1 < rounds and budget_s is not None and timing.spent[Format.FP32] > budget_s:
            # the reference itself is over budget: every format stops with it
            for fmt in timing.active:
                notes[fmt] = notes[fmt] or (f"stopped after {r + 1} round(s): fp32 spent "
                                            f"{timing.spent[Format.FP32]:.1f} s of a "
                                            f"{budget_s:g} s budget")
            break
    return timing, runs, notes, {f: warm[f] for f in slow}


def _slow_in_warmup(warm: Mapping[Format, float], runs: Mapping[Format, _FormatRun]
                    ) -> dict[Format, float]:
    """The formats over ``_CLEARLY_SLOWER`` x fp32's time in the warm-up, with their ratio
    (fp32's first run is the slower one as a rule, so the ratio errs low)."""
    t32 = warm.get(Format.FP32, math.nan)
    if not (math.isfinite(t32) and t32 > 0):
        return {}
    return {f: t / t32 for f, t in warm.items()
            if f is not Format.FP32 and runs[f].error is None and math.isfinite(t)
            and t > _CLEARLY_SLOWER * t32}


def measure_layers(model: nn.Module, example_batch: Any, fqns: Iterable[str],
                   formats: Iterable[Format | str] = FORMAT_ORDER, *,
                   options: TimingOptions | None = None,
                   **keywords: Any) -> dict[str, dict[Format, LayerTime]]:
    """Time each module in ``fqns`` alone, forward + backward, in each format, at the shapes it
    sees when ``model`` runs on ``example_batch``.

    ``example_batch`` is what the model takes: a dict (``model(**b)``), a tuple or list
    (``model(*b)``) or a tensor; ``loss_fn(model, batch)``, when given, is called instead for
    the one capture run. ``options`` (a :class:`~autoprec.measure.options.TimingOptions`) or
    its fields as keywords (``warmup=``, ``repeats=``, ``loss_fn=``, ``train=``,
    ``budget_s=``, ``seed=``; a keyword overrides the field) say how. Each module's formats
    are timed against fp32 in ``repeats``
    interleaved rounds (two repetitions each, the minimum kept) after ``warmup`` untimed ones;
    see :mod:`autoprec.measure.timer`. ``train`` runs the model in training mode (dropout as
    in a training step). ``budget_s`` caps the seconds spent on one (module, format): a format
    the device runs very slowly stops early with a note, as does one more than 8x slower than
    fp32. ``seed`` fixes the random output gradients.

    A module called several times per forward is timed on its first call and its time
    multiplied by the number of calls. A format a module raises in gives a LayerTime with the
    error text and ``seconds=inf``. The model is left as it was: no regions or hooks, the same
    parameters, buffers, gradients and training flags, and the caller's RNG state.
    """
    opts = with_keywords(options, TimingOptions, keywords, "measure_layers")
    if not isinstance(model, nn.Module):
        raise TypeError(f"measure_layers(model, ...) needs an nn.Module, got {type(model).__name__}.")
    fqns = list(dict.fromkeys(fqns))
    fmts = list(dict.fromkeys(Format.parse(f) for f in formats))
    if not fqns or not fmts:
        raise ValueError("measure_layers needs at least one fqn and one format; got "
                         f"fqns={fqns!r}, formats={fmts!r}.")
    if opts.warmup < 0 or opts.repeats < 1:
        raise ValueError(f"measure_layers needs warmup >= 0 and repeats >= 1, got "
                         f"warmup={opts.warmup}, repeats={opts.repeats}.")
    modules = dict(model.named_modules())
    _check_measurable(model, modules, fqns)
    device = device_of(model, example_batch)
    bench = _Bench(supported_formats(device), Clock(device), opts)
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    results: dict[str, dict[Format, LayerTime]] = {}
    with model_state(model, weights=False), torch.random.fork_rng(devices=rng_devices):
        for p in model.parameters():
            p.grad = None
        model.train(opts.train)
        torch.manual_seed(opts.seed)
        captured = _capture_inputs(model, example_batch, fqns, opts.loss_fn)
        for fqn in fqns:
            results[fqn] = _measure_module(fqn, modules[fqn], captured.get(fqn), fmts, bench)
    return results


@dataclass(frozen=True)
class _Bench:
    """What every module of one measure_layers call is timed with."""

    support: Mapping[Format, Support]
    clock: Clock
    options: TimingOptions


def _check_measurable(model: nn.Module, modules: dict[str, nn.Module], fqns: list[str]) -> None:
    missing = [f for f in fqns if f not in modules]
    if missing:
        close = difflib.get_close_matches(missing[0], list(modules), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"{type(model).__name__} has no module {missing[0]!r}"
                         f"{' (and ' + str(len(missing) - 1) + ' more)' if len(missing) > 1 else ''}"
                         f".{hint} Names are as in model.named_modules().")
    # Regions of a policy already applied would nest inside or around the format being timed
    # (the innermost wins), so every format would measure as that policy's.
    applied = [n or "(root)" for n, m in modules.items() if rewrite.applied_formats(m)]
    if applied:
        raise ValueError(f"{type(model).__name__} has an autoprec policy applied (at "
                         f"{applied[0]}); measure_layers times each format itself. Call "
                         "autoprec.remove(model) first.")


def _measure_module(fqn: str, module: nn.Module, inputs: _Inputs | None, fmts: list[Format],
                    bench: _Bench) -> dict[Format, LayerTime]:
    support, clock = bench.support, bench.clock
    emulated = {f for f in fmts if support[f] is Support.EMULATED}
    if inputs is None:
        msg = (f"module `{fqn}` was not called when the model ran on the example batch, so "
               "it has no inputs to time it with")
        return {f: LayerTime(fqn, f, math.inf, math.inf, math.nan, f in emulated, MEASURED,
                             "", msg) for f in fmts}
    runnable = [f for f in fmts if support[f] is not Support.UNSUPPORTED]
    # fp32 is the reference of every comparison, and the floor of emulated formats
    timed = [Format.FP32, *[f for f in runnable if f is not Format.FP32]]
    timing, runs, notes, warm = _time_module(module, inputs, timed, clock, bench.options)
    fp8_note = ""
    if any(f.is_scaled for f in runnable):
        try:
            fp8_note = _fp8_note(module, inputs)
        except Exception:  # noqa: BLE001 - the fp8 run itself reports the error
            pass
    fp32_ok = runs[Format.FP32].error is None
    fp32_s = timing.seconds(Format.FP32) * inputs.calls if fp32_ok else None
    out: dict[Format, LayerTime] = {}
    for fmt in fmts:
        note = [n for n in (notes.get(fmt, ""), fp8_note if fmt.is_scaled else "") if n]
        if inputs.calls > 1:
            note.append(f"called {inputs.calls}x per forward: one call timed, times "
                        f"{inputs.calls}")
        if fmt in emulated:
            note.append(f"{fmt} emulated on {clock.device.type}: not representative; reported "
                        "as max(own, fp32) time")
        error = (f"{clock.device} cannot run {fmt}" if fmt not in runnable
                 else runs[fmt].error)
        if error is None and fmt in warm:  # far slower in its one warm-up run
            raw, spread, rounds, ratio = warm[fmt] * inputs.calls, math.nan, 1, None
        elif error is not None or not timing.rounds_of(fmt):
            out[fmt] = LayerTime(fqn, fmt, math.inf, math.inf, math.nan, fmt in emulated,
                                 MEASURED, "; ".join(note), error or "no successful run", 0)
            continue
        else:
            raw, spread = timing.seconds(fmt) * inputs.calls, timing.spread(fmt)
            rounds, ratio = timing.rounds_of(fmt), timing.ratio(fmt) if fp32_ok else None
        seconds = max(raw, fp32_s) if fmt in emulated and fp32_s is not None else raw
        out[fmt] = LayerTime(fqn, fmt, seconds, raw, spread, fmt in emulated, MEASURED,
                             "; ".join(note), None, rounds, ratio)
    return out
