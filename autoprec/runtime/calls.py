"""The registry of matmul-like calls: one table that says what a call multiplies, the M, K and N
of its products, whether a precision region rounds it, and whether FP8 takes it.

Every stage that needs to know reads this table, so they cannot disagree:

- the FP8 router (:mod:`autoprec.runtime.rewrite`) quantizes a call when :func:`matmul_form`
  gives its operands and :func:`autoprec.runtime.fp8.fp8_matmul` applies the kernel's shape
  rule (:func:`fp8_shape_supported` on :func:`product_of`);
- capture (:mod:`autoprec.measure.capture`) maps the aten ops it traces to the same calls
  (:func:`from_aten`) and counts their :meth:`Call.products` as the layer's matmuls;
- sensitivity's range statistics count a call's :meth:`Call.operands` and its output, for fp8
  only where the router quantizes;
- the per-layer timing probe, the profile's fp8 blocker and the cost model ask
  :func:`fp8_blocker` which products really run in FP8;
- the guard and capture decide which modules compute with :func:`layer_kind`.

``tests/test_calls.py`` runs every registered call through all of them and checks they agree.

Argument positions are the same at the torch level (``F.linear(input, weight, bias)``,
``torch.addmm(input, mat1, mat2)``, ``Tensor.addmm(self, mat1, mat2)``) and at the aten level
(``aten.linear``, ``aten.addmm``), so one parameter list serves both. Products are computed from
shapes, so capture (which has shapes) and the router (which has tensors) use the same code.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from autoprec.scaling import KERNEL_MULTIPLE

__all__ = [
    "Call",
    "Product",
    "CALLS",
    "KINDS",
    "COMPUTING_KINDS",
    "lookup",
    "from_aten",
    "from_name",
    "product_of",
    "matmul_form",
    "fp8_shape_supported",
    "fp8_blocker",
    "layer_kind",
    "class_kind",
]

# What a module that computes is. Embedding lookups and norms compute the same in every format
# (autocast keeps norms in FP32; a lookup has no arithmetic), so only COMPUTING_KINDS are tuned
# and guarded.
KINDS = ("linear", "conv", "matmul", "embedding", "norm", "attention")
COMPUTING_KINDS = ("linear", "conv", "attention", "matmul")


class Product(NamedTuple):
    """One matrix product ``[batch] x (M, K) @ (K, N)``."""

    batch: int
    m: int
    k: int
    n: int

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n


Shape = Sequence[int]


def _prod(xs) -> int:
    # a list, not a generator: torch.compile cannot trace a generator passed to a builtin, and
    # this runs at every fp8 matmul (a graph break each)
    return math.prod([int(x) for x in xs])


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (tuple, list, torch.Size)) and all(isinstance(v, int) for v in value):
        return tuple(value)
    return None


def product_of(a: Shape, b: Shape) -> Product:
    """The product ``a @ b`` runs, with ``torch.matmul``'s semantics: a 2-D second operand takes
    every leading dimension of the first into M (one mm over all rows, as ``F.linear`` and
    :func:`~autoprec.runtime.fp8.fp8_matmul` run it); otherwise leading dimensions broadcast
    into the batch. A 1-D operand is a row (M = 1) or a column (N = 1)."""
    a, b = tuple(a), tuple(b)
    if len(a) == 1:
        a = (1, a[0])
    if len(b) == 1:
        b = (b[0], 1)
    if len(b) == 2:
        return Product(1, _prod(a[:-1]), a[-1], b[-1])
    batch = _prod(torch.broadcast_shapes(a[:-2], b[:-2]))
    return Product(batch, a[-2], a[-1], b[-1])


def fp8_shape_supported(m: int, k: int, n: int,
                        multiple: int = KERNEL_MULTIPLE) -> tuple[bool, str]:
    """Whether the scaled kernels can take an (M, K) x (K, N) product and its two backward
    products (each a multiple of ``multiple``, :func:`shape_multiple`); if not, the reason,
    for the profile and the policy."""
    bad = [f"{name}={v}" for name, v in (("M", m), ("K", k), ("N", n)) if v % multiple]
    if bad:
        kernel = "torch._scaled_mm needs" if multiple == KERNEL_MULTIPLE else \
            "block-scaled GEMMs need"
        return False, (f"{kernel} M, K and N to be multiples of {multiple} "
                       f"(forward, dgrad and wgrad); here {', '.join(bad)}: runs in bf16")
    return True, ""


def _conv_gemm(x: Shape, w: Shape, out: Shape, transposed: bool) -> Product:
    """A convolution as implicit GEMM; groups are read off the shapes, not the arguments."""
    spatial = len(w) - 2
    batched = len(x) == len(w)
    n = x[0] if batched else 1
    kernel = _prod(w[2:])
    if not transposed:  # w: [C_out, C_in/groups, *k]
        groups = max(1, x[-spatial - 1] // w[1])
        return Product(groups, n * _prod(out[-spatial:]), w[1] * kernel, w[0] // groups)
    # transposed, w: [C_in, C_out/groups, *k]: each input pixel scatters a kernel-sized patch
    groups = max(1, out[-spatial - 1] // w[1])
    return Product(groups, n * _prod(x[-spatial:]), w[0] // groups, w[1] * kernel)


def _einsum_products(equation: str, shapes: Sequence[Shape | None]) -> list[Product]:
    eq = equation.replace(" ", "")
    if "." in eq or len(shapes) != 2 or any(s is None for s in shapes):
        return []  # ellipses or >2 operands: not a product we can name
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != 2:
        return []
    a, b = terms
    if not arrow:
        out = "".join(sorted(c for c in set(a + b) if (a + b).count(c) == 1))
    sizes = {c: s for term, shape in zip(terms, shapes) for c, s in zip(term, shape)}
    dims = lambda cs: _prod(sizes[c] for c in cs)  # noqa: E731
    return [Product(dims(set(a) & set(b) & set(out)), dims(set(a) & set(out) - set(b)),
                    dims((set(a) & set(b)) - set(out)), dims(set(b) & set(out) - set(a)))]


# ------------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class Call:
    """One matmul-like call."""

    # Registry key, also the op name capture records: "linear", "addmm", "conv", "sdpa", ...
    name: str
    # Torch-level callables (what a TorchFunctionMode sees) that are this call.
    functions: tuple[Callable, ...]
    # aten op names (what torch.export and a dispatch mode see) that are this call.
    aten: tuple[str, ...]
    # Positional parameter names, the same at the torch and the aten level.
    params: tuple[str, ...]
    # The multiplied operands among params (not an additive bias, mask or ALiBi term).
    multiplied: tuple[str, ...]
    # Shapes of the bound arguments (+ the output's) -> the products the call runs.
    shapes_to_products: Callable[[dict, tuple | None], list[Product]]
    # A precision region rounds it: it is on torch.autocast's lower-precision list.
    rounded: bool = True
    # The FP8 router quantizes it; otherwise it runs bf16 inside an fp8 region.
    fp8: bool = False

    def bind(self, args: Sequence[Any], kwargs: dict | None = None) -> dict[str, Any]:
        """Argument name -> value, positional or keyword."""
        bound = dict(zip(self.params, args))
        for key, value in (kwargs or {}).items():
            if key in self.params:
                bound[key] = value
        return bound

    def operands(self, args: Sequence[Any], kwargs: dict | None = None) -> list[Any]:
        """The multiplied operands (tensors or shapes) that are present."""
        if self.name == "einsum":
            return list(_einsum_operands(args))
        bound = self.bind(args, kwargs)
        return [bound[p] for p in self.multiplied if bound.get(p) is not None]

    def products(self, args: Sequence[Any], kwargs: dict | None = None,
                 out: Any = None) -> list[Product]:
        """The products this call runs, from its arguments (tensors or shape tuples) and, for
        convolutions, its output."""
        if self.name == "einsum":
            return _einsum_products(args[0], [_shape(o) for o in _einsum_operands(args)])
        shapes = {k: _shape(v) for k, v in self.bind(args, kwargs).items()}
        shapes["transposed"] = self.bind(args, kwargs).get("transposed")
        return self.shapes_to_products(shapes, _shape(out))


def _einsum_operands(args: Sequence[Any]) -> Sequence[Any]:
    rest = args[1:]
    return rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) \
        and not all(isinstance(v, int) for v in rest[0]) else rest


def _two(p: str, q: str) -> Callable[[dict, Any], list[Product]]:
    return lambda s, out: [product_of(s[p], s[q])] if s.get(p) and s.get(q) else []


def _linear(s: dict, out) -> list[Product]:
    x, w = s.get("input"), s.get("weight")
    if not x or not w:
        return []
    return [product_of(x, (w[1], w[0]) if len(w) == 2 else (w[0], 1))]


def _mv(p: str, q: str) -> Callable[[dict, Any], list[Product]]:
    return lambda s, out: [product_of(s[p], (s[q][0], 1))] if s.get(p) and s.get(q) else []


def _sdpa(s: dict, out) -> list[Product]:
    q, k, v = s.get("query"), s.get("key"), s.get("value")
    if not (q and k and v):
        return []
    b = _prod(q[:-2])
    return [Product(b, q[-2], q[-1], k[-2]), Product(b, q[-2], k[-2], v[-1])]


def _conv(transposed: bool) -> Callable[[dict, Any], list[Product]]:
    def products(s: dict, out) -> list[Product]:
        x, w = s.get("input"), s.get("weight")
        if not (x and w and out):
            return []
        flag = s.get("transposed")
        return [_conv_gemm(x, w, out, transposed or flag is True)]
    return products


_T = torch.Tensor
_CONV_PARAMS = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed")
CALLS: tuple[Call, ...] = (
    Call("linear", (F.linear,), ("linear",), ("input", "weight", "bias"), ("input", "weight"),
         _linear, fp8=True),
    Call("addmm", (torch.addmm, _T.addmm), ("addmm",), ("input", "mat1", "mat2"),
         ("mat1", "mat2"), _two("mat1", "mat2"), fp8=True),
    Call("mm", (torch.mm, _T.mm), ("mm",), ("input", "mat2"), ("input", "mat2"),
         _two("input", "mat2"), fp8=True),
    Call("matmul", (torch.matmul, _T.matmul, _T.__matmul__), ("matmul",), ("input", "other"),
         ("input", "other"), _two("input", "other"), fp8=True),
    Call("bmm", (torch.bmm, _T.bmm), ("bmm",), ("input", "mat2"), ("input", "mat2"),
         _two("input", "mat2"), fp8=True),
    # Batched products with an additive term (ALiBi, masks): bf16 in an fp8 region.
    Call("baddbmm", (torch.baddbmm, _T.baddbmm), ("baddbmm",), ("input", "batch1", "batch2"),
         ("batch1", "batch2"), _two("batch1", "batch2")),
    Call("addbmm", (torch.addbmm, _T.addbmm), ("addbmm",), ("input", "batch1", "batch2"),
         ("batch1", "batch2"), _two("batch1", "batch2")),
    # Not on CPU autocast's lower-precision list.
    Call("mv", (torch.mv, _T.mv), ("mv",), ("input", "vec"), ("input", "vec"),
         _mv("input", "vec"), rounded=False),
    Call("addmv", (torch.addmv, _T.addmv), ("addmv",), ("input", "mat", "vec"), ("mat", "vec"),
         _mv("mat", "vec"), rounded=False),
    # Decomposes into bmm below autocast, so it is rounded like one.
    Call("einsum", (torch.einsum,), ("einsum",), ("equation",), (), lambda s, out: []),
    # PyTorch has no FP8 convolution or attention kernels: bf16 in an fp8 region.
    Call("conv", (F.conv1d, F.conv2d, F.conv3d),
         ("convolution", "_convolution", "conv1d", "conv2d", "conv3d", "mkldnn_convolution",
          "cudnn_convolution", "miopen_convolution", "_slow_conv2d_forward",
          "slow_conv3d_forward"), _CONV_PARAMS, ("input", "weight"), _conv(False)),
    Call("conv_transpose", (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d),
         ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
          "cudnn_convolution_transpose", "slow_conv_transpose2d", "slow_conv_transpose3d"),
         _CONV_PARAMS, ("input", "weight"), _conv(True)),
    Call("sdpa", (F.scaled_dot_product_attention,),
         ("scaled_dot_product_attention", "_scaled_dot_product_attention_math",
          "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
          "_scaled_dot_product_fused_attention_overrideable"),
         ("query", "key", "value", "attn_mask"), ("query", "key", "value"), _sdpa),
    # Already FP8 (someone else's): counted for FLOPs, never rounded again.
    Call("scaled_mm", (), ("_scaled_mm",), ("input", "mat2"), ("input", "mat2"),
         _two("input", "mat2"), rounded=False),
)

_BY_FUNCTION: dict[Callable, Call] = {f: c for c in CALLS for f in c.functions}
_BY_ATEN: dict[str, Call] = {a: c for c in CALLS for a in c.aten}
_BY_NAME: dict[str, Call] = {c.name: c for c in CALLS}


def lookup(func: Callable) -> Call | None:
    """The registered call a torch-level callable is, or None."""
    try:
        return _BY_FUNCTION.get(func)
    except TypeError:  # an unhashable callable is no registered call
        return None


def from_aten(name: str) -> Call | None:
    """The registered call an aten op (by its name without the ``aten::`` namespace) is."""
    return _BY_ATEN.get(name)


def from_name(name: str) -> Call | None:
    """The registered call named ``name`` (as capture records it), or None."""
    return _BY_NAME.get(name)


# ------------------------------------------------------------------------------ FP8
def matmul_form(call: Call, args: Sequence[Any], kwargs: dict | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(a, b, bias)`` with ``call(...) == a @ b + bias`` for a call the FP8 router takes, or
    None when it does not: a call FP8 has no route for, ``out=``, a ``beta``/``alpha`` other
    than 1, a non-floating or 1-D operand."""
    if not call.fp8:
        return None
    kwargs = kwargs or {}
    if "out" in kwargs or kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        return None
    bound = call.bind(args, kwargs)
    if call.name == "linear":
        a, w, bias = bound.get("input"), bound.get("weight"), bound.get("bias")
        b = w.t() if isinstance(w, torch.Tensor) else None
    elif call.name == "addmm":
        a, b, bias = bound.get("mat1"), bound.get("mat2"), bound.get("input")
    else:
        if len(args) != 2 or kwargs:
            return None
        (a, b), bias = args, None
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2
               for t in (a, b)):
        return None
    return a, b, bias


