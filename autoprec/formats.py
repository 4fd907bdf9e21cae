"""Numeric formats a layer can compute in: what each computes per GEMM, and their ranges.

A *format* names how the matmul-like work of a layer is computed; parameters always stay
FP32 master weights. The formats and what they mean:

- ``fp32``: autocast off inside the layer, floating inputs upcast to FP32 (the reference).
- ``bf16``: ``torch.autocast(dtype=torch.bfloat16)``: matmul/conv inputs in BF16 with FP32
  accumulation, autocast's per-op rules for everything else (norms, softmax in FP32).
- ``fp16``: the same with ``torch.float16``; training needs loss scaling (GradScaler).
- ``fp8`` with a recipe (torchao's names): matmul-like calls get FP8 operands with dynamic
  scales and a BF16 output (see :mod:`autoprec.runtime.fp8`); the rest of the layer runs as
  ``bf16``. Real on CUDA devices of compute capability 8.9 or newer (rowwise: 9.0), emulated
  elsewhere. Written ``fp8`` (the policy's default recipe, tensorwise unless it says otherwise)
  or ``fp8:<recipe>``:

  - ``fp8`` / ``fp8:tensorwise``: one scale per tensor; E4M3 operands, E5M2 gradients;
  - ``fp8:rowwise``: one scale per row of each operand (along the contracted dimension), E4M3
    everywhere, gradients included;
  - ``fp8:rowwise_with_gw_hp``: rowwise, with the weight-gradient product in BF16.
- Blackwell's block-scaled formats (:mod:`autoprec.blockscale` has their rounding;
  real kernels on CUDA compute capability 10.0, through torchao where it has them, emulated
  everywhere by autoprec's own kernel):

  - ``mxfp8`` (torchao's ``mxfp8_rceil``, Megatron's ``mxfp8``): every operand of all three
    GEMMs in E4M3 with one power-of-two (E8M0) scale per 32 values along that GEMM's
    contraction, the scale rounded up (RCEIL);
  - ``mxfp8:gw_hp``: the same with the weight-gradient GEMM in BF16;
  - ``nvfp4`` (NVIDIA's training recipe): E2M1 values with an E4M3 scale per 16 along the
    contraction and an FP32 scale per tensor; the gradients rounded stochastically, and the
    weight-gradient GEMM's operands through a 16-point random Hadamard transform;
  - ``nvfp4:plain``: the same rounding to nearest everywhere, without the transform.

  The fp8 formats, FP8 recipes and these alike are "scaled" formats (:attr:`Numerics.is_scaled`
  is true of all: their products go through autoprec's scaled-GEMM router and return BF16);
  a bare ``fp8`` means the FP8 recipes only.

**Per-GEMM precision.** A format names what each of its three GEMMs computes, so the recipes
above are points of a space: :func:`per_gemm` gives the format whose forward, input-gradient
and weight-gradient GEMMs are those of three formats, spelled ``fwd/dgrad/wgrad``
(``nvfp4/mxfp8/mxfp8``); any such spelling parses, a bare ``fp8`` in it meaning the policy's
recipe as it does alone. A mix is a value, not a registration: it is named by what it computes
(each GEMM by the first registered format that has it: ``nvfp4:plain/bf16/bf16`` is
``nvfp4/bf16/bf16``, the same forward), made once and kept (so ``is`` works), and listed by
``Format`` after the registered formats in an order of its own: which mixes some input
happened to spell earlier changes no result (mixes never enter what "every format" means:
:meth:`Format.registered`).

**Formats as data.** What a format computes is a frozen :class:`Numerics`: per GEMM of a
layer's product (forward ``a @ b``, input gradient ``grad @ b.T``, weight gradient
``a.T @ grad``) a :class:`Gemm` saying what its two operands are cast to and how they are
scaled, plus the autocast dtype of the rest of the layer, the dtype its activations leave in,
loss scaling, the format it demotes to and the names other stacks give it (torchao's recipe,
Megatron's). Every format is one entry of one factory, :func:`register` (the built-ins are the
table ``_BUILTINS`` below); consumers (emulation, engines, cost and memory models, selection,
exports) read these fields and never compare a format's spelling. :class:`Format` is an
interned ``str`` (``Format.FP8 == "fp8"``, ``is`` works, pickles and deep-copies to the same
object) whose class iterates over the registered formats, built-ins first.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from autoprec._util import quoted
from autoprec.scaling import (
    FP4_E2M1,
    FP8_E4M3,
    FP8_E5M2,
    NONE,
    Scaling,
    scaling_named,
    scalings,
    shape_multiple,
)

__all__ = [
    "Format",
    "Gemm",
    "per_gemm",
    "Numerics",
    "register",
    "unregister",
    "fp8_recipes",
    "torchao_takes",
    "Support",
    "FP8_E4M3",
    "FP8_E5M2",
    "FP4_E2M1",
    "BLOCK_FORMATS",
    "FORMAT_ORDER",
    "FP8_RECIPES",
    "FP8_FORMATS",
    "GROUPS",
    "format_group",
    "in_group",
    "expand_formats",
]

@dataclass(frozen=True)
class Gemm:
    """One GEMM of a layer's product: what its two operands are cast to, and their scales."""

    # the dtypes of the first and second operand in the kernel
    a: torch.dtype
    b: torch.dtype
    # how the operands are scaled: a registered scaling's name (autoprec.scaling), read back
    # as the Scaling object; FP8 and FP4 operands need one
    scaling: str = "none"
    # scales rounded down to powers of two (torchao's rowwise recipes)
    pow2_scales: bool = False
    # mx: how the E8M0 scale's exponent is rounded, "rceil" (up, NVIDIA's) or "floor" (OCP's)
    rounding: str = ""
    # nvfp4: both operands through a 16-point random Hadamard transform along the contraction
    # (it cancels in the product and spreads outliers over their block)
    hadamard: bool = False
    # nvfp4: the gradient operand (dgrad's first, wgrad's second) rounded stochastically
    stochastic: bool = False

    def __post_init__(self):
        s = scaling_named(self.scaling)
        object.__setattr__(self, "scaling", s)
        low = any(d in t.elements for t in scalings() for d in (self.a, self.b))
        if s.is_scaled != low:
            raise ValueError(f"A Gemm of {self.a} x {self.b} with scaling {quoted(s)}: FP8 "
                             "and FP4 operands need scales (tensor, row, mx or nvfp4), other "
                             "dtypes none.")
        if low and not {self.a, self.b} <= set(s.elements):
            raise ValueError(f"A Gemm with {s} scaling takes operands in "
                             f"{', '.join(map(str, s.elements))}, not {self.a} x {self.b}.")
        if not self.rounding:
            object.__setattr__(self, "rounding", s.roundings[0])
        if self.rounding not in s.roundings:
            ways = f"round by one of {', '.join(s.roundings)}" if any(s.roundings) else \
                "take no rounding"
            raise ValueError(f"Gemm rounding {quoted(self.rounding)}: {s} scales {ways}.")
        if (self.hadamard or self.stochastic) and not s.transforms:
            raise ValueError("The Hadamard transform and stochastic rounding are NVFP4's; a "
                             f"Gemm with {s} scaling takes neither.")

    @property
    def is_scaled(self) -> bool:
        """Whether the GEMM is scaled low precision (FP8, MXFP8 or NVFP4)."""
        return self.scaling.is_scaled

    @property
    def block(self) -> int | None:
        """Values per scale along the contraction for block scalings (32, 16), else None."""
        return self.scaling.block

    @property
    def operand_bytes(self) -> float:
        """Bytes per element the kernel reads of each operand (the wider of the two), block
        scales included (an FP4 value is half a byte)."""
        bits = max(4 if d is FP4_E2M1 else 8 * d.itemsize for d in (self.a, self.b))
        return bits / 8 + self.scaling.scale_bytes

    @property
    def precision_rank(self) -> float:
        if self.a is torch.float32:
            return 0.0
        return self.scaling.precision


