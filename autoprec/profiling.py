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
import functools
import gc
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec._util import (
    BOOL,
    FLOATISH,
    INT,
    MAX_INT,
    NUM,
    OPT_NUM,
    OPT_TEXT,
    TEXT,
    brief,
    check_schema,
    decode_float,
    encode_float,
    fits,
    read_json,
    shown,
    worker_id,
    write_json,
)
from autoprec.costmodel import estimate_step
from autoprec.formats import Format, Support, expand_formats
from autoprec.host import device_name, supported_formats
from autoprec.measure import shards
from autoprec.measure.capture import Layer, LayerGraph, capture
from autoprec.measure.deviation import check_reference_gradients
from autoprec.measure.options import SensitivityOptions, TimingOptions, with_keywords
from autoprec.measure.sensitivity import (
    LayerSensitivity,
    SensitivityResults,
    check_sensitivity_mode,
    measure_sensitivity,
)
from autoprec.measure.timing import LayerTime, measure_layers
from autoprec.policy import Budget
from autoprec.pricing import CostSource
from autoprec.reporter import Reporter
from autoprec.runtime.calls import COMPUTING_KINDS
from autoprec.task import default_loss
from autoprec.verdict import Verdict, can_win

__all__ = [
    "Profile",
    "LayerProfile",
    "ProfileOptions",
    "profile",
    "split_units",
]

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
    # format -> why its numerics were not measured: fp8 the kernel does not take, or (a
    # profile made with only_winnable, as the tune's is) a format that cannot win on this
    # device (emulated, far slower than fp32); the search never offers either
    skipped: dict[Format, str] = field(default_factory=dict)
    # format -> why its first-order estimate was re-measured exactly (sensitivity="auto"),
    # and the estimate's loss change it replaced
    exact_why: dict[Format, str] = field(default_factory=dict)
    estimated_loss: dict[Format, float] = field(default_factory=dict)

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
                "skipped": {f.value: why for f, why in self.skipped.items()},
                "exact_why": {f.value: why for f, why in self.exact_why.items()},
                "estimated_loss": {f.value: encode_float(v)
                                   for f, v in self.estimated_loss.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerProfile:
        sens = d["sensitivity"] if "sensitivity" in d else d["errors"]  # version 1: "errors"
        return cls(layer=Layer.from_dict(d["layer"]),
                   sensitivity={Format(k): LayerSensitivity.from_dict(v) for k, v in sens.items()},
                   times={Format(k): LayerTime.from_dict(v) for k, v in d["times"].items()},
                   skipped={Format(k): str(v) for k, v in d.get("skipped", {}).items()},
                   exact_why={Format(k): str(v) for k, v in d.get("exact_why", {}).items()},
                   estimated_loss={Format(k): decode_float(v, "profile layer")
                                   for k, v in d.get("estimated_loss", {}).items()})

    def source(self, fmt: Format) -> str:
        """"measured", "estimated", or "" (no numbers) for this layer in ``fmt``."""
        err = self.sensitivity.get(fmt)
        return "" if err is None else err.source

    def verdict(self, fmt: Format, *, max_loss_increase: float | None = None) -> Verdict:
        """Whether ``fmt`` can win on this layer as profiled (:func:`autoprec.verdict.can_win`
        on its times, fp8 blocker, recorded skips and numbers); ``max_loss_increase`` also
        asks its loss change to stay within that budget."""
        return can_win(fmt, self.times, blocker=self.fp8_blocker if fmt.is_scaled else "",
                       skipped=self.skipped, sensitivity=self.sensitivity,
                       max_loss_increase=max_loss_increase)


@dataclass
class Profile:
    """Per-layer sensitivity and speed of one task's model in each format: what
    :func:`profile` returns, ``tune(prof=...)`` reuses, and :meth:`save` / :meth:`load` keep
    in a file.

    Attributes:
        task_name: the task's name.
        model_name: the model's class name.
        device: where the numbers were measured, e.g. ``"cpu (AMD EPYC ...)"`` or
            ``"cuda (NVIDIA H200)"``.
        target: None: times measured on ``device``; else the cost model's device (``"h100"``,
            ...).
        capture_method: which tracer captured the layers (``"export"``, ``"symbolic_trace"``,
            ``"hooks"``).
        formats: the formats profiled.
        layers: the layers that compute (whose format changes their arithmetic), in execution
            order.
        edges: (producer, consumer) edges between layers.
        fixed: layers captured but not searched (embeddings, norms), with their kind.
        elapsed: seconds the profile took.
        torch_version: the torch version that measured it.
        sensitivity_mode: how the sensitivities were obtained: ``"exact"``, ``"fast"``
            (first-order estimates) or ``"auto"`` (estimates, the doubtful and near-budget ones
            measured exactly); see ``measure_sensitivity``.
        units: how the work was split: units of layers, and who did each (``"host:pid"``,
            tries).
    """

    task_name: str
    model_name: str
    device: str
    target: str | None
    capture_method: str
    formats: tuple[Format, ...]
    layers: list[LayerProfile]
    edges: list[tuple[str, str]] = field(default_factory=list)
    fixed: dict[str, str] = field(default_factory=dict)
    elapsed: float = 0.0
    torch_version: str = str(torch.__version__)
    sensitivity_mode: str = "exact"
    units: list[dict] = field(default_factory=list)

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

    def verdict(self, fqn: str, fmt: Format, *,
                max_loss_increase: float | None = None) -> Verdict:
        """Whether ``fmt`` can win on this layer, and if not which rule says so and why (see
        :mod:`autoprec.verdict`)."""
        return self.layer(fqn).verdict(fmt, max_loss_increase=max_loss_increase)

    def allows(self, fqn: str, fmt: Format) -> bool:
        """Whether the search should offer ``fmt`` for this layer: it can win here on speed,
        its numerics stayed finite, and for fp8, its matmuls can really run as FP8 (otherwise
        fp8 = bf16 here)."""
        return self.verdict(fqn, fmt).can_win

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

    def to_dict(self) -> dict:
        return {"autoprec_profile": PROFILE_SCHEMA, "task_name": self.task_name,
                "model_name": self.model_name, "device": self.device, "target": self.target,
                "capture_method": self.capture_method,
                "formats": [f.value for f in self.formats],
                "layers": [lp.to_dict() for lp in self.layers],
                "edges": [list(e) for e in self.edges], "fixed": dict(self.fixed),
                "elapsed": self.elapsed, "torch_version": self.torch_version,
                "sensitivity_mode": self.sensitivity_mode, "units": list(self.units)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Profile:
        check_schema(d, "autoprec_profile", PROFILE_SCHEMA, "profile", readable=(1,))
        _check_record(d)  # every field its type first: a profile file is untrusted input
        try:
            return cls(task_name=d["task_name"], model_name=d["model_name"],
                       device=d["device"], target=d["target"],
                       capture_method=d["capture_method"],
                       formats=tuple(Format(f) for f in d["formats"]),
                       layers=[LayerProfile.from_dict(x) for x in d["layers"]],
                       edges=[tuple(e) for e in d.get("edges", [])], fixed=d.get("fixed", {}),
                       elapsed=d.get("elapsed", 0.0), torch_version=d.get("torch_version", ""),
                       sensitivity_mode=d.get("sensitivity_mode", "exact"),
                       units=list(d.get("units", [])))
        except (KeyError, TypeError) as e:
            raise ValueError(f"a malformed profile record ({type(e).__name__}: {e})") from None

    def save(self, path) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path) -> Profile:
        """Read a profile file (bounded in size and nesting, every field checked); a bad one
        is a one-line ValueError naming the file and the field."""
        data = read_json(path, "profile")
        try:
            return cls.from_dict(data)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
            detail = " ".join(str(e).split()) if isinstance(e, ValueError) else \
                f"a malformed record ({type(e).__name__}: {' '.join(str(e).split())})"
            raise ValueError(f"{shown(path)} is not a valid autoprec profile: "
                             f"{shown(detail.rstrip('.'), 400)}. Regenerate it with `autoprec "
                             "profile` (or `autoprec tune`).") from None


# ------------------------------------------------------------------ checking a record
# Field kinds of a profile record as to_dict writes it (before the dataclasses check values).

_TOP_FIELDS = {"task_name": TEXT, "model_name": TEXT, "device": TEXT, "target": OPT_TEXT,
               "capture_method": TEXT, "elapsed": NUM, "torch_version": TEXT,
               "sensitivity_mode": TEXT}
_LAYER_FIELDS = {"fqn": TEXT, "kind": TEXT, "module_type": TEXT, "flops": INT,
                 "bytes": INT, "params": INT}
_SENSITIVITY_FIELDS = {"layer": TEXT, "format": TEXT, "finite": BOOL, "n_batches": INT,
                       "source": TEXT}  # the rest: FLOATISH
_TIME_FIELDS = {"fqn": TEXT, "format": TEXT, "fmt": TEXT, "seconds": OPT_NUM,
                "raw_seconds": OPT_NUM, "spread": OPT_NUM, "emulated": BOOL,
                "source": TEXT, "note": TEXT, "error": OPT_TEXT, "repeats": INT}


def _wrong(value: Any, kind: str, name: str) -> ValueError:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= MAX_INT:
        got = f"an integer of {len(str(abs(value)))} digits"
    else:
        got = brief(value)
    return ValueError(f"`{name}` must be {kind}, got {got}")


def _expect(value: Any, kind: str, name: str) -> None:
    if not fits(value, kind):
        raise _wrong(value, kind, name)


def _mapping(value: Any, name: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise _wrong(value, "a mapping", name)
    return value


def _list(value: Any, name: str) -> list:
    if not isinstance(value, list):
        raise _wrong(value, "a list", name)
    return value


def _fields(record: Any, kinds: Mapping[str, str], name: str, rest: str | None = None) -> None:
    for key, value in _mapping(record, name).items():
        kind = kinds.get(key, rest)
        if kind is not None:
            _expect(value, kind, f"{name}.{key}")


def _check_record(d: Mapping[str, Any]) -> None:
    """The type of every field a profile record carries, as a ValueError naming the first
    wrong one (``layers[3].layer.fqn``); values are checked by the dataclasses after."""
    _fields(d, _TOP_FIELDS, "profile")
    for i, f in enumerate(_list(d.get("formats", []), "formats")):
        _expect(f, TEXT, f"formats[{i}]")
    for i, e in enumerate(_list(d.get("edges", []), "edges")):
        if not isinstance(e, list) or len(e) != 2:
            raise _wrong(e, "a [producer, consumer] pair", f"edges[{i}]")
        _expect(e[0], TEXT, f"edges[{i}][0]")
        _expect(e[1], TEXT, f"edges[{i}][1]")
    _fields(d.get("fixed", {}), {}, "fixed", TEXT)
    for i, u in enumerate(_list(d.get("units", []), "units")):
        for key, value in _mapping(u, f"units[{i}]").items():
            if value is not None and not isinstance(value, (str, bool)):
                _expect(value, NUM, f"units[{i}].{key}")
    for i, lp in enumerate(_list(d.get("layers", []), "layers")):
        name = f"layers[{i}]"
        lp = _mapping(lp, name)
        layer = _mapping(lp.get("layer", {}), f"{name}.layer")
        _fields(layer, _LAYER_FIELDS, f"{name}.layer")
        for j, m in enumerate(_list(layer.get("matmuls", []), f"{name}.layer.matmuls")):
            if not isinstance(m, list) or len(m) != 4:
                raise _wrong(m, "a list of 4 integers (batch, M, K, N)",
                             f"{name}.layer.matmuls[{j}]")
            for v in m:
                _expect(v, INT, f"{name}.layer.matmuls[{j}]")
        for j, c in enumerate(_list(layer.get("calls", []), f"{name}.layer.calls")):
            _expect(c, TEXT, f"{name}.layer.calls[{j}]")
        sens = lp.get("sensitivity", lp.get("errors", {}))
        for fmt, rec in _mapping(sens, f"{name}.sensitivity").items():
            _fields(rec, _SENSITIVITY_FIELDS, f"{name}.sensitivity.{fmt}", FLOATISH)
        for fmt, rec in _mapping(lp.get("times", {}), f"{name}.times").items():
            _fields(rec, _TIME_FIELDS, f"{name}.times.{fmt}")
            vs = rec.get("vs_fp32")
            if vs is not None:
                _fields(vs, {"rounds": INT}, f"{name}.times.{fmt}.vs_fp32", OPT_NUM)
        for key in ("skipped", "exact_why"):
            _fields(lp.get(key, {}), {}, f"{name}.{key}", TEXT)
        _fields(lp.get("estimated_loss", {}), {}, f"{name}.estimated_loss", FLOATISH)


def _device_name(device: torch.device) -> str:
    return f"{device.type} ({device_name(device)})"


@dataclass(frozen=True)
class ProfileOptions:
    """How :func:`profile` measures: batches, timing and sensitivity settings."""

    # calibration batches of the task when no batches are given
    n_batches: int = 1
    # report progress on stderr (or a Reporter to report through)
    progress: bool | Reporter = True
    # timing rounds per layer, and the seconds of timing one layer x format may spend
    # (the keyword `budget_s` of profile() sets it too)
    repeats: int = 8
    time_budget_s: float = 5.0
    # "auto", "fast" or "exact" (see measure_sensitivity)
    sensitivity: str = "auto"
    # the error budget (a Budget, not seconds): "auto" measures the estimates near it exactly
    budget: Budget | None = None
    # measure the numerics only of the formats that can win on the device (the tune's
    # economy); off, every requested format is measured on every layer it runs
    only_winnable: bool = False
    # how the exact comparisons get the FP32 reference's gradients: "auto", "kept",
    # "recomputed" or "spilled" (see measure_sensitivity)
    reference_gradients: str = "auto"
    # a build of the task's model to measure on instead of building one (the tune's own):
    # captured, timed and measured in place, and left as it was (no weight moves; its mode,
    # dropout and BatchNorm momenta are put back)
    model: Any = None

    @classmethod
    def of(cls, options: ProfileOptions | None, keywords: dict[str, Any]) -> ProfileOptions:
        """``options`` with the fields given as keywords of profile() replaced, checked."""
        if "budget_s" in keywords:
            if "time_budget_s" in keywords:
                raise TypeError("profile() got both budget_s and time_budget_s; they are one "
                                "setting (seconds of timing per layer x format): pass one.")
            keywords["time_budget_s"] = keywords.pop("budget_s")
        opts = with_keywords(options, cls, keywords, "profile")
        for name in ("n_batches", "repeats"):
            value = getattr(opts, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"profile({name}=...) must be a positive integer, got "
                                 f"{value!r}.")
        check_sensitivity_mode(opts.sensitivity)  # before any model is built
        check_reference_gradients(opts.reference_gradients)
        return opts


def profile(task, formats: Sequence[Format | str] = ("fp32", "bf16", "fp16", "fp8"), *,
            target: str | None = None, batches: Sequence[Any] | None = None,
            layers: Sequence[str] | None = None, options: ProfileOptions | None = None,
            share: UnitRunner | None = None, **keywords: Any) -> Profile:
    """Measure every layer of ``task``'s model that computes, in every format.

    Args:
        task (Task): the task whose model is profiled.
        formats: each is measured on every layer it runs (an FP8 recipe whose kernel does not take
            a layer's matmuls is skipped there, and the profile says why); FP32 is added.
        target: None times layers on the task's device; ``"h100"`` (etc.) prices them with the
            cost model instead (numerics are still measured here).
        batches: defaults to the task's first ``n_batches`` calibration batches.
        layers: restricts the profile to these fqns.
        options: the settings (a :class:`ProfileOptions`), overridden by ``keywords``.
        share: runs the profile's units of layers, possibly split with other workers
            (:mod:`autoprec.tuning.share`): ``share(units, work)`` returns each unit's rows and
            who did it. None: this process does every layer in one unit.
        **keywords: ``n_batches``, ``progress``, ``repeats`` and ``time_budget_s`` (or
            ``budget_s``: timing rounds per layer and seconds per layer x format);
            ``only_winnable=True`` skips, as the tune does, the formats that cannot win on the
            device (emulated, at least ``SLOWER_THAN_FP32`` x the fp32 time, an FP8 recipe no
            faster than bf16); ``sensitivity``: "auto" (default: first-order estimates, the
            doubtful and those near the error budget ``budget`` measured exactly), "fast"
            (estimates only) or "exact" (every pair measured; see
            :func:`autoprec.measure.sensitivity.measure_sensitivity`);
            ``reference_gradients``: how the exact comparisons get the FP32 reference's
            gradients, "kept", "recomputed" per comparison, "spilled" outside the device's
            memory, or "auto" (default: kept unless they would take over a quarter of the
            free memory; the same numbers every way);
            ``model=`` a model FSDP2 shards (``fully_shard``, every rank of a ``torchrun``
            calling ``profile`` alike, on the same batches): each forward and backward is an
            FSDP2 pass, each rank re-runs its share of the layers in the first-order estimate,
            every rank gets the whole profile (the numbers one process computes). Layers are
            priced (``target=``).

    Returns:
        The :class:`Profile`: each layer's sensitivity and time in each format.
    """
    opts = ProfileOptions.of(options, keywords)
    source = CostSource.of(target)  # an unknown target fails here, before any measurement
    if batches is not None:  # the task's own batches were checked when it was built
        from autoprec.task import check_batches

        check_batches(batches, "profile(batches=...) batch")
    t_start = time.perf_counter()
    fmts = expand_formats(formats, where="in profile(formats=...)")
    if Format.FP32 not in fmts:
        fmts = (Format.FP32, *fmts)
    if opts.model is not None and shards.is_sharded(opts.model):
        _check_sharded(source, share)
    ctx = _Context.build(task, fmts, source, batches, layers, opts)
    work = functools.partial(_profile_unit, ctx, opts)
    fqns = [L.fqn for L in ctx.chosen]
    if share is None:
        rows, units = work(fqns), [{"layers": len(fqns), "by": worker_id(), "tries": 1}]
    else:
        rows, units = share(split_units(fqns), work)
    ctx.release()
    by_fqn = {r["layer"]["fqn"]: r for r in rows}
    return Profile(task_name=task.name, model_name=ctx.graph.model_name,
                   device=_device_name(task.device), target=target,
                   capture_method=ctx.graph.method, formats=fmts,
                   layers=[LayerProfile.from_dict(by_fqn[f]) for f in fqns],
                   edges=[tuple(e) for e in ctx.graph.edges],
                   fixed={L.fqn: L.kind for L in ctx.graph.layers if L.fqn not in set(fqns)},
                   elapsed=time.perf_counter() - t_start, sensitivity_mode=opts.sensitivity,
                   units=units)


def _check_sharded(source: CostSource, share: Any) -> None:
    """What a profile of a model FSDP2 shards cannot do: time its layers one by one (each
    would need its unit gathered on one rank alone) or split them among other processes
    (its ranks measure together, each layer's numerics on one of them)."""
    if source.measured:
        raise ValueError("profile() of a model FSDP2 shards prices its layers for a GPU "
                         "instead of timing them one by one: pass target= (e.g. 'h100').")
    if share is not None:
        raise ValueError("profile(share=...) splits the layers among processes that each hold "
                         "the model, but FSDP2 shards this one: its ranks measure together "
                         "and divide the layers already; leave share out.")


# A UnitRunner: (units of layer fqns, work on one unit -> its rows) -> (all rows, who did what)
UnitRunner = Callable[[list[list[str]], Callable[[list[str]], list[dict]]],
                      tuple[list[dict], list[dict]]]


def split_units(fqns: Sequence[str], n: int = 8) -> list[list[str]]:
    """About ``n`` units of consecutive layers (fewer for small models), never splitting a
    layer from its listed descendants, wherever they come in ``fqns`` (a capture lists a
    module's children before it when they run first, as HF Llama's attention projections
    do): a unit's listed layers are the ones it pins to fp32 while it switches their parent,
    and a parent's own time is its time minus theirs. A fixed number of units, not a fixed
    size: each unit pays one reference pass, so per-layer cost stays flat in depth."""
    listed = set(fqns)
    families: dict[str, list[str]] = {}  # the outermost listed ancestor -> it and its own
    for f in fqns:
        parts = f.split(".")
        top = next((a for a in (".".join(parts[:i]) for i in range(1, len(parts)))
                    if a in listed), f)
        families.setdefault(top, []).append(f)
    size = max(1, math.ceil(len(fqns) / n))
    units: list[list[str]] = []
    for family in families.values():
        if units and len(units[-1]) < size:
            units[-1].extend(family)
        else:
            units.append(list(family))
    return units


@dataclass
class _Context:
    """What every unit of one worker's profile shares: the model, its capture, the batches."""

    task: Any
    fmts: tuple[Format, ...]
    source: CostSource
    model: Any
    example: Any
    graph: LayerGraph
    chosen: list[Layer]
    calib: list
    reporter: Reporter

    @classmethod
    def build(cls, task, fmts: tuple[Format, ...], source: CostSource, batches, layers,
              opts: ProfileOptions) -> _Context:
        model = opts.model if opts.model is not None else task.build_model()
        # what the loss function runs the model on: `(inputs, labels)` batches whose loss_fn
        # calls model(inputs) are captured and timed as model(inputs)
        example = task.model_call(model, task.example_batch())
        graph: LayerGraph = capture(model, example)
        chosen = _computing_layers(graph, layers)
        if source.priced and task.shape_batch is not None:
            chosen = _at_production_shapes(model, task.model_call(model, task.shape_batch),
                                           [L.fqn for L in chosen])
        calib = list(batches) if batches is not None else list(task.batches[:opts.n_batches])
        return cls(task, fmts, source, model, example, graph, chosen, calib,
                   Reporter.of(opts.progress))

    def release(self) -> None:
        self.model = self.example = self.task = None


def _profile_unit(ctx: _Context, opts: ProfileOptions, fqns: list[str]) -> list[dict]:
    """One unit's rows (LayerProfile dicts): speed first (measured, or priced at production
    shapes), then the numerics: of every format, or with ``only_winnable`` of only the formats
    that can win (a format far slower than fp32 is never chosen for speed)."""
    fmts, layer_of = ctx.fmts, {L.fqn: L for L in ctx.chosen}
    chosen = [layer_of[f] for f in fqns]
    if ctx.source.measured:
        times = _measured_times(ctx, fqns, opts)
    else:
        times = {L.fqn: {fmt: ctx.source.price_layer(L, fmt) for fmt in fmts} for L in chosen}
    skipped = {L.fqn: _skips(L, times.get(L.fqn, {}), fmts, opts.only_winnable)
               for L in chosen}
    low = [f for f in fmts if f is not Format.FP32]
    only = {f: [x for x in low if x not in skipped[f]] for f in fqns}
    if any(only.values()):
        # on the profile's own model (no copy of it: a policy's regions are installed and
        # removed, no weight moves, and its dropout and mode are put back afterwards)
        errors = measure_sensitivity(ctx.model, fqns, low, batches=ctx.calib,
                                     loss_fn=ctx.task.loss_fn or default_loss,
                                     options=SensitivityOptions(
                                         progress=ctx.reporter.bar("sensitivity"), only=only,
                                         mode=opts.sensitivity, budget=opts.budget or Budget(),
                                         seed=ctx.task.seed, in_place=True,
                                         reference_gradients=opts.reference_gradients))
        # The unit's measurement (its model copy, FP32 reference gradients per batch: 5 model
        # sizes) sits in reference cycles that outlive it until a full collection, which
        # Python runs by object counts, not bytes: at Llama-3-8B width the next unit's reference
        # was built beside it and a 3-layer profile ran out of 24 GB. Free it now.
        gc.collect()
    else:  # nothing to measure in this unit: no reference pass either
        errors = SensitivityResults({}, exact_why={})
    why = errors.exact_why
    rows = [LayerProfile(layer=L, sensitivity=dict(errors.get(L.fqn, {})),
                         times=dict(times.get(L.fqn, {})), skipped=skipped[L.fqn],
                         exact_why={f: w for f, (w, _) in why.get(L.fqn, {}).items()},
                         estimated_loss={f: e for f, (_, e) in why.get(L.fqn, {}).items()})
            for L in chosen]
    return [r.to_dict() for r in rows]


def _measured_times(ctx: _Context, fqns: list[str], opts: ProfileOptions):
    """Each layer's time in each format the device runs natively; a format it only emulates
    (FP8 on CPU) is not timed: it is never faster than fp32 there, so its time is fp32's (the
    floor measure_layers would report too) and timing it would only cost seconds per layer."""
    support = supported_formats(ctx.task.device)
    native = [f for f in ctx.fmts if support[f] is Support.NATIVE]
    ctx.reporter.log(f"timing {len(fqns)} layers x {len(native)} formats")
    timing = TimingOptions(repeats=opts.repeats, budget_s=opts.time_budget_s)
    times = _own_times(measure_layers(ctx.model, ctx.example, fqns, native, options=timing),
                       fqns)
    for fqn in fqns:
        t32 = times[fqn].get(Format.FP32)
        for fmt in ctx.fmts:
            if fmt not in native and t32 is not None:
                times[fqn][fmt] = LayerTime(
                    fqn, fmt, t32.seconds, math.nan, math.nan, emulated=True,
                    note=f"{fmt} only emulated on {ctx.task.device}: not timed, never faster "
                         "than fp32 (its time is fp32's)")
    return times


def _skips(layer: Layer, times: Mapping[Format, LayerTime], fmts: Sequence[Format],
           only_winnable: bool) -> dict[Format, str]:
    """The timed formats whose numerics are not measured for ``layer``, and why: an FP8 recipe
    whose kernel does not take its matmuls (it would not run in FP8), and with
    ``only_winnable`` every format that cannot win on it (:func:`autoprec.verdict.can_win`
    before any numerics)."""
    blocker = LayerProfile(layer).fp8_blocker
    out = {}
    for fmt in fmts:
        if times.get(fmt) is None:
            continue
        verdict = can_win(fmt, times, blocker=blocker if fmt.is_scaled else "")
        if not verdict.can_win and (only_winnable or verdict.rule == "blocked"):
            out[fmt] = verdict.why
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
