"""profile(): each layer's numerical sensitivity and speed in each format, as one table.

    measure/capture.py     -> which layers compute, their shapes and FLOPs
    measure/sensitivity.py -> error of each layer x format, that layer alone switched
    measure/timing.py      -> forward+backward seconds of each layer x format, measured on
    costmodel.py              the device, or priced by the cost model for a `target`

A :class:`Profile` is plain data: saved to and loaded from JSON, printed as a table, and read
by the search (its integer program treats it as additive) and by ``autoprec show``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec._util import ProgressBar, check_schema, log, read_json, text_table, write_json
from autoprec.costmodel import estimate_layer, estimate_step
from autoprec.formats import FORMAT_ORDER, Format, device_name, expand_formats
from autoprec.measure.capture import Layer, LayerGraph, capture
from autoprec.measure.sensitivity import LayerSensitivity, measure_sensitivity
from autoprec.measure.timing import LayerTime, measure_layers
from autoprec.runtime.calls import COMPUTING_KINDS

__all__ = ["Profile", "LayerProfile", "profile", "PROFILE_SCHEMA"]

# Version 2: LayerProfile's `errors` became `sensitivity`, LayerTime's `fmt` became `format`,
# layers carry the registered call of each matmul. Version 1 files are read and migrated.
PROFILE_SCHEMA = 2


@dataclass
class LayerProfile:
    """One layer's row of the profile."""

    # the layer as captured: fqn, kind, matmul shapes and their calls, FLOPs, bytes, params
    layer: Layer
    # format -> error with this layer alone switched (fp32 is the reference, absent)
    sensitivity: dict[Format, LayerSensitivity] = field(default_factory=dict)
    # format -> forward+backward seconds of the layer's own work
    times: dict[Format, LayerTime] = field(default_factory=dict)
    # format -> why its numerics were not measured: it cannot win on this device (emulated,
    # far slower than fp32, or fp8 the kernel does not take), so the search never offers it
    skipped: dict[Format, str] = field(default_factory=dict)

    @property
    def fqn(self) -> str:
        return self.layer.fqn

    @property
    def fp8_blocker(self) -> str:
        """Why fp8 would not run this layer's matmuls as FP8 ("" when it would): the call
        registry's reason for the first product it does not take."""
        if not self.layer.matmuls:
            return "no matmul to run in FP8"
        return next((r for r in self.layer.fp8_blockers() if r), "")

    def to_dict(self) -> dict:
        return {"layer": self.layer.to_dict(),
                "sensitivity": {f.value: e.to_dict() for f, e in self.sensitivity.items()},
                "times": {f.value: t.to_dict() for f, t in self.times.items()},
                "skipped": {f.value: why for f, why in self.skipped.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerProfile:
        sens = d["sensitivity"] if "sensitivity" in d else d["errors"]  # version 1: "errors"
        return cls(layer=Layer.from_dict(d["layer"]),
                   sensitivity={Format(k): LayerSensitivity.from_dict(v) for k, v in sens.items()},
                   times={Format(k): LayerTime.from_dict(v) for k, v in d["times"].items()},
                   skipped={Format(k): str(v) for k, v in d.get("skipped", {}).items()})


@dataclass
class Profile:
    """Per-layer sensitivity and speed of one task's model in each format."""

    # the task's name and the model's class name
    task_name: str
    model_name: str
    # where the numbers were measured, e.g. "cpu (AMD EPYC ...)" or "cuda (NVIDIA H200)"
    device: str
    # None: times measured on `device`; else the cost model's device ("h100", ...)
    target: str | None
    # which tracer captured the layers ("export", "symbolic_trace", "hooks")
    capture_method: str
    formats: tuple[Format, ...]
    # the layers that compute (whose format changes their arithmetic), in execution order
    layers: list[LayerProfile]
    # (producer, consumer) edges between layers
    edges: list[tuple[str, str]] = field(default_factory=list)
    # layers captured but not searched (embeddings, norms), with their kind
    fixed: dict[str, str] = field(default_factory=dict)
    # seconds the profile took
    elapsed: float = 0.0
    torch_version: str = str(torch.__version__)

    def __post_init__(self):
        self._index = {lp.fqn: lp for lp in self.layers}

    # ------------------------------------------------------------ queries
    def layer(self, fqn: str) -> LayerProfile:
        try:
            return self._index[fqn]
        except KeyError:
            raise KeyError(f"Layer {fqn!r} is not in the profile of {self.model_name}; profiled "
                           f"layers: {', '.join(lp.fqn for lp in self.layers[:8])}, ...") from None

    def loss_change(self, fqn: str, fmt: Format) -> float:
        """Relative loss change with only this layer in ``fmt`` (0 for fp32; inf when the
        run was non-finite; nan when not measured)."""
        return self._measured(fqn, fmt, "loss_rel_change")

    def grad_error(self, fqn: str, fmt: Format) -> float:
        """Gradient error with only this layer in ``fmt``, like :meth:`loss_change`."""
        return self._measured(fqn, fmt, "grad_rel_error")

    def _measured(self, fqn: str, fmt: Format, what: str) -> float:
        if fmt is Format.FP32:
            return 0.0
        err = self.layer(fqn).sensitivity.get(fmt)
        if err is None:
            return math.nan
        return getattr(err, what) if err.finite else math.inf

    def seconds(self, fqn: str, fmt: Format) -> float:
        t = self.layer(fqn).times.get(fmt)
        return math.nan if t is None else t.seconds

    def allows(self, fqn: str, fmt: Format) -> bool:
        """Whether the search should offer ``fmt`` for this layer: its numerics stayed finite,
        and for fp8, its matmuls can really run as FP8 (otherwise fp8 = bf16 here)."""
        if fmt is Format.FP32:
            return True
        lp = self.layer(fqn)
        if fmt in lp.skipped or (fmt.is_fp8 and lp.fp8_blocker):
            return False
        err = lp.sensitivity.get(fmt)
        return err is not None and err.finite and math.isfinite(self.seconds(fqn, fmt))

    def layer_seconds(self, assignment: Mapping[str, Format]) -> float:
        """Sum of the profiled per-layer seconds under ``assignment`` (fqn -> format)."""
        return math.fsum(self.seconds(lp.fqn, assignment[lp.fqn]) for lp in self.layers)

    def estimate_step(self, assignment: Mapping[str, Format | str], target: str) -> float:
        """Cost-model seconds of the layers' work under ``assignment``, with casts priced on
        the graph's edges between layers whose activations differ in dtype."""
        layers = [lp.layer for lp in self.layers]
        names = {lp.fqn for lp in self.layers}
        edges = [(a, b) for a, b in self.edges if a in names and b in names]
        return estimate_step(layers, {k: Format.parse(v) for k, v in assignment.items()},
                             target, edges=edges)

    def reason(self, fqn: str, fmt: Format, *, max_loss_change: float = 0.01) -> str:
        """The measured reason this layer is not in ``fmt`` (for `autoprec show`)."""
        lp = self.layer(fqn)
        if fmt.is_fp8 and lp.fp8_blocker:
            return lp.fp8_blocker
        if fmt in lp.skipped:
            return lp.skipped[fmt]
        err = lp.sensitivity.get(fmt)
        name = fmt.label
        if err is not None and not err.finite:
            return f"{name} non-finite (loss or gradients overflowed)"
        lc = self.loss_change(fqn, fmt)
        if math.isfinite(lc) and lc > max_loss_change:
            return f"{name} alone changes the loss by {lc:+.2%} (> {max_loss_change:.2%})"
        t = lp.times.get(fmt)
        t16 = lp.times.get(Format.BF16)
        if t is not None and t.emulated:
            return f"{name} only emulated on {self.device}: never faster than fp32 here"
        if t is not None and t16 is not None and fmt.is_fp8 and t.seconds >= t16.seconds:
            return (f"{name} not faster than bf16 here ({_us(t.seconds)} vs "
                    f"{_us(t16.seconds)}): too small to gain")
        parts = []
        if math.isfinite(lc):
            parts.append(f"loss {lc:+.3%}")
        ge = self.grad_error(fqn, fmt)
        if math.isfinite(ge):
            parts.append(f"grad err {ge:.3g}")
        if t is not None:
            parts.append(f"{t.seconds * 1e6:.0f} us")
        return f"{name}: " + ", ".join(parts) + " (the search preferred another format overall)"

    def fp8_reason(self, fqn: str, chosen: Format, *, max_loss_change: float = 0.01) -> str:
        """For ``autoprec show``: why this layer is in ``chosen`` and, for a layer not in fp8,
        why not in its fastest profiled FP8 recipe; for an fp8 layer, each profiled recipe's
        speed against bf16 and its loss change, the chosen one first."""
        recipes = [f for f in self.formats if f.is_fp8]
        if not recipes:
            return "fp8 not profiled"
        if not chosen.is_fp8:
            fastest = min(recipes, key=lambda f: _or_inf(self.seconds(fqn, f)))
            return self.reason(fqn, fastest, max_loss_change=max_loss_change)
        order = [chosen, *(f for f in recipes if f is not chosen)]
        return "; ".join(("chosen: " if f is chosen else "") + self._recipe_summary(fqn, f)
                         for f in order)

    def _recipe_summary(self, fqn: str, fmt: Format) -> str:
        lp = self.layer(fqn)
        why = lp.fp8_blocker or lp.skipped.get(fmt, "")
        if why:
            return f"{fmt.recipe} skipped ({why.removeprefix(fmt.label + ' ')})"
        t, t16 = lp.times.get(fmt), lp.times.get(Format.BF16)
        speed = (f"{t16.seconds / t.seconds:.2f}x bf16" if t is not None and t16 is not None
                 and t.seconds > 0 else "speed ?")
        lc = self.loss_change(fqn, fmt)
        loss = "non-finite" if math.isinf(lc) else f"loss {lc:+.3%}"
        return f"{fmt.recipe} {speed}, {loss}"

    # ------------------------------------------------------------ output
    def table(self) -> str:
        fmts = [f for f in FORMAT_ORDER if f in self.formats]
        low = [f for f in fmts if f is not Format.FP32]
        header = ["layer", "kind", "shape (M,K,N)", "GFLOP", *[f"{f} err" for f in low],
                  *[f"{f} us" for f in fmts], "verdict"]
        rows = []
        for lp in self.layers:
            L = lp.layer
            shape = ",".join(str(x) for x in L.matmuls[0][1:]) if L.matmuls else "-"
            if len(L.matmuls) > 1:
                shape += f" +{len(L.matmuls) - 1}"
            row = [L.fqn, L.kind, shape, f"{L.flops / 1e9:.3f}"]
            for f in low:
                e = lp.sensitivity.get(f)
                row.append(("skip" if f in lp.skipped else "-") if e is None else
                           ("NONFINITE" if not e.finite else f"{e.loss_rel_change:+.1e}"))
            for f in fmts:
                t = lp.times.get(f)
                row.append("-" if t is None else f"{t.seconds * 1e6:.0f}" + ("*" if t.emulated
                                                                             else ""))
            rows.append([*row, self._verdict(lp, fmts)])
        src = f"cost model {self.target}" if self.target else f"measured on {self.device}"
        return (text_table(header, rows) + "\nerr: relative loss change with the layer alone in "
                f"the format; us: fwd+bwd microseconds ({src}); * emulated (never counted as "
                "fast); skip: not measured, the format cannot win here (see `skipped`).")

    def _verdict(self, lp: LayerProfile, fmts) -> str:
        """Fastest format whose solo loss change stays under 1%."""
        best, best_t = Format.FP32, lp.times.get(Format.FP32)
        for f in fmts:
            if f is Format.FP32 or not self.allows(lp.fqn, f):
                continue
            t = lp.times.get(f)
            if t is None or t.emulated or abs(self.loss_change(lp.fqn, f)) > 0.01:
                continue
            if best_t is None or t.seconds < best_t.seconds:
                best, best_t = f, t
        flags = [f"{f} non-finite" for f, e in lp.sensitivity.items() if not e.finite]
        return f"{best}" + (f" ({'; '.join(flags)})" if flags else "")

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        return {"autoprec_profile": PROFILE_SCHEMA, "task_name": self.task_name,
                "model_name": self.model_name, "device": self.device, "target": self.target,
                "capture_method": self.capture_method,
                "formats": [f.value for f in self.formats],
                "layers": [lp.to_dict() for lp in self.layers],
                "edges": [list(e) for e in self.edges], "fixed": dict(self.fixed),
                "elapsed": self.elapsed, "torch_version": self.torch_version}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Profile:
        check_schema(d, "autoprec_profile", PROFILE_SCHEMA, "profile", readable=(1,))
        try:
            return cls(task_name=d["task_name"], model_name=d["model_name"],
                       device=d["device"], target=d["target"],
                       capture_method=d["capture_method"],
                       formats=tuple(Format(f) for f in d["formats"]),
                       layers=[LayerProfile.from_dict(x) for x in d["layers"]],
                       edges=[tuple(e) for e in d.get("edges", [])], fixed=d.get("fixed", {}),
                       elapsed=d.get("elapsed", 0.0), torch_version=d.get("torch_version", ""))
        except (KeyError, TypeError) as e:
            raise ValueError(f"a malformed profile record ({type(e).__name__}: {e})") from None

    def save(self, path) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path) -> Profile:
        data = read_json(path, "profile")
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path} is not a valid autoprec profile: {e}") from None


