"""A roofline cost model of devices that are not present, so a CPU machine can tune for a GPU.

:func:`estimate_layer` prices one captured layer in one format on a device of
:mod:`autoprec.devices` (a :class:`~autoprec.devices.DeviceSpec`; ``DEVICES``: h100, h200,
b200, b300, a100, cpu-amx): each matmul at max(compute, memory) for its forward
and its two backward products (dgrad, wgrad), plus the casts into and out of the format, FP8's
amax reductions and transposed copies, and a fixed cost per kernel. That is why small layers
gain nothing from FP8 (torchao measured a 1024x2048x1024 linear at 0.80x of BF16 on H100,
4096x8192x16384 at 1.39x) and the model reproduces the crossover. Which products run in FP8
is the call registry's to say (:meth:`autoprec.graph.Layer.fp8_blockers`): the
others are priced as bf16, as they run.

:func:`estimate_step` prices a whole assignment. Given the captured graph's edges it prices
the casts where they happen, on the edges between layers whose activations differ in dtype;
without edges every layer pays its own casts in and out (an upper bound, and what the
per-layer table shows).

A format a device only emulates is priced as its emulation and never below fp32 or bf16.

:mod:`autoprec.titan_step` prices a whole Llama-style training step as torchtitan runs it
(the blocks' linears with this layer model, plus the work that is not a linear) and its peak
memory, so the model can be checked against published measurements of whole steps;
:mod:`autoprec.calibration` holds those measurements, the checks against them and how far off
the model was (``CALIBRATION``).

Everything about a format comes from its :class:`~autoprec.formats.Numerics`: each GEMM is
priced at the rate and operand width of what it runs in (an FP8 GEMM at the format's rate, a
high-precision one at its dtype's), the casts by the FP8 GEMMs' scaling, the edges by the
dtype activations leave in.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from autoprec.devices import DeviceSpec, resolve_target
from autoprec.formats import Format, Gemm, Numerics, Support
from autoprec.graph import Layer
from autoprec.measure.timing import MODEL_PREFIX, LayerTime
from autoprec.scaling import shape_multiple

__all__ = [
    "gemm_seconds",
    "forward_gemm_seconds",
    "weight_cast_seconds",
    "estimate_layer",
    "estimate_layers",
    "estimate_step",
    "linear_seconds",
    "produced_elements",
]


# bytes per FP32 element (this and the others below as torch's dtypes say)
_FP32 = torch.float32.itemsize


def as_layer(record: Any) -> Layer:
    """``record`` as a :class:`~autoprec.graph.Layer`: a Layer as it is; anything else with
    ``fqn``, ``kind`` and ``matmuls`` (and optionally ``module_type``, ``calls``, ``flops``,
    ``bytes``, ``params``, else empty) made into one, so the model below reads one type."""
    if isinstance(record, Layer):
        return record
    return Layer(fqn=record.fqn, kind=record.kind,
                 module_type=getattr(record, "module_type", ""),
                 matmuls=tuple(getattr(record, "matmuls", ()) or ()),
                 calls=tuple(getattr(record, "calls", ()) or ()),
                 **{k: int(getattr(record, k, 0)) for k in ("flops", "bytes", "params")})


def _weight_operand(layer: Layer, batch: int) -> bool:
    """Whether the second operand of a matmul of this layer is a weight (cast from the FP32
    master) rather than an activation (only matters with graph edges)."""
    if layer.kind in ("linear", "conv"):
        return True
    return batch == 1 and layer.params > 0


def _gemm(m: int, k: int, n: int, in_bytes: int, out_bytes: int, flops: float,
          spec: DeviceSpec, batch: int = 1) -> float:
    """One kernel of ``batch`` (M, K) x (K, N) GEMMs: max(compute, memory, one launch),
    torchao's roofline form."""
    compute = 2.0 * batch * m * k * n / (flops * spec.efficiency)
    memory = batch * ((m * k + k * n) * in_bytes + m * n * out_bytes) / \
        (spec.bandwidth * spec.bandwidth_efficiency)
    return max(compute, memory, spec.launch_s)


