"""The prepared GPU run (issues 5 and 40): real FP8 (``torch._scaled_mm``) against its
emulation, per-layer speed of HF GPT-2 beside the cost model's price, whole training steps of
the policy ``autoprec tune --target h200`` wrote on CPU, FP8 recipes x engines, a paired loss
certificate of that policy against BF16, and the profile's peak memory against a training
step's, all measured in one run.

For the runner, from the repository root of a checkout on the GPU machine:

    # torch (CUDA build), transformers, scipy and pyyaml are expected there; torchao (a release
    # built for that torch) adds section 4's torchao engine. `autoprec` itself is imported from
    # the checkout: no install is needed. The dry run also tunes, so it needs optuna:
    pip install optuna scipy pyyaml
    #   no network there? build wheels on a machine with one and carry them over:
    #   pip download optuna scipy pyyaml -d wheels/      (here)
    #   pip install --no-index --find-links wheels/ optuna scipy pyyaml     (there)
    bash benchmarks/gpu/run_h200.sh               # tests/test_cuda.py, then every section
    python benchmarks/gpu_check.py                # < 8 min on one H200
    python benchmarks/gpu_check.py --sections recipes --compile   # section 4 compiled

Everything printed also goes to ``$OUT/gpu_check-<date>.txt`` when ``$OUT`` is set (the GPU
runner collects ``$OUT``), else to ``benchmarks/results/``. No network is needed: the models
are randomly initialised from configs, the data the Python standard library's source.

The policy is the one ``autoprec tune examples/gpt2_bytes.py:gpu_task --target h200`` wrote on
CPU (``--policy``, default ``benchmarks/gpu/gpt2_4x1024_h200.yaml``, with the profile it was
priced with beside it): the run checks a CPU tune's price on the device it was made for.

    python benchmarks/gpu_check.py --dry-run      # the same code path on CPU, tiny sizes, ~1 min

The dry run is how the script is tested before the GPU run (it tunes its tiny model on CPU for
h200 the same way). On CPU the "real" FP8 of the numerics section is ``torch._scaled_mm``
forced with ``native=True`` at tiny shapes (the CPU kernel does the same arithmetic, so it
checks the layouts, not the GPU's accumulation); every other FP8 number is the emulation
(quantize -> dequantize -> FP32 matmul), slower than FP32 by construction: CPU speed and
memory figures say nothing about a GPU.

Sections (each runs even when an earlier one failed; a failure prints its traceback and makes
the exit status 1):

1. FP8 numerics: relative difference of ``_scaled_mm`` (native=True) and the emulation
   (native=False) on the same random operands, forward, dgrad and wgrad, next to the FP8
   error itself (emulation vs the exact FP64 product of the unrounded operands).
2. Per-layer speed (``measure_layers``, CUDA events on a GPU) of GPT-2's block 0 layers and
   lm_head in fp32/bf16/fp16/fp8, as speed-ups over fp32 and fp8 over bf16, each beside the
   h200 cost model's price of the same layer (measured / priced per row); plus lone linears.
3. Whole training step (forward, backward, grad clip, AdamW): robust time (variants
   interleaved), forward + backward alone beside its price, peak memory
   (``torch.cuda.max_memory_allocated``) and the loss after a short training run from the same
   init on the same data, for FP32, autocast(bf16), the bf16 policy, uniform FP8 and the
   CPU-tuned policy; a second FP32 run with another batch order gives the batch-order noise.
4. FP8 recipes and engines: lone ``nn.Linear`` layers at Llama-3-8B training shapes (16K
   tokens), forward + backward in bf16 and in each recipe on each engine (autoprec's own
   ``_scaled_mm`` path and torchao's ``Float8Linear``), interleaved, eager or (``--compile``)
   compiled: measured speed-up over bf16 with its 95% interval next to the cost model's price,
   and the two engines' outputs against each other.
5. A paired loss certificate (``autoprec.certify``) of the CPU-tuned policy against BF16.
6. Peak memory of ``autoprec.profile`` (fast and exact sensitivity) against a training step's
   on a Llama built on the device, the first of ``mem_sizes`` that fits.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import importlib
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import _common  # noqa: F401  (puts the repo root on sys.path, HF offline)
import torch
from _common import ROOT, device_line, interleaved
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

FORMATS = ("fp32", "bf16", "fp16", "fp8")
SECTIONS = ("numerics", "layers", "step", "recipes", "certificate", "memory")


# ============================================================================ configuration
@dataclasses.dataclass
class Config:
    dry_run: bool
    device: str
    n_layer: int
    n_embd: int
    n_head: int
    batch: int
    seq: int
    # (M, K, N) of x[M,K] @ w[N,K].T, or (B, H, T, d) of an attention score product
    numeric_shapes: list
    # (M, K, N) of lone nn.Linear layers for the FP8 crossover
    linear_sweep: list
    # (M, K, N) of lone nn.Linear layers for the recipe x engine section
    recipe_shapes: list
    warmup: int
    repeats: int
    layer_budget_s: float
    step_rounds: int
    steps: int
    trials: int
    tune_timeout: float
    budget_s: float
    # the certificate's reference run (steps) and the memory section's Llama sizes (hidden x
    # layers), largest first: the first that fits is measured
    cert_steps: int = 200
    # section 4 times torch.compile'd layers (the casts fused, as torchao's roofline assumes)
    compile: bool = False
    mem_sizes: tuple = ("4096x16", "2048x16")
    lr: float = 6e-4
    eval_batches: int = 2

    @classmethod
    def full(cls) -> Config:
        # examples/gpt2_bytes.py:gpu_task's model and batch: the model `autoprec tune --target
        # h200` tuned on CPU (benchmarks/gpu/gpt2_4x1024_h200.yaml)
        return cls(dry_run=False, device="cuda", n_layer=4, n_embd=1024, n_head=16, batch=8,
                   seq=1024,
                   numeric_shapes=[(8192, 768, 2304), (8192, 768, 3072), (8192, 3072, 768),
                                   (8192, 768, 256), (4096, 4096, 4096), (8, 12, 1024, 64)],
                   linear_sweep=[(8192, 768, 768), (8192, 768, 3072), (8192, 4096, 4096),
                                 (16384, 8192, 8192)],
                   recipe_shapes=[(16384, 4096, 4096), (16384, 4096, 1024), (16384, 4096, 512),
                                  (16384, 4096, 14336), (16384, 14336, 4096), (1024, 1024, 1024)],
                   warmup=3, repeats=10, layer_budget_s=12.0, step_rounds=10, steps=150,
                   trials=12, tune_timeout=150.0, budget_s=400.0)

    @classmethod
    def dry(cls) -> Config:
        return cls(dry_run=True, device="cpu", n_layer=2, n_embd=64, n_head=2, batch=2, seq=64,
                   numeric_shapes=[(32, 64, 48), (64, 128, 64), (2, 2, 32, 16)],
                   linear_sweep=[(64, 64, 64), (128, 128, 128)],
                   recipe_shapes=[(64, 64, 64), (128, 64, 32)],
                   warmup=1, repeats=3, layer_budget_s=5.0, step_rounds=4, steps=6,
                   trials=4, tune_timeout=60.0, budget_s=240.0, cert_steps=8,
                   mem_sizes=("128x2",))


# ============================================================================ output
class _Tee:
    """stdout that is also written, line by line, to a file (kept even if the run is killed)."""

    def __init__(self, stream, path: str):
        self.stream = stream
        self.file = open(path, "w", buffering=1)

    def write(self, s: str) -> int:
        self.stream.write(s)
        self.file.write(s)
        return len(s)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()

    def isatty(self) -> bool:
        return False

    def close(self) -> None:
        self.file.close()


def _out_dir(explicit: str | None) -> str:
    d = explicit or os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(d, exist_ok=True)
    return d


def _section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(3, 86 - len(title)), flush=True)


def _table(rows: list[list], header: list[str]) -> None:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def _f(x: float, fmt: str = ".3g") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, fmt)


def _x(ratio: float) -> str:
    return "n/a" if ratio is None or not math.isfinite(ratio) else f"{ratio:.2f}x"


# ============================================================================ helpers
class ScaledMMCounter(TorchDispatchMode):
    """Counts ``aten._scaled_mm`` calls (the real FP8 kernel), forward and backward."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._scaled_mm:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def _model(cfg: Config):
    from examples.gpt2_bytes import make_model

    return make_model(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head, seq_len=cfg.seq)


