"""The cost model against published measurements: the figures (``PUBLISHED``: torchtitan's
Llama-3-8B steps on 8 H100s and torchao's linears; ``BLACKWELL_PUBLISHED``: torchtitan's
GB200/B200 steps and Transformer Engine's B300 GEMMs; ``MEASURED_H200``: FP8 linears measured
on one H200), the checks that price each as it ran (:func:`check_rows`, :func:`memory_rows`,
:func:`blackwell_rows`, :func:`measured_rows`), and what they found (``CALIBRATION``: how far
off each target's model was, which :mod:`autoprec.pricing` prints beside every priced figure).

benchmarks/bench_published.py prints the rows as tables, tests/test_calibration.py and
tests/test_blackwell.py hold them within ``CALIBRATION``'s errors. Whole steps are priced by
:mod:`autoprec.titan_step`, single linears and GEMMs by :mod:`autoprec.costmodel`; this module
imports both, neither imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from autoprec.costmodel import gemm_seconds, linear_seconds
from autoprec.devices import DeviceSpec
from autoprec.formats import Format
from autoprec.titan_step import (
    LLAMA3_8B,
    StepSpec,
    TrainingSetup,
    price_training_memory,
    price_training_step,
)

__all__ = [
    "CALIBRATION",
    "LLAMA3_8B_GB200",
    "PUBLISHED",
    "BLACKWELL_PUBLISHED",
    "MEASURED_H200",
    "blackwell_rows",
    "check_rows",
    "measured_rows",
    "memory_rows",
    "step_tokens_per_s",
]


@dataclass(frozen=True)
class Published:
    """A published measurement the model is checked against: a whole training step of
    ``LLAMA3_8B`` (``shape`` None; tokens/s per GPU, as torchtitan logs them) or one linear
    layer's forward + backward (``shape`` (M, K, N); ``value`` its speed-up over bf16)."""

    # where it is published, and the run (measurements of one run share a bf16 baseline)
    where: str
    run: str
    # "bf16" or the fp8 recipe every (block) linear ran in
    fmt: str
    value: float
    # peak memory as published (steps only)
    peak_memory: str = ""
    fp8_all_gather: bool = False
    shape: tuple[int, int, int] | None = None
    # used to fit a constant (its error says nothing about the model's accuracy)
    fitted: bool = False
    # the run's torchtitan saved aten.abs outputs under per-op SAC (before torchtitan#820)
    sac_saves_abs: bool = False
    # the source writes "GB" for torchtitan's logged GiB
    gb_is_gib: bool = False

    def peak_memory_bytes(self) -> float | None:
        """``peak_memory`` in bytes ("47.65 GiB" is 47.65 x 2**30; "GB" 10**9, or 2**30 where
        the source's GB are GiB); None when nothing was published."""
        if not self.peak_memory:
            return None
        value, unit = self.peak_memory.split()
        scale = {"GiB": 2**30, "GB": 2**30 if self.gb_is_gib else 1e9}[unit]
        return float(value) * scale