def _gemms(b: int, m: int, k: int, n: int, fmt: Format, spec: DeviceSpec) -> float:
    """Forward (M,K,N), dgrad (M,N,K) and wgrad (K,M,N) of one product in a native format,
    each as its Gemm says: an FP8 GEMM at the format's rate, a high-precision one (the wgrad of
    rowwise_with_gw_hp) at its dtype's; a batched FP8 product runs one ``_scaled_mm`` per
    matrix (it takes 2-D operands only)."""
    shapes = {"fwd": (m, k, n), "dgrad": (m, n, k), "wgrad": (k, m, n)}
    total = 0.0
    for name, gemm in fmt.numerics.gemms.items():
        total += _product_gemm(*shapes[name], gemm, fmt, spec, b)
    return total


def _product_gemm(x: int, y: int, z: int, gemm: Gemm, fmt: Format, spec: DeviceSpec,
                  b: int = 1) -> float:
    """One GEMM of a product in ``fmt``, ``b`` (X, Y) x (Y, Z) matrices, as its Gemm says."""
    run = fmt if gemm.is_scaled else Format.of_dtype(gemm.a)
    in_b, out_b = gemm.operand_bytes, run.output_dtype.itemsize
    rate = spec.rate(gemm)
    if gemm.is_scaled and b > 1:  # one _scaled_mm per matrix
        return b * _gemm(x, y, z, in_b, out_b, rate, spec)
    return _gemm(x, y, z, in_b, out_b, rate, spec, batch=b)  # one batched kernel


# Bytes each cast kernel moves per element of a tensor, per cast scheme (the FP8 GEMMs'
# scaling, and which GEMMs stay in high precision) and role of the tensor in the linear layer,
# from torchao's roofline (torchao/testing/training/roofline_utils.py,
# get_tensor_memory_traffic_ovhd_s, no fusion with the previous op; its tensorwise, rowwise and
# rowwise_with_gw_hp): reads in BF16, writes in FP8 (a per-tensor amax reduction reads once
# more; row scales need a transposed BF16 copy, except for a tensor only the forward or only
# the dgrad quantizes, as when the wgrad stays in BF16).
# Rowwise's two backward GEMMs add one more kernel each, which torchao's roofline leaves out:
# they run with slow accumulation, which torchao does not give the rowwise CUTLASS kernel (too
# slow); it runs cuBLAS's tensorwise kernel with unit scales and multiplies the BF16 output by
# the row scales afterwards (torchao.float8.float8_ops.addmm_float8_unwrapped, pytorch/ao#1325;
# "at least one extra triton kernel per GEMM", pytorch/ao#2184): a read and a write of the
# dgrad's output (shaped like the input) and of the wgrad's (shaped like the weight). Without
# them the model priced rowwise's whole-step speed-up 5-7% above the three published
# measurements, with them 0.5-2.5% (benchmarks/bench_published.py).
_BF, _F8 = torch.bfloat16.itemsize, torch.float8_e4m3fn.itemsize
_RESCALE = 2 * _BF
_CAST_KERNELS = {
    (("tensor", ()), "weight"): (_BF, 0, _BF + _F8, _BF + _F8),
    (("tensor", ()), "input"): (_BF, 0, _BF + 2 * _F8),
    (("tensor", ()), "grad_output"): (_BF, 0, _BF + 2 * _F8),
    (("row", ()), "weight"): (_BF + _F8, 2 * _BF, _BF + _F8, _RESCALE),
    (("row", ()), "input"): (2 * _BF + _F8, _BF + _F8, _RESCALE),
    (("row", ()), "grad_output"): (2 * _BF + _F8, _BF + _F8),
    (("row", ("wgrad",)), "weight"): (_BF + _F8, 0, _BF + _F8),
    (("row", ("wgrad",)), "input"): (_BF + _F8,),
    (("row", ("wgrad",)), "grad_output"): (_BF + _F8,),
}