def _batches(cfg: Config, n: int, seed: int, skip: int = 0):
    from examples.data import byte_batches

    return byte_batches(n, cfg.batch, cfg.seq, seed=seed, skip=skip)


class _Clock:
    def __init__(self, budget_s: float):
        self.t0 = time.perf_counter()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()


# ============================================================================ 1. numerics
def _numerics_row(shape: tuple, dev: torch.device) -> tuple[list, list[float]]:
    """One row of section 1: real vs emulated vs exact, forward, dgrad and wgrad."""
    from autoprec.runtime.fp8 import fp8_linear, fp8_matmul

    gen = torch.Generator(device=dev).manual_seed(1234)
    if len(shape) == 3:
        m, k, n = shape
        a = torch.randn(m, k, device=dev, generator=gen)
        b = torch.randn(n, k, device=dev, generator=gen) / math.sqrt(k)
        g = torch.randn(m, n, device=dev, generator=gen)

        def op(x, y, native):
            return fp8_linear(x, y, native=native)

        def exact(x, y):
            return x @ y.t()

        label, kind = f"{m}x{k}x{n}", "linear"
    else:
        bsz, h, t, d = shape
        a = torch.randn(bsz, h, t, d, device=dev, generator=gen)
        b = torch.randn(bsz, h, t, d, device=dev, generator=gen) / math.sqrt(d)
        g = torch.randn(bsz, h, t, t, device=dev, generator=gen)

        def op(x, y, native):
            return fp8_matmul(x, y.transpose(-1, -2), native=native)

        def exact(x, y):
            return x @ y.transpose(-1, -2)

        label, kind = f"{bsz}x{h}x({t}x{d}x{t})", "q@k.T"
    g16 = g.to(torch.bfloat16)
    res = {}
    for name, native in (("emu", False), ("real", True)):
        x = a.clone().requires_grad_()
        y = b.clone().requires_grad_()
        counter = ScaledMMCounter()
        with counter:
            out = op(x, y, native)
            out.backward(g16)
        _sync(dev)
        res[name] = (out.detach(), x.grad, y.grad, counter.calls)
    x64 = a.double().requires_grad_()
    y64 = b.double().requires_grad_()
    exact(x64, y64).backward(g16.double())
    ref = (exact(a.double(), b.double()), x64.grad, y64.grad)
    diffs = [_rel(r, e) for r, e in zip(res["real"][:3], res["emu"][:3])]
    errs = [_rel(e, x) for e, x in zip(res["emu"][:3], ref)]
    margin = min(errs) / max(diffs) if max(diffs) > 0 else math.inf
    ok = max(diffs) <= 1e-2 and margin >= 4 and res["real"][3] > 0
    return [label, kind, *[_f(v, ".2e") for v in diffs], " / ".join(_f(v, ".2e") for v in errs),
            "inf" if math.isinf(margin) else f"{margin:.0f}x", res["real"][3],
            "ok" if ok else "CHECK"], diffs


def section_numerics(cfg: Config, dev: torch.device, ctx: dict) -> None:
    _section("1. FP8 numerics: real torch._scaled_mm (native=True) vs emulation (native=False)")
    if dev.type == "cpu":
        print("CPU dry run: 'real' is the CPU torch._scaled_mm kernel at tiny shapes (same "
              "arithmetic as the emulation: this checks the layouts, not a GPU's accumulation).")
    print("real~emu: ||real - emu|| / ||emu||, same operands, forward output (bf16), dgrad, "
          "wgrad (fp32).\nfp8 err: ||emu - exact|| / ||exact||, exact = FP64 product of the "
          "unrounded operands (the FP8 rounding itself).\nmargin: fp8 err / real~emu (how many "
          "times smaller the kernel-vs-emulation difference is than FP8's own error).")
    rows, worst = [], 0.0
    for shape in cfg.numeric_shapes:
        try:
            row, diffs = _numerics_row(shape, dev)
            worst = max(worst, *diffs)
        except Exception as e:  # noqa: BLE001 - the other shapes still count
            traceback.print_exc(file=sys.stdout)
            ctx["failed"].append(f"numerics:{shape}")
            row = [str(shape), "-", "-", "-", "-", "-", "-", "-",
                   f"FAILED: {type(e).__name__}"]
        rows.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    _table(rows, ["shape", "product", "out real~emu", "dgrad real~emu", "wgrad real~emu",
                  "fp8 err out/dgrad/wgrad", "margin", "_scaled_mm calls", "verdict"])
    print("verdict ok: real~emu <= 1e-2, at least 4x below FP8's own error, and the kernel ran "
          "(_scaled_mm calls > 0).")
    ctx["numerics_worst"] = worst
    ctx["numerics_ok"] = all(r[-1] == "ok" for r in rows)