_TITAN = "torchtitan, Jan 2025"
_AO = "torchao float8 README (torch 2.7.0a0, torchao 0.10)"
PUBLISHED: tuple[Published, ...] = (
    # torchtitan commit 7a04053 ("example of float8 with rowwise scaling"), its log: 8 H100s
    # (95 GiB each by the log's memory percentages: Meta's H100 variant, 2.4 TB/s, which
    # torchao's roofline and notes describe as 500 W parts), torch.compile; rowwise with
    # pytorch/ao#1629 (its 58.55 GiB is SAC saving abs() outputs, fixed by torchtitan#820,
    # whose log shows the same 58.55 GiB with abs saved and 47.77 GiB without). Its save
    # list still held aten.abs for all three runs; only rowwise saves abs() by it.
    Published("torchtitan 7a04053 log", _TITAN, "bf16", 5760, "47.65 GiB", fitted=True,
              sac_saves_abs=True),
    Published("torchtitan 7a04053 log", _TITAN, "fp8:rowwise", 6424, "58.55 GiB",
              sac_saves_abs=True),
    Published("torchtitan 7a04053 log", _TITAN, "fp8:tensorwise", 7186, "47.32 GiB",
              fp8_all_gather=True, sac_saves_abs=True),
    # the same comparison as landed (torchtitan PR #808's description, same bf16 run; its
    # rowwise run after #820)
    Published("torchtitan #808", _TITAN, "fp8:rowwise", 6468, "47.77 GiB"),
    # torchao's torchao/float8/README.md, "e2e training benchmarks", NVIDIA H100 (Mar 2025;
    # torchtitan 0.0.2, after #820). Its "Peak Memory (GB)" is torchtitan's GiB: the
    # benchmark's parser (benchmarks/float8/training/parse_torchtitan_logs.py) reads
    # "memory: ...GiB" from the log and prints "Max Memory Usage: ... GiB".
    Published("torchao README", _AO, "bf16", 6150, "47.65 GB", gb_is_gib=True),
    Published("torchao README", _AO, "fp8:tensorwise", 7689.5, "47.77 GB",
              fp8_all_gather=True, gb_is_gib=True),
    Published("torchao README", _AO, "fp8:rowwise", 6768, "47.79 GB", gb_is_gib=True),
    # single linears, forward + backward, torch.compile, H100: torchao README's examples
    # (tensorwise, 2024) and pytorch/ao#2185's float8 linear microbenchmark (rowwise, May 2025)
    Published("torchao README", "torchao linear benchmark", "fp8:tensorwise", 0.80,
              shape=(1024, 2048, 1024)),
    Published("torchao README", "torchao linear benchmark", "fp8:tensorwise", 1.39,
              shape=(4096, 8192, 16384)),
    *(Published("pytorch/ao#2185", "torchao linear benchmark", "fp8:rowwise", x, shape=s)
      for s, x in (((16384, 8192, 1280), 1.11), ((16384, 1024, 8192), 1.43),
                   ((16384, 8192, 7168), 1.73), ((16384, 3584, 8192), 1.71))),
)


# torchtitan's docs/nvfp4.md (PR #3914): Llama-3-8B on C4, FSDP over 4 GPUs (4x GB200, sm_100,
# by the PR's commit message), local batch 32 x 2048, torch.compile, the llama3_8b recipe's
# per-op SAC; torch 2.14 nightly, torchao 0.18.
LLAMA3_8B_GB200 = dataclasses.replace(
    LLAMA3_8B, name="Llama-3-8B, 4 GB200s, FSDP2, local batch 32 x 2048, per-op SAC",
    seq_len=2048, batch=32, gpus=4)


@dataclass(frozen=True)
class BlackwellFigure:
    """A published Blackwell measurement: a whole training step's tokens/s per GPU (``kind``
    "step": every block linear in ``fmt`` but the last ``bf16_tail`` blocks, the output layer
    in ``output``), or a GEMM-only speed-up over BF16 (``kind`` "gemm")."""

    where: str
    # measurements of one run share its bf16 baseline
    run: str
    fmt: str
    value: float
    target: str = "b200"
    kind: str = "step"
    setup: TrainingSetup = LLAMA3_8B_GB200
    bf16_tail: int = 0
    output: str = "bf16"
    # used to fit a constant (its error says nothing about the model's accuracy)
    fitted: bool = False