def _cast_scheme(numerics: Numerics) -> tuple[str, tuple[str, ...]]:
    """The key of ``_CAST_KERNELS``: an FP8 format's scaling and its high-precision GEMMs; a
    ValueError for a scheme whose casts this model has no traffic for."""
    scheme = (numerics.scaling, numerics.high_precision)
    if (scheme, "weight") not in _CAST_KERNELS:
        raise ValueError(f"The cost model has no cast traffic for {numerics.label} ({scheme[0]} "
                         f"scales, high-precision GEMMs {scheme[1] or 'none'}); add its cast "
                         "kernels to autoprec.costmodel._CAST_KERNELS.")
    return scheme


# The GEMMs (and operand) that take each tensor of a product: the input A is the forward's and
# the weight gradient's first operand, B the forward's and the input gradient's second, the
# incoming gradient the input gradient's first and the weight gradient's second.
_TAKEN_BY = {"input": (("fwd", 0), ("wgrad", 0)), "weight": (("fwd", 1), ("dgrad", 1)),
             "grad_output": (("dgrad", 0), ("wgrad", 1))}


def _scaled_casts(b: int, m: int, k: int, n: int, numerics: Numerics,
                  spec: DeviceSpec) -> float:
    """The casts of one product in a format whose casts ``_CAST_KERNELS`` has no row for (the
    block-scaled formats, per-GEMM mixes), each max(traffic, launch): every scaled GEMM casts
    each of its operands along its own contraction in one kernel (read BF16, write the
    operand's values and block scales: torchao's MXFP8 roofline, a dim-0 and a dim-1 cast per
    tensor), and a tensor that a GEMM scales per tensor (FP8 tensorwise, NVFP4's FP32 scale)
    first has its amax taken, once per transform of it (NVFP4's Hadamard-transformed operands
    need their own)."""
    bw = spec.cast_bandwidth
    total = 0.0
    for role, numel in (("input", b * m * k), ("weight", b * k * n), ("grad_output", b * m * n)):
        gemms = [numerics.gemms[name] for name, _ in _TAKEN_BY[role]]
        scaled = [g for g in gemms if g.is_scaled]
        total += sum(max((_BF + g.operand_bytes) * numel / bw, spec.launch_s) for g in scaled)
        amaxes = {g.hadamard for g in scaled if g.scaling.tensor_amax}
        total += len(amaxes) * max(_BF * numel / bw, spec.launch_s)
    return total


def _casts(b: int, m: int, k: int, n: int, numerics: Numerics, weight: bool,
           spec: DeviceSpec) -> float:
    """The casts of one product in a scaled format: the FP8 recipes' calibrated kernels
    (``_CAST_KERNELS``), or for any other format :func:`_scaled_casts`."""
    scheme = (numerics.scaling, numerics.high_precision)
    if not numerics.is_block_scaled and (scheme, "weight") in _CAST_KERNELS:
        return _fp8_casts(b, m, k, n, scheme, weight, spec)
    return _scaled_casts(b, m, k, n, numerics, spec)


def _fp8_casts(b: int, m: int, k: int, n: int, scheme: tuple, weight: bool,
               spec: DeviceSpec) -> float:
    """The casts to FP8 around one product, forward and backward: A (M x K, the input), B (K x N,
    the weight, or a second input), the incoming gradient (M x N); each kernel max(traffic,
    launch)."""
    return sum(_role_casts(numel, scheme, role, spec)
               for numel, role in ((b * m * k, "input"), (b * k * n, "weight" if weight else "input"),
                                   (b * m * n, "grad_output")))


def _role_casts(numel: int, scheme: tuple, role: str, spec: DeviceSpec) -> float:
    """The cast kernels of one tensor of ``numel`` elements in ``role``, each max(traffic,
    launch)."""
    bw = spec.cast_bandwidth
    return sum(max(per * numel / bw, spec.launch_s) for per in _CAST_KERNELS[(scheme, role)])