# ============================================================================ 2. layer speed
class _ShapeProbe(TorchFunctionMode):
    """(batch, M, K, N) of each matmul-like call, attributed to every listed module it runs
    inside (so a block's FLOPs include its layers', as its time does)."""

    def __init__(self, stack: list, shapes: dict):
        super().__init__()
        self.stack, self.shapes = stack, shapes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from autoprec.runtime import calls

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        call = calls.lookup(func)
        if self.stack and call is not None:
            try:
                products = call.products(args, kwargs, out)  # the registry's M/K/N
            except Exception:  # noqa: BLE001 - a probe must not break the forward
                products = []
            for fqn in dict.fromkeys(self.stack):  # an enclosing module computes it too
                self.shapes[fqn].extend(tuple(p) for p in products)
        return out


def _matmul_shapes(model, batch, fqns) -> dict[str, list[tuple]]:
    mods = dict(model.named_modules())
    stack: list[str] = []
    shapes: dict[str, list] = {f: [] for f in fqns}
    handles = []

    def pre(fqn):
        def hook(module, args):
            stack.append(fqn)
        return hook

    def post(module, args, output):
        stack.pop()  # returns None: the output is left alone

    try:
        for f in fqns:
            handles.append(mods[f].register_forward_pre_hook(pre(f)))
            handles.append(mods[f].register_forward_hook(post))
        with torch.no_grad(), _ShapeProbe(stack, shapes):
            if isinstance(batch, dict):
                model(**batch)
            else:
                model(batch)
    finally:
        for h in handles:
            h.remove()
    return shapes


def _shape_text(shapes: list[tuple]) -> str:
    if not shapes:
        return "-"
    parts = []
    for b, m, k, n in shapes[:2]:
        parts.append(f"{m}x{k}x{n}" if b == 1 else f"{b}x({m}x{k}x{n})")
    return ", ".join(parts) + (f" +{len(shapes) - 2}" if len(shapes) > 2 else "")


def _speed_rows(times: dict, shapes: dict, labels: dict,
                priced: dict | None = None) -> tuple[list[list], list[str], list[tuple]]:
    """Rows of section 2; ``priced`` (fqn -> format -> cost-model seconds) adds the price of
    bf16 over fp32 and fp8 over bf16 beside the measured ones, and their ratio."""
    from autoprec.formats import Format

    rows, gains, checks = [], [], []
    for fqn, per in times.items():
        t = {f: per[Format(f)] for f in FORMATS}
        raw = {f: (t[f].raw_seconds if t[f].ok else math.inf) for f in FORMATS}
        fp32 = raw["fp32"]
        flops = sum(2 * b * m * k * n for b, m, k, n in shapes.get(fqn, []))
        fp8_vs_bf16 = raw["bf16"] / raw["fp8"] if raw["fp8"] > 0 else math.nan
        if t["fp8"].emulated:
            verdict = "fp8 emulated here (not a speed)"
        elif not t["fp8"].ok:
            verdict = f"fp8 failed: {t['fp8'].error[:40]}"
        elif "do not run in fp8" in (t["fp8"].note or ""):
            verdict = "fp8 falls back to bf16 (shape)"
        elif fp8_vs_bf16 >= 1.05:
            verdict = "fp8 gains over bf16"
            gains.append(labels.get(fqn, fqn))
        else:
            verdict = "too small to gain from fp8"
        cells = []
        for f in ("bf16", "fp16", "fp8"):
            star = "*" if t[f].emulated else ""
            cells.append(_x(fp32 / raw[f]) + star if math.isfinite(raw[f]) else "failed")
        p = (priced or {}).get(fqn)
        if p:
            bf_p, f8_p = p["fp32"] / p["bf16"], p["bf16"] / p["fp8"]
            bf_m = fp32 / raw["bf16"]
            cells += [_x(bf_p), _f(bf_m / bf_p, ".2f"), _x(f8_p), _f(fp8_vs_bf16 / f8_p, ".2f")]
            checks.append((labels.get(fqn, fqn), bf_m / bf_p, fp8_vs_bf16 / f8_p))
        elif priced is not None:
            cells += ["-", "-", "-", "-"]
        rows.append([labels.get(fqn, fqn), _shape_text(shapes.get(fqn, [])),
                     f"{flops * 3 / 1e9:.3g}", _f(fp32 * 1e3, ".3g"), *cells[:3],
                     _x(fp8_vs_bf16) + ("*" if t["fp8"].emulated else ""), *cells[3:],
                     _f(max((t[f].spread for f in FORMATS
                             if t[f].ok and math.isfinite(t[f].spread)), default=math.nan), ".2f"),
                     verdict])
    return rows, gains, checks


def _priced_layers(prof, fqns: list[str], target: str) -> dict[str, dict[str, float]]:
    """Cost-model seconds (forward + backward) of each fqn in fp32/bf16/fp8 on ``target``,
    from the layers the CPU profile captured: a layer alone pays its casts in and out (as
    measure_layers runs it); a module holding several (a whole block) is priced as its layers
    with the casts on the edges between them. Elementwise work the profile does not capture
    (norms, GELU, softmax) is not priced."""
    from autoprec.costmodel import estimate_layer, estimate_step
    from autoprec.formats import Format

    out = {}
    for fqn in fqns:
        inside = [lp for lp in prof.layers if lp.fqn == fqn or lp.fqn.startswith(fqn + ".")]
        if not inside:
            continue
        names = {lp.fqn for lp in inside}
        edges = [(a, b) for a, b in prof.edges if a in names and b in names]
        per = {}
        for f in ("fp32", "bf16", "fp8"):
            fmt = Format.parse(f)
            if len(inside) == 1:
                per[f] = estimate_layer(inside[0].layer, fmt, target).seconds
            else:
                per[f] = estimate_step([lp.layer for lp in inside],
                                       {n: fmt for n in names}, target, edges=edges)
        out[fqn] = per
    return out


def _priced_linear(m: int, k: int, n: int, target: str) -> dict[str, float]:
    """A lone nn.Linear (with bias, FP32 input) priced as measure_layers runs it."""
    from autoprec.costmodel import estimate_layer
    from autoprec.graph import Layer

    layer = Layer(fqn="linear", kind="linear", module_type="Linear", matmuls=((1, m, k, n),),
                  calls=("linear",), params=k * n + n, bytes=4 * (m * k + k * n + m * n))
    return {f: estimate_layer(layer, f, target).seconds for f in ("fp32", "bf16", "fp8")}


_SPEED_HEADER = ["layer", "matmuls (MxKxN)", "GFLOP f+b", "fp32 ms", "bf16", "fp16", "fp8",
                 "fp8 vs bf16", "bf16 priced", "meas/priced", "fp8 vs bf16 priced",
                 "meas/priced", "max IQR/med", "verdict"]