def _plain(dtype: torch.dtype) -> Gemm:
    return Gemm(dtype, dtype)


@dataclass(frozen=True)
class Numerics:
    """What one format computes: the frozen description every consumer reads."""

    # the policy's spelling (``fp8`` for tensorwise) and the full name for tables
    name: str
    label: str
    # forward (a @ b), input gradient (grad @ b.T), weight gradient (a.T @ grad)
    fwd: Gemm
    dgrad: Gemm
    wgrad: Gemm
    # dtype autocast runs the rest of the layer in; None: autocast off (fp32)
    autocast: torch.dtype | None
    # dtype the layer's activations leave in (an FP8 product returns BF16)
    output: torch.dtype
    # the name of the format the guard demotes to (one step towards safety)
    demotes_to: str
    # training needs a GradScaler
    loss_scaling: bool = False
    # autoprec's FP8 recipe (what follows ``fp8:``), torchao's name for the same numbers
    # (Float8LinearConfig.from_recipe_name) and Megatron-Core's Fp8Recipe; None: none has it
    recipe: str | None = None
    torchao_recipe: str | None = None
    megatron_recipe: str | None = None
    # the torchtitan Linear that computes exactly these numerics, besides torchao's
    # Float8Linear (which an FP8 recipe with a torchao name runs as): "MXFP8Linear",
    # "NVFP4Linear"; None: none
    torchtitan_linear: str | None = None

    @property
    def gemms(self) -> dict[str, Gemm]:
        return {"fwd": self.fwd, "dgrad": self.dgrad, "wgrad": self.wgrad}

    @property
    def is_scaled(self) -> bool:
        """Whether any GEMM runs in FP8 (the layer's products go through an FP8 kernel)."""
        return any(g.is_scaled for g in self.gemms.values())

    @property
    def compute(self) -> torch.dtype:
        """The dtype of the forward operands (E4M3 in every FP8 recipe): the range that counts."""
        return self.fwd.a

    @property
    def scaling(self) -> Scaling:
        """The scaled GEMMs' scaling (the first's), ``none`` without scaled GEMMs."""
        return next((g.scaling for g in self.gemms.values() if g.is_scaled), NONE)

    @property
    def high_precision(self) -> tuple[str, ...]:
        """The GEMMs of an FP8 format that stay in 16 bits (``("wgrad",)`` for gw_hp)."""
        if not self.is_scaled:
            return ()
        return tuple(k for k, g in self.gemms.items() if not g.is_scaled)

    @property
    def saves_quantized(self) -> bool:
        """autoprec's FP8 kernel keeps the quantized forward operands for backward: a
        per-tensor scale is the same along either axis, so dgrad and wgrad reuse them; a
        row-scaled recipe saves its inputs and quantizes them again along each contraction
        (so does every format with a GEMM not tensor-scaled)."""
        return all(g.scaling.one_scale for g in self.gemms.values())

    @property
    def is_block_scaled(self) -> bool:
        """Whether any GEMM has block scales (MX, NVFP4): Blackwell's formats."""
        return bool(self.fwd.block or self.dgrad.block or self.wgrad.block)

    @property
    def block(self) -> int:
        """The largest block along a contraction (1 without block scales): each of M, K and N
        of a product must be a multiple of it (each is contracted by one of the GEMMs)."""
        return max([self.fwd.block or 1, self.dgrad.block or 1, self.wgrad.block or 1])

    @property
    def cuda_capability(self) -> tuple[int, int] | None:
        """The CUDA compute capability with FP8 kernels for every FP8 GEMM (None: no FP8)."""
        needs = [g.scaling.capability for g in self.gemms.values() if g.is_scaled]
        if None in needs:  # a scaling no GPU has kernels for
            return None
        return max(needs) if needs else None

    @property
    def precision_rank(self) -> float:
        return sum(g.precision_rank for g in self.gemms.values()) / 3