def _boundary_casts(a: int, c: int, fmt: Format, spec: DeviceSpec) -> float:
    """Activations arriving in FP32 and leaving back to it, forward and backward (a layer
    priced alone, without the graph's edges: an upper bound)."""
    if fmt.compute_dtype is torch.float32:
        return 0.0
    bw = spec.bandwidth * spec.bandwidth_efficiency
    per = _FP32 + torch.bfloat16.itemsize
    return sum(max(2 * el * per / bw, spec.launch_s) for el in (a, a, c, c)) / 2


def _price(layer: Layer, fmt: Format, spec: DeviceSpec, *,
           boundary_casts: bool = True) -> tuple[float, bool, list[str]]:
    """(seconds, emulated, notes) for one layer in one format on ``spec``. Which products run
    in FP8 is the call registry's to say (a record without calls: the shape rule alone)."""
    bw = spec.bandwidth * spec.bandwidth_efficiency
    matmuls = layer.matmuls
    notes: list[str] = []
    emulated = False
    total = 0.0
    matmul_fp32_bytes = 0
    blockers = layer.fp8_blockers(shape_multiple(fmt.numerics)) if fmt.is_scaled \
        else [""] * len(matmuls)
    for (b, m, k, n), blocker in zip(matmuls, blockers):
        matmul_fp32_bytes += _FP32 * b * (m * k + k * n + m * n)
        # A product FP8 does not take (the registry says why) runs, and is priced, as bf16.
        run = Format.BF16 if fmt.is_scaled and blocker else fmt
        weight = _weight_operand(layer, b)
        if boundary_casts:
            total += _boundary_casts(b * m * k, b * m * n, run, spec)
        if run.is_scaled and spec.support[run] is Support.EMULATED:
            # Emulation: quantize -> dequantize (read FP32, write FP8, read FP8, write FP32 per
            # element of A, W, grad) around FP32 matmuls.
            emulated = True
            q_el = b * (m * k + k * n + m * n)
            total += _gemms(b, m, k, n, Format.FP32, spec)
            total += (q_el * (_FP32 + 2 * (_FP32 + 1))) / bw + 9 * spec.launch_s
        else:
            total += _gemms(b, m, k, n, run, spec)
            if run.is_scaled:
                total += _casts(b, m, k, n, run.numerics, weight, spec)
    blocked = [r for r in blockers if r]
    if fmt.is_scaled and blocked:
        notes.append(f"{len(blocked)} of {len(matmuls)} matmuls priced as bf16: {blocked[0]}")
    # Elementwise work (softmax, masks, norms, lookups): memory-bound, and autocast keeps it
    # in FP32 in every format, so the format changes little. Backward moves about twice the
    # forward's bytes.
    rest = max(0, layer.bytes - matmul_fp32_bytes)
    if rest or not matmuls:
        total += 3 * rest / bw + 3 * spec.launch_s
    if not matmuls:
        notes.append(f"memory-bound {layer.kind or 'layer'}: the format changes little")
    return total, emulated, notes


def linear_seconds(m: int, k: int, n: int, fmt: Format | str,
                   target: str | DeviceSpec) -> float:
    """Forward + backward seconds of one linear layer, ``(M, K) x (K, N)``, in ``fmt`` on
    ``target``, with its input, weight and gradient arriving in BF16: the three GEMMs plus, in
    fp8, the recipe's casts. This is the quantity of torchao's float8 roofline
    (``torchao/testing/training/roofline_utils.py``), which ``tests/test_costmodel.py`` holds
    this model to."""
    fmt = Format.parse(fmt)
    _, spec = resolve_target(target)
    # no elementwise work beyond the product's own operands
    layer = Layer(fqn="linear", kind="linear", module_type="Linear", matmuls=((1, m, k, n),),
                  calls=("linear",), params=k * n, bytes=_FP32 * (m * k + k * n + m * n))
    return _price(layer, fmt, spec, boundary_casts=False)[0]


def gemm_seconds(m: int, k: int, n: int, fmt: Format | str,
                 target: str | DeviceSpec) -> float:
    """The three GEMMs alone (forward, dgrad, wgrad) of an ``(M, K) x (K, N)`` linear in
    ``fmt`` on ``target``, without casts: the quantity of a GEMM-only benchmark."""
    _, spec = resolve_target(target)
    return _gemms(1, m, k, n, Format.parse(fmt), spec)