def section_layers(cfg: Config, dev: torch.device, ctx: dict, prof) -> None:
    from autoprec.measure.timing import measure_layers
    from autoprec.task import move_to

    _section(f"2. Per-layer speed: HF GPT-2 {cfg.n_layer}x{cfg.n_embd}, batch "
             f"{cfg.batch}x{cfg.seq} (measure_layers, "
             f"{'CUDA events' if dev.type == 'cuda' else 'wall clock'})")
    print("Each layer alone, forward + backward at the shapes it sees in the model, formats "
          "interleaved; columns bf16/fp16/fp8 are speed-ups over fp32 (fp32 time / format time, "
          ">1 is faster); 'fp8 vs bf16' is bf16 time / fp8 time. attn includes its c_attn and "
          "c_proj; block includes everything in transformer.h.0.")
    target = prof.target or "h200"
    print(f"priced: the {target} cost model's ratio for the same layer at the same shapes (from "
          f"the layers the CPU profile captured; norms, GELU and softmax are not priced); "
          f"meas/priced = measured ratio / priced ratio (1.00 = the model was right).")
    if dev.type == "cpu":
        print("* emulated: on CPU fp8 is quantize -> dequantize -> fp32 matmul, slower than fp32 "
              "by construction; these ratios are not a speed measurement.")
    torch.manual_seed(0)
    model = _model(cfg).to(dev)
    batch = move_to(_batches(cfg, 1, seed=0)[0], dev)
    h0 = "transformer.h.0"
    fqns = [f"{h0}.attn.c_attn", f"{h0}.attn.c_proj", f"{h0}.attn", f"{h0}.mlp.c_fc",
            f"{h0}.mlp.c_proj", h0, "lm_head"]
    labels = {f: f.replace("transformer.", "") for f in fqns}
    labels[f"{h0}.attn"] = "h.0.attn (whole)"
    labels[h0] = "h.0 (whole block)"
    shapes = _matmul_shapes(model, batch, fqns)
    t0 = time.perf_counter()
    times = measure_layers(model, batch, fqns, FORMATS, warmup=cfg.warmup, repeats=cfg.repeats,
                           budget_s=cfg.layer_budget_s)
    rows, gains, checks = _speed_rows(times, shapes, labels, _priced_layers(prof, fqns, target))
    _table(rows, _SPEED_HEADER)
    print(f"({time.perf_counter() - t0:.1f} s)")
    fp8_notes = sorted({per[k].note for per in times.values() for k in per
                        if k.value == "fp8" and per[k].note})
    for n in fp8_notes[:4]:
        print(f"fp8 note: {n}")
    del model, batch
    ctx["gpt2_fp8_gains"] = gains

    print("\nLone linear layers (x[M,K] @ W[N,K].T + b, input needs grad), same measurement:")
    rows, sweep_gains = [], []
    for m, k, n in cfg.linear_sweep:
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n).to(dev)
        x = torch.randn(m, k, device=dev, requires_grad=True)
        tl = measure_layers(lin, x, [""], FORMATS, warmup=cfg.warmup, repeats=cfg.repeats,
                            budget_s=cfg.layer_budget_s)
        label = f"linear {m}x{k}x{n}"
        r, g, c = _speed_rows({label: tl[""]}, {label: [(1, m, k, n)]}, {},
                              {label: _priced_linear(m, k, n, target)})
        rows += r
        sweep_gains += g
        checks += c
        del lin, x, tl
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    _table(rows, _SPEED_HEADER)
    ctx["sweep_fp8_gains"] = sweep_gains
    ctx["layer_checks"] = checks


# ============================================================================ 3. whole step
@dataclasses.dataclass
class Variant:
    name: str
    autocast: bool = False
    policy: object = None  # autoprec.Policy


def _prepare(variant: Variant, base, dev: torch.device, cfg: Config):
    """A fresh copy of the base model on the device, with the variant's precision, its
    optimizer (AdamW, warmup + cosine) and GradScaler (only an fp16 policy has one)."""
    import autoprec

    model = copy.deepcopy(base).to(dev).train()
    scaler = None
    if variant.policy is not None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*can only emulate.*")
            autoprec.apply(model, variant.policy, strict=False)
        scaler = variant.policy.grad_scaler(dev)
        if not scaler.is_enabled():
            scaler = None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1,
                            betas=(0.9, 0.95), fused=dev.type == "cuda")
    return model, opt, scaler


def _lr_factor(step: int, total: int) -> float:
    warm = max(1, total // 10)
    if step < warm:
        return (step + 1) / warm
    p = (step - warm) / max(1, total - warm)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))


def _step_fn(model, opt, scaler, variant: Variant, dev: torch.device):
    ac = torch.autocast(dev.type, dtype=torch.bfloat16) if variant.autocast \
        else contextlib.nullcontext()

    def step(batch):
        with ac:
            loss = model(**batch).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _fwd_bwd_fn(model, scaler, variant: Variant, dev: torch.device):
    """Forward + backward alone (what the cost model prices), gradients dropped after."""
    ac = torch.autocast(dev.type, dtype=torch.bfloat16) if variant.autocast \
        else contextlib.nullcontext()

    def fwd_bwd(batch):
        with ac:
            loss = model(**batch).loss
        (scaler.scale(loss) if scaler is not None else loss).backward()
        for p in model.parameters():
            p.grad = None
    return fwd_bwd


def _eval_loss(model, variant: Variant, batches, dev: torch.device) -> float:
    ac = torch.autocast(dev.type, dtype=torch.bfloat16) if variant.autocast \
        else contextlib.nullcontext()
    model.eval()
    with torch.no_grad(), ac:
        losses = [float(model(**b).loss) for b in batches]
    model.train()
    return statistics.fmean(losses)


def cpu_tuned(cfg: Config, args, outdir: str, stamp: str, ctx: dict):
    """The policy ``autoprec tune --target h200`` wrote on CPU for this model, and the profile
    it was priced with. The full run reads both from the files the CPU tune wrote
    (``--policy``, ``--profile``); the dry run makes them the same way at its tiny size."""
    import autoprec
    from autoprec import Profile, load_policy

    if not cfg.dry_run:
        policy, prof = load_policy(args.policy), Profile.load(args.profile)
        print(f"policy tuned on CPU for {prof.target}: {os.path.relpath(args.policy, ROOT)} "
              f"(profile {os.path.relpath(args.profile, ROOT)}, numerics on {prof.device})")
        return policy, prof
    task = autoprec.Task(model=lambda: _model(cfg), batches=_batches(cfg, 2, seed=1),
                         device="cpu", name=f"gpt2-{cfg.n_layer}x{cfg.n_embd}-dry")
    path = os.path.join(outdir, f"gpu_check-{stamp}-cpu-tuned.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        result = autoprec.tune(task, target="h200", n_trials=cfg.trials, progress=False,
                               storage=f"sqlite:///{os.path.join(tmp, 'study.db')}",
                               output=path)
    ctx["files"] += result.save(path)
    print(f"dry run: tuned on CPU for h200 -> {path}")
    return result.policy, result.profile


