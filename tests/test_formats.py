"""Each format's numerics through a real region, against a float64 reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoprec
from autoprec import Format, supported_formats
from autoprec.formats import Support

# SQNR floors (dB) of a 256-deep linear layer's output vs float64, with margin below what
# each format measures here: fp32 ~140, fp16 ~70, bf16 ~48, fp8 E4M3 ~28.
FLOORS = {"fp32": 100.0, "fp16": 55.0, "bf16": 38.0, "fp8": 22.0}
CEILINGS = {"fp32": 200.0, "fp16": 85.0, "bf16": 60.0, "fp8": 38.0}


def sqnr_db(ref, x):
    ref, x = ref.detach().double(), x.detach().double()
    return float(10 * torch.log10(ref.square().sum() / (ref - x).square().sum()))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "fp8"])
def test_linear_numerics_per_format(fmt):
    layer = nn.Linear(256, 128)
    x = torch.randn(64, 256)
    ref = x.double() @ layer.weight.double().t() + layer.bias.double()
    with pytest.warns(UserWarning, match="emulate") if fmt == "fp8" else _nullcontext():
        autoprec.apply(layer, autoprec.Policy(default=fmt))
    out = layer(x)
    s = sqnr_db(ref, out)
    assert FLOORS[fmt] <= s <= CEILINGS[fmt], f"{fmt}: SQNR {s:.1f} dB outside [{FLOORS[fmt]}, {CEILINGS[fmt]}]"
    expected_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                      "fp8": torch.bfloat16}[fmt]
    assert out.dtype == expected_dtype


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_parse_and_errors():
    assert Format.parse("BF16") is Format.BF16
    assert Format.parse(Format.FP8) is Format.FP8
    with pytest.raises(ValueError, match=r"Unknown format 'fp9'.*expected one of fp32, bf16, fp16, fp8"):
        Format.parse("fp9")
    assert str(Format.FP16) == "fp16"


def test_ranges_match_the_standards():
    assert Format.FP16.max_value == 65504.0
    assert Format.FP16.min_subnormal == pytest.approx(2.0 ** -24)
    assert Format.FP8.max_value == 448.0  # E4M3
    assert Format.BF16.max_value > 3e38
    assert Format.FP8.demoted() is Format.BF16 and Format.BF16.demoted() is Format.FP32


def test_supported_formats_on_cpu():
    sup = supported_formats("cpu")
    assert sup[Format.FP32] is Support.NATIVE and sup[Format.BF16] is Support.NATIVE
    assert sup[Format.FP8] is Support.EMULATED


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_supported_formats_on_cuda():
    major, minor = torch.cuda.get_device_capability()
    sup = supported_formats("cuda")
    assert (sup[Format.FP8] is Support.NATIVE) == ((major, minor) >= (8, 9))


def test_cpu_features_agree_with_the_kernel_flags():
    # torch's probe and the kernel's own flags must say the same of the BF16 instructions
    # (the header line of the test log, and every speed test, rest on this)
    from autoprec.host import cpu_features

    feats = cpu_features()
    assert feats.capability == torch.backends.cpu.get_cpu_capability()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags"))
    except (OSError, StopIteration):
        pytest.skip("no x86 /proc/cpuinfo flags on this host")
    assert feats.bf16_dot == bool(flags & {"avx512_bf16", "amx_bf16"}), feats.describe()
    assert feats.fp16_dot == bool(flags & {"avx512_fp16", "amx_fp16"}), feats.describe()
    assert feats.name in feats.describe() and feats.capability in feats.describe()