def forward_gemm_seconds(m: int, k: int, n: int, fmt: Format | str,
                         target: str | DeviceSpec) -> float:
    """The forward GEMM alone of an ``(M, K) x (K, N)`` linear in ``fmt`` on ``target``, without
    casts: what selective activation checkpointing recomputes of it."""
    _, spec = resolve_target(target)
    fmt = Format.parse(fmt)
    return _product_gemm(m, k, n, fmt.numerics.gemms["fwd"], fmt, spec)


def weight_cast_seconds(numel: int, fmt: Format | str, target: str | DeviceSpec) -> float:
    """The cast kernels of a linear's weight of ``numel`` elements in the FP8 recipe ``fmt``
    (its amax, its FP8 cast and transposed copy, as the recipe's cast traffic counts them; each
    max(traffic, launch)): what a weight gathered already in FP8 does not pay."""
    _, spec = resolve_target(target)
    return _role_casts(numel, _cast_scheme(Format.parse(fmt).numerics), "weight", spec)


def estimate_layer(layer: Layer, fmt: Format | str, target: str | DeviceSpec, *,
                   boundary_casts: bool = True) -> LayerTime:
    """Roofline estimate of forward + backward seconds of ``layer`` in ``fmt`` on ``target``.

    ``layer`` is an :class:`autoprec.graph.Layer` or a record :func:`as_layer` makes one of
    (``fqn``, ``kind``, ``matmuls`` ((batch, M, K, N) per forward), ``bytes`` (read + written
    per forward at FP32) and ``params``). ``target`` is a key of ``DEVICES`` (h100, h200, a100, cpu-amx) or a
    :class:`DeviceSpec`. Each matmul costs 3x its forward (dgrad, wgrad) at max(compute,
    memory), plus casts in and out of the format (and FP8's amax reductions and transposed
    copies) and a fixed cost per kernel. FP8 products the kernel cannot take run, and are
    priced, as bf16 (see ``note``). An emulated format costs its emulation and never less than
    fp32 or bf16. ``boundary_casts=False`` leaves out the casts of the layer's activations in
    from and out to FP32: the layer as part of a graph whose edges price those casts
    (:func:`estimate_step` with ``edges``), as the profile prices it.
    """
    layer = as_layer(layer)
    fmt = Format.parse(fmt, where=f"for layer `{layer.fqn}`")
    key, spec = resolve_target(target)
    fqn = layer.fqn
    if spec.support[fmt] is Support.UNSUPPORTED:
        return LayerTime(fqn=fqn, format=fmt, seconds=math.inf, raw_seconds=math.inf, spread=0.0,
                         source=f"{MODEL_PREFIX}{key}", error=f"{key} cannot run {fmt}")
    (raw, seconds), emulated, notes = _estimate(layer, fmt, spec, key,
                                                boundary_casts=boundary_casts)
    return LayerTime(fqn=fqn, format=fmt, seconds=seconds, raw_seconds=raw, spread=0.0,
                     emulated=emulated, source=f"{MODEL_PREFIX}{key}", note="; ".join(notes))


def _estimate(layer: Layer, fmt: Format, spec: DeviceSpec, key: str, *,
              boundary_casts: bool = True) -> tuple[tuple[float, float], bool, list[str]]:
    """((raw, floored) seconds, emulated, notes)."""
    raw, emulated, notes = _price(layer, fmt, spec, boundary_casts=boundary_casts)
    seconds = raw
    if emulated:
        # Emulated FP8 is bf16-or-fp32 work plus quantization: it cannot beat either.
        floor = max(_price(layer, f, spec, boundary_casts=boundary_casts)[0]
                    for f in (Format.FP32, Format.BF16) if spec.support[f] is Support.NATIVE)
        seconds = max(raw, floor)
        notes.append(f"{fmt} emulated on {key}: not representative; priced as never faster "
                     "than fp32 or bf16")
    return (raw, seconds), emulated, notes