_NV = "torchtitan nvfp4.md"
_MX = "torchtitan mxfp8.md (torchao 0.13)"
BLACKWELL_PUBLISHED: tuple[BlackwellFigure, ...] = (
    BlackwellFigure(_NV, _NV, "bf16", 21919, fitted=True),
    # torchtitan's MXFP8 converter with no fqns converts every Linear, the output layer too
    BlackwellFigure(_NV, _NV, "mxfp8", 28084, output="mxfp8"),
    # llama3_8b_first_85_pct_layers_nvfp4: the last ceil(32 x 0.15) = 5 blocks and the output
    # layer in bf16
    BlackwellFigure(_NV, _NV, "nvfp4", 30040, bf16_tail=5),
    # the same PR's description: every Linear in NVFP4 (its loss is not in the doc's table)
    BlackwellFigure("torchtitan #3914", _NV, "nvfp4", 31758, output="nvfp4", fitted=True),
    # docs/mxfp8.md, dense Llama-3-8B: 8 power-limited B200s, local batch 1 x 8192, compile,
    # FSDP2, per-op SAC (torchtitan's float8 and MX converters then left the output in bf16)
    BlackwellFigure(_MX, _MX, "bf16", 8307.5, setup=LLAMA3_8B),
    BlackwellFigure(_MX, _MX, "mxfp8", 9642, setup=LLAMA3_8B),
    BlackwellFigure(_MX, _MX, "fp8:tensorwise", 10417, setup=LLAMA3_8B),
    # Transformer Engine's GEMM-only speed-ups over BF16 on a B300, 5B model (its GEMM shapes
    # are not published; priced at Llama-3-8B's block linears, 8192 tokens)
    *(BlackwellFigure("Transformer Engine (B300, GEMMs only)", "te", fmt, x, target="b300",
                      kind="gemm", fitted=fitted)
      for fmt, x, fitted in (("mxfp8", 1.44, True), ("fp8:tensorwise", 1.41, False),
                             ("nvfp4", 2.03, True))),
)


def _blackwell_step(p: BlackwellFigure, fmt: str, output: str, tail: int,
                    step: StepSpec | None) -> float:
    parts = price_training_step(p.setup, fmt, p.target, step=step, bf16_tail=tail,
                                output=output)
    return p.setup.tokens / sum(parts.values())


def blackwell_rows(step: StepSpec | None = None) -> list[CheckRow]:
    """Every figure of ``BLACKWELL_PUBLISHED`` against the model's price of it: a run's bf16
    tokens/s, each other step's speed-up over the same run's bf16, each GEMM-only speed-up.
    ``step`` replaces the b200 StepSpec (the fit of its time_scale)."""
    rows = []
    base = {p.run: p.value for p in BLACKWELL_PUBLISHED if p.kind == "step" and p.fmt == "bf16"}
    for p in BLACKWELL_PUBLISHED:
        if p.kind == "gemm":
            shapes = LLAMA3_8B.linears().values()
            t = LLAMA3_8B.tokens
            priced = sum(gemm_seconds(t, k, n, "bf16", p.target) for k, n in shapes) / \
                sum(gemm_seconds(t, k, n, p.fmt, p.target) for k, n in shapes)
            rows.append(CheckRow(f"{p.fmt} GEMM-only speed-up", p.where, p.value, priced,
                                 p.fitted, "linear"))
            continue
        bf16 = _blackwell_step(p, "bf16", "bf16", 0, step)
        if p.fmt == "bf16":
            rows.append(CheckRow(f"bf16 tokens/s ({p.setup.gpus} GPUs, {p.setup.batch} x "
                                 f"{p.setup.seq_len})", p.where, p.value, bf16, p.fitted,
                                 "step"))
            continue
        tail = f", last {p.bf16_tail} blocks bf16" if p.bf16_tail else ""
        rows.append(CheckRow(f"{p.fmt} speed-up (output {p.output}{tail})", p.where,
                             p.value / base[p.run],
                             _blackwell_step(p, p.fmt, p.output, p.bf16_tail, step) / bf16,
                             p.fitted, "step"))
    return rows


@dataclass(frozen=True)
class CheckRow:
    """One published figure against the model's price of it."""

    figure: str
    where: str
    published: float
    priced: float
    fitted: bool
    # "step" (a whole step) or "linear" (one layer)
    kind: str

    @property
    def error(self) -> float:
        """Relative error of the price: priced / published - 1."""
        return self.priced / self.published - 1