def _device_name(device: torch.device) -> str:
    return f"{device.type} ({device_name(device)})"


def profile(task, formats: Sequence[Format | str] = ("fp32", "bf16", "fp16", "fp8"), *,
            target: str | None = None, batches: Sequence[Any] | None = None,
            layers: Sequence[str] | None = None, n_batches: int = 1, progress: bool = True,
            repeats: int = 8, budget_s: float = 5.0) -> Profile:
    """Measure every layer of ``task``'s model that computes, in every format.

    ``target=None`` times layers on the task's device; ``target="h100"`` (etc.) prices them
    with the cost model instead (numerics are still measured here). ``batches`` defaults to the
    task's first ``n_batches`` calibration batches. ``layers`` restricts the profile to these
    fqns. ``repeats`` and ``budget_s``: timing rounds per layer and seconds per layer x format.
    """
    for name, value in (("n_batches", n_batches), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"profile({name}=...) must be a positive integer, got {value!r}.")
    if target is not None:
        from autoprec.costmodel import resolve_target

        resolve_target(target)  # an unknown target fails here, before any measurement
    t_start = time.perf_counter()
    fmts = expand_formats(formats, where="in profile(formats=...)")
    if Format.FP32 not in fmts:
        fmts = (Format.FP32, *fmts)
    model = task.build_model()
    # what the loss function runs the model on: `(inputs, labels)` batches whose loss_fn calls
    # model(inputs) are captured and timed as model(inputs)
    example = task.model_call(model, task.example_batch())
    graph: LayerGraph = capture(model, example)
    chosen = _computing_layers(graph, layers)
    fqns = [L.fqn for L in chosen]
    calib = list(batches) if batches is not None else list(task.batches[:n_batches])
    # Speed first (measured, or priced at production shapes), then the numerics of only the
    # formats that can win: a format far slower than fp32 is never chosen for speed.
    if target is not None and task.shape_batch is not None:
        chosen = _at_production_shapes(model, task.model_call(model, task.shape_batch), fqns)
    if target is None:
        log(f"timing {len(fqns)} layers x {len(fmts)} formats", progress)
        times = _own_times(measure_layers(model, example, fqns, fmts, repeats=repeats,
                                          budget_s=budget_s), fqns)
    else:
        # without the casts in and out of each layer: the search prices the step with the
        # graph's edges, where a cast is paid only between layers of different dtypes
        times = {L.fqn: {fmt: estimate_layer(L, fmt, target, boundary_casts=False)
                         for fmt in fmts} for L in chosen}
    skipped = {L.fqn: _cannot_win(L, times.get(L.fqn, {}), fmts) for L in chosen}
    # the sensitivity measurement builds its own copy: one model in memory at a time
    del model, example
    low = [f for f in fmts if f is not Format.FP32]
    bar = ProgressBar("sensitivity", enabled=progress)
    errors = measure_sensitivity(task, fqns, low, batches=calib, progress=bar,
                                 only={f: [x for x in low if x not in skipped[f]] for f in fqns})
    rows = [LayerProfile(layer=L, sensitivity=dict(errors.get(L.fqn, {})),
                         times=dict(times.get(L.fqn, {})), skipped=skipped[L.fqn])
            for L in chosen]
    return Profile(task_name=task.name, model_name=graph.model_name,
                   device=_device_name(task.device), target=target,
                   capture_method=graph.method, formats=fmts, layers=rows,
                   edges=[tuple(e) for e in graph.edges],
                   fixed={L.fqn: L.kind for L in graph.layers if L.fqn not in set(fqns)},
                   elapsed=time.perf_counter() - t_start)