def estimate_layers(layers: Iterable[Layer], formats: Iterable[Format | str],
                    target: str | DeviceSpec) -> dict[str, dict[Format, LayerTime]]:
    """:func:`estimate_layer` for every layer and format, shaped like :func:`measure_layers`."""
    fmts = [Format.parse(f) for f in formats]
    return {layer.fqn: {f: estimate_layer(layer, f, target) for f in fmts} for layer in layers}


def output_elements(layer: Layer) -> int:
    """Elements of the tensor a layer passes on along an edge (what a cast between two layers
    converts): its last product's result (attention's ``scores @ v``, not the scores), or for
    a layer without matmuls half its FP32 traffic (input and output of equal size)."""
    if layer.matmuls:
        p = layer.matmuls[-1]
        return p.batch * p.m * p.n
    return layer.bytes // (2 * _FP32)


def produced_elements(layer: Layer) -> int:
    """Elements of every product's result in one forward (all calls of a layer called twice,
    attention's scores too): what the elementwise work after the products reads and saves in
    the layer's output dtype (the memory model's residual is per such element)."""
    return sum(p.batch * p.m * p.n for p in layer.matmuls)


def estimate_step(layers: Iterable[Layer], assignment: Mapping[str, Format | str],
                  target: str | DeviceSpec, *,
                  edges: Iterable[tuple[str, str]] | None = None,
                  default: Format | str | None = None) -> float:
    """Modeled seconds of forward + backward of the whole set of ``layers`` under
    ``assignment`` (fqn -> format) on ``target``.

    Without ``edges``, the sum of :func:`estimate_layer` (each layer pays its own casts in and
    out, as :func:`measure_layers` measures it: an upper bound). With ``edges`` ((producer,
    consumer) fqn pairs, e.g. ``LayerGraph.edges``), layers keep their activations in their own
    dtype and each edge between layers of different activation dtypes pays one cast, forward
    and backward; an fp8 layer outputs bf16, so fp8 -> bf16 costs nothing. ``default`` is the
    format of layers the assignment does not name; None makes a missing layer an error.
    """
    key, spec = resolve_target(target)
    layers = [as_layer(x) for x in layers]
    default_fmt = Format.parse(default, where="for `default`") if default is not None else None
    fmts: dict[str, Format] = {}
    for layer in layers:
        if layer.fqn in assignment:
            fmts[layer.fqn] = Format.parse(assignment[layer.fqn], where=f"for layer `{layer.fqn}`")
        elif default_fmt is not None:
            fmts[layer.fqn] = default_fmt
    missing = [layer.fqn for layer in layers if layer.fqn not in fmts]
    if missing:
        raise ValueError(f"The assignment gives no format for {len(missing)} layer(s), e.g. "
                         f"{', '.join(map(repr, missing[:3]))}; add them or pass default=.")
    by_fqn = {layer.fqn: layer for layer in layers}
    unknown = [f for f in assignment if f not in by_fqn]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(by_fqn), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"The assignment names {unknown[0]!r}, which is not one of the layers."
                         f"{hint}")
    boundary = edges is None
    total = sum(_estimate(layer, fmts[layer.fqn], spec, key, boundary_casts=boundary)[0][1]
                for layer in layers)
    if edges is not None:
        bw = spec.bandwidth * spec.bandwidth_efficiency
        for src, dst in edges:
            if src not in by_fqn or dst not in by_fqn:
                bad = src if src not in by_fqn else dst
                raise ValueError(f"Edge ({src!r}, {dst!r}) names {bad!r}, which is not one of "
                                 "the layers.")
            a, b = fmts[src].output_dtype, fmts[dst].output_dtype
            if a == b:
                continue
            elems = output_elements(by_fqn[src])
            # Forward cast of the activation, backward cast of its gradient.
            per = elems * (a.itemsize + b.itemsize)
            total += 2 * per / bw + 2 * spec.launch_s
    return total
