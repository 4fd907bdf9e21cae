"""Capture: which modules of a model compute, what they compute, and how data flows between them.

``capture(model, example_batch)`` runs the model once on ``example_batch`` under a tracer and
returns a :class:`LayerGraph`: the model's layers in execution order, each with the shapes of
the matmuls it runs (``(batch, M, K, N)``), its FLOPs, bytes moved and parameters, plus the
edges along which tensors flow from one layer to another (where a change of format costs a
cast). It is the input of profiling and search, and plain data: it saves to and loads from JSON.

Three tracers, tried in this order (``method="auto"``); the first that works wins:

- ``"export"``: ``torch.export.export(..., strict=False)``. Every node carries
  ``nn_module_stack`` (which module ran it) and a fake tensor with its shape. Works on HF
  GPT-2, BERT and ResNet (with ``use_cache=False``).
- ``"symbolic_trace"``: ``torch.fx`` symbolic tracing (layer modules kept as leaves) plus
  ``ShapeProp`` on the real batch. Takes some models export cannot (helpers marked with
  ``torch.fx.wrap``), fails on HF models (Python control flow on inputs).
- ``"hooks"``: runs the model eagerly under module hooks (which module is running) and a
  ``TorchDispatchMode`` (which aten ops it runs, on which tensors). Takes any model that runs.
  Its edges are real data flow too (tensors followed by identity), not just the order in which
  layers ran.

All three are read into one small op list (``_Op``) that a single builder turns into layers, so
the tracers agree on what a layer is. The export and fx graphs are walked, not run: export's
fake tensors and ShapeProp (an ``fx.Interpreter``) already put each node's shape in its meta.

What is a layer: a module that computes. Leaves by class: ``nn.Linear`` and HF ``Conv1D``
("linear"), ``nn.Conv*`` ("conv"), ``nn.Embedding`` ("embedding"), any ``*Norm``/``*Norm2d``
class ("norm"). And any other module that itself runs a matmul-like op outside its child layers,
such as GPT-2's attention running ``q @ k.T`` or ``scaled_dot_product_attention``: "attention"
(class named like attention, or an SDPA op), "conv" (functional convs only) or "matmul".
Each op is attributed to the innermost module that ran it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import operator
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from autoprec._util import class_name, split_batch, tensors
from autoprec.graph import METHODS, Layer, LayerGraph
from autoprec.measure import shards
from autoprec.runtime import calls
from autoprec.runtime.attribution import CallAttribution
from autoprec.runtime.calls import KINDS, Product, class_kind, layer_kind

__all__ = ["Layer", "LayerGraph", "CaptureError", "capture", "KINDS", "METHODS"]

logger = logging.getLogger(__name__)


# Norms cost a few elementwise ops per element (mean, variance, normalise, scale, shift); the
# exact count does not matter next to the matmuls, only that it is small and nonzero.
_NORM_FLOPS_PER_ELEMENT = 5
_FP32_BYTES = 4


class CaptureError(RuntimeError):
    """No tracer could capture the model; the message lists why each one failed."""


# ============================================================================ ops (one IR)
# The three tracers each turn what they see into a list of _Op in execution order, over
# _Values (tensors) named by hashable keys; one builder (_build) turns that into a LayerGraph.
# Normalised op names: the registry's call names (autoprec.runtime.calls) for matmul-like ops;
# "embedding", "norm", and "other".
_MATMUL_OPS = frozenset(c.name for c in calls.CALLS)
_EMBEDDING_ATEN = frozenset({"embedding", "_embedding_bag", "embedding_bag"})
_NORM_OP = re.compile(r"(?:^|_)(?:batch|layer|group|instance|rms)_norm(?:$|_)")


def _aten_name(target: Any) -> str:
    """Normalised name of an aten OpOverload: a registered call's name, "embedding", "norm",
    or "other"."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return "other"
    ns, _, name = schema.name.partition("::")
    if ns != "aten":
        return "other"
    call = calls.from_aten(name)
    if call is not None:
        return call.name
    if name in _EMBEDDING_ATEN:
        return "embedding"
    if _NORM_OP.search(name) and "backward" not in name:
        return "norm"
    return "other"


