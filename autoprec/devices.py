"""The devices the cost model prices for: what it needs to know of each (:class:`DeviceSpec`:
datasheet peaks, the fractions of them a GEMM and a copy sustain, the cost of a kernel, how it
runs each format), the catalogue (``DEVICES``: h100, h200, b200, b300, a100, cpu-amx, each
entry saying where its figures come from), and how a target names one (:func:`resolve_target`).

A device rates and runs a format it does not name as it does a named one of the same kernels
(:func:`kernel_class`): a new FP8 recipe with per-tensor scales is what a device says of
tensorwise, so a registered format needs no device edits. The roofline that prices a layer on
a device is :mod:`autoprec.costmodel`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autoprec.formats import BLOCK_FORMATS, FORMAT_ORDER, FP8_FORMATS, Format, Gemm, Support
from autoprec.scaling import scalings

__all__ = ["DeviceSpec", "DEVICES", "resolve_target"]


def kernel_class(fmt: Format) -> tuple[Any, tuple[int, int] | None]:
    """What a device's matmul rate and support for ``fmt`` depend on: the dtype of its
    forward operands (a scaled forward: its scaling and operand width, so E4M3 and E5M2
    elements read alike) and the CUDA capability its scaled GEMMs need (None: none)."""
    fwd = fmt.numerics.fwd
    return (_gemm_key(fwd) if fwd.is_scaled else fwd.a), fmt.numerics.cuda_capability


class _PerFormat(dict):
    """A DeviceSpec's per-format table: a format it does not name reads the entry of a named
    format of the same :func:`kernel_class`, so a registered format needs no device edits."""

    def __missing__(self, fmt):
        if isinstance(fmt, Format):
            for named, value in list(self.items()):
                if kernel_class(named) == kernel_class(fmt):
                    return value
            if not fmt.is_scaled:  # a plain format is named or missing (no GEMM to look up)
                raise KeyError(fmt)
            # a per-GEMM mix: its forward's rate; the least support of its GEMMs
            values = [self.for_gemm(g) for g in fmt.numerics.gemms.values()]
            if all(isinstance(v, Support) for v in values):
                return min(values, key=_SUPPORT_ORDER.index)
            return values[0]
        raise KeyError(fmt)

    def has(self, fmt: Format) -> bool:
        try:
            self[fmt]
        except KeyError:
            return False
        return True

    def for_gemm(self, gemm: Gemm):
        """The entry of one GEMM: a plain one's dtype's format, a scaled one's first named
        format whose forward GEMM is scaled and as wide alike (an E5M2 gradient GEMM of
        tensorwise reads tensorwise's rate, a composite's MX dgrad reads mxfp8's)."""
        if not gemm.is_scaled:
            return self[Format.of_dtype(gemm.a)]
        for named, value in list(self.items()):
            if _gemm_key(named.numerics.fwd) == _gemm_key(gemm):
                return value
        if self and all(isinstance(v, Support) for v in self.values()):
            # a scaling no format of this device's table has: the device has no kernel for
            # it, autoprec's emulation runs it (priced as such)
            return Support.EMULATED
        raise KeyError(gemm)


_SUPPORT_ORDER = (Support.UNSUPPORTED, Support.EMULATED, Support.NATIVE)


def _gemm_key(gemm: Gemm) -> tuple[str, float]:
    """What a scaled GEMM's rate depends on: its scaling and operand width."""
    return gemm.scaling, gemm.operand_bytes


@dataclass(frozen=True)
class DeviceSpec:
    """What the roofline model needs to know about a device."""

    # Human-readable name, shown in notes and reports.
    name: str
    # Dense peak matmul FLOP/s per format the device runs natively (no sparsity).
    matmul_flops: Mapping[Format, float]
    # Peak memory bandwidth in bytes/s.
    bandwidth: float
    # How each format runs: NATIVE needs an entry in matmul_flops; EMULATED formats are priced
    # as their emulation (FP32 matmuls plus quantization) and never faster than FP32.
    support: Mapping[Format, Support]
    # Fraction of peak FLOP/s a large GEMM sustains.
    efficiency: float = 0.7
    # Fraction of peak bandwidth a large copy sustains.
    bandwidth_efficiency: float = 0.8
    # Fixed seconds per kernel (launch, prologue, tail): what makes small layers gain nothing.
    launch_s: float = 3e-6
    # Per scaling of a GEMM ("tensor", "row", "mx", "nvfp4"), the fraction of ``efficiency``
    # its kernels sustain (1 where not named): Blackwell's low-precision GEMMs reach less of
    # their peak than its BF16 ones (Transformer Engine measured MXFP8 GEMMs at 1.44x BF16
    # on a B300, whose peak ratio is 2).
    scaled_efficiency: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # Fraction of peak bandwidth the scaled formats' cast kernels reach (amax reductions,
    # scaling casts, transposed copies); None: ``bandwidth_efficiency``, as for any copy.
    cast_efficiency: float | None = None

    @property
    def cast_bandwidth(self) -> float:
        """Bytes/s the cast kernels into a scaled format move."""
        fraction = self.bandwidth_efficiency if self.cast_efficiency is None \
            else self.cast_efficiency
        return self.bandwidth * fraction

    def rate(self, gemm: Gemm) -> float:
        """Peak FLOP/s of one GEMM's kernel times its scaling's ``scaled_efficiency``."""
        return self.matmul_flops.for_gemm(gemm) * self.scaled_efficiency.get(gemm.scaling, 1.0)

    def __post_init__(self):
        flops = _PerFormat({Format.parse(k, where=f"in DeviceSpec {self.name!r}"): float(v)
                            for k, v in dict(self.matmul_flops).items()})
        support = _PerFormat({Format.parse(k, where=f"in DeviceSpec {self.name!r}"): Support(v)
                              for k, v in dict(self.support).items()})
        object.__setattr__(self, "matmul_flops", flops)
        object.__setattr__(self, "support", support)
        # the registered formats (a per-GEMM mix is priced from its GEMMs' entries)
        missing = [f.value for f in Format.registered() if not support.has(f)]
        if missing:
            raise ValueError(f"DeviceSpec {self.name!r} does not say how it runs "
                             f"{', '.join(missing)}; give support for every format "
                             f"({', '.join(f.value for f in Format.registered())}).")
        if support[Format.FP32] is not Support.NATIVE:
            raise ValueError(f"DeviceSpec {self.name!r} must run fp32 natively: it is the "
                             "reference emulated formats are priced against.")
        for f, s in support.items():
            rate = flops[f] if flops.has(f) else None
            if s is Support.NATIVE and not (rate or 0) > 0:
                raise ValueError(f"DeviceSpec {self.name!r} runs {f} natively but gives no "
                                 f"positive matmul_flops for it (got {rate!r}).")
        if self.cast_efficiency is not None and not 0 < self.cast_efficiency <= 1:
            raise ValueError(f"DeviceSpec {self.name!r} needs cast_efficiency in (0, 1] or None, "
                             f"got {self.cast_efficiency!r}.")
        for key in ("efficiency", "bandwidth_efficiency"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ValueError(f"DeviceSpec {self.name!r} has {key}={value!r}; it must be in "
                                 "(0, 1].")
        scaled = [s for s in scalings() if s.is_scaled]
        bad = {k: v for k, v in dict(self.scaled_efficiency).items()
               if k not in scaled or not 0 < v <= 1}
        if bad:
            raise ValueError(f"DeviceSpec {self.name!r} has scaled_efficiency {bad!r}; keys are "
                             f"scalings ({', '.join(scaled)}), values in (0, 1].")
        if not self.bandwidth > 0 or self.launch_s < 0:
            raise ValueError(f"DeviceSpec {self.name!r} needs bandwidth > 0 and launch_s >= 0, "
                             f"got bandwidth={self.bandwidth!r}, launch_s={self.launch_s!r}.")


def _tflops(**per_format: float) -> dict[Format, float]:
    """Dense matmul TFLOP/s per format name -> FLOP/s per Format (fp8: every recipe)."""
    out = {}
    for name, tflops in per_format.items():
        for f in (FP8_FORMATS if name == "fp8" else (Format(name),)):
            out[f] = tflops * 1e12
    return out


# The built-ins: a format registered later (or a per-GEMM mix parsed before this import) reads
# the entry of its kernel class, so what was parsed first changes no device.
_ALL_NATIVE = {f: Support.NATIVE for f in FORMAT_ORDER}
# Hopper (sm_90): FP8 tensor cores, no block-scaled ones (Blackwell's sm_100): those emulated.
_HOPPER = {**_ALL_NATIVE, **{f: Support.EMULATED for f in BLOCK_FORMATS}}
# No FP8 tensor cores (torch._scaled_mm needs CUDA sm_89+): fp8 is emulated.
_NO_FP8 = {**_HOPPER, **{f: Support.EMULATED for f in FP8_FORMATS}}

DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec(
        name="NVIDIA H100 SXM5 80GB",
        # NVIDIA H100 datasheet, dense: FP32 67 TFLOP/s on CUDA cores (PyTorch leaves TF32 off
        # for matmuls: torch.backends.cuda.matmul.allow_tf32 = False); BF16/FP16 Tensor Core
        # 989 (1979 is with sparsity); FP8 1979 (3958 with sparsity), every recipe.
        matmul_flops=_tflops(fp32=67, bf16=989, fp16=989, fp8=1979),
        # Datasheet: HBM3, 3.35 TB/s.
        bandwidth=3.35e12,
        support=_HOPPER,
        # Calibrated to torchao's H100 roofline (torchao/testing/training/roofline_utils.py):
        # GEMMs at 0.78 of peak, 2 us per kernel, and 2.4 TB/s x 0.92 = 2.2 TB/s for memory-bound
        # kernels (0.66 of the datasheet's 3.35). A plain copy reaches 0.9 of peak (4.3 of
        # 4.8 TB/s measured on an H200), but FP8's cast kernels (amax reductions, transposing
        # casts) do not: at 2.2 TB/s the roofline gives the ~40% per-layer slowdown measured for
        # a 16384x4096x512 linear in fp8 (pytorch/ao#2410), at 3.0 TB/s only ~15%.
        # tests/test_costmodel.py holds these speedups within 15% of torchao's roofline;
        # tests/test_calibration.py holds whole steps to measurements (autoprec.calibration's CALIBRATION).
        efficiency=0.78, bandwidth_efficiency=0.66, launch_s=2e-6,
    ),
    "a100": DeviceSpec(
        name="NVIDIA A100 SXM4 80GB",
        # NVIDIA A100 datasheet, dense: FP32 19.5 TFLOP/s (TF32 off, PyTorch's matmul
        # default); BF16/FP16 Tensor Core 312 (624 with sparsity).
        matmul_flops=_tflops(fp32=19.5, bf16=312, fp16=312),
        # Datasheet (80GB SXM): HBM2e, 2,039 GB/s.
        bandwidth=2.039e12,
        support=_NO_FP8,  # Ampere is sm_80
        # Assumed like Hopper: large BF16 GEMMs reach ~0.8 of peak in cuBLAS.
        efficiency=0.8, bandwidth_efficiency=0.9, launch_s=3e-6,
    ),
    "cpu-amx": DeviceSpec(
        # An example CPU target with fast BF16, not the machine autoprec is developed on (an AMD
        # EPYC without AMX; see DESIGN.md). Its rates are the sustained figures the project's
        # first notes gave for a 2-core Xeon with AMX on a 2048x2048 matmul, 2 threads; they
        # were not re-measured here.
        name="Intel Xeon, 2 cores, AMX-BF16 (example CPU target)",
        # BF16 on AMX tiles; FP16 on AVX512-FP16, slower than FP32.
        matmul_flops=_tflops(fp32=0.34, bf16=2.0, fp16=0.30),
        # An estimate, not a measurement: ~10 GB/s of sustained DRAM bandwidth per core.
        bandwidth=20e9,
        support=_NO_FP8,
        # The FLOP/s above are already sustained (measured), not datasheet peaks.
        efficiency=1.0, bandwidth_efficiency=1.0,
        # PyTorch eager dispatch + oneDNN primitive lookup per op on CPU.
        launch_s=10e-6,
    ),
}

# NVIDIA H200 datasheet: the H100's compute (FP32 67, BF16/FP16 989, FP8 1979 TFLOP/s dense)
# with HBM3e at 4.8 TB/s, and the H100 entry's calibrated efficiencies (measured on one: BF16
# GEMM 790 TFLOP/s, 0.80 of peak; copy 4.3 TB/s, 0.90).
# Measured on one (calibration.MEASURED_H200, benchmarks/gpu/h200-2026-12-04/): torchao's compiled FP8
# linears gained less than the H100 entry's casts at 0.66 of bandwidth price (16384x4096x4096
# tensorwise 1.08x, priced 1.56x; 16384x4096x1024 0.54x, priced 1.21x). The cast kernels'
# fraction of the bandwidth is fitted to the three tensorwise rows: 0.19 (0.91 TB/s); the five
# rowwise rows are held out (calibration.CALIBRATION["h200"]).
DEVICES["h200"] = dataclasses.replace(DEVICES["h100"], name="NVIDIA H200 SXM 141GB",
                                      bandwidth=4.8e12, cast_efficiency=0.19)
DEVICES["b200"] = DeviceSpec(
    name="NVIDIA B200 (HGX, 1000 W)",
    # NVIDIA HGX B200 datasheet per GPU, dense (half the sparse figures): BF16/FP16 2.25
    # PFLOP/s, FP8 (every recipe, MXFP8 too) 4.5, FP4 (NVFP4) 9; FP32 75 TFLOP/s (TF32 off).
    # torchao's roofline (torchao/testing/training/roofline_utils.py, "NVIDIA B200") has the
    # same tensor peaks.
    matmul_flops=_tflops(fp32=75, bf16=2250, fp16=2250, fp8=4500, mxfp8=4500, nvfp4=9000),
    # Datasheet: HBM3e, 7.7 TB/s (torchao's roofline: a 7680-bit bus at 3.996 GHz, 7.67).
    bandwidth=7.7e12,
    support=_ALL_NATIVE,
    # torchao's B200 entry: GEMMs at 0.78 of peak, copies at 0.92 of its bandwidth (both
    # "copied over from H100" there), 2 us per kernel.
    efficiency=0.78, bandwidth_efficiency=0.92, launch_s=2e-6,
    # Fitted (calibration.BLACKWELL_PUBLISHED, benchmarks/bench_published.py): 8-bit GEMMs at 0.72 of
    # BF16's sustained fraction, to Transformer Engine's MXFP8 GEMM-only 1.44x on a B300 (its
    # FP8 current-scaling 1.41x is held out); NVFP4's at 0.51, to torchtitan's all-NVFP4 step
    # (31,758 tokens/s against BF16's 21,919). The other published steps are held out
    # (calibration.CALIBRATION["b200"] says how far off they come out).
    scaled_efficiency={"tensor": 0.72, "row": 0.72, "mx": 0.72, "nvfp4": 0.51},
)
# torchao's roofline's "NVIDIA B300 SXM6 AC": B200's BF16 and FP8 peaks, FP4 at 14 PFLOP/s
# dense, 8 TB/s, GEMMs at 0.82 and copies at 0.84 (measured there); for Transformer Engine's
# published B300 GEMM speed-ups.
DEVICES["b300"] = dataclasses.replace(
    DEVICES["b200"], name="NVIDIA B300 SXM6",
    matmul_flops=_tflops(fp32=75, bf16=2250, fp16=2250, fp8=4500, mxfp8=4500, nvfp4=14000),
    bandwidth=8e12, efficiency=0.82, bandwidth_efficiency=0.84,
    # 8-bit as the B200's; NVFP4 at 0.33, fitted to Transformer Engine's 2.03x
    scaled_efficiency={"tensor": 0.72, "row": 0.72, "mx": 0.72, "nvfp4": 0.33})
DEVICES = {k: DEVICES[k] for k in ("h100", "h200", "b200", "b300", "a100", "cpu-amx")}


def resolve_target(target: str | DeviceSpec) -> tuple[str, DeviceSpec]:
    if isinstance(target, DeviceSpec):
        return target.name, target
    key = str(target).strip().lower()
    if key not in DEVICES:
        raise ValueError(f"Unknown cost-model target {target!r}; expected one of "
                         f"{', '.join(DEVICES)} (or pass a DeviceSpec).")
    return key, DEVICES[key]
