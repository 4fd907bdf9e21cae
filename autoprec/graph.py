"""What capture produces: a model's layers (:class:`Layer`) in execution order and the data
flow between them (:class:`LayerGraph`). Plain data, saved as JSON, built by hand in tests; the
tracers that fill it live in :mod:`autoprec.measure.capture`, the cost and memory models read it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from autoprec._util import check_keys, check_schema, read_json, text_table, write_json
from autoprec.runtime import calls
from autoprec.runtime.calls import KINDS, Product
from autoprec.scaling import KERNEL_MULTIPLE

__all__ = ["Layer", "LayerGraph", "METHODS"]

# The tracers a graph can come from (autoprec.measure.capture), in the order "auto" tries them.
METHODS = ("export", "symbolic_trace", "hooks")
GRAPH_SCHEMA = 2


def _tuple4(value: Any, where: str) -> tuple[int, int, int, int]:
    t = tuple(int(v) for v in value)
    if len(t) != 4 or min(t) < 0:
        raise ValueError(f"{where}: a matmul is (batch, M, K, N) with non-negative ints, got "
                         f"{value!r}.")
    return t  # type: ignore[return-value]


@dataclass(frozen=True)
class Layer:
    """One module that computes, with what it computes per forward of the model."""

    # Module name as in model.named_modules() ('' is the root module).
    fqn: str
    # One of KINDS: "linear", "conv", "matmul", "embedding", "norm", "attention".
    kind: str
    # Class name of the module, e.g. "Conv1D", "Linear", "GPT2Attention".
    module_type: str
    # (batch, M, K, N) of each matmul-like op this module itself runs per forward of the model,
    # in execution order (ops of child layers excluded). Conv as implicit GEMM: batch = groups,
    # M = N*H_out*W_out, K = C_in/groups*kh*kw, N = C_out/groups. SDPA counts as its two matmuls.
    matmuls: tuple[tuple[int, int, int, int], ...] = ()
    # The registered call (autoprec.runtime.calls) that runs each of `matmuls`: "linear",
    # "addmm", "matmul", "sdpa", "conv", ... (what decides whether FP8 takes it).
    calls: tuple[str, ...] = ()
    # Forward FLOPs per forward of the model: 2*batch*M*K*N summed over matmuls; embeddings 0;
    # norms a small elementwise estimate. A module called twice counts both calls.
    flops: int = 0
    # Bytes read + written per forward at fp32 (4 bytes per floating element, integer tensors
    # at their own size): activations in, weights read, activations out of this layer.
    bytes: int = 0
    # Parameters this module owns, recursively, excluding those of child layers.
    params: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Layer {self.fqn!r} has kind {self.kind!r}; expected one of "
                             f"{', '.join(KINDS)}.")
        object.__setattr__(self, "matmuls", tuple(Product(*_tuple4(m, f"Layer {self.fqn!r}"))
                                                  for m in self.matmuls))
        object.__setattr__(self, "calls", tuple(str(c) for c in self.calls))
        unknown = [c for c in self.calls if calls.from_name(c) is None]
        if unknown or (self.calls and len(self.calls) != len(self.matmuls)):
            raise ValueError(f"Layer {self.fqn!r} has calls {self.calls!r}: one registered call "
                             f"name per matmul ({len(self.matmuls)}) is needed.")
        for name in ("flops", "bytes", "params"):
            value = getattr(self, name)
            if int(value) != value or value < 0:
                raise ValueError(f"Layer {self.fqn!r} has {name}={value!r}; it must be a "
                                 "non-negative integer.")
            object.__setattr__(self, name, int(value))

    @property
    def matmul_flops(self) -> int:
        """FLOPs of the matmuls alone (2*batch*M*K*N each)."""
        return sum(p.flops for p in self.matmuls)

    def fp8_blockers(self, multiple: int = KERNEL_MULTIPLE) -> list[str]:
        """Per matmul, why it would not run in FP8 in an fp8 region ("" where it would);
        ``multiple``: what the format's kernels need M, K, N multiples of (its
        :func:`~autoprec.scaling.shape_multiple`)."""
        names = self.calls or ("",) * len(self.matmuls)  # older records: the shape rule alone
        out = []
        for name, p in zip(names, self.matmuls):
            call = calls.from_name(name)
            out.append(calls.fp8_blocker(call, p, multiple=multiple) if call is not None
                       else calls.fp8_shape_supported(p.m, p.k, p.n, multiple)[1])
        return out

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["matmuls"] = [list(m) for m in self.matmuls]
        d["calls"] = list(self.calls)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Layer:
        names = [f.name for f in dataclasses.fields(cls)]
        check_keys(d, "layer", known=names, required=("fqn", "kind", "module_type"))
        d = dict(d)
        d["matmuls"] = tuple(tuple(m) for m in d.get("matmuls", ()))
        d["calls"] = tuple(d.get("calls", ()))
        return cls(**d)


@dataclass(frozen=True)
class LayerGraph:
    """The layers of a model in execution order and the data flow between them."""

    # type(model).__name__.
    model_name: str
    # The tracer that captured it: "export", "symbolic_trace" or "hooks".
    method: str
    # Layers in execution order (by the first op each runs).
    layers: tuple[Layer, ...]
    # (producer fqn, consumer fqn): a tensor flows from one layer to the other, possibly through
    # non-layer ops (reshape, add, gelu, ...); where the two differ in format it costs a cast.
    edges: tuple[tuple[str, str], ...] = ()
    # fqn -> index into layers; derived, not compared or saved.
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"LayerGraph method {self.method!r} is not one of "
                             f"{', '.join(METHODS)}.")
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "edges", tuple((str(a), str(b)) for a, b in self.edges))
        index = {}
        for i, layer in enumerate(self.layers):
            if layer.fqn in index:
                raise ValueError(f"LayerGraph lists layer {layer.fqn!r} twice; fqns are unique.")
            index[layer.fqn] = i
        for a, b in self.edges:
            for end in (a, b):
                if end not in index:
                    raise ValueError(f"LayerGraph edge ({a!r}, {b!r}) names {end!r}, which is "
                                     "not one of its layers.")
        object.__setattr__(self, "_index", index)

    # ------------------------------------------------------------------ lookups
    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self._index

    def layer(self, fqn: str) -> Layer:
        """The layer named ``fqn``; KeyError naming close matches when there is none."""
        try:
            return self.layers[self._index[fqn]]
        except KeyError:
            close = difflib.get_close_matches(fqn, list(self._index), n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise KeyError(f"{self.model_name} has no layer {fqn!r}.{hint}") from None

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(layer.fqn for layer in self.layers)

    def by_kind(self, kind: str) -> tuple[Layer, ...]:
        """Layers of one kind, in execution order."""
        if kind not in KINDS:
            raise ValueError(f"Unknown layer kind {kind!r}; expected one of {', '.join(KINDS)}.")
        return tuple(layer for layer in self.layers if layer.kind == kind)

    def matmul_layers(self) -> tuple[Layer, ...]:
        """Layers whose FLOPs come from matmul-like ops (linear, conv, attention, matmul)."""
        return tuple(layer for layer in self.layers if layer.matmuls)

    @property
    def total_flops(self) -> int:
        return sum(layer.flops for layer in self.layers)

    def producers(self, fqn: str) -> tuple[str, ...]:
        """Layers whose outputs flow into ``fqn``."""
        self.layer(fqn)
        return tuple(a for a, b in self.edges if b == fqn)

    def consumers(self, fqn: str) -> tuple[str, ...]:
        """Layers that read the outputs of ``fqn``."""
        self.layer(fqn)
        return tuple(b for a, b in self.edges if a == fqn)

    # ------------------------------------------------------------------ printing
    def table(self) -> str:
        """One row per layer: fqn, kind, matmul shapes (batch x M x K x N), GFLOPs, params."""
        def shape(layer: Layer) -> str:
            parts = [("x".join(map(str, m)) if m[0] > 1 else "x".join(map(str, m[1:])))
                     for m in layer.matmuls]
            text = ", ".join(parts) or "-"
            return text if len(text) <= 36 else text[:33] + "..."

        rows = [(layer.fqn or "(root)", layer.kind, layer.module_type, shape(layer),
                 f"{layer.flops / 1e9:.4f}", f"{layer.params:,}") for layer in self.layers]
        return text_table(("fqn", "kind", "type", "matmuls (b x M x K x N)", "GFLOPs", "params"),
                          rows, right=(4, 5))

    def __str__(self) -> str:
        return (f"LayerGraph of {self.model_name} ({self.method}): {len(self.layers)} layers, "
                f"{len(self.edges)} edges, {self.total_flops / 1e9:.3f} GFLOPs per forward\n"
                + self.table())

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return {"autoprec_graph": GRAPH_SCHEMA, "model_name": self.model_name,
                "method": self.method, "layers": [layer.to_dict() for layer in self.layers],
                "edges": [list(e) for e in self.edges]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerGraph:
        check_schema(d, "autoprec_graph", GRAPH_SCHEMA, "LayerGraph")
        check_keys(d, "LayerGraph", known=("autoprec_graph", "model_name", "method", "layers",
                                           "edges"),
                   required=("model_name", "method", "layers"))
        return cls(model_name=d["model_name"], method=d["method"],
                   layers=tuple(Layer.from_dict(x) for x in d["layers"]),
                   edges=tuple(tuple(e) for e in d.get("edges", ())))

    def save(self, path: str | os.PathLike) -> None:
        """Write as JSON (see :meth:`load`)."""
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> LayerGraph:
        data = read_json(path, "LayerGraph")
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path} is not a valid LayerGraph file: {e}") from e