def _conv_transposed(target: Any, args: tuple) -> bool:
    name = getattr(getattr(target, "_schema", None), "name", "") or getattr(target, "__name__",
                                                                             "")
    if "transpose" in name:
        return True
    if name.endswith("convolution") and len(args) > 6 and isinstance(args[6], bool):
        return args[6]  # aten.convolution(input, weight, bias, stride, pad, dil, transposed, ..)
    return False


@dataclass
class _Value:
    """A tensor (or a tuple of them) flowing through the traced program."""

    numel: int
    nbytes: int         # at fp32: 4 per floating element, integers at their own size


@dataclass
class _Op:
    """One op the model ran, normalised across tracers."""

    name: str                                  # see _MATMUL_OPS; "embedding", "norm", "other"
    owner: str | None                          # innermost module that ran it; None: not a module
    shapes: list[tuple[int, ...] | None]       # shape of each positional tensor argument
    out: tuple[int, ...] | None                # shape of the (first) tensor output
    inputs: list[Any]                          # keys of the values it reads
    outputs: list[Any]                         # keys of the values it writes
    transposed: bool = False                   # conv only
    equation: str | None = None                # einsum only
    gather_key: Any = None                     # embedding: key of the table (read sparsely)


@dataclass
class _Trace:
    ops: list[_Op]
    values: dict[Any, _Value]

    def read_outputs(self, keys: list) -> None:
        """A last op, in no module, that reads what the model returns: values a layer makes
        and the model returns are written out of that layer."""
        self.ops.append(_Op("other", None, [], None, list(keys), []))


def _size(x: Any) -> int:
    try:
        return int(x)
    except Exception:  # an unbacked SymInt: use its example value where there is one
        hint = getattr(getattr(x, "node", None), "hint", None)
        return int(hint) if hint is not None else 1


def _bytes_at_fp32(numel: int, dtype: torch.dtype) -> int:
    if dtype.is_floating_point or dtype.is_complex:
        return numel * _FP32_BYTES * (2 if dtype.is_complex else 1)
    return numel * dtype.itemsize