def step_tokens_per_s(fmt: Format | str, *, fp8_all_gather: bool = False,
                      setup: TrainingSetup = LLAMA3_8B, target: str | DeviceSpec = "h100",
                      step: StepSpec | None = None) -> float:
    """Tokens per second per GPU of a step of ``setup`` as :func:`price_training_step` prices
    it."""
    parts = price_training_step(setup, fmt, target, fp8_all_gather=fp8_all_gather, step=step)
    return setup.tokens / sum(parts.values())


def check_rows(target: str | DeviceSpec = "h100", step: StepSpec | None = None) -> list[CheckRow]:
    """Every figure of ``PUBLISHED`` against the model's price of it: a run's bf16 tokens/s,
    each fp8 run's speed-up over the same run's bf16, each linear's speed-up."""
    rows = []
    base = {p.run: p.value for p in PUBLISHED if p.shape is None and p.fmt == "bf16"}
    bf16 = step_tokens_per_s("bf16", target=target, step=step)
    for p in PUBLISHED:
        label = p.fmt.removeprefix("fp8:")
        if p.shape is not None:
            m, k, n = p.shape
            priced = linear_seconds(m, k, n, "bf16", target) / linear_seconds(m, k, n, p.fmt,
                                                                              target)
            rows.append(CheckRow(f"{label} speed-up, {m}x{k}x{n} linear", p.where, p.value,
                                 priced, p.fitted, "linear"))
        elif p.fmt == "bf16":
            rows.append(CheckRow("bf16 tokens/s", p.where, p.value, bf16, p.fitted, "step"))
        else:
            fp8 = step_tokens_per_s(p.fmt, fp8_all_gather=p.fp8_all_gather, target=target,
                                    step=step)
            gather = " (fp8 all-gather)" if p.fp8_all_gather else ""
            rows.append(CheckRow(f"{label}{gather} speed-up", p.where, p.value / base[p.run],
                                 fp8 / bf16, p.fitted, "step"))
    return rows


def memory_rows(target: str | DeviceSpec = "h100", step: StepSpec | None = None) -> list[CheckRow]:
    """Every published peak memory of ``PUBLISHED`` against :func:`price_training_memory`'s
    (GiB per GPU, as torchtitan logs it: the allocator's peak reserved bytes), the run's
    recipe, FP8 all-gather and save list as it ran."""
    rows = []
    for p in PUBLISHED:
        published = p.peak_memory_bytes()
        if published is None:
            continue
        parts = price_training_memory(LLAMA3_8B, p.fmt, target, fp8_all_gather=p.fp8_all_gather,
                                      sac_saves_abs=p.sac_saves_abs, step=step)
        gather = " (fp8 all-gather)" if p.fp8_all_gather else ""
        bug = ", abs() saved" if p.sac_saves_abs and "rowwise" in p.fmt else ""
        rows.append(CheckRow(f"{p.fmt.removeprefix('fp8:')}{gather}{bug} peak memory", p.where,
                             published / 2**30, sum(parts.values()) / 2**30, p.fitted,
                             "memory"))
    return rows


# FP8 linears measured on one H200 (issue 40's run, 2026-12-04; torch 2.11, CUDA 13, torchao
# 0.17's Float8Linear under torch.compile; benchmarks/gpu_check.py section 4 with --compile,
# its output in benchmarks/gpu/h200-2026-12-04/gpu_check-compile-recipes.txt): forward +
# backward speed-up over the same compiled bf16 linear, 10 interleaved rounds, the 95% interval
# in the figure's name. The tensorwise rows fitted DEVICES["h200"].cast_efficiency. Left out:
# 16384x4096x1024 rowwise_with_gw_hp, which hit dynamo's recompile limit and ran eager.
_H200_RUN = "gpu_check on one H200, torch.compile, torchao 0.17"
MEASURED_H200: tuple[Published, ...] = tuple(
    Published(where=_H200_RUN, run=f"{shape[0]}x{shape[1]}x{shape[2]} [{low}-{high}]",
              fmt=fmt, value=value, shape=shape, fitted=fmt == "fp8:tensorwise")
    for shape, fmt, value, low, high in (
        ((16384, 4096, 4096), "fp8:tensorwise", 1.075, 1.052, 1.204),
        ((16384, 4096, 4096), "fp8:rowwise", 0.889, 0.851, 0.976),
        ((16384, 4096, 4096), "fp8:rowwise_with_gw_hp", 0.973, 0.930, 0.994),
        ((16384, 4096, 14336), "fp8:tensorwise", 1.396, 1.360, 1.432),
        ((16384, 4096, 14336), "fp8:rowwise", 1.185, 1.159, 1.202),
        ((16384, 4096, 14336), "fp8:rowwise_with_gw_hp", 1.196, 1.184, 1.219),
        ((16384, 4096, 1024), "fp8:tensorwise", 0.540, 0.480, 0.573),
        ((16384, 4096, 1024), "fp8:rowwise", 0.461, 0.414, 0.511),
    ))


