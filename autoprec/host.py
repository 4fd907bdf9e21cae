"""Facts about the machine autoprec runs on: the device's name, the CPU's matmul features, the
16-bit dtypes it has no matmul units for, and which formats it runs natively or emulates.

A format's own facts (what it computes, the CUDA capability its kernels need) are
:mod:`autoprec.formats`'; this module asks the machine.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

import torch

from autoprec.formats import Format, Support

__all__ = [
    "supported_formats",
    "fp8_is_native",
    "device_name",
    "CpuFeatures",
    "cpu_features",
    "slow_16bit_dtypes",
]


def fp8_is_native(device: torch.device | str, fmt: Format = Format.FP8) -> bool:
    """True where ``torch._scaled_mm`` has fast FP8 kernels for every FP8 GEMM of ``fmt``:
    CUDA compute capability >= 8.9 for per-tensor scales, >= 9.0 for rowwise ones
    (:attr:`Numerics.cuda_capability`); False for a format without FP8 GEMMs, and for the
    block-scaled formats, which autoprec's kernels emulate on every device (their real kernels
    are torchao's: ``engine=torchao``)."""
    device = torch.device(device)
    need = fmt.numerics.cuda_capability
    if need is None or fmt.numerics.is_block_scaled or device.type != "cuda" \
            or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= need


def supported_formats(device: torch.device | str = "cpu") -> dict[Format, Support]:
    """Which formats ``device`` runs natively and which are emulated.

    FP8 kernels exist on CPU (``torch._scaled_mm``) but are orders of magnitude slower than
    FP32 there, so FP8 counts as emulated everywhere except CUDA sm_89+ (rowwise: sm_90+).

    Args:
        device: the device asked about (a ``torch.device`` or its name).

    Returns:
        Each format -> ``Support.NATIVE`` or ``Support.EMULATED``.

    Raises:
        RuntimeError: a CUDA device was asked about and CUDA is not available.
    """
    device = torch.device(device)
    out = {f: Support.EMULATED if f.is_scaled else Support.NATIVE for f in Format}
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"Device {device} was requested but CUDA is not available.")
        for f in Format:
            if f.is_scaled and fp8_is_native(device, f):
                out[f] = Support.NATIVE
            elif f.compute_dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
                out[f] = Support.EMULATED
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


@functools.cache
def _host_features() -> CpuFeatures:
    return cpu_features()


def slow_16bit_dtypes(device: torch.device | str = "cpu") -> frozenset[torch.dtype]:
    """The 16-bit dtypes ``device`` has no matmul units for: on a CPU, BF16 without BF16
    dot-product instructions (a Zen 3 runs a BF16 matmul ~120x slower than FP32) and FP16
    without FP16 ones; none on a GPU. Their GEMMs are worth emulating in FP32 where only their
    numerics count (:func:`autoprec.runtime.fp8.emulating`: the same values)."""
    if torch.device(device).type != "cpu":
        return frozenset()
    host = _host_features()
    return frozenset(d for d, fast in ((torch.bfloat16, host.bf16_dot),
                                       (torch.float16, host.fp16_dot)) if not fast)