# name -> Format, in registration order: the built-ins first, in FORMAT_ORDER. Per-GEMM mixes
# are not registered: they are values made from these (_MIXES).
_REGISTRY: dict[str, Format] = {}
# every spelling parse accepts (name and label) -> Format, of the registered formats
_SPELLINGS: dict[str, Format] = {}
# canonical name -> per-GEMM mix made so far: a memo, so that a mix is one object (``is``
# works), never a list of what exists: every mix is a pure function of its three GEMMs
_MIXES: dict[str, Format] = {}
# _MIXES in their own order (by their parts' places in the registry), None when stale
_mix_order: list[tuple[Format, ...] | None] = [None]


def _mixes() -> tuple[Format, ...]:
    """The mixes made so far, ordered by their parts' registry places (forward first): the
    same order whichever input spelled them first."""
    if _mix_order[0] is None:
        place = {f: i for i, f in enumerate(_REGISTRY.values())}
        _mix_order[0] = tuple(sorted(_MIXES.values(),
                                     key=lambda m: tuple(place.get(p, -1) for p in m.parts)))
    return _mix_order[0]


class _FormatType(type):
    """Format's class: iterates, counts and looks up the formats as an Enum does: the
    registered ones in registration order, then the per-GEMM mixes made so far."""

    def __iter__(cls) -> Iterator[Format]:
        return iter((*_REGISTRY.values(), *_mixes()))

    def __len__(cls) -> int:
        return len(_REGISTRY) + len(_MIXES)

    def __contains__(cls, value: object) -> bool:
        if not isinstance(value, Format):
            return False
        name = str.__str__(value)
        return _REGISTRY.get(name) is value or _MIXES.get(name) is value

    def __call__(cls, value: object) -> Format:
        """``Format("bf16")``: the format of that name (exactly; a per-GEMM mix by its
        canonical name, ``Format("nvfp4/mxfp8/mxfp8")``, made if need be, as unpickling in a
        fresh process does); ValueError else."""
        if isinstance(value, str):
            name = str.__str__(value)
            found = _REGISTRY.get(name) or _MIXES.get(name)
            if found is None and name.count("/") == 2:
                with contextlib.suppress(ValueError):
                    found = per_gemm(*name.split("/"))
            if found is not None and found.value == name:
                return found
        raise ValueError(f"{quoted(value)} is not a valid Format")


