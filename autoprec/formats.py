"""Numeric formats a layer can compute in, their ranges, and what a device runs natively.

A *format* names how the matmul-like work of a layer is computed; parameters always stay
FP32 master weights. The four formats and what they mean:

- ``fp32``: autocast off inside the layer, floating inputs upcast to FP32 (the reference).
- ``bf16``: ``torch.autocast(dtype=torch.bfloat16)``: matmul/conv inputs in BF16 with FP32
  accumulation, autocast's per-op rules for everything else (norms, softmax in FP32).
- ``fp16``: the same with ``torch.float16``; training needs loss scaling (GradScaler).
- ``fp8``: matmul-like calls get E4M3 forward operands and E5M2 gradients with dynamic
  per-tensor scales and a BF16 output (see :mod:`autoprec.runtime.fp8`); the rest of the layer runs
  as ``bf16``. Real on CUDA devices of compute capability 8.9 or newer, emulated elsewhere.
"""

from __future__ import annotations

import enum
import platform

import torch

__all__ = [
    "Format",
    "Support",
    "FP8_E4M3",
    "FP8_E5M2",
    "FORMAT_ORDER",
    "supported_formats",
    "fp8_is_native",
    "device_name",
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
    FP8 = "fp8"

    def __str__(self) -> str:  # "bf16", not "Format.BF16", in messages and YAML
        return self.value

    @classmethod
    def parse(cls, value: Format | str, *, where: str = "") -> Format:
        """Return the Format named by ``value``; a clear ValueError for anything else."""
        if isinstance(value, Format):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        valid = ", ".join(f.value for f in cls)
        loc = f" {where}" if where else ""
        raise ValueError(f"Unknown format {value!r}{loc}; expected one of {valid}.")

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
        """One step towards safety: fp8 -> bf16 -> fp32; fp16 -> fp32 (used by the guard)."""
        return {Format.FP8: Format.BF16, Format.BF16: Format.FP32,
                Format.FP16: Format.FP32, Format.FP32: Format.FP32}[self]


# Cheapest-first order used in tables and for tie-breaking.
FORMAT_ORDER: tuple[Format, ...] = (Format.FP32, Format.BF16, Format.FP16, Format.FP8)

_AUTOCAST_DTYPE = {
    Format.FP32: None,
    Format.BF16: torch.bfloat16,
    Format.FP16: torch.float16,
    # Inside an fp8 region everything that is not a routed matmul runs as bf16.
    Format.FP8: torch.bfloat16,
}
_COMPUTE_DTYPE = {
    Format.FP32: torch.float32,
    Format.BF16: torch.bfloat16,
    Format.FP16: torch.float16,
    Format.FP8: FP8_E4M3,
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


def fp8_is_native(device: torch.device | str) -> bool:
    """True where ``torch._scaled_mm`` has fast FP8 kernels: CUDA compute capability >= 8.9."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (8, 9)


def supported_formats(device: torch.device | str = "cpu") -> dict[Format, Support]:
    """Which formats ``device`` runs natively and which are emulated.

    FP8 kernels exist on CPU (``torch._scaled_mm``) but are orders of magnitude slower than
    FP32 there, so FP8 counts as emulated everywhere except CUDA sm_89+.
    """
    device = torch.device(device)
    out = {Format.FP32: Support.NATIVE, Format.BF16: Support.NATIVE,
           Format.FP16: Support.NATIVE, Format.FP8: Support.EMULATED}
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"Device {device} was requested but CUDA is not available.")
        if not torch.cuda.is_bf16_supported():
            out[Format.BF16] = Support.EMULATED
        if fp8_is_native(device):
            out[Format.FP8] = Support.NATIVE
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