def _priced_steps(prof, variants: list) -> dict[str, float]:
    """The cost model's seconds of the profiled layers' forward + backward under each variant
    (autocast priced as the bf16 policy: the cost model knows no autocast)."""
    from autoprec import Policy
    from autoprec.tuning.space import expand

    out = {}
    for v in variants:
        policy = v.policy if v.policy is not None else Policy(
            default="bf16" if v.autocast else "fp32")
        out[v.name] = prof.estimate_step(expand(policy, prof), prof.target or "h200")
    return out


def section_step(cfg: Config, dev: torch.device, ctx: dict, *, clock: _Clock, tuned,
                 prof) -> None:
    from autoprec import Policy
    from autoprec.task import move_to

    _section(f"3. Whole training step: HF GPT-2 {cfg.n_layer}x{cfg.n_embd}, batch "
             f"{cfg.batch}x{cfg.seq}, AdamW + grad clip; the policy tuned on CPU for "
             f"{prof.target}")
    variants = [Variant("fp32"), Variant("autocast(bf16)", autocast=True),
                Variant("bf16 policy", policy=Policy(default="bf16")),
                Variant("fp8 uniform", policy=Policy(default="fp8")),
                Variant("tuned (CPU, h200)", policy=tuned)]
    priced = _priced_steps(prof, variants)
    if dev.type == "cpu":
        print("CPU dry run: fp8 is emulated (quantize -> dequantize -> fp32 matmul), so its time "
              "is not a speed; peak memory is a CUDA measurement (n/a here).")

    torch.manual_seed(0)
    base = _model(cfg)  # the same init as tune's task (Task seeds 0 before the factory)
    batch = move_to(_batches(cfg, 1, seed=0)[0], dev)

    # -- one step of each variant alone: does it run, how many real FP8 kernels (aten._scaled_mm,
    # forward + backward), and (CUDA) its peak memory with only this variant resident
    mem: dict[str, tuple[float, float]] = {}
    calls: dict[str, int] = {}
    for v in list(variants):
        try:
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            model, opt, scaler = _prepare(v, base, dev, cfg)
            step = _step_fn(model, opt, scaler, v, dev)
            counter = ScaledMMCounter()
            with counter:
                step(batch)  # also allocates the AdamW state
            calls[v.name] = counter.calls
            if dev.type == "cuda":
                _sync(dev)
                resident = torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                step(batch)
                _sync(dev)
                peak = torch.cuda.max_memory_allocated(dev)
                mem[v.name] = (peak - before, peak - resident)
        except Exception:  # noqa: BLE001 - measure the variants that do run
            print(f"variant {v.name} FAILED in its first training step; left out:")
            traceback.print_exc(file=sys.stdout)
            ctx["failed"].append(f"step:{v.name}")
            variants.remove(v)
        finally:
            model = opt = scaler = step = None
    if [v.name for v in variants[:2]] != ["fp32", "autocast(bf16)"]:
        raise RuntimeError("fp32 or autocast(bf16) failed: no reference for the ratios")

    # -- step time, all variants resident, interleaved round-robin
    steps = {}
    for v in variants:
        model, opt, scaler = _prepare(v, base, dev, cfg)
        steps[v.name] = _step_fn(model, opt, scaler, v, dev)
        steps[f"{v.name} f+b"] = _fwd_bwd_fn(model, scaler, v, dev)
    model = opt = scaler = None
    times = interleaved({k: (lambda s=s: s(batch)) for k, s in steps.items()},
                        warmup=cfg.warmup, rounds=cfg.step_rounds, device=dev.type)
    del steps
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    sec = {k: times.seconds(k) for k in times.active}
    fb = {v.name: times.ratio("fp32 f+b", f"{v.name} f+b") for v in variants}

    # -- training runs: same init, same batches (order A); fp32 again with order B for noise
    runs = [(v, 0) for v in variants] + [(variants[0], 1)]
    per_step = sum(sec[v.name] for v, _ in runs) * 1.5
    n_steps = cfg.steps
    if clock.left() < n_steps * per_step + 10:
        n_steps = max(5, int((clock.left() - 10) / per_step))
        print(f"note: training shortened to {n_steps} steps (of {cfg.steps}) to fit the "
              f"{cfg.budget_s:.0f} s budget ({clock.left():.0f} s left)")
    data = [move_to(b, dev) for b in _batches(cfg, n_steps, seed=2)]
    held_out = [move_to(b, dev) for b in _batches(cfg, cfg.eval_batches, seed=99,
                                                  skip=3_000_000)]
    order_b = torch.randperm(n_steps, generator=torch.Generator().manual_seed(7)).tolist()
    losses: dict[str, tuple[float, float, str]] = {}
    for v, order in runs:
        key = v.name if order == 0 else "fp32 (order B)"
        t0 = time.perf_counter()
        curve, note, ev = [], "", math.nan
        try:
            model, opt, scaler = _prepare(v, base, dev, cfg)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: _lr_factor(i, n_steps))
            step = _step_fn(model, opt, scaler, v, dev)
            for i in range(n_steps):
                torch.manual_seed(i)
                loss = float(step(data[order_b[i] if order else i]))
                sched.step()
                curve.append(loss)
                if not math.isfinite(loss):
                    note = f"non-finite loss at step {i}"
                    break
            if not note:
                ev = _eval_loss(model, v, held_out, dev)
        except Exception as e:  # noqa: BLE001 - the other runs still count
            note = f"failed at step {len(curve)}: {type(e).__name__}"
            traceback.print_exc(file=sys.stdout)
            ctx["failed"].append(f"train:{key}")
        finally:
            model = opt = scaler = step = sched = None
        tail = curve[-max(1, len(curve) // 10):]
        losses[key] = (statistics.fmean(tail) if tail else math.nan, ev, note)
        print(f"  trained {key}: {len(curve)} steps in {time.perf_counter() - t0:.1f} s, "
              f"held-out loss {_f(ev, '.4f')} {note}", flush=True)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    # -- the table
    ref_t, bf_t = sec["fp32"], sec["autocast(bf16)"]
    ref_l, bf_l = losses["fp32"][1], losses["autocast(bf16)"][1]
    rows = []
    for v in variants:
        s = sec[v.name]
        peak, act = mem.get(v.name, (math.nan, math.nan))
        p32 = mem.get("fp32", (math.nan,))[0]
        pbf = mem.get("autocast(bf16)", (math.nan,))[0]
        train_l, ev, note = losses[v.name]
        sp = times.speedup(v.name, "fp32")
        price = priced["fp32"] / priced[v.name]
        rows.append([v.name, f"{s * 1e3:.1f}", f"{sp.low:.2f}-{sp.high:.2f}", _x(ref_t / s),
                     _x(bf_t / s), f"{fb[v.name].value:.2f} [{fb[v.name].low:.2f}-"
                     f"{fb[v.name].high:.2f}]", _x(price), _f(fb[v.name].value / price, ".2f"),
                     _f(peak / 2**30, ".2f"), _f(act / 2**30, ".2f"),
                     _f(peak / p32, ".2f"), _f(peak / pbf, ".2f"), _f(train_l, ".4f"),
                     _f(ev, ".4f"), _f((ev - ref_l) / ref_l, "+.2%"),
                     _f((ev - bf_l) / bf_l, "+.2%"), calls[v.name], note])
    train_b, ev_b, note_b = losses["fp32 (order B)"]
    rows.append(["fp32 (order B)", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
                 _f(train_b, ".4f"),
                 _f(ev_b, ".4f"), _f((ev_b - ref_l) / ref_l, "+.2%"),
                 _f((ev_b - bf_l) / bf_l, "+.2%"), "-", note_b or "run-to-run noise"])
    print(f"\nstep = forward + backward + clip + AdamW, {cfg.step_rounds} interleaved rounds, "
          f"the tune's timing protocol (20% quantile of per-round minima); speed-up = fp32 (or "
          f"autocast) time / variant time, with the 95% interval of the speed-up over fp32.\n"
          f"peak = torch.cuda.max_memory_allocated over one step (weights + grads + AdamW + "
          f"activations); act = peak minus what was resident before the step; mem ratios are "
          f"variant / fp32 and variant / autocast.\nloss after {n_steps} steps (lr {cfg.lr:g}, "
          f"warmup + cosine, same init and batches): train = mean of the last tenth, held-out = "
          f"{cfg.eval_batches} batches in the variant's precision; Δ = relative to fp32 / "
          f"autocast(bf16).")
    print(f"f+b: forward + backward alone (no clip, no optimizer), speed-up over fp32 with its "
          f"95% interval; priced: the {prof.target} cost model's speed-up of the profiled "
          f"layers' forward + backward over fp32, as the CPU tune priced it (autocast priced "
          f"as the bf16 policy); meas/priced = f+b measured / priced.")
    _table(rows, ["variant", "step ms", "95% int.", "vs fp32", "vs bf16", "f+b vs fp32",
                  "priced", "meas/priced", "peak GiB", "act GiB",
                  "mem/fp32", "mem/bf16", "train loss", "held-out", "Δ vs fp32", "Δ vs bf16",
                  "_scaled_mm/step", "note"])
    noise = abs(ev_b - ref_l) / ref_l if math.isfinite(ev_b) and ref_l else math.nan
    print(f"fp32 run-to-run noise (batch order only): {_f(noise, '.2%')} of held-out loss")
    ctx["step"] = {v.name: ref_t / sec[v.name] for v in variants}
    ctx["step_bf16"] = {v.name: bf_t / sec[v.name] for v in variants}
    ctx["step_checks"] = {v.name: (fb[v.name].value, priced["fp32"] / priced[v.name])
                          for v in variants}
    ctx["loss"] = {k: v[1] for k, v in losses.items()}
    ctx["scaled_mm"] = calls
    ctx["noise"] = noise


# ============================================================================ main
# ============================================================================ 4. recipes x engines
def _linear_step(model, x, g):
    def step():
        for p in model.parameters():
            p.grad = None
        x.grad = None
        y = model(x)
        y.backward(g.to(y.dtype))
    return step


def section_recipes(cfg: Config, dev: torch.device, ctx: dict) -> None:
    from _common import ratio_cell

    from autoprec import Policy, apply, remove
    from autoprec.costmodel import linear_seconds
    from autoprec.formats import FP8_RECIPES
    from autoprec.runtime.engines import torchao_available

    engines = ["autoprec"] + (["torchao"] if torchao_available() else [])
    target = "h200" if dev.type == "cuda" and "H200" in torch.cuda.get_device_name(dev) \
        else "h100"
    _section(f"4. FP8 recipes x engines: lone nn.Linear, forward + backward, vs bf16 "
             f"(priced: {target} cost model){', torch.compile' if cfg.compile else ', eager'}")
    if len(engines) == 1:
        print("torchao is not installed: only autoprec's engine (pip install 'autoprec[torchao]')")
    if dev.type == "cpu":
        print("* CPU dry run: every fp8 here is emulated; the measured ratios are not speed.")
    header = ["shape (MxKxN)", "recipe", *[f"{e} measured" for e in engines], "priced",
              "engines differ"]
    rows, summary = [], []
    for m, k, n in cfg.recipe_shapes:
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=False).to(dev)
        x = torch.randn(m, k, device=dev).to(torch.bfloat16).requires_grad_()
        g = torch.randn(m, n, device=dev)
        fns, models, outs = {}, {}, {}
        base = torch.nn.Sequential(copy.deepcopy(lin))
        apply(base, Policy(default="bf16"))
        fns["bf16"] = _linear_step(torch.compile(base) if cfg.compile else base, x, g)
        for recipe in FP8_RECIPES:
            for engine in engines:
                model = torch.nn.Sequential(copy.deepcopy(lin))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    apply(model, Policy(default=f"fp8:{recipe}", engine=engine))
                models[(recipe, engine)] = model
                fns[f"{recipe}/{engine}"] = _linear_step(
                    torch.compile(model) if cfg.compile else model, x, g)
                with torch.no_grad():
                    outs[(recipe, engine)] = model(x).float()
        cmp = interleaved(fns, warmup=cfg.warmup, rounds=cfg.repeats, device=dev.type)
        for recipe in FP8_RECIPES:
            cells = [ratio_cell(cmp.ratio("bf16", f"{recipe}/{e}")) for e in engines]
            priced = (linear_seconds(m, k, n, "bf16", target)
                      / linear_seconds(m, k, n, f"fp8:{recipe}", target))
            diff = (_rel(outs[(recipe, "autoprec")], outs[(recipe, "torchao")])
                    if "torchao" in engines else math.nan)
            rows.append([f"{m}x{k}x{n}", recipe, *cells, f"{priced:.2f}", _f(diff)])
            best = cmp.ratio("bf16", f"{recipe}/{engines[-1]}")
            summary.append(f"{m}x{k}x{n} {recipe} {best.value:.2f}/{priced:.2f}")
        for model in models.values():
            remove(model)
        del lin, x, g, fns, models, outs, base
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    _table(rows, header)
    print("measured: bf16 time / fp8 time with its 95% interval (>1: fp8 faster); priced: the "
          "cost model's ratio; engines differ: relative difference of the two engines' outputs")
    ctx["recipes"] = summary


# ============================================================================ 5. certificate
def section_certificate(cfg: Config, dev: torch.device, ctx: dict, *, tuned, clock: _Clock) -> None:
    """A paired loss certificate of the CPU-tuned policy against BF16, on this device."""
    import autoprec

    _section(f"5. Paired loss certificate: the policy tuned on CPU vs BF16, "
             f"{cfg.cert_steps}-step reference run")
    task = autoprec.Task(
        model=lambda: _model(cfg), batches=_batches(cfg, 2, seed=1), device=dev,
        name=f"gpt2-{cfg.n_layer}x{cfg.n_embd}",
        train_batches=lambda n, seed: _batches(cfg, n, seed=seed),
        eval_batches=_batches(cfg, cfg.eval_batches, seed=99, skip=3_000_000))
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        res = autoprec.certify(task, tuned, steps=cfg.cert_steps, strict=False, progress=True)
    cert = res.certificate
    print(cert.describe())
    rows = [[start, _f(ref, ".4f"), _f(pol, ".4f"), _f((pol - ref) / ref, "+.3%")]
            for start, (ref, pol) in sorted(res.losses.items())]
    _table(rows, ["branch from step", "bf16 held-out", "policy held-out", "gap"])
    print(f"verdict {cert.verdict}: gap {cert.gap:+.3%} [{cert.low:+.3%}, {cert.high:+.3%}] "
          f"({cert.confidence:.0%}), tolerance {cert.tolerance:.2%}, {cert.branches} branches "
          f"of {cert.horizon} steps ({time.perf_counter() - t0:.0f} s)")
    ctx["certificate"] = (cert.verdict, cert.gap, cert.low, cert.high, cert.branches)


# ============================================================================ 6. memory
def _llama_task(hidden: int, layers: int, dev: torch.device):
    """bench_profile_memory's Llama (vocab 32k, GQA, 2 x 64-token batches) on ``dev``."""
    from bench_profile_memory import _task

    return _task(hidden, layers, device=str(dev))


def _cuda_peak(fn, dev: torch.device) -> tuple[float, object]:
    """Bytes allocated at the peak of ``fn()`` above what was allocated before it."""
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    out = fn()
    _sync(dev)
    return torch.cuda.max_memory_allocated(dev) - base, out


def _train_steps(task) -> int:
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        task.loss(model, task.batches[0]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def section_memory(cfg: Config, dev: torch.device, ctx: dict, *, clock: _Clock) -> None:
    """The profile's peak memory against a training step's, on the largest Llama that fits."""
    import autoprec

    _section("6. Profile peak memory vs a training step's (torch.cuda.max_memory_allocated)")
    if dev.type != "cuda":
        print("CPU dry run: CUDA peak memory is not measured here (benchmarks/"
              "bench_profile_memory.py measures RSS on CPU); the code path still runs.")
    print("step: build + 2 AdamW steps (fp32 weights, grads, optimizer state, activations); "
          "fast / exact: autoprec.profile(fp32, bf16, fp8; target h200; sensitivity fast / "
          "exact; 2 batches of 2x64 tokens). P = the model's fp32 weights.")
    rows = []
    if clock.left() < 60:
        print(f"skipped: {clock.left():.0f} s left of the {cfg.budget_s:.0f} s budget")
        return
    for size in cfg.mem_sizes:
        hidden, layers = (int(x) for x in size.split("x"))
        task = _llama_task(hidden, layers, dev)
        try:
            if dev.type == "cuda":
                step, params = _cuda_peak(lambda task=task: _train_steps(task), dev)
            else:
                step, params = math.nan, _train_steps(task)
            figures = {"step": step}
            for mode in ("fast", "exact"):
                if clock.left() < 30:
                    print(f"{size} {mode}: skipped, {clock.left():.0f} s left of the budget")
                    continue
                t0 = time.perf_counter()

                def run(mode=mode, task=task):
                    return autoprec.profile(task, ("fp32", "bf16", "fp8"), target="h200",
                                            sensitivity=mode, n_batches=2, progress=False)
                if dev.type == "cuda":
                    figures[mode] = _cuda_peak(run, dev)[0]
                else:
                    run()
                    figures[mode] = math.nan
                print(f"{size} {mode}: {time.perf_counter() - t0:.0f} s", flush=True)
        except torch.OutOfMemoryError:
            print(f"llama {size}: out of memory; trying the next size")
            gc.collect()
            torch.cuda.empty_cache()
            continue
        for part, peak in figures.items():
            rows.append([f"llama {size}", f"{params / 4 / 1e9:.2f}B", part,
                         _f(peak / 2**30, ".2f"), _f(peak / params, ".2f"),
                         _f(peak / step, ".2f")])
        ctx["memory"] = {part: (peak / params, peak / step) for part, peak in figures.items()}
        break
    _table(rows, ["model", "params", "part", "peak GiB", "x P", "x step"])


def _check_deps(dry_run: bool) -> None:
    missing = []
    for mod in ("yaml", "transformers", "scipy") + (("optuna",) if dry_run else ()):
        try:
            importlib.import_module(mod)
        except ImportError:
            missing.append({"yaml": "pyyaml"}.get(mod, mod))
    if missing:
        print(f"gpu_check: missing Python packages: {', '.join(missing)}.\n"
              f"  Install them first (from the repository root):\n"
              f"    pip install {' '.join(missing)}\n"
              f"  No network on this machine? On one with network: "
              f"pip download {' '.join(missing)} -d wheels/ ; carry wheels/ over, then:\n"
              f"    pip install --no-index --find-links wheels/ {' '.join(missing)}\n"
              , file=sys.stderr, flush=True)
        sys.exit(2)


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true",
                    help="the same code path on CPU at tiny sizes (tests the script)")
    ap.add_argument("--policy", default=os.path.join(ROOT, "benchmarks", "gpu",
                                                     "gpt2_4x1024_h200.yaml"),
                    help="the policy `autoprec tune --target h200` wrote on CPU for this model")
    ap.add_argument("--profile", default=None,
                    help="the profile that tune priced it with (default: beside --policy)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--output-dir", default=None, help="default: $OUT, else benchmarks/results")
    ap.add_argument("--compile", action="store_true",
                    help="section 4: time torch.compile'd layers instead of eager ones")
    ap.add_argument("--recipe-shapes", default=None,
                    help="section 4's shapes, e.g. 16384x4096x4096,16384x4096x14336")
    for name, typ in (("layers", int), ("width", int), ("heads", int), ("batch", int),
                      ("seq", int), ("steps", int), ("trials", int), ("budget-s", float)):
        ap.add_argument(f"--{name}", type=typ, default=None, help="override the config")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.profile is None:
        args.profile = os.path.splitext(args.policy)[0] + ".profile.json"
    _check_deps(args.dry_run)
    cfg = Config.dry() if args.dry_run else Config.full()
    for arg, attr in (("layers", "n_layer"), ("width", "n_embd"), ("heads", "n_head"),
                      ("batch", "batch"), ("seq", "seq"), ("steps", "steps"),
                      ("trials", "trials"), ("budget_s", "budget_s")):
        if getattr(args, arg) is not None:
            setattr(cfg, attr, getattr(args, arg))
    cfg.compile = args.compile
    if args.recipe_shapes:
        cfg.recipe_shapes = [tuple(int(v) for v in shape.split("x"))
                             for shape in args.recipe_shapes.split(",")]
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here. Run it on the GPU machine, or use --dry-run to "
              "test the script on CPU.", file=sys.stderr)
        return 2
    dev = torch.device(cfg.device)
    clock = _Clock(cfg.budget_s)
    outdir = _out_dir(args.output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S") + ("-dryrun" if args.dry_run else "")
    path = os.path.join(outdir, f"gpu_check-{stamp}.txt")
    tee = _Tee(sys.stdout, path)
    sys.stdout = tee
    ctx: dict = {"files": [path], "failed": []}
    try:
        import transformers

        from autoprec.host import supported_formats

        print(f"gpu_check {'DRY RUN (CPU, tiny sizes)' if args.dry_run else '(full)'} -- "
              f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
        print(device_line())
        sup = {f.value: s.value for f, s in supported_formats(dev).items()}
        cuda = ""
        if dev.type == "cuda":
            cap = torch.cuda.get_device_capability(dev)
            cuda = (f"; CUDA {torch.version.cuda}, sm_{cap[0]}{cap[1]}, TF32 matmul "
                    f"{'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}")
        print(f"transformers {transformers.__version__}; formats on {dev}: "
              f"{', '.join(f'{k} {v}' for k, v in sup.items())}{cuda}")
        print(f"GPT-2 {cfg.n_layer} layers x {cfg.n_embd} wide, {cfg.n_head} heads, vocab 256 "
              f"(bytes), eager attention (its matmuls visible to the FP8 router); batch "
              f"{cfg.batch}x{cfg.seq}; budget {cfg.budget_s:.0f} s")
        if dev.type == "cpu":
            print("NOTE: CPU dry run. FP8 is EMULATED everywhere except the numerics section's "
                  "'real' column (CPU torch._scaled_mm via native=True); no number here is a GPU "
                  "measurement.")
        sections = {s.strip() for s in args.sections.split(",") if s.strip()}
        tuned, prof = cpu_tuned(cfg, args, outdir, stamp, ctx)
        for name, fn in (("numerics", lambda: section_numerics(cfg, dev, ctx)),
                         ("layers", lambda: section_layers(cfg, dev, ctx, prof)),
                         ("step", lambda: section_step(cfg, dev, ctx, clock=clock, tuned=tuned,
                                                       prof=prof)),
                         ("recipes", lambda: section_recipes(cfg, dev, ctx)),
                         ("certificate", lambda: section_certificate(cfg, dev, ctx, tuned=tuned,
                                                                     clock=clock)),
                         ("memory", lambda: section_memory(cfg, dev, ctx, clock=clock))):
            if name not in sections:
                continue
            t0 = time.perf_counter()
            try:
                fn()
            except Exception:  # noqa: BLE001 - the next section still runs
                print(f"\nsection {name} FAILED:")
                traceback.print_exc(file=sys.stdout)
                ctx["failed"].append(name)
            print(f"[{name}: {time.perf_counter() - t0:.0f} s; {clock.elapsed():.0f} s total]",
                  flush=True)
            if dev.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()

        _section("Summary")
        if "numerics_worst" in ctx:
            print(f"numerics: worst real~emu {ctx['numerics_worst']:.2e}; "
                  f"{'all ok' if ctx['numerics_ok'] else 'CHECK the table'}")
        if "gpt2_fp8_gains" in ctx:
            print(f"GPT-2 layers where fp8 beats bf16 by >=5%: "
                  f"{', '.join(ctx['gpt2_fp8_gains']) or 'none'}; lone linears: "
                  f"{', '.join(ctx['sweep_fp8_gains']) or 'none'}")
        if "step" in ctx:
            print("step speed-up vs fp32: " + ", ".join(f"{k} {_x(v)}" for k, v in
                                                         ctx["step"].items()))
            print("step speed-up vs autocast(bf16): " + ", ".join(
                f"{k} {_x(v)}" for k, v in ctx["step_bf16"].items()))
            print("held-out loss: " + ", ".join(f"{k} {_f(v, '.4f')}" for k, v in
                                                ctx["loss"].items()))
        if "layer_checks" in ctx:
            print("layers, measured / priced: " + "; ".join(
                f"{k} bf16 {_f(a, '.2f')} fp8 {_f(b, '.2f')}" for k, a, b in ctx["layer_checks"]))
        if "step_checks" in ctx:
            print("f+b speed-up vs fp32, measured / priced: " + ", ".join(
                f"{k} {_f(m, '.2f')}/{_f(p, '.2f')}" for k, (m, p) in ctx["step_checks"].items()))
        if "recipes" in ctx:
            print("fp8 recipes vs bf16 (measured / priced): " + "; ".join(ctx["recipes"]))
        if "certificate" in ctx:
            v, gap, lo, hi, n = ctx["certificate"]
            print(f"certificate: {v}, gap {gap:+.3%} [{lo:+.3%}, {hi:+.3%}], {n} branches")
        if "memory" in ctx:
            print("memory (x P, x step): " + ", ".join(
                f"{k} {_f(a, '.2f')}P {_f(b, '.2f')}x" for k, (a, b) in ctx["memory"].items()))
        print(f"failed sections: {', '.join(ctx['failed']) or 'none'}; "
              f"total {clock.elapsed():.0f} s")
        print("files: " + ", ".join(ctx["files"]))
    finally:
        sys.stdout = tee.stream
        tee.close()
    return 1 if ctx["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