class Format(str, metaclass=_FormatType):
    """A layer's compute format: an interned string (``Format.BF16 == "bf16"``, compared with
    ``is``) that reads and writes as plain YAML; its meaning is :attr:`numerics`.

    ``Format(value)``, ``value`` the name as a policy file spells it (``Format("bf16")``), is
    the format of that name (exactly; a per-GEMM mix by its canonical name,
    ``Format("nvfp4/mxfp8/mxfp8")``, made if need be); :meth:`parse` reads a policy's looser
    spellings (``"FP8"``, a bare ``fp8`` as a recipe).

    Attributes:
        name: the name of the ``Format.<NAME>`` attribute (``"BF16"``).
        numerics: what the format computes: a frozen :class:`Numerics`.
        parts: a per-GEMM mix's three formats (forward, input gradient, weight gradient);
            ``()`` for a registered format.

    Raises:
        ValueError: ``value`` names no format.
    """

    # set once by register() (or per_gemm); Formats are immutable
    name: str
    numerics: Numerics
    # a per-GEMM mix's three formats (forward, input gradient, weight gradient), each the
    # first registered format with that GEMM; () for a registered format
    parts: tuple[Format, ...]

    FP32: Format
    BF16: Format
    FP16: Format
    FP8: Format
    FP8_ROWWISE: Format
    FP8_ROWWISE_GW_HP: Format
    MXFP8: Format
    MXFP8_GW_HP: Format
    NVFP4: Format
    NVFP4_PLAIN: Format

    def __setattr__(self, key, value):
        raise AttributeError(f"Format {self.value!r} is immutable.")

    def __str__(self) -> str:  # "bf16", not "Format.BF16", in messages and YAML
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"<Format.{self.name}: {self.value!r}>"

    def __reduce_ex__(self, protocol):
        return Format, (self.value,)  # unpickles to the registered object

    def __copy__(self) -> Format:
        return self

    def __deepcopy__(self, memo) -> Format:
        return self

    @property
    def value(self) -> str:
        """The policy's spelling as a plain ``str`` (what YAML and JSON get)."""
        return str.__str__(self)

    @classmethod
    def parse(cls, value: Format | str, *, where: str = "",
              fp8_recipe: str = "tensorwise") -> Format:
        """Return the Format named by ``value``; a clear ValueError for anything else. A bare
        ``fp8`` means ``fp8:<fp8_recipe>``."""
        if isinstance(value, Format):
            return value
        if isinstance(value, str):
            text = value.strip().lower()
            if text.count("/") == 2:  # a mix: its parts read as they would alone
                return per_gemm(*text.split("/"), where=where, fp8_recipe=fp8_recipe)
            if text == "fp8":
                text = f"fp8:{fp8_recipe}"
            if text in _SPELLINGS:
                return _SPELLINGS[text]
        valid = ", ".join(f.value for f in cls.registered())
        loc = f" {where}" if where else ""
        raise ValueError(f"Unknown format {quoted(value)}{loc}; expected one of {valid} "
                         f"(fp8 is fp8:{fp8_recipe} here), or fwd/dgrad/wgrad of three of them.")

    @classmethod
    def registered(cls) -> tuple[Format, ...]:
        """The registered formats (the built-ins, then those :func:`register` added), in
        order, without the per-GEMM mixes: what "every format" means, whatever mixes some
        input has spelled."""
        return tuple(_REGISTRY.values())

    @classmethod
    def fp8(cls, recipe: str = "tensorwise") -> Format:
        """The FP8 format of ``recipe`` (one of :func:`fp8_recipes`)."""
        return cls.parse(f"fp8:{recipe}", where="(FP8 recipe)")

    @property
    def label(self) -> str:
        """The full name, recipe included (``fp8:tensorwise``), for tables and reports."""
        return self.numerics.label

    @property
    def is_scaled(self) -> bool:
        return self.numerics.is_scaled

    @property
    def recipe(self) -> str | None:
        """The FP8 recipe (``rowwise``), or None for a format that is not FP8."""
        return self.numerics.recipe

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype autocast uses inside a region of this format; None means autocast off."""
        return self.numerics.autocast

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the matmul operands (FP8's E4M3 for fp8)."""
        return self.numerics.compute

    @property
    def output_dtype(self) -> torch.dtype:
        """The dtype the layer's activations leave in (fp8: BF16)."""
        return self.numerics.output

    @property
    def needs_loss_scaling(self) -> bool:
        return self.numerics.loss_scaling

    @property
    def max_value(self) -> float:
        """Largest finite value of the operand format: values above it overflow."""
        return _FP4_RANGE[0] if self.compute_dtype is FP4_E2M1 else \
            float(torch.finfo(self.compute_dtype).max)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value: below it precision degrades (underflow)."""
        return _FP4_RANGE[1] if self.compute_dtype is FP4_E2M1 else \
            float(torch.finfo(self.compute_dtype).smallest_normal)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value at all: below it a value flushes to zero."""
        if self.compute_dtype is FP4_E2M1:
            return _FP4_RANGE[2]
        fi = torch.finfo(self.compute_dtype)
        # smallest_normal * eps is the smallest subnormal for IEEE-like formats.
        return float(fi.smallest_normal * fi.eps)

    def demoted(self) -> Format:
        """One step towards safety: nvfp4 -> mxfp8 -> bf16 -> fp32, fp8 (any recipe) -> bf16,
        fp16 -> fp32 (used by the guard)."""
        return Format(self.numerics.demotes_to)

    @classmethod
    def of_dtype(cls, dtype: torch.dtype) -> Format:
        """The plain (unscaled) format whose GEMMs run in ``dtype``: what an FP8 recipe's
        high-precision GEMM is priced and run as."""
        for f in _BUILTIN_PLAIN:
            if f.numerics.fwd.a is dtype:
                return f
        raise ValueError(f"No plain format computes in {dtype}; expected float32, bfloat16 or "
                         "float16.")


