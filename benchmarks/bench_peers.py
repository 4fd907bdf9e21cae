"""Peer benchmark: which nn.Linear layers to run in FP8, and with which recipe, on a Llama with
Llama-3-8B's layer shapes, as the field's tools decide it and as autoprec's tune decides it.

    python benchmarks/bench_peers.py [--layers 3] [--trials 24] [--steps 60] [--seeds 3]
    python benchmarks/bench_peers.py --target b200 [--max-grad-error 1.0]

The model: HF Llama, hidden 4096, SwiGLU 14336, 32 heads, 8 KV heads of 128 (Llama-3-8B's
layers), ``--layers`` of them (3: the fewest for which Megatron's rule puts any layer in FP8;
4 at full width needs more than 24 GB here), byte vocabulary (examples/llama_bytes.py). Each policy is priced
by the H100 cost model (``--target``) at 8 x 4096 tokens per step; numerics are measured here,
by emulation. The policies:

- bf16: every layer in BF16 (the anchor);
- fp8 tensorwise / rowwise: every nn.Linear in FP8 (``convert_to_float8_training`` with no
  filter), the rest BF16;
- torchao auto (tensorwise / rowwise): torchao's own H100 shape rule,
  ``torchao.float8.float8_linear_utils._auto_filter_for_recipe`` with the output layer left out
  (torchtitan's default ``filter_fqns``);
- Megatron first/last BF16: the first and the last transformer layer (and the output layer) in
  BF16, every other nn.Linear FP8 tensorwise (``--first-last-layers-bf16``);
- autoprec: ``tune(target=...)`` on this model: a format and recipe per layer (role).

With ``--target b200`` (Blackwell: MXFP8 and NVFP4 run natively there) the rules are the
field's Blackwell ones, and autoprec tunes over bf16, the FP8 recipes, mxfp8 (and its BF16
weight gradient), nvfp4 and their per-GEMM mixes (``per_gemm``):

- bf16; every nn.Linear in mxfp8 (torchtitan's MXFP8 converter with no fqns, the output layer
  included); every nn.Linear in nvfp4;
- torchtitan's NVFP4 rule (``llama3_8b_first_85_pct_layers_nvfp4``): nvfp4 but the last
  ceil(15%) of the blocks and the output layer in bf16;
- NeMo-RL's selective MXFP8: the first 2 and the last 4 blocks (and the output) in bf16 (on
  fewer than 7 blocks that is every block: the rule as written);
- the Llama4-Scout MXFP8 run's rule: ``output``, ``attention.wk`` and ``attention.wv`` in bf16
  (its ``router.gate`` has no dense counterpart), every other Linear mxfp8.

Speed: the cost model's step time of the searched layers (their matmuls, the FP8 casts and the
casts on the graph's edges), as BF16 time / policy time. A model, not a measurement: it has no
spread, but it has a calibration error (``autoprec.calibration.CALIBRATION``: whole-step speed-ups
within 3% of torchtitan's measured Llama-3-8B steps, benchmarks/bench_published.py), and two
prices closer than that are a tie (``autoprec.pricing.priced_tie``), written as one. These are
the searched layers alone: in a whole step the rest of the work dilutes them (bench_published:
1.56x on the blocks' linears is 1.25x on the step).

Accuracy: each policy's certificate against bf16 (``autoprec.certify``: paired branches from
one bf16 reference run, docs/certificate.md), at its defaults (200 steps,
branches of 100, tolerance 0.5%) or ``--steps``. Training at full width takes minutes per step
on 2 CPU cores, so the certificates are of a narrower model of the same structure and the same
layer names (``--loss-width``, default 512: hidden 512, SwiGLU 1792, 32 heads and 8 KV heads of
16), each policy applied by name. FP8, MXFP8 and NVFP4 are emulated here, exactly (same
rounding as the GPU kernels, see tests/test_fp8.py and tests/test_blockscale.py).

The claim: autoprec's policy, if its certificate passes, is at least as fast as the fastest
policy (peer rule or bf16) whose certificate passes; a priced difference inside the cost
model's calibration error is a tie.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tempfile
import time
import warnings

import _common  # noqa: F401  (puts the repo root on sys.path, HF offline)
import torch
from _common import device_line, print_table

from autoprec import Policy, Task, certify
from autoprec.certificate import Certificate
from autoprec.certification import DEFAULT_STEPS
from autoprec.devices import DEVICES
from autoprec.formats import Format, Support
from autoprec.pricing import calibration_error, calibration_line, priced_tie
from autoprec.tuning import TuneConfig, tune
from examples.data import byte_batches
from examples.llama_bytes import LLAMA3_8B, gpu_task, make_model


def _linears(n_layer: int, widths: dict) -> dict[str, torch.nn.Linear]:
    """Every nn.Linear of the tuned model, with its shape (built on the meta device)."""
    with torch.device("meta"):
        model = make_model(n_layer, **widths)
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def peer_policies(n_layer: int, widths: dict) -> dict[str, Policy]:
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    linears = _linears(n_layer, widths)
    every = {f: f for f in linears}

    def fp8(names, recipe="tensorwise") -> Policy:
        return Policy(default="bf16", layers={f: f"fp8:{recipe}" for f in names})

    outer = ("model.layers.0.", f"model.layers.{n_layer - 1}.", "lm_head")
    peers = {"bf16": Policy(default="bf16"),
             "fp8 tensorwise (all Linear)": fp8(every),
             "fp8 rowwise (all Linear)": fp8(every, "rowwise")}
    for recipe in ("tensorwise", "rowwise"):
        keep = _auto_filter_for_recipe(recipe, filter_fqns=["lm_head"])
        peers[f"torchao auto {recipe}"] = fp8([f for f, m in linears.items() if keep(m, f)],
                                              recipe)
    peers["Megatron first/last bf16"] = fp8([f for f in linears if not f.startswith(outer)])
    return peers


def blackwell_policies(n_layer: int, widths: dict) -> dict[str, Policy]:
    """The field's Blackwell rules on this model (see the module docstring)."""
    linears = _linears(n_layer, widths)

    def only(fmt: str, names) -> Policy:
        return Policy(default="bf16", layers={f: fmt for f in names})

    def blocks(indices) -> tuple[str, ...]:
        return tuple(f"model.layers.{i}." for i in indices)

    tail = blocks(range(n_layer - math.ceil(0.15 * n_layer), n_layer))
    nemo = blocks([*range(min(2, n_layer)), *range(max(0, n_layer - 4), n_layer)])
    body = [f for f in linears if f != "lm_head"]
    return {"bf16": Policy(default="bf16"),
            "mxfp8 (all Linear)": only("mxfp8", linears),
            "nvfp4 (all Linear)": only("nvfp4", linears),
            "torchtitan nvfp4, last 15% bf16": only("nvfp4", [f for f in body
                                                             if not f.startswith(tail)]),
            "NeMo-RL mxfp8, first 2/last 4 bf16": only("mxfp8", [f for f in body
                                                                if not f.startswith(nemo)]),
            "Llama4-Scout mxfp8 (wk, wv, output bf16)": only(
                "mxfp8", [f for f in body if not f.endswith(("k_proj", "v_proj"))])}