def _tensor_leaves(obj: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor in a nested value (fake tensors, TensorMetadata, lists)."""
    out: list = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append((tuple(_size(s) for s in x.shape), x.dtype))
        elif isinstance(x, TensorMetadata):
            out.append((tuple(_size(s) for s in x.shape), x.dtype))
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif isinstance(x, Mapping):
            for y in x.values():
                visit(y)

    visit(obj)
    return out


def _value_of(leaves: list) -> _Value:
    return _Value(numel=sum(math.prod(s) for s, _ in leaves),
                  nbytes=sum(_bytes_at_fp32(math.prod(s), d) for s, d in leaves))


# ============================================================================ FLOPs per op
def _op_matmuls(op: _Op) -> list[Product]:
    """The products a matmul-like op runs, as the call registry computes them."""
    call = calls.from_name(op.name)
    if call is None:
        return []
    if op.name == "einsum":
        args: list = [op.equation or "", *op.shapes]
    elif op.name in ("conv", "conv_transpose"):
        args = [*op.shapes[:2], None, None, None, None, op.transposed]
    else:
        args = list(op.shapes)
    try:
        return call.products(args, out=op.out)
    except (IndexError, TypeError, ValueError) as e:
        raise RuntimeError(f"Cannot read the matmul shape of a {op.name} op with argument shapes "
                           f"{op.shapes} (output {op.out}).") from e


def _prod(xs) -> int:
    return math.prod(int(x) for x in xs)


# ============================================================================ tracer: export
class _Modules:
    """Maps the module paths tracers report to canonical names in model.named_modules()."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.by_id = {}
        for fqn, m in model.named_modules(remove_duplicate=True):
            self.by_id.setdefault(id(m), fqn)
        self.modules = dict(model.named_modules())
        self._cache: dict[str, str] = {}

    def canon(self, path: str) -> str:
        if path in self._cache:
            return self._cache[path]
        clean = re.sub(r"\[(\w+)\]", r".\1", path).strip(".")
        if clean.startswith("L__self__"):
            clean = clean[len("L__self__"):].strip(".")
        fqn = ""
        probe = clean
        while probe:
            try:
                fqn = self.by_id.get(id(self.model.get_submodule(probe)), probe)
                break
            except AttributeError:
                probe = probe.rpartition(".")[0]
        self._cache[path] = fqn
        return fqn

    def owner(self, meta: Mapping[str, Any]) -> str:
        stack = meta.get("nn_module_stack") or {}
        if not stack:
            return ""
        path = list(stack.values())[-1][0]
        return self.canon(path)


def _trace_export(model: nn.Module, args: tuple, kwargs: dict, modules: _Modules) -> _Trace:
    ep = torch.export.export(model, args, kwargs, strict=False)
    trace = _Trace(ops=[], values={})
    outputs = _walk_fx(ep.graph_module, modules, trace, env={}, scope=("export",))
    trace.read_outputs([k for k in outputs if k is not None])
    return trace


class _Outputs(tuple):
    """Value keys of an inlined subgraph's outputs; the getitem nodes after it index this."""


def _read(env: dict, nodes: list) -> list:
    keys: list = []
    for n in nodes:
        k = env.get(n)
        if isinstance(k, _Outputs):
            keys.extend(x for x in k if x is not None)
        elif k is not None:
            keys.append(k)
    return keys


def _walk_fx(gm: fx.GraphModule, modules: _Modules, trace: _Trace, env: dict, scope: tuple,
             shape_key: str = "val") -> list:
    """Append the ops of an export graph (aten ops, ``val`` metadata) or an fx graph
    (``tensor_meta``) to ``trace``; returns the keys of what the graph outputs, by position.
    Higher-order ops with one subgraph (grad-mode and autocast regions) are walked inline."""
    for node in gm.graph.nodes:
        key = (*scope, node.name)
        try:
            if node.op == "placeholder":
                if node not in env:  # top level: a model input, parameter or buffer
                    trace.values[key] = _value_of(_tensor_leaves(node.meta.get(shape_key)))
                    env[node] = key
                continue
            if node.op == "get_attr":
                attr = _getattr_path(gm, node.target)
                if isinstance(attr, torch.Tensor):
                    trace.values[key] = _value_of(_tensor_leaves(attr))
                    env[node] = key
                continue
            if node.op == "output":
                outs = node.args[0]
                if isinstance(outs, (tuple, list)) and all(isinstance(a, fx.Node) or a is None
                                                           for a in outs):
                    return [env.get(a) for a in outs]  # by position: getitem indexes it
                return _read(env, node.all_input_nodes)  # a dict or a nested structure
            if (node.target is operator.getitem and isinstance(env.get(node.args[0]), _Outputs)
                    and isinstance(node.args[1], int)):
                env[node] = env[node.args[0]][node.args[1]]  # an alias, not an op
                continue
            if node.op == "call_function" and _is_inlinable_hop(gm, node):
                # The subgraph's ops run as if inline; the HOP itself computes nothing.
                sub, operands = _hop_subgraph(gm, node)
                placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
                sub_env = {ph: env[a] for ph, a in zip(placeholders, operands) if a in env}
                env[node] = _Outputs(_walk_fx(sub, modules, trace, sub_env, key, shape_key))
                continue
            trace.values[key] = _value_of(_tensor_leaves(node.meta.get(shape_key)))
            op = _fx_node_op(gm, node, modules, env, shape_key, trace)
            op.outputs = [key]
            env[node] = key
            trace.ops.append(op)
        except Exception as e:
            raise RuntimeError(f"autoprec.capture could not read node {node.format_node()} of "
                               f"{type(modules.model).__name__}: {e}") from e
    return []


def _getattr_path(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _hop_subgraph(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.GraphModule, list]:
    subs = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.op == "get_attr"
            and isinstance(_getattr_path(gm, a.target), fx.GraphModule)]
    i = subs[0]
    operands = [a for a in node.args[i + 1:] if isinstance(a, fx.Node)]
    return _getattr_path(gm, node.args[i].target), operands


def _is_inlinable_hop(gm: fx.GraphModule, node: fx.Node) -> bool:
    if not isinstance(node.target, torch._ops.HigherOrderOperator):
        return False
    subs = [a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"
            and isinstance(_getattr_path(gm, a.target), fx.GraphModule)]
    # One subgraph (wrap_with_set_grad_enabled, wrap_with_autocast, ...): it runs exactly once.
    # Control flow (cond: two branches, one runs) stays opaque rather than double counted.
    return len(subs) == 1


def _shape_of(node: Any, shape_key: str) -> tuple[int, ...] | None:
    """Shape of a node that holds one tensor; None for anything else."""
    if not isinstance(node, fx.Node):
        return None
    leaves = _tensor_leaves(node.meta.get(shape_key))
    return leaves[0][0] if len(leaves) == 1 else None


# fx (symbolic_trace) call_function / call_method targets that are not registered calls,
# normalised like aten ops; registered calls are looked up in the registry.
_FX_FUNCTIONS: dict[Any, str] = {
    F.embedding: "embedding", operator.matmul: "matmul",
    F.layer_norm: "norm", F.group_norm: "norm", F.batch_norm: "norm", F.instance_norm: "norm",
}
if hasattr(F, "rms_norm"):
    _FX_FUNCTIONS[F.rms_norm] = "norm"


def _fx_function_name(target: Any) -> str:
    call = calls.lookup(target)
    return call.name if call is not None else _FX_FUNCTIONS.get(target, "other")


def _fx_method_name(name: str) -> str:
    call = calls.lookup(getattr(torch.Tensor, str(name), None))
    return call.name if call is not None else "other"


def _fx_node_op(gm: fx.GraphModule, node: fx.Node, modules: _Modules, env: dict,
                shape_key: str, trace: _Trace) -> Any:
    inputs = _read(env, node.all_input_nodes)
    out_leaves = _tensor_leaves(node.meta.get(shape_key))
    out = out_leaves[0][0] if out_leaves else None
    shapes = [_shape_of(a, shape_key) for a in node.args]
    if node.op == "call_module":
        op = _module_op(modules, node, inputs, shapes, out)
        # A leaf module's parameters and floating buffers (BN running stats) are no graph
        # inputs: read them as weight values.
        leaf = modules.model.get_submodule(node.target)
        weights = [*leaf.named_parameters(),
                   *((n, b) for n, b in leaf.named_buffers() if b.is_floating_point())]
        for pname, p in weights:
            key = ("param", id(p))
            trace.values.setdefault(key, _value_of(_tensor_leaves(p)))
            op.inputs.append(key)
            if op.name == "embedding" and pname == "weight":
                op.gather_key = key
        return op
    owner = modules.owner(node.meta)
    if node.op == "call_function" and hasattr(node.target, "_schema"):
        name = _aten_name(node.target)
    elif node.op == "call_function":
        name = _fx_function_name(node.target)
    elif node.op == "call_method":
        name = _fx_method_name(node.target)
    else:
        name = "other"
    op = _Op(name, owner, shapes, out, inputs, [])
    if name in ("conv", "conv_transpose"):
        op.transposed = _conv_transposed(node.target, node.args)
    elif name == "einsum":
        op.equation = node.args[0] if isinstance(node.args[0], str) else None
        operands = node.args[1] if len(node.args) == 2 and isinstance(node.args[1],
                                                                      (list, tuple)) \
            else node.args[1:]
        op.shapes = [_shape_of(a, shape_key) for a in operands]
    elif name == "embedding":
        if node.target is F.embedding:  # F.embedding(input, weight); aten is (weight, input)
            op.shapes = shapes[1::-1] + shapes[2:]
            table = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        else:
            table = node.args[0]
        op.gather_key = env.get(table)
    return op


def _module_op(modules: _Modules, node: fx.Node, inputs: list, shapes: list,
               out: tuple | None) -> _Op:
    """A call_module node: a layer the fx tracer kept as a leaf, read from the module itself."""
    fqn = modules.canon(node.target)
    module = modules.modules.get(fqn) or modules.model.get_submodule(node.target)
    kind = class_kind(module)
    x = shapes[0] if shapes else None
    if kind == "linear":
        w = tuple(module.weight.shape)
        if isinstance(module, nn.Linear):
            return _Op("linear", fqn, [x, w], out, inputs, [])
        # HF Conv1D runs torch.addmm(bias, x.view(-1, in), weight [in, out])
        rows = (math.prod(x[:-1]), x[-1]) if x else None
        return _Op("addmm", fqn, [(w[1],), rows, w], out, inputs, [])
    if kind == "conv":
        return _Op("conv", fqn, [x, tuple(module.weight.shape)], out, inputs, [],
                   transposed=bool(getattr(module, "transposed", False)))
    if kind == "embedding":
        return _Op("embedding", fqn, [tuple(module.weight.shape), x], out, inputs, [])
    if kind == "norm":
        return _Op("norm", fqn, shapes, out, inputs, [])
    return _Op("other", fqn, shapes, out, inputs, [])


# ============================================================================ tracer: fx
class _LayerTracer(fx.Tracer):
    """Keeps every layer-class module a leaf (so HF Conv1D or custom norms are not traced
    through) besides torch.nn's own leaves."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return class_kind(m) is not None or super().is_leaf_module(m, module_qualified_name)


def _trace_fx(model: nn.Module, args: tuple, kwargs: dict, modules: _Modules) -> _Trace:
    tracer = _LayerTracer()
    graph = tracer.trace(model)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    # ShapeProp takes positional args in placeholder order: bind the batch to the signature.
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = []
    for ph in placeholders:
        name = ph.target.lstrip("*")
        if name not in bound.arguments:
            raise RuntimeError(f"symbolic_trace made an input {ph.target!r} that the batch does "
                               "not provide.")
        values.append(bound.arguments[name])
    with torch.no_grad():
        ShapeProp(gm).propagate(*values)
    trace = _Trace(ops=[], values={})
    outputs = _walk_fx(gm, modules, trace, env={}, scope=("fx",), shape_key="tensor_meta")
    trace.read_outputs([k for k in outputs if k is not None])
    return trace


# ============================================================================ tracer: hooks
class _HookState:
    """What the hooks tracer has seen: the trace, the module stack, the value key of each live
    tensor, and the registered calls running now."""

    def __init__(self):
        self.trace = _Trace(ops=[], values={})
        # the modules running now, innermost last (kept by _CallLog, read by _OpLog too)
        self.stack: list[str] = []
        self.keys = WeakTensorKeyDictionary()  # tensor -> key of the value it holds now
        self.counter = iter(range(1 << 62))
        # registered calls running now: their aten ops are theirs, not ops of their own
        self.inside: list = []

    def key_of(self, t: torch.Tensor, new: bool = False) -> Any:
        if not new and t in self.keys:
            return self.keys[t]
        key = ("hooks", next(self.counter))
        self.trace.values[key] = _value_of(_tensor_leaves(t))
        self.keys[t] = key
        return key

    @property
    def owner(self) -> str:
        return self.stack[-1] if self.stack else ""


class _CallLog(CallAttribution):
    """Records matmul-like calls as the registry's calls, as the FP8 router sees them
    (F.linear, not the t + addmm it becomes below autograd; einsum, not its bmm), each in the
    innermost running module (the stack it keeps is the state's, which _OpLog reads too)."""

    def __init__(self, state: _HookState):
        super().__init__()
        self.state = state
        self.running = state.stack

    def attribute(self, call: calls.Call, func: Callable, args: tuple, kwargs: dict) -> Any:
        st = self.state
        if st.inside:
            return func(*args, **kwargs)
        st.inside.append(call)
        try:
            result = func(*args, **kwargs)
        finally:
            st.inside.pop()
        try:
            st.trace.ops.append(_call_op(call, args, kwargs, result, self.owner(), st.key_of))
        except Exception as e:
            raise RuntimeError(f"autoprec.capture(method='hooks') could not record {call.name} "
                               f"in module {self.owner() or '(root)'!r}: {e}") from e
        return result


class _OpLog(TorchDispatchMode):
    """Records the other aten ops, after autograd and composite decomposition (F.layer_norm as
    native_layer_norm), for data flow, bytes, norms and embeddings."""

    def __init__(self, state: _HookState):
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        st = self.state
        if st.inside:
            return result
        try:
            name = _aten_name(func)
            shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args]
            ins = [st.key_of(t) for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
            op = _Op(name, st.owner, shapes, tuple(outs[0].shape) if outs else None, ins, [])
            if name in ("conv", "conv_transpose"):
                op.transposed = _conv_transposed(func, args)
            elif name == "embedding" and isinstance(args[0], torch.Tensor):
                op.gather_key = st.key_of(args[0])
            # Every output is a new value, even an in-place op's: it is a new version.
            op.outputs = [st.key_of(t, new=True) for t in outs]
            st.trace.ops.append(op)
        except Exception as e:
            raise RuntimeError(f"autoprec.capture(method='hooks') could not record {func} "
                               f"in module {st.owner or '(root)'!r}: {e}") from e
        return result


def _trace_hooks(model: nn.Module, args: tuple, kwargs: dict, modules: _Modules) -> _Trace:
    st = _HookState()
    log = _CallLog(st)
    handles = []
    try:
        handles = log.track(model.named_modules())
        with torch.no_grad(), _OpLog(st), log:
            result = model(*args, **kwargs)
        st.trace.read_outputs([st.keys[t] for t in tensors(result) if t in st.keys])
    finally:
        for h in handles:
            h.remove()
    return st.trace


def _call_op(call: calls.Call, args: tuple, kwargs: dict, result: Any, owner: str,
             key_of: Callable) -> _Op:
    """One registered call as an op: its argument shapes (in the registry's parameter order,
    or the operands of an einsum), the tensors it reads, what it made."""
    def shape(value: Any) -> tuple[int, ...] | None:
        return tuple(value.shape) if isinstance(value, torch.Tensor) else None

    if call.name == "einsum":
        shapes = [shape(t) for t in call.operands(args, kwargs)]
    else:
        bound = call.bind(args, kwargs)
        shapes = [shape(bound.get(p)) for p in call.params]
    ins = [key_of(t) for t in tree_leaves([*args, *kwargs.values()])
           if isinstance(t, torch.Tensor)]
    outs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
    op = _Op(call.name, owner, shapes, tuple(outs[0].shape) if outs else None, ins, [],
             transposed=call.name == "conv_transpose",
             equation=args[0] if call.name == "einsum" and isinstance(args[0], str) else None)
    op.outputs = [key_of(t, new=True) for t in outs]
    return op


# ============================================================================ builder
def _build(model: nn.Module, trace: _Trace, method: str, modules: _Modules) -> LayerGraph:
    ops = trace.ops
    own: dict[str, list[int]] = {}  # module fqn -> indices of the ops it ran itself
    for i, op in enumerate(ops):
        if op.owner is not None:
            own.setdefault(op.owner, []).append(i)

    # Which modules are layers (runtime.calls.layer_kind, the rule the guard uses too): layer
    # classes that ran ops of their own, and any module that itself ran a matmul-like op
    # outside its child layers.
    kinds: dict[str, str] = {}
    for fqn, idx in own.items():
        module = modules.modules.get(fqn)
        kind = None if module is None else layer_kind(module, {ops[i].name for i in idx})
        if kind is not None:
            kinds[fqn] = kind

    # An op belongs to a layer when that layer is the innermost module running it. Ops of
    # non-layer modules (GELU, dropout, the residual add of a block), also those nested inside
    # a layer, belong to none: they compute in whatever format reaches them and cost no cast.
    regions = [op.owner if op.owner in kinds else None for op in ops]
    order = {fqn: _first(own[fqn], ops) for fqn in kinds}

    producer_op, consumed_outside, edges = _data_flow(ops, regions, order)
    layers = []
    for fqn in sorted(kinds, key=order.__getitem__):
        kind = kinds[fqn]
        module = modules.modules[fqn]
        found = [(m, ops[i].name) for i in own[fqn] if ops[i].name in _MATMUL_OPS
                 for m in _op_matmuls(ops[i])]
        nbytes, out_numel = _region_bytes(ops, own[fqn], trace.values, producer_op,
                                          consumed_outside)
        flops = sum(m.flops for m, _ in found)
        if kind == "norm":
            flops += _NORM_FLOPS_PER_ELEMENT * out_numel
        layers.append(Layer(fqn=fqn, kind=kind, module_type=type(module).__name__,
                            matmuls=tuple(m for m, _ in found),
                            calls=tuple(name for _, name in found), flops=flops, bytes=nbytes,
                            params=_own_params(module, fqn, kinds)))
    return LayerGraph(model_name=class_name(model), method=method, layers=tuple(layers),
                      edges=tuple(edges))


def _data_flow(ops: list[_Op], regions: list[str | None], order: dict[str, int]):
    """Each value remembers the layers whose outputs reach it through non-layer ops. Returns
    (value key -> index of the op that made it, values read outside the layer that made them,
    layer edges)."""
    producer_op: dict[Any, int] = {}
    sources: dict[Any, frozenset] = {}
    edges: dict[tuple[str, str], None] = {}
    consumed_outside: set = set()
    for i, op in enumerate(ops):
        reg = regions[i]
        src: set = set()
        for k in op.inputs:
            src |= sources.get(k, frozenset())
            p = producer_op.get(k)
            if p is not None and regions[p] != reg:
                consumed_outside.add(k)
        if reg is not None:
            for p in sorted(src - {reg}, key=order.__getitem__):
                edges[(p, reg)] = None
            src = {reg}
        for k in op.outputs:
            producer_op[k] = i
            sources[k] = frozenset(src)
    return producer_op, consumed_outside, edges


def _first(idx: list[int], ops: list[_Op]) -> int:
    """Where a layer sits in execution order: at its first computing op (so BERT's attention,
    whose reshapes of q run before k and v are projected, sorts after v at its SDPA), else at
    its first op."""
    return next((i for i in idx if ops[i].name != "other"), idx[0])


def _region_bytes(ops: list[_Op], idx: list[int], values: dict[Any, _Value],
                  producer_op: dict[Any, int], consumed_outside: set) -> tuple[int, int]:
    """Bytes a layer's region reads and writes at fp32 (values from outside it, weights, and
    values it makes that are read outside it), and the element count of those outputs."""
    members = set(idx)
    reads: dict[Any, int] = {}
    writes: dict[Any, int] = {}
    for i in idx:
        op = ops[i]
        for k in op.inputs:
            if producer_op.get(k) in members or k not in values:
                continue
            nbytes = values[k].nbytes
            if k == op.gather_key and op.out is not None:
                # An embedding reads only the rows it gathers, not the whole table.
                nbytes = min(nbytes, _prod(op.out) * _FP32_BYTES)
            reads[k] = max(reads.get(k, 0), nbytes)
        for k in op.outputs:
            if k in consumed_outside and k in values:
                writes[k] = values[k].nbytes
    out_numel = sum(values[k].numel for k in writes)
    return sum(reads.values()) + sum(writes.values()), out_numel


def _own_params(module: nn.Module, fqn: str, kinds: dict) -> int:
    """Parameters of ``module`` and its descendants, except those inside child layers."""
    seen: set[int] = set()
    total = 0

    def visit(m: nn.Module, name: str) -> None:
        nonlocal total
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        for child_name, child in m.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if full not in kinds:
                visit(child, full)

    visit(module, fqn)
    return total


# ============================================================================ capture
_TRACERS = {"export": _trace_export, "symbolic_trace": _trace_fx, "hooks": _trace_hooks}


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode for the capture (no dropout, BN running stats), each module's flag restored."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


@contextlib.contextmanager
def _quiet_failures() -> Iterator[None]:
    """Hold back what a tracer writes to stderr and torch's shape-guard warnings while it
    tries: a failed export prints its partial graph and a warning before raising, which is noise
    when capture then falls back. What a successful attempt wrote is passed on."""
    import io
    import sys

    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    buffer = io.StringIO()
    shapes_log.setLevel(logging.ERROR)
    ok = False
    try:
        with contextlib.redirect_stderr(buffer), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        ok = True
    finally:
        shapes_log.setLevel(level)
        if ok:
            sys.stderr.write(buffer.getvalue())
            for w in caught:  # re-issued under the caller's filters
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        elif buffer.getvalue():
            logger.debug("tracer output before it failed:\n%s", buffer.getvalue())


def capture(model: nn.Module, example_batch: Any, *, method: str = "auto") -> LayerGraph:
    """The layers of ``model``, with shapes, FLOPs and data flow, from one forward on
    ``example_batch``.

    The model runs in eval mode and is left as it was (training flags restored, no hooks
    left).

    Args:
        model: the model to capture.
        example_batch: what the model takes: a dict (``model(**batch)``), a tuple or list
            (``model(*batch)``) or a tensor (``model(batch)``).
        method: ``"auto"`` (try ``"export"``, then ``"symbolic_trace"``, then ``"hooks"``;
            only ``"hooks"`` for a model FSDP2 shards) or one of them to force it.

    Returns:
        A :class:`~autoprec.graph.LayerGraph`: the layers in execution order and the data
        flow between them.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``method`` is none of the above.
        CaptureError: no tracer could capture the model (the message lists why each one
            failed), or the forced ``method`` could not.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture(model, example_batch) needs an nn.Module, got "
                        f"{type(model).__name__}.")
    if method != "auto" and method not in METHODS:
        raise ValueError(f"Unknown capture method {method!r}; expected 'auto' or one of "
                         f"{', '.join(map(repr, METHODS))}.")
    args, kwargs = split_batch(example_batch)
    modules = _Modules(model)
    tried = METHODS if method == "auto" else (method,)
    if method == "auto" and shards.is_sharded(model):
        # FSDP2 all-gathers in its hooks: only a real forward runs them (a failed export
        # leaves its units half set up)
        tried = ("hooks",)
    failures: list[tuple[str, BaseException]] = []
    with _eval_mode(model):
        for name in tried:
            try:
                quiet = _quiet_failures() if method == "auto" else contextlib.nullcontext()
                with quiet:
                    trace = _TRACERS[name](model, args, kwargs, modules)
            except Exception as e:  # noqa: BLE001 - any tracer failure means: try the next one
                if method != "auto":
                    raise CaptureError(f"capture(method={name!r}) could not trace "
                                       f"{type(model).__name__}: {type(e).__name__}: "
                                       f"{_first_line(e)}. Try method='auto' or 'hooks'.") from e
                logger.info("autoprec.capture: %s could not trace %s (%s: %s); trying the next "
                            "method.", name, type(model).__name__, type(e).__name__,
                            _first_line(e))
                failures.append((name, e))
                continue
            # Building is not a tracer failure: a bug there should surface, not fall back.
            return _build(model, trace, name, modules)
    reasons = "; ".join(f"{n}: {type(e).__name__}: {_first_line(e)}" for n, e in failures)
    raise CaptureError(f"No method could capture {type(model).__name__} ({reasons}). Check that "
                       "model(**batch) / model(*batch) / model(batch) runs on example_batch.") \
        from failures[-1][1]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= 200 else line[:197] + "..."