# E2M1's largest, smallest normal and only subnormal value (torch.finfo has no FP4)
_FP4_RANGE = (6.0, 1.0, 0.5)


def register(numerics: Numerics, attribute: str | None = None) -> Format:
    """The one factory of formats: make ``numerics`` a Format (``Format(numerics.name)``,
    parsed from its name and label), optionally bound as ``Format.<attribute>``. The emulation
    and engines must have kernels for its GEMMs (each GEMM's scaling says which it has:
    :meth:`autoprec.scaling.Scaling.has_kernel`); a name already taken (or ``scaled``, a group
    word: :data:`GROUPS`) is an error, and so is a name with ``/`` (the spelling of a per-GEMM
    mix: :func:`per_gemm` makes those)."""
    taken = [s for s in (numerics.name, numerics.label) if s in _SPELLINGS]
    if taken:
        raise ValueError(f"Format {quoted(taken[0])} is already registered; give the new format "
                         "another name.")
    if any(s in GROUPS for s in (numerics.name, numerics.label)):
        raise ValueError(f"Format {quoted(numerics.name)}: {', '.join(GROUPS)} are group words "
                         "(each stands for several formats); give the new format another name.")
    if "/" in numerics.name or "/" in numerics.label:
        raise ValueError(f"Format {quoted(numerics.name)}: a name with '/' spells a per-GEMM "
                         "mix (fwd/dgrad/wgrad), which per_gemm makes; give the format another "
                         "name.")
    if numerics.demotes_to not in _REGISTRY and numerics.demotes_to != numerics.name:
        raise ValueError(f"Format {quoted(numerics.name)} demotes to {quoted(numerics.demotes_to)}"
                         ", which is not a registered format.")
    if numerics.is_scaled:
        _check_kernels(numerics)
    fmt = _make(numerics, attribute)
    _REGISTRY[numerics.name] = fmt
    _SPELLINGS.update({numerics.name: fmt, numerics.label: fmt})
    _mix_order[0] = None
    return fmt


def _check_kernels(numerics: Numerics) -> None:
    """A ValueError unless autoprec's scaled kernels (:mod:`autoprec.runtime.fp8`) compute
    ``numerics``: per-tensor scales on all three GEMMs with the forward operands reused by
    dgrad and wgrad, or per GEMM whatever each GEMM's scaling has a kernel for."""
    fwd, dgrad, wgrad = numerics.fwd, numerics.dgrad, numerics.wgrad
    if numerics.saves_quantized:
        ok = (not any(g.pow2_scales for g in (fwd, dgrad, wgrad))
              and dgrad.b == fwd.b and wgrad.a == fwd.a and dgrad.a == wgrad.b)
    else:
        ok = all(g.scaling.has_kernel(g) for g in (fwd, dgrad, wgrad))
    if not ok:
        raise ValueError(
            f"autoprec's scaled kernels do not compute {numerics.label}: they take per-tensor "
            "scales on all three GEMMs (the forward operands reused by dgrad and wgrad, one "
            "dtype for the gradient), or per GEMM what each GEMM's scaling has a kernel for "
            "(power-of-two row scales in E4M3, MX or NVFP4 blocks, a BF16 or FP32 GEMM). Give "
            "the scaling a kernel (autoprec.scaling.Scaling) for these numerics.")