def price(prof, policies: dict[str, Policy], target: str) -> dict[str, float]:
    """Cost-model seconds of the searched layers under each policy."""
    fqns = [lp.fqn for lp in prof.layers]
    return {name: prof.estimate_step({f: p.format_for(f) for f in fqns}, target)
            for name, p in policies.items()}


def fp8_share(prof, policy: Policy) -> float:
    """The share of the searched layers' FLOPs in a scaled format (FP8, MXFP8, NVFP4)."""
    total = sum(lp.layer.flops for lp in prof.layers)
    return sum(lp.layer.flops for lp in prof.layers
               if policy.format_for(lp.fqn).is_scaled) / max(total, 1)


def _priced_verdict(ours: float, theirs: float, target: str) -> str:
    """Two priced speed-ups compared as the cost model can tell them apart: a difference
    inside its calibration error is a tie."""
    gap = ours / theirs - 1
    if priced_tie(ours, theirs, target):
        return (f"tie ({gap:+.1%}, inside the cost model's {calibration_error(target):.0%} "
                "calibration error)")
    return f"{'faster' if gap > 0 else 'slower'} by {abs(gap):.1%} (outside the calibration error)"


def loss_task(args) -> Task:
    """The narrow model the certificates train (see the module docstring)."""
    w = args.loss_width

    def build():
        torch.manual_seed(0)
        return make_model(args.layers, hidden=w, intermediate=w * 7 // 2, heads=32, kv_heads=8,
                          seq_len=args.seq)
    return Task(model=build, batches=byte_batches(4, args.batch, args.seq, seed=1),
                name=f"llama-{w}", device="cpu",
                train_batches=lambda n, seed: byte_batches(n, args.batch, args.seq, seed=seed),
                eval_batches=byte_batches(4, args.batch, args.seq, seed=10_000, skip=3_000_000),
                optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr,
                                                           weight_decay=0.0))