def _or_inf(x: float) -> float:
    return x if math.isfinite(x) else math.inf


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds >= 1e-5 else f"{seconds * 1e6:.1f} us"


# A format this many times slower than fp32 on a layer cannot win on this device.
_CANNOT_WIN = 2.0


def _cannot_win(layer: Layer, times: Mapping[Format, LayerTime],
                fmts: Sequence[Format]) -> dict[Format, str]:
    """Formats not worth measuring the numerics of for ``layer``, and why: fp8 the kernel does
    not take (it would run bf16), a format the device only emulates, one at least twice as
    slow as fp32 here, or an fp8 recipe no faster than bf16 (which is as fast and more
    precise)."""
    out = {}
    t32, t16 = times.get(Format.FP32), times.get(Format.BF16)
    for fmt in fmts:
        t = times.get(fmt)
        if fmt is Format.FP32 or t is None:
            continue
        blocker = LayerProfile(layer).fp8_blocker if fmt.is_fp8 else ""
        if blocker:
            out[fmt] = blocker
        elif t.emulated:
            out[fmt] = f"{fmt} only emulated here: never faster than fp32; numerics not measured"
        elif t32 is not None and t32.ok and (not t.ok or t.seconds >= _CANNOT_WIN * t32.seconds):
            what = "failed" if not t.ok else f"{t.seconds / t32.seconds:.1f}x the fp32 time"
            out[fmt] = f"{fmt} cannot win here ({what}); numerics not measured"
        elif fmt.is_fp8 and t16 is not None and t16.ok and t.seconds >= t16.seconds:
            out[fmt] = (f"{fmt} not faster than bf16 here ({_us(t.seconds)} vs "
                        f"{_us(t16.seconds)}): bf16 is as fast and more precise")
    return out