def fp8_blocker(call: Call, product: Product | None = None, *, routable: bool = True,
                multiple: int = KERNEL_MULTIPLE) -> str:
    """Why a product of ``call`` does not run in FP8 inside an fp8 region ("" when it does).
    ``routable=False``: the router declined the call's arguments (:func:`matmul_form`);
    ``multiple``: the format's :func:`shape_multiple`."""
    if call.name in ("conv", "conv_transpose"):
        return "convolution: PyTorch has no FP8 conv kernels, it runs bf16 in an fp8 region"
    if not call.fp8:
        return f"{call.name}: no FP8 route, it runs bf16 in an fp8 region"
    if not routable:
        return f"{call.name} with these arguments (1-D, out=, beta/alpha): runs bf16"
    if product is not None:
        return fp8_shape_supported(product.m, product.k, product.n, multiple)[1]
    return ""


# ------------------------------------------------------------------------------ layers
_NORM_CLASS_NAME = re.compile(r"Norm(?:[123]d)?$")
_ATTENTION_CLASS_NAME = re.compile(r"atten|attn", re.IGNORECASE)


def class_kind(module: nn.Module) -> str | None:
    """The kind of a module that is a layer by its class alone, else None."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    # HF transformers.pytorch_utils.Conv1D (GPT-2): a linear layer with a transposed weight
    # that calls torch.addmm; matched by name so that nothing here imports transformers.
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return "linear"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "embedding"
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase,
                           nn.LocalResponseNorm)) or (hasattr(nn, "RMSNorm") and
                                                      isinstance(module, nn.RMSNorm)):
        return "norm"
    if _NORM_CLASS_NAME.search(type(module).__name__):
        return "norm"
    return None


def layer_kind(module: nn.Module, own_calls: Collection[str] = ()) -> str | None:
    """What ``module`` is as a layer, from its class and the registered calls its own forward
    ran (outside its child layers), or None when it is not a layer. The one rule for "which
    modules compute": capture passes the calls it traced, the guard those it observed.

    A module of a layer class is that; any other module that runs a matmul-like call itself is
    "attention" (it runs SDPA, or its class is named like attention), "conv" (only
    convolutions) or "matmul"."""
    kind = class_kind(module)
    if kind is not None:
        return kind
    names = {n for n in own_calls if n in _BY_NAME}
    if not names:
        return None
    if "sdpa" in names or _ATTENTION_CLASS_NAME.search(type(module).__name__):
        return "attention"
    if names <= {"conv", "conv_transpose"}:
        return "conv"
    return "matmul"
