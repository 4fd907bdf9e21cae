"""Numeric formats a layer can compute in, their ranges, and what a device runs natively.

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
"""

from __future__ import annotations

import enum
import platform
from dataclasses import dataclass

import torch

__all__ = [
    "Format",
    "Support",
    "FP8_E4M3",
    "FP8_E5M2",
    "FORMAT_ORDER",
    "FP8_RECIPES",
    "FP8_FORMATS",
    "expand_formats",
    "supported_formats",
    "fp8_is_native",
    "device_name",
    "CpuFeatures",
    "cpu_features",
]

# torch's names for the two FP8 encodings of "FP8 Formats for Deep Learning"
# (Micikevicius et al. 2022): E4M3 (max 448, no infinities) for weights and activations,
# E5M2 (max 57344) for gradients.
FP8_E4M3 = torch.float8_e4m3fn
FP8_E5M2 = torch.float8_e5m2


class Format(str, enum.Enum):
    """A layer's compute format. String-valued so it reads and writes as plain YAML."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"  # tensorwise
    FP8_ROWWISE = "fp8:rowwise"
    FP8_ROWWISE_GW_HP = "fp8:rowwise_with_gw_hp"

    def __str__(self) -> str:  # "bf16", not "Format.BF16", in messages and YAML
        return self.value

    @classmethod
    def parse(cls, value: Format | str, *, where: str = "",
              fp8_recipe: str = "tensorwise") -> Format:
        """Return the Format named by ``value``; a clear ValueError for anything else. A bare
        ``fp8`` means ``fp8:<fp8_recipe>``."""
        if isinstance(value, Format):
            return value
        if isinstance(value, str):
            text = value.strip().lower()
            if text == "fp8":
                text = f"fp8:{fp8_recipe}"
            if text == "fp8:tensorwise":
                text = "fp8"
            try:
                return cls(text)
            except ValueError:
                pass
        valid = ", ".join(f.value for f in cls)
        loc = f" {where}" if where else ""
        raise ValueError(f"Unknown format {value!r}{loc}; expected one of {valid} "
                         "(fp8 is fp8:tensorwise).")

    @classmethod
    def fp8(cls, recipe: str = "tensorwise") -> Format:
        """The FP8 format of ``recipe`` (one of FP8_RECIPES)."""
        return cls.parse(f"fp8:{recipe}", where="(FP8 recipe)")

    @property
    def label(self) -> str:
        """The full name, recipe included (``fp8:tensorwise``), for tables and reports."""
        return "fp8:tensorwise" if self is Format.FP8 else self.value

    @property
    def is_fp8(self) -> bool:
        return self.value.startswith("fp8")

    @property
    def recipe(self) -> str | None:
        """The FP8 recipe (torchao's name), or None for a format that is not FP8."""
        if not self.is_fp8:
            return None
        return self.value.partition(":")[2] or "tensorwise"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype autocast uses inside a region of this format; None means autocast off."""
        return _AUTOCAST_DTYPE[self]

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the matmul operands (FP8's E4M3 for fp8)."""
        return _COMPUTE_DTYPE[self]

    @property
    def needs_loss_scaling(self) -> bool:
        return self is Format.FP16

    @property
    def max_value(self) -> float:
        """Largest finite value of the operand format: values above it overflow."""
        return _RANGE[self][0]

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value: below it precision degrades (underflow)."""
        return _RANGE[self][1]

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value at all: below it a value flushes to zero."""
        return _RANGE[self][2]

    def demoted(self) -> Format:
        """One step towards safety: fp8 (any recipe) -> bf16 -> fp32; fp16 -> fp32 (used by
        the guard)."""
        if self.is_fp8:
            return Format.BF16
        return {Format.BF16: Format.FP32, Format.FP16: Format.FP32,
                Format.FP32: Format.FP32}[self]


# Cheapest-first order used in tables and for tie-breaking.
FORMAT_ORDER: tuple[Format, ...] = (Format.FP32, Format.BF16, Format.FP16, Format.FP8,
                                    Format.FP8_ROWWISE, Format.FP8_ROWWISE_GW_HP)
def expand_formats(values, *, where: str = "") -> tuple[Format, ...]:
    """The formats named by ``values``, in FORMAT_ORDER, without repeats; a bare ``fp8``
    means every FP8 recipe (``fp8:tensorwise`` alone is written so)."""
    wanted: set[Format] = set()
    for v in values:
        if isinstance(v, str) and v.strip().lower() == "fp8":
            wanted.update(FP8_FORMATS)
        else:
            wanted.add(Format.parse(v, where=where))
    return tuple(f for f in FORMAT_ORDER if f in wanted)


# torchao's recipe names, in FORMAT_ORDER.
FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FP8_FORMATS: tuple[Format, ...] = tuple(f for f in FORMAT_ORDER if f.is_fp8)

_AUTOCAST_DTYPE = {
    Format.FP32: None,
    Format.BF16: torch.bfloat16,
    Format.FP16: torch.float16,
    # Inside an fp8 region everything that is not a routed matmul runs as bf16.
    **{f: torch.bfloat16 for f in FP8_FORMATS},
}
_COMPUTE_DTYPE = {
    Format.FP32: torch.float32,
    Format.BF16: torch.bfloat16,
    Format.FP16: torch.float16,
    **{f: FP8_E4M3 for f in FP8_FORMATS},
}


def _range(dtype: torch.dtype) -> tuple[float, float, float]:
    fi = torch.finfo(dtype)
    # smallest_normal * eps is the smallest subnormal for IEEE-like formats.
    return float(fi.max), float(fi.smallest_normal), float(fi.smallest_normal * fi.eps)


_RANGE = {f: _range(_COMPUTE_DTYPE[f]) for f in Format}


class Support(str, enum.Enum):
    """How a device runs a format."""

    NATIVE = "native"  # real kernels in this format
    EMULATED = "emulated"  # numerics exact, speed not representative (never faster)
    UNSUPPORTED = "unsupported"


def fp8_is_native(device: torch.device | str, fmt: Format = Format.FP8) -> bool:
    """True where ``torch._scaled_mm`` has fast FP8 kernels for ``fmt``'s recipe: CUDA compute
    capability >= 8.9 for per-tensor scales, >= 9.0 for rowwise ones."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    need = (8, 9) if fmt.recipe == "tensorwise" else (9, 0)
    return torch.cuda.get_device_capability(index) >= need


def supported_formats(device: torch.device | str = "cpu") -> dict[Format, Support]:
    """Which formats ``device`` runs natively and which are emulated.

    FP8 kernels exist on CPU (``torch._scaled_mm``) but are orders of magnitude slower than
    FP32 there, so FP8 counts as emulated everywhere except CUDA sm_89+ (rowwise: sm_90+).
    """
    device = torch.device(device)
    out = {Format.FP32: Support.NATIVE, Format.BF16: Support.NATIVE,
           Format.FP16: Support.NATIVE, **{f: Support.EMULATED for f in FP8_FORMATS}}
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"Device {device} was requested but CUDA is not available.")
        if not torch.cuda.is_bf16_supported():
            out[Format.BF16] = Support.EMULATED
        for f in FP8_FORMATS:
            if fp8_is_native(device, f):
                out[f] = Support.NATIVE
    # Elsewhere (CPU and other devices) autocast runs both half formats; whether they are fast
    # is for timing to say.
    return out


def device_name(device: torch.device | str = "cpu") -> str:
    """A readable name of the device: the GPU's name, or the CPU's model from /proc/cpuinfo."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


@dataclass(frozen=True)
class CpuFeatures:
    """What this CPU's matmul units can do, for a header line and for tests that must know
    which format the host is fast at before they say anything about speed."""

    # The CPU's model name (device_name("cpu")).
    name: str
    # torch.backends.cpu.get_cpu_capability(): the widest vector ISA torch dispatches to
    # (AVX512 on Zen 4 and on Intel server parts alike, AVX2 on Zen 3): not enough to say
    # whether BF16 is fast.
    capability: str
    # BF16 dot-product instructions (x86 AVX512-BF16 or AMX-BF16, Arm BF16): without them
    # oneDNN converts BF16 to FP32 around every product and bf16 matmuls lose to fp32
    # (benchmarks/bench_cpu.py: 3.4x slower on an AVX512 Xeon without them, ~130x on a Zen 3).
    bf16_dot: bool
    # FP16 arithmetic in the matmul units (AVX512-FP16, AMX-FP16, Arm FP16 dot products).
    fp16_dot: bool

    def describe(self) -> str:
        def have(flag: bool) -> str:
            return "yes" if flag else "no"
        return (f"{self.name}, torch CPU capability {self.capability}, BF16 dot-product "
                f"instructions: {have(self.bf16_dot)}, FP16: {have(self.fp16_dot)}")


def cpu_features() -> CpuFeatures:
    """The host CPU's matmul features, from torch's own CPU probe where this torch has it
    (``torch._C._cpu._get_cpu_capability()``, what its kernels dispatch on), else the flags
    in /proc/cpuinfo."""
    flags: set[str] = set()
    probe = getattr(getattr(torch._C, "_cpu", None), "_get_cpu_capability", None)
    if probe is not None:
        try:
            flags = {k for k, v in probe().items() if v is True}
        except Exception:  # a private call: its absence or change must not break anything
            flags = set()
    if not flags:
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith(("flags", "Features")):
                        flags = set(line.split(":", 1)[1].split())
                        break
        except OSError:
            pass
    return CpuFeatures(
        name=device_name("cpu"), capability=torch.backends.cpu.get_cpu_capability(),
        bf16_dot=bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}),
        fp16_dot=bool(flags & {"avx512_fp16", "amx_fp16", "fphp", "asimdhp"}))