def _computing_layers(graph: LayerGraph, layers: Sequence[str] | None) -> list[Layer]:
    chosen = [L for L in graph.layers if L.kind in COMPUTING_KINDS and L.flops > 0]
    if layers is not None:
        unknown = set(layers) - {L.fqn for L in graph.layers}
        if unknown:
            raise ValueError(f"profile(layers=...) names {sorted(unknown)}, which are not "
                             f"computing layers of {graph.model_name}.")
        chosen = [L for L in chosen if L.fqn in set(layers)]
    if not chosen:
        raise ValueError(f"{graph.model_name} has no layer to tune: the model has no linear, "
                         "conv, attention or matmul layer (captured layers: "
                         f"{', '.join(L.fqn or '(root)' for L in graph.layers[:6]) or 'none'}).")
    return chosen


def _at_production_shapes(model, shape_batch, fqns: list[str]) -> list[Layer]:
    """The layers captured on the task's shape_batch: a cost model prices production shapes,
    while numerics used the calibration batches."""
    big = {L.fqn: L for L in capture(model, shape_batch).layers}
    missing = [f for f in fqns if f not in big]
    if missing:
        raise RuntimeError(f"Capturing the task's shape_batch found different layers than its "
                           f"calibration batch (missing {missing[:4]}).")
    return [big[f] for f in fqns]


def _own_times(times: dict[str, dict[Format, LayerTime]], fqns: Sequence[str]):
    """A parent layer (an attention module) is timed with its child layers inside it; subtract
    the children's times in the same format so the per-layer times add up."""
    out = {}
    for f in fqns:
        children = [c for c in fqns if c.startswith(f + ".")]
        if not children:
            out[f] = times.get(f, {})
            continue
        own = {}
        for fmt, t in times.get(f, {}).items():
            sub = sum(times[c][fmt].seconds for c in children if fmt in times.get(c, {}))
            # never below a tenth of the measured total: timing noise must not make it free
            sec = max(t.seconds - sub, 0.1 * t.seconds)
            own[fmt] = dataclasses.replace(t, seconds=sec,
                                           note=(t.note + "; " if t.note else "")
                                           + f"own time: minus {len(children)} child layers")
        # an emulated format runs fp32 kernels plus the rounding: a difference of two noisy
        # timings must not report it faster than fp32
        base = own.get(Format.FP32)
        for fmt, t in own.items():
            if t.emulated and base is not None and t.seconds < base.seconds:
                own[fmt] = dataclasses.replace(t, seconds=base.seconds)
        out[f] = own
    return out