def _make(numerics: Numerics, attribute: str | None, parts: tuple[Format, ...] = ()) -> Format:
    fmt = str.__new__(Format, numerics.name)
    object.__setattr__(fmt, "name", attribute or numerics.name.upper().replace(":", "_"))
    object.__setattr__(fmt, "numerics", numerics)
    object.__setattr__(fmt, "parts", parts)
    if attribute is not None:
        type.__setattr__(Format, attribute, fmt)
    return fmt


_ROLES = ("fwd", "dgrad", "wgrad")


def per_gemm(fwd: Format | str, dgrad: Format | str, wgrad: Format | str, *,
             where: str = "", fp8_recipe: str = "tensorwise") -> Format:
    """The format whose forward, input-gradient and weight-gradient GEMMs are those of three
    formats (``per_gemm("nvfp4", "mxfp8", "mxfp8")``; a bare ``fp8`` is ``fp8:<fp8_recipe>``,
    as :meth:`Format.parse` reads it): a registered format of those GEMMs, or the mix of them,
    spelled ``fwd/dgrad/wgrad`` with each GEMM named by the first registered format that has
    it (so two spellings of one computation are one format; its label spells each part's
    label, recipe included: ``fp8:tensorwise/bf16/bf16``). Its other layer work runs under BF16
    autocast, its activations leave in BF16 and it demotes to bf16, as every FP8 recipe; at
    least one GEMM must be scaled (FP8, MX or NVFP4) and none FP16 (it would need loss scaling
    the others do not have). A mix registers nothing: it is made once and kept, the same
    object for the same GEMMs whatever was parsed before."""
    given = [Format.parse(p, where=where, fp8_recipe=fp8_recipe) for p in (fwd, dgrad, wgrad)]
    gemms = tuple(getattr(p.numerics, role) for p, role in zip(given, _ROLES))
    registered = Format.registered()
    same = next((f for f in registered if tuple(f.numerics.gemms.values()) == gemms), None)
    if same is not None:
        return same
    # each GEMM by the first registered format with it: one name per computation
    parts = tuple(next(f for f in registered if getattr(f.numerics, role) == g)
                  for role, g in zip(_ROLES, gemms))
    name = "/".join(p.value for p in parts)
    made = _MIXES.get(name)
    if made is not None:
        return made
    loc = f" {where}" if where else ""
    if not any(g.is_scaled for g in gemms) or any(g.a is torch.float16 for g in gemms):
        raise ValueError(f"Per-GEMM format {quoted(name)}{loc}: at least one GEMM must be "
                         "scaled (fp8, mxfp8, nvfp4) and none fp16; write a plain format for "
                         "the rest.")
    numerics = Numerics(name=name, label="/".join(p.label for p in parts), fwd=gemms[0],
                        dgrad=gemms[1], wgrad=gemms[2], autocast=torch.bfloat16,
                        output=torch.bfloat16, demotes_to="bf16")
    _check_kernels(numerics)
    made = _MIXES[name] = _make(numerics, None, parts)
    _mix_order[0] = None
    return made


def unregister(fmt: Format) -> None:
    """Take a format :func:`register` added (or a per-GEMM mix made) out again (tests); the
    built-ins stay. Mixes with a part ``fmt`` go with it."""
    if fmt in FORMAT_ORDER:
        raise ValueError(f"{fmt} is a built-in format and cannot be unregistered.")
    if fmt.parts:
        if _MIXES.get(fmt.value) is not fmt:
            raise ValueError(f"{fmt!r} is not a per-GEMM mix made here.")
        del _MIXES[fmt.value]
        _mix_order[0] = None
        return
    if _REGISTRY.get(fmt.value) is not fmt:
        raise ValueError(f"{fmt!r} is not registered.")
    for mix in [m for m in _MIXES.values() if fmt in m.parts]:
        unregister(mix)
    del _REGISTRY[fmt.value]
    for spelling in (fmt.numerics.name, fmt.numerics.label):
        _SPELLINGS.pop(spelling, None)
    if getattr(Format, fmt.name, None) is fmt:
        type.__delattr__(Format, fmt.name)
    _mix_order[0] = None


