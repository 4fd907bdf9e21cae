"""profile(): each layer's numerical sensitivity and speed in each format, as one table.

    capture (graph.py) -> which layers compute, their shapes and FLOPs
    sensitivity.py     -> error of each layer x format, that layer alone switched
    timing.py          -> forward+backward seconds of each layer x format, measured on the
                          device or priced by the cost model for a `target`

A :class:`Profile` is plain data: saved to and loaded from JSON, printed as a table, and read
by the search (its integer program treats it as additive) and by ``autoprec show``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec.formats import FORMAT_ORDER, Format, device_name
from autoprec.fp8 import fp8_shape_supported
from autoprec.graph import Layer, LayerGraph, capture
from autoprec.sensitivity import LayerError, measure_sensitivity
from autoprec.task import Task
from autoprec.timing import LayerTime, estimate_layer, measure_layers

__all__ = ["Profile", "LayerProfile", "profile", "SEARCHABLE_KINDS", "ProgressBar"]

# Kinds whose format changes what they compute. Embedding lookups and norms compute the
# same under every format (autocast keeps norms in FP32; a lookup has no arithmetic).
SEARCHABLE_KINDS = ("linear", "conv", "attention", "matmul")


class ProgressBar:
    """A one-line progress bar on stderr: ``[#####-----] 12/63 label``."""

    def __init__(self, title: str, *, enabled: bool = True, width: int = 28):
        self.title, self.enabled, self.width = title, enabled, width
        self.t0 = time.perf_counter()

    def __call__(self, done: int, total: int, label: str = "") -> None:
        if not self.enabled or total <= 0:
            return
        if not sys.stderr.isatty():
            # logs and CI: one line per tenth instead of carriage-return redraws
            step = max(1, total // 10)
            if done % step and done < total:
                return
            if done < total:
                sys.stderr.write(f"{self.title}: {done}/{total} {label}\n")
                sys.stderr.flush()
                return
        filled = int(self.width * done / total)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (total - done) if done else float("nan")
        eta_s = f" eta {eta:4.0f}s" if math.isfinite(eta) else ""
        sys.stderr.write(f"\r{self.title} [{'#' * filled}{'-' * (self.width - filled)}] "
                         f"{done}/{total}{eta_s} {label[:48]:<48}")
        if done >= total:
            sys.stderr.write(f"\r{self.title}: {total} done in {elapsed:.1f}s{' ' * 60}\n")
        sys.stderr.flush()


@dataclass
class LayerProfile:
    """One layer's row of the profile."""

    # the layer as captured: fqn, kind, matmul shapes, FLOPs, bytes, params
    layer: Layer
    # format -> error with this layer alone switched (fp32 is the reference, absent)
    errors: dict[Format, LayerError] = field(default_factory=dict)
    # format -> forward+backward seconds of the layer's own work
    times: dict[Format, LayerTime] = field(default_factory=dict)
    # why fp8 cannot run this layer's matmuls as FP8 ("" when it can)
    fp8_blocker: str = ""

    @property
    def fqn(self) -> str:
        return self.layer.fqn

    def to_dict(self) -> dict:
        return {"layer": self.layer.to_dict(),
                "errors": {f.value: e.to_dict() for f, e in self.errors.items()},
                "times": {f.value: t.to_dict() for f, t in self.times.items()},
                "fp8_blocker": self.fp8_blocker}

    @classmethod
    def from_dict(cls, d: dict) -> LayerProfile:
        return cls(layer=Layer.from_dict(d["layer"]),
                   errors={Format(k): LayerError.from_dict(v) for k, v in d["errors"].items()},
                   times={Format(k): LayerTime.from_dict(v) for k, v in d["times"].items()},
                   fp8_blocker=d.get("fp8_blocker", ""))


@dataclass
class Profile:
    """Per-layer sensitivity and speed of one task's model in each format."""

    # the task's name and the model's class name
    task_name: str
    model_name: str
    # where the numbers were measured, e.g. "cpu (Intel Xeon ...)" or "cuda (NVIDIA H200)"
    device: str
    # None: times measured on `device`; else the cost model's device ("h100", ...)
    target: str | None
    # which tracer captured the layers ("export", "symbolic_trace", "hooks")
    capture_method: str
    formats: tuple[Format, ...]
    # searchable layers (those whose format changes their arithmetic), in execution order
    layers: list[LayerProfile]
    # (producer, consumer) edges between layers
    edges: list[tuple[str, str]] = field(default_factory=list)
    # layers captured but not searched (embeddings, norms), with their kind
    fixed: dict[str, str] = field(default_factory=dict)
    # seconds the profile took
    elapsed: float = 0.0
    torch_version: str = str(torch.__version__)

    # ------------------------------------------------------------ queries
    def layer(self, fqn: str) -> LayerProfile:
        for lp in self.layers:
            if lp.fqn == fqn:
                return lp
        raise KeyError(f"Layer {fqn!r} is not in the profile of {self.model_name}; profiled "
                       f"layers: {', '.join(lp.fqn for lp in self.layers[:8])}, ...")

    def searchable(self) -> list[LayerProfile]:
        return list(self.layers)

    def loss_change(self, fqn: str, fmt: Format) -> float:
        """Relative loss change with only this layer in ``fmt`` (0 for fp32; inf when the
        run was non-finite)."""
        if fmt is Format.FP32:
            return 0.0
        err = self.layer(fqn).errors.get(fmt)
        if err is None:
            return float("nan")
        return err.loss_rel_change if err.finite else float("inf")

    def grad_error(self, fqn: str, fmt: Format) -> float:
        if fmt is Format.FP32:
            return 0.0
        err = self.layer(fqn).errors.get(fmt)
        if err is None:
            return float("nan")
        return err.grad_rel_error if err.finite else float("inf")

    def seconds(self, fqn: str, fmt: Format) -> float:
        t = self.layer(fqn).times.get(fmt)
        return float("nan") if t is None else t.seconds

    def allows(self, fqn: str, fmt: Format) -> bool:
        """Whether the search should offer ``fmt`` for this layer: its numerics stayed finite,
        and for fp8, its matmuls can really run as FP8 (otherwise fp8 = bf16 here)."""
        if fmt is Format.FP32:
            return True
        lp = self.layer(fqn)
        if fmt is Format.FP8 and lp.fp8_blocker:
            return False
        err = lp.errors.get(fmt)
        return err is not None and err.finite and math.isfinite(self.seconds(fqn, fmt))

    def estimate_step(self, assignment: dict[str, Format], target: str) -> float:
        """Cost-model seconds of the searchable layers' work under ``assignment``."""
        from autoprec.timing import estimate_step

        layers = [lp.layer for lp in self.layers]
        return estimate_step(layers, {k: Format.parse(v) for k, v in assignment.items()},
                             target)

    def reason(self, fqn: str, fmt: Format, *, max_loss_change: float = 0.01) -> str:
        """The measured reason this layer is not in ``fmt`` (for `autoprec show`)."""
        lp = self.layer(fqn)
        if fmt is Format.FP8 and lp.fp8_blocker:
            return lp.fp8_blocker
        err = lp.errors.get(fmt)
        if err is not None and not err.finite:
            return f"{fmt} non-finite (loss or gradients overflowed)"
        lc = self.loss_change(fqn, fmt)
        if math.isfinite(lc) and lc > max_loss_change:
            return f"{fmt} alone changes the loss by {lc:+.2%} (> {max_loss_change:.2%})"
        t = self.layer(fqn).times.get(fmt)
        t16 = self.layer(fqn).times.get(Format.BF16)
        if t is not None and t.emulated:
            return f"{fmt} only emulated on {self.device}: {t.note or 'not faster'}"
        if t is not None and t16 is not None and fmt is Format.FP8 and t.seconds >= t16.seconds:
            return (f"fp8 not faster than bf16 here ({t.seconds * 1e6:.0f} vs "
                    f"{t16.seconds * 1e6:.0f} us): too small to gain")
        parts = []
        if math.isfinite(lc):
            parts.append(f"loss {lc:+.3%}")
        ge = self.grad_error(fqn, fmt)
        if math.isfinite(ge):
            parts.append(f"grad err {ge:.3g}")
        if t is not None:
            parts.append(f"{t.seconds * 1e6:.0f} us")
        return f"{fmt}: " + ", ".join(parts) + " (the search preferred another format overall)"

    # ------------------------------------------------------------ output
    def table(self) -> str:
        fmts = [f for f in FORMAT_ORDER if f in self.formats]
        head = ["layer", "kind", "shape (M,K,N)", "GFLOP"]
        for f in fmts:
            head.append(f"{f} err" if f is not Format.FP32 else "")
        head = [h for h in head if h]
        for f in fmts:
            head.append(f"{f} us")
        head.append("verdict")
        rows = []
        for lp in self.layers:
            L = lp.layer
            shape = ",".join(str(x) for x in L.matmuls[0][1:]) if L.matmuls else "-"
            if len(L.matmuls) > 1:
                shape += f" +{len(L.matmuls) - 1}"
            row = [L.fqn, L.kind, shape, f"{L.flops / 1e9:.3f}"]
            for f in fmts:
                if f is Format.FP32:
                    continue
                e = lp.errors.get(f)
                row.append("-" if e is None else ("NONFINITE" if not e.finite
                                                  else f"{e.loss_rel_change:+.1e}"))
            for f in fmts:
                t = lp.times.get(f)
                row.append("-" if t is None else f"{t.seconds * 1e6:.0f}" + ("*" if t.emulated else ""))
            row.append(self._verdict(lp, fmts))
            rows.append(row)
        widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
        out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
        out.append("-" * len(out[0]))
        out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
        src = f"cost model {self.target}" if self.target else f"measured on {self.device}"
        out.append(f"err: relative loss change with the layer alone in the format; us: fwd+bwd "
                   f"microseconds ({src}); * emulated (never counted as fast).")
        return "\n".join(out)

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
        flags = [f"{f} non-finite" for f, e in lp.errors.items() if not e.finite]
        return f"{best}" + (f" ({'; '.join(flags)})" if flags else "")

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        return {"autoprec_profile": 1, "task_name": self.task_name,
                "model_name": self.model_name, "device": self.device, "target": self.target,
                "capture_method": self.capture_method,
                "formats": [f.value for f in self.formats],
                "layers": [lp.to_dict() for lp in self.layers],
                "edges": [list(e) for e in self.edges], "fixed": dict(self.fixed),
                "elapsed": self.elapsed, "torch_version": self.torch_version}

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        if d.get("autoprec_profile") != 1:
            raise ValueError("Not an autoprec profile (missing `autoprec_profile: 1`).")
        return cls(task_name=d["task_name"], model_name=d["model_name"], device=d["device"],
                   target=d["target"], capture_method=d["capture_method"],
                   formats=tuple(Format(f) for f in d["formats"]),
                   layers=[LayerProfile.from_dict(x) for x in d["layers"]],
                   edges=[tuple(e) for e in d.get("edges", [])], fixed=d.get("fixed", {}),
                   elapsed=d.get("elapsed", 0.0), torch_version=d.get("torch_version", ""))

    def save(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        with open(path) as f:
            return cls.from_dict(json.load(f))


def _device_name(device: torch.device) -> str:
    return f"{device.type} ({device_name(device)})"


def _fp8_blocker(layer: Layer) -> str:
    if layer.kind == "conv":
        return "convolution: no FP8 conv kernels in PyTorch, fp8 would run bf16"
    if not layer.matmuls:
        return "no matmul to run in FP8"
    for _batch, m, k, n in layer.matmuls:
        ok, reason = fp8_shape_supported(m, k, n)
        if not ok:
            return reason
    return ""


def profile(task: Task, formats: Sequence[Format | str] = ("fp32", "bf16", "fp16", "fp8"), *,
            target: str | None = None, batches: Sequence[Any] | None = None,
            layers: Sequence[str] | None = None, n_batches: int = 1, progress: bool = True,
            repeats: int = 5, budget_s: float = 5.0) -> Profile:
    """Measure every searchable layer of ``task``'s model in every format.

    ``target=None`` times layers on the task's device; ``target="h100"`` (etc.) prices them
    with the cost model instead (numerics are still measured here). ``batches`` defaults to the
    task's first ``n_batches`` calibration batches. ``layers`` restricts the profile to these
    fqns.
    """
    t_start = time.perf_counter()
    fmts = tuple(f for f in FORMAT_ORDER if f in {Format.parse(x) for x in formats})
    if Format.FP32 not in fmts:
        fmts = (Format.FP32, *fmts)
    model = task.build_model()
    example = task.example_batch()
    graph: LayerGraph = capture(model, example)
    searchable = [L for L in graph.layers if L.kind in SEARCHABLE_KINDS and L.flops > 0]
    if layers is not None:
        wanted = set(layers)
        unknown = wanted - {L.fqn for L in graph.layers}
        if unknown:
            raise ValueError(f"profile(layers=...) names {sorted(unknown)}, which are not "
                             f"computing layers of {graph.model_name}.")
        searchable = [L for L in searchable if L.fqn in wanted]
    fqns = [L.fqn for L in searchable]
    calib = list(batches) if batches is not None else list(task.batches[:n_batches])

    low = [f for f in fmts if f is not Format.FP32]
    bar = ProgressBar("sensitivity", enabled=progress)
    errors = measure_sensitivity(task, fqns, low, batches=calib, progress=bar)

    layer_by_fqn = {L.fqn: L for L in searchable}
    if target is not None and task.shape_batch is not None:
        # price the layers at production shapes; numerics above used the calibration batches
        priced = capture(model, task.shape_batch)
        big = {L.fqn: L for L in priced.layers}
        missing = [f for f in fqns if f not in big]
        if missing:
            raise RuntimeError(f"Capturing the task's shape_batch found different layers than "
                               f"its calibration batch (missing {missing[:4]}).")
        layer_by_fqn = {f: big[f] for f in fqns}
        searchable = [big[f] for f in fqns]
    if target is None:
        if progress:
            print(f"timing {len(fqns)} layers x {len(fmts)} formats", file=sys.stderr, flush=True)
        times = measure_layers(model, example, fqns, fmts, repeats=repeats, budget_s=budget_s)
        times = _own_times(times, fqns)
    else:
        times = {f: {fmt: estimate_layer(layer_by_fqn[f], fmt, target) for fmt in fmts}
                 for f in fqns}

    rows = [LayerProfile(layer=L, errors=dict(errors.get(L.fqn, {})),
                         times=dict(times.get(L.fqn, {})), fp8_blocker=_fp8_blocker(L))
            for L in searchable]
    fixed = {L.fqn: L.kind for L in graph.layers if L not in searchable}
    return Profile(task_name=task.name, model_name=graph.model_name,
                   device=_device_name(task.device), target=target,
                   capture_method=graph.method, formats=fmts, layers=rows,
                   edges=[tuple(e) for e in graph.edges], fixed=fixed,
                   elapsed=time.perf_counter() - t_start)


def _own_times(times: dict[str, dict[Format, LayerTime]], fqns: Sequence[str]):
    """A parent layer (an attention module) is timed with its child layers inside it; subtract
    the children's times in the same format so the per-layer times add up."""
    import dataclasses

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
        out[f] = own
    return out