def certified(policy: Policy, task: Task, args) -> Certificate:
    """``policy``'s certificate against bf16 on the narrow model (applied by layer name: the
    narrow model is another model, its fingerprint differs)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        return certify(task, dataclasses.replace(policy, fingerprint=None), steps=args.steps,
                       strict=False, progress=False).certificate


def _parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=3, help="transformer layers (>= 3)")
    ap.add_argument("--target", default="h100")
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                    help="the certificates' reference run (branches of half of it)")
    ap.add_argument("--loss-width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--formats", nargs="+", default=None,
                    help="the tune's formats (default: fp32 bf16 fp8, and on a Blackwell "
                         "target also mxfp8 mxfp8:gw_hp nvfp4, with their per-GEMM mixes)")
    ap.add_argument("--sensitivity", default="auto", choices=("auto", "fast", "exact"),
                    help="the tune's sensitivity mode (fast: first-order estimates only; the "
                         "loss runs below judge the result either way)")
    ap.add_argument("--max-grad-error", type=float, default=None,
                    help="the tune's gradient-error budget (default: autoprec's, 0.25); raise it "
                         "to let the search take formats whose gradients move more, as NVFP4's")
    ap.add_argument("--calib-batches", type=int, default=4,
                    help="calibration batches (2 x 64 tokens each) the tune measures numerics on; "
                         "each unit of the profile keeps their FP32 gradients, 2.6 GB a batch at "
                         "full width (2 ran within 18.9 GB here)")
    ap.add_argument("--quick", action="store_true",
                    help="a check of this script: the tuned model 1/8 as wide, priced at 8x512 "
                         "tokens, few trials and steps; its figures mean nothing")
    args = ap.parse_args()
    if args.quick:
        args.trials, args.steps, args.loss_width = 4, 16, 64
    if args.layers < 3:
        ap.error("--layers must be at least 3: with 2, Megatron's rule leaves no layer in FP8")
    return args


def main() -> None:
    args = _parse()
    print(device_line(), flush=True)
    t0 = time.perf_counter()
    widths = {k: v // 8 for k, v in LLAMA3_8B.items()} if args.quick else dict(LLAMA3_8B)
    task = gpu_task(n_layer=args.layers, seq_len=512 if args.quick else 4096,
                    calib_batches=args.calib_batches, **widths)
    out = tempfile.mkdtemp(prefix="bench-peers-") + "/policy.yaml"
    blackwell = DEVICES[args.target].support[Format.NVFP4] is Support.NATIVE
    formats = tuple(args.formats) if args.formats else \
        ("fp32", "bf16", "fp8", "mxfp8", "mxfp8:gw_hp", "nvfp4") if blackwell \
        else ("fp32", "bf16", "fp8")
    config = TuneConfig(formats=formats, target=args.target, per_gemm=blackwell,
                        n_trials=args.trials, output=out, sensitivity=args.sensitivity)
    if args.max_grad_error is not None:
        config = config.replace(max_grad_error=args.max_grad_error)
    res = tune(task, config)
    tune_s = time.perf_counter() - t0
    prof = res.profile
    peers = blackwell_policies if blackwell else peer_policies
    policies = {**peers(args.layers, widths), "autoprec (tuned)": res.policy}
    print(f"\ntune for {args.target}: {tune_s:.0f} s, {len(res.trials)} trials; policy:")
    print(res.policy.to_yaml())

    seconds = price(prof, policies, args.target)
    t1 = time.perf_counter()
    task_n = loss_task(args)
    certs = {}
    for name, p in policies.items():
        if name != "bf16":  # the reference itself
            certs[name] = certified(p, task_n, args)
            print(f"certificate of {name}: {certs[name].describe()}", flush=True)
    loss_s = time.perf_counter() - t1
    _report(args, prof, policies, seconds, certs, widths, task)
    print(f"certificates: {loss_s:.0f} s; total {time.perf_counter() - t0:.0f} s")


def _report(args, prof, policies, seconds, certs, widths, task) -> None:
    ours = seconds["bf16"] / seconds["autoprec (tuned)"]
    rows, passing = [], {"bf16": 1.0}
    for name, p in policies.items():
        speed = seconds["bf16"] / seconds[name]
        cert = certs.get(name)
        if cert is not None and cert.verdict == "pass" and name != "autoprec (tuned)":
            passing[name] = speed
        against = "-" if name == "autoprec (tuned)" else (
            "tie" if priced_tie(ours, speed, args.target) else f"{ours / speed - 1:+.1%}")
        rows.append([name, f"{fp8_share(prof, p):.0%}", f"{speed:.3f}", against,
                     "reference" if cert is None else cert.verdict,
                     "-" if cert is None else f"{cert.gap:+.3%} [{cert.low:+.3%}, {cert.high:+.3%}]"])
    shape = ", ".join(f"{k} {v}" for k, v in widths.items())
    print(f"\nLlama, {args.layers} layers of {shape}; {args.target} cost model at "
          f"8x{task.shape_batch['input_ids'].shape[1]} tokens; certificates vs bf16 at width "
          f"{args.loss_width}, {args.steps}-step reference run")
    print_table(rows, ["policy", "scaled FLOPs", f"priced speed vs bf16 ({args.target})",
                       "autoprec vs it (priced)", "certificate", "gap [interval]"])
    print(calibration_line(args.target))
    best = max(passing, key=passing.get)
    ok = certs["autoprec (tuned)"].verdict == "pass"
    print(f"\nfastest policy whose certificate passes: {best} at {passing[best]:.3f}x; "
          f"autoprec at {ours:.3f}x, its certificate: {certs['autoprec (tuned)'].verdict}")
    print(f"autoprec against it: {_priced_verdict(ours, passing[best], args.target)}")
    claim = ok and (ours >= passing[best] or priced_tie(ours, passing[best], args.target))
    print(f"claim (certified, and at least as fast as the fastest certified policy; a priced "
          f"difference inside the calibration error is a tie): {'holds' if claim else 'FAILS'}")
    if not math.isfinite(ours):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