def measured_rows(target: str | DeviceSpec = "h200",
                  rows: Iterable[Published] = MEASURED_H200) -> list[CheckRow]:
    """Each measured linear of ``rows`` against ``target``'s price of its speed-up over bf16."""
    out = []
    for p in rows:
        m, k, n = p.shape
        priced = linear_seconds(m, k, n, "bf16", target) / linear_seconds(m, k, n, p.fmt, target)
        out.append(CheckRow(f"{p.fmt.removeprefix('fp8:')} speed-up, {p.run} linear", p.where,
                            p.value, priced, p.fitted, "linear"))
    return out


@dataclass(frozen=True)
class Calibration:
    """What a target's cost model was checked against and how far off it was: the largest
    error over the figures no constant was fitted to (``check_rows``), rounded up to 0.5%."""

    target: str
    checked_against: str
    # whole-step speed-ups (tensorwise, rowwise over bf16)
    speedup_error: float
    # whole-step tokens/s, with StepSpec.time_scale fitted to one of them
    time_error: float
    # single linears' speed-ups
    linear_error: float
    # whole-step peak memory per GPU (memory_rows), with StepSpec.reserved_ratio fitted to one
    # of them. autoprec prints no priced memory for a target (its memory model,
    # autoprec.memory, is calibrated by steps measured on the task's device), so
    # pricing.calibration_line does not carry it.
    memory_error: float = 0.0


CALIBRATION: dict[str, Calibration] = {
    "h100": Calibration(
        target="h100",
        checked_against="torchtitan Llama-3-8B 8xH100 FSDP2 float8 (tensorwise, rowwise)",
        speedup_error=0.03, time_error=0.065, linear_error=0.37, memory_error=0.01),
    "b200": Calibration(
        target="b200",
        checked_against="torchtitan Llama-3-8B on 4 GB200s (MXFP8; NVFP4 with a BF16 tail) and "
                        "8 power-limited B200s (MXFP8, tensorwise; torchao 0.13)",
        # tensorwise on the 8 B200s: priced 1.121x, published 1.254x; the current stack's
        # rows are within 5.5%
        speedup_error=0.11,
        # the 8 power-limited B200s' bf16 step: 2.18x slower than priced
        time_error=1.185,
        # Transformer Engine's B300 FP8 current-scaling GEMMs
        linear_error=0.025),
}
# The H200's single linears were measured (MEASURED_H200); its whole steps were not: a step is
# a sum of such linears and work priced as on the H100, so its speed-up is taken to be as
# uncertain as the linears' (the H100's 3% holds for torchtitan's steps, which an H200 has not
# been checked against).
CALIBRATION["h200"] = Calibration(
    target="h200",
    checked_against="FP8 linears on one H200 under torch.compile (torchao 0.17; eager FP8 was "
                    "slower than bf16 at every shape measured)",
    speedup_error=0.17, time_error=CALIBRATION["h100"].time_error, linear_error=0.17)
# The B300 model is the B200's with B300 peaks: its steps are as uncertain.
CALIBRATION["b300"] = dataclasses.replace(
    CALIBRATION["b200"], target="b300",
    checked_against="Transformer Engine's B300 GEMM-only speed-ups (steps: the b200 model's)")