def torchao_takes(fmt: Format, *, linear: bool, in_features: int, out_features: int) -> bool:
    """The one rule of which layers torchao's float8 training computes: an ``nn.Linear``
    (``linear``) in an FP8 format torchao has a recipe for (``Numerics.torchao_recipe``) whose
    in and out features are multiples of 16 (MX: 32). The FP8 kernel cannot take other
    widths; torchao's own filter skips them too, and autoprec runs them in bf16. Whether
    torchao *does* run the
    layer also depends on the policy's engine and the machine: :func:`autoprec.runtime.engines.torchao_runs`,
    :func:`~autoprec.runtime.engines.engine_for`."""
    multiple = shape_multiple(fmt.numerics)
    return (linear and fmt.numerics.torchao_recipe is not None
            and not in_features % multiple and not out_features % multiple)


def fp8_recipes() -> tuple[str, ...]:
    """The FP8 recipes registered now (a bare ``fp8`` may mean any of them; the block-scaled
    formats are not FP8 recipes)."""
    return tuple(f.recipe for f in Format.registered() if f.recipe is not None)


def _block_entry(name: str, fwd: Gemm, dgrad: Gemm, wgrad: Gemm, demotes_to: str, *,
                 torchao: str | None = None, megatron: str | None = None,
                 titan: str | None = None) -> Numerics:
    """A block-scaled format: as an FP8 recipe (BF16 autocast for the rest, BF16 output), not
    one of the ``fp8:`` recipes."""
    return Numerics(name=name, label=name, fwd=fwd, dgrad=dgrad, wgrad=wgrad,
                    autocast=torch.bfloat16, output=torch.bfloat16, demotes_to=demotes_to,
                    torchao_recipe=torchao, megatron_recipe=megatron, torchtitan_linear=titan)


def _fp8_entry(recipe: str, fwd: Gemm, dgrad: Gemm, wgrad: Gemm, *, name: str | None = None,
               torchao: str | None = None, megatron: str | None = None) -> Numerics:
    """An FP8 recipe: the rest of the layer under bf16 autocast, BF16 output, demoted to bf16."""
    return Numerics(name=name or f"fp8:{recipe}", label=f"fp8:{recipe}", fwd=fwd, dgrad=dgrad,
                    wgrad=wgrad, autocast=torch.bfloat16, output=torch.bfloat16,
                    demotes_to="bf16", recipe=recipe, torchao_recipe=torchao,
                    megatron_recipe=megatron)


def _plain_entry(name: str, dtype: torch.dtype, demotes_to: str,
                 loss_scaling: bool = False) -> Numerics:
    g = _plain(dtype)
    return Numerics(name=name, label=name, fwd=g, dgrad=g, wgrad=g,
                    autocast=None if dtype is torch.float32 else dtype, output=dtype,
                    demotes_to=demotes_to, loss_scaling=loss_scaling)


def _builtins() -> dict[str, Numerics]:
    """The built-in formats (attribute -> numerics), cheapest-first: the factory's table."""
    e4, e5, f4 = FP8_E4M3, FP8_E5M2, FP4_E2M1
    row = Gemm(e4, e4, "row", pow2_scales=True)
    mx, bf16 = Gemm(e4, e4, "mx", rounding="rceil"), _plain(torch.bfloat16)
    nv = Gemm(f4, f4, "nvfp4")
    return {
        "FP32": _plain_entry("fp32", torch.float32, "fp32"),
        "BF16": _plain_entry("bf16", torch.bfloat16, "fp32"),
        "FP16": _plain_entry("fp16", torch.float16, "fp32", loss_scaling=True),
        # torchao float8's default and Transformer Engine's current scaling: E4M3 forward,
        # E5M2 gradients, one dynamic scale per tensor
        "FP8": _fp8_entry("tensorwise", Gemm(e4, e4, "tensor"), Gemm(e5, e4, "tensor"),
                          Gemm(e4, e5, "tensor"), name="fp8", torchao="tensorwise",
                          megatron="tensorwise"),
        # Megatron's blockwise (1x128 / 128x128 tiles) and mxfp8 (1x32 blocks) are other
        # recipes, and Transformer Engine has no rowwise one
        "FP8_ROWWISE": _fp8_entry("rowwise", row, row, row, torchao="rowwise"),
        "FP8_ROWWISE_GW_HP": _fp8_entry("rowwise_with_gw_hp", row, row, _plain(torch.bfloat16),
                                        torchao="rowwise_with_gw_hp"),
        # torchao's MXFP8 training recipes (MXFP8TrainingRecipe) and Transformer Engine's
        # MXFP8BlockScaling (E4M3 everywhere; Megatron's --fp8-recipe mxfp8)
        "MXFP8": _block_entry("mxfp8", mx, mx, mx, "bf16", torchao="mxfp8_rceil",
                              megatron="mxfp8", titan="MXFP8Linear"),
        "MXFP8_GW_HP": _block_entry("mxfp8:gw_hp", mx, mx, bf16, "bf16",
                                    torchao="mxfp8_rceil_wgrad_with_hp"),
        # Transformer Engine's NVFP4BlockScaling (Megatron's --fp4-recipe nvfp4): stochastic
        # rounding of the gradients, the Hadamard transform on the weight gradient's operands
        # (its 16x16 weight blocks are not emulated: weights are scaled per 1x16 here)
        "NVFP4": _block_entry("nvfp4", nv, Gemm(f4, f4, "nvfp4", stochastic=True),
                              Gemm(f4, f4, "nvfp4", hadamard=True, stochastic=True), "mxfp8",
                              megatron="nvfp4", titan="NVFP4Linear"),
        "NVFP4_PLAIN": _block_entry("nvfp4:plain", nv, nv, nv, "mxfp8"),
    }


for _attribute, _numerics in _builtins().items():
    _REGISTRY[_numerics.name] = _make(_numerics, _attribute)
    _SPELLINGS.update({_numerics.name: _REGISTRY[_numerics.name],
                       _numerics.label: _REGISTRY[_numerics.name]})

# Cheapest-first order used in tables and for tie-breaking: the built-ins.
FORMAT_ORDER: tuple[Format, ...] = tuple(Format)
_BUILTIN_PLAIN = tuple(f for f in FORMAT_ORDER if not f.is_scaled)
# The built-in FP8 recipes (torchao's names), in FORMAT_ORDER.
FP8_FORMATS: tuple[Format, ...] = tuple(f for f in FORMAT_ORDER if f.recipe is not None)
FP8_RECIPES: tuple[str, ...] = tuple(f.recipe for f in FP8_FORMATS)
# The built-in block-scaled formats (Blackwell's MXFP8 and NVFP4).
BLOCK_FORMATS: tuple[Format, ...] = tuple(f for f in FORMAT_ORDER
                                          if f.numerics.is_block_scaled)


# The words that stand for a group of formats wherever a set of formats is written (the
# formats a tune or profile considers, a phase's `formats:` key, GuardConfig.formats), with the
# same meaning in each. Where one format is wanted, `fp8` alone is the policy's FP8 recipe.
# Narrowest first: a phase key that is a group word is looked up in this order.
GROUPS: dict[str, str] = {
    "fp8": "every FP8 recipe (fp8:tensorwise, fp8:rowwise, ...)",
    "scaled": "every scaled format: the FP8 recipes, mxfp8, nvfp4 and any registered one",
}


def in_group(fmt: Format, word: str) -> bool:
    """Whether the group word ``word`` (:data:`GROUPS`) stands for ``fmt`` (a per-GEMM mix
    included: a mix is scaled when one of its GEMMs is)."""
    if word == "fp8":
        return fmt.recipe is not None
    if word == "scaled":
        return fmt.is_scaled
    raise ValueError(f"{quoted(word)} is not a group word; the group words are "
                     f"{', '.join(GROUPS)}.")


def format_group(word: Any) -> tuple[Format, ...] | None:
    """The registered formats that the group word ``word`` stands for (:data:`GROUPS`), or
    None when it is none. A :class:`Format` is never a group: ``Format.FP8`` is the
    tensorwise recipe, though it is the string "fp8"."""
    if not isinstance(word, str) or isinstance(word, Format):
        return None
    text = word.strip().lower()
    if text not in GROUPS:
        return None
    return tuple(f for f in Format.registered() if in_group(f, text))


def expand_formats(values, *, where: str = "") -> tuple[Format, ...]:
    """The formats named by ``values``, in registration order (FORMAT_ORDER first), without
    repeats; a group word (:data:`GROUPS`: ``fp8``, ``scaled``) stands for its formats, and
    ``fp8:tensorwise`` alone is written so. A :class:`Format` is itself, so expanding formats
    already expanded changes nothing."""
    wanted: set[Format] = set()
    for v in values:
        group = format_group(v)
        wanted.update(group if group is not None else (Format.parse(v, where=where),))
    return tuple(f for f in Format if f in wanted)


class Support(str, enum.Enum):
    """How a device runs a format."""

    NATIVE = "native"  # real kernels in this format
    EMULATED = "emulated"  # numerics exact, speed not representative (never faster)
    UNSUPPORTED = "unsupported"
