"""How tight the certificate is for its cost, and what the tune's old budget says beside it.

    python benchmarks/bench_certificate.py --part width     [--models llama gpt2] [--steps 200]
    python benchmarks/bench_certificate.py --part verdicts  [--models llama gpt2] [--steps 200]
    python benchmarks/bench_certificate.py --part verdicts --models llama-64 gpt2-64

Models: HF Llama and HF GPT-2 byte LMs, 2 layers, 128 wide (``llama-64``/``gpt2-64``: 64
wide, the held-out pair), batch 8x64, AdamW, cosine LR.
Policies put every Linear (lm_head included) in one format, the rest in bf16; fp32 and fp16
are whole-model.

**width**: for fp8 (tensorwise) and nvfp4, against bf16:
- unpaired batch-order noise: bf16 runs of ``steps`` steps on 3 batch orders (same init), the
  s.d. of their held-out loss (relative): what "gap vs reference" carries when the two runs
  see other batches;
- paired whole runs: the policy on each of those orders from the same init, the s.d. of the
  3 paired gaps (today's pairing);
- the certificate (``sequential=False``: every branch, one look at 95%): its interval's
  half-width, and its cost in training steps (reference run + branches).
At the certificate's cost, a design of whole-run pairs affords ``cost / (2 * steps)`` pairs;
its 95% half-width is ``1.96 * sd / sqrt(pairs)`` (``sd`` of a pair's gap: sqrt(2) x the
unpaired s.d., or the paired s.d.). The table gives each and the ratio to the certificate's.

**verdicts**: the certificate (its defaults) of each of 9 policies against bf16, beside the
tune's proxies measured on the calibration batches at init (whole-model gradient error and
one-step loss change vs FP32) and a candidate for a budget that predicts the certificate: the
persistent gradient bias (``autoprec.budget.gradient_bias``: the error of the gradient
averaged over 8 batches, relative to the averaged gradient) at init and halfway through the
certificate's own bf16 reference run, with how persistent the error is. Then, against the
certificate's verdict (confusion tables): the old budget (gradient error <= 0.25, loss change
<= 1%), the "FP4 All the Way" rule (bias < 1/sqrt(3)) at init and mid-run, and a bias budget
(``--threshold``, default ``DEFAULT_BIAS_BUDGET`` = 0.21: the value between the largest passing
and the smallest non-passing bias of the 128-wide pair, tested on the 64-wide one); and each
proxy's Spearman with the certified gap.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

import _common  # noqa: F401  (path and environment set-up)
import torch
from _common import device_line
from scipy import stats

import autoprec
from autoprec.budget import DEFAULT_BIAS_BUDGET, RULE_RATIO, gradient_bias
from autoprec.certification import certify, held_out_loss, start_run, train_step, training_stream
from autoprec.host import slow_16bit_dtypes
from autoprec.measure.deviation import DeviationMeter, prepare_for_measurement
from autoprec.runtime.fp8 import emulating
from examples.data import byte_batches

LINEARS = {"llama": ("model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj", "lm_head"),
           "gpt2": ("transformer.h.*.attn.c_attn", "transformer.h.*.attn.c_proj",
                    "transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj", "lm_head")}
VERDICT_POLICIES = ("bf16", "fp32", "fp16", "fp8", "fp8:rowwise", "mxfp8", "nvfp4",
                    "nvfp4/bf16/bf16", "nvfp4:plain")
# Beyond the nine: fp16 with its loss scale held at 1 (no scaling: what a GradScaler is for),
# and autoprec's own policy, tuned for a B200 by the bias budget at the certificate's halfway
# point (tune(budget_at=steps // 2); priced at 512 x 64 tokens a step).
EXTRA_POLICIES = ("fp16:scale-1", "autoprec")
TUNE_FORMATS = ("bf16", "fp8", "mxfp8", "nvfp4")


def task(model: str) -> autoprec.Task:
    """``llama``/``gpt2``: 2 layers, 128 wide; ``llama-64``/``gpt2-64``: 64 wide (held out:
    a threshold fitted on the 128-wide pair is tested on these)."""
    family, _, width = model.partition("-")
    width = int(width or 128)
    if family == "llama":
        from examples.llama_bytes import make_model as llama

        def build():
            return llama(n_layer=2, hidden=width, intermediate=3 * width, heads=4, kv_heads=2,
                         seq_len=64)
    else:
        from examples.gpt2_bytes import make_model as gpt2

        def build():
            return gpt2(n_layer=2, n_embd=width, n_head=2, seq_len=64)
    return autoprec.Task(model=build, batches=byte_batches(4, 8, 64, seed=1), name=model,
                         device="cpu",
                         train_batches=lambda n, seed: byte_batches(n, 8, 64, seed=seed),
                         eval_batches=byte_batches(4, 8, 64, seed=10_000, skip=3_000_000))


def policy(model: str, name: str, steps: int = 200) -> autoprec.Policy:
    if name in ("bf16", "fp32", "fp16"):
        return autoprec.Policy(default=name)
    if name == "fp16:scale-1":
        return autoprec.Policy(default="fp16", loss_scaling=autoprec.policy.LossScaling(
            init_scale=1.0, growth_interval=2 ** 31 - 1))
    if name == "autoprec":
        return tuned(model, steps)
    return autoprec.Policy(default="bf16",
                           layers=dict.fromkeys(LINEARS[model.partition("-")[0]], name))


def tuned(model: str, steps: int) -> autoprec.Policy:
    """autoprec's policy for ``model``: a tune for a B200 (per-GEMM mixes offered) judged by
    the bias budget measured halfway through the certificate's run."""
    t = task(model)
    t.shape_batch = byte_batches(1, 512, 64, seed=2)[0]
    with tempfile.TemporaryDirectory() as tmp:
        res = autoprec.tune(t, formats=TUNE_FORMATS, target="b200", per_gemm=True,
                            budget_at=steps // 2, n_trials=16, seed=0, progress=False,
                            output=os.path.join(tmp, f"{model}.yaml"))
    used = sorted(f.label for f in res.policy.formats_used())
    print(f"autoprec's policy for {model}: {', '.join(used)}; winner's bias "
          f"{res.best.grad_bias:.3f}, priced {res.best.speedup}", flush=True)
    return res.policy


def whole_run(t: autoprec.Task, pol: autoprec.Policy | None, steps: int, order: int) -> float:
    """Held-out loss after ``steps`` steps from the task's init on batch order ``order``."""
    batches = training_stream(t, steps, t.seed + 1000 * (order + 1))
    with emulating(slow_16bit_dtypes(t.device)):
        run = start_run(t, pol, steps, strict=True)
        for i, b in enumerate(batches):
            train_step(t, run, b, i)
        return held_out_loss(t, run.model, list(t.eval_batches))


def width(models: list[str], steps: int) -> None:
    rows = []
    for m in models:
        t, ref = task(m), policy(m, "bf16")
        refs = [whole_run(t, ref, steps, k) for k in range(3)]
        unpaired = statistics.stdev(refs) / statistics.fmean(refs)
        for name in ("fp8", "nvfp4"):
            pol = policy(m, name)
            t0 = time.perf_counter()
            paired = [(whole_run(t, pol, steps, k) - r) / r for k, r in enumerate(refs)]
            cert = certify(t, pol, steps=steps, sequential=False, progress=False).certificate
            cost = cert.steps + cert.policy_steps
            pairs = cost / (2 * steps)
            h_cert = (cert.high - cert.low) / 2
            h_unp = 1.96 * math.sqrt(2) * unpaired / math.sqrt(pairs)
            h_pair = 1.96 * statistics.stdev(paired) / math.sqrt(pairs)
            rows.append([m, name, f"{unpaired:.3%}", f"{statistics.stdev(paired):.3%}",
                         f"{statistics.fmean(paired):+.2%}", f"{cert.gap:+.3%}",
                         f"{h_cert:.3%}", f"{cost}", f"{h_unp:.3%}", f"{h_pair:.3%}",
                         f"{h_unp / h_cert:.1f}x", f"{h_pair / h_cert:.1f}x",
                         f"{time.perf_counter() - t0:.0f}"])
            print(" | ".join(rows[-1]), flush=True)
    header = ["model", "policy", "unpaired sd", "paired sd", "paired gap (3)", "cert gap",
              "cert half-width", "cost (steps)", "unpaired half-width at cost",
              "paired half-width at cost", "unpaired/cert", "paired/cert", "s"]
    _print(header, rows)


def policy_of_bf16() -> autoprec.Policy:
    return autoprec.Policy(default="bf16")


def verdicts(models: list[str], steps: int, threshold: float = DEFAULT_BIAS_BUDGET,
             policies: tuple[str, ...] = VERDICT_POLICIES) -> None:
    rows, table = [], {}
    for m in models:
        t = task(m)
        numerics = DeviationMeter(prepare_for_measurement(t.build_model()), list(t.batches),
                            t.loss_fn or autoprec.task.default_loss)
        for name in policies:
            pol = policy(m, name, steps)
            t0 = time.perf_counter()
            dev = numerics.compare(pol)
            at_init = gradient_bias(t, pol, step=0, run_steps=steps)
            mid = gradient_bias(t, pol, step=steps // 2, run_steps=steps)
            bias0, bias_mid, persist = at_init.bias, mid.bias, mid.persistence
            cert = certify(t, pol, steps=steps, progress=False).certificate
            old = dev.finite and dev.grad_rel_error <= 0.25 and dev.loss_rel_change <= 0.01
            table[m, name] = (cert, dev, old, bias0, bias_mid, bias0 < RULE_RATIO,
                              bias_mid < RULE_RATIO, bias_mid < threshold)
            rows.append([m, name, cert.verdict, f"{cert.gap:+.3%}",
                         f"[{cert.low:+.3%}, {cert.high:+.3%}]", str(cert.branches),
                         f"{dev.grad_rel_error:.3f}", f"{dev.loss_rel_change:+.3%}",
                         f"{bias0:.3f}", f"{bias_mid:.3f}", f"{persist:.2f}",
                         "admit" if old else "reject",
                         "admit" if bias_mid < threshold else "reject",
                         f"{time.perf_counter() - t0:.0f}"])
            print(" | ".join(rows[-1]), flush=True)
    _print(["model", "policy", "certificate", "gap", "interval", "branches", "grad error",
            "loss change", "bias at init", f"bias at step {steps // 2}", "persistence",
            "old budget", f"bias budget {threshold:.2f} at step {steps // 2}", "s"], rows)
    _confusion(table, threshold)


def _confusion(table: dict, threshold: float) -> None:
    """Each budget's admission against the certificate's verdict, then each proxy's Spearman
    with the certified gap."""
    rows = list(table.values())
    for label, column in (("old budget (gradient error <= 0.25, loss change <= 1%)", 2),
                          (f"rule at init (gradient bias < {RULE_RATIO:.3f})", 5),
                          (f"rule mid-run (gradient bias < {RULE_RATIO:.3f})", 6),
                          (f"bias budget mid-run (gradient bias < {threshold:.3f})", 7)):
        counts: dict[tuple[str, str], int] = {}
        for r in rows:
            key = ("admit" if r[column] else "reject", r[0].verdict)
            counts[key] = counts.get(key, 0) + 1
        agree = counts.get(("admit", "pass"), 0) + counts.get(("reject", "fail"), 0) + \
            counts.get(("reject", "undecided"), 0)
        print(f"\n{label} vs certificate: agrees with it (admits a pass, rejects what does not "
              f"pass) on {agree} of {len(rows)}")
        _print(["budget", "pass", "fail", "undecided"],
               [[o, *(str(counts.get((o, v), 0)) for v in ("pass", "fail", "undecided"))]
                for o in ("admit", "reject")])
    gaps = [r[0].gap for r in rows]
    for label, values in (("gradient error", [r[1].grad_rel_error for r in rows]),
                          ("loss change", [r[1].loss_rel_change for r in rows]),
                          ("gradient bias at init", [r[3] for r in rows]),
                          ("gradient bias mid-run", [r[4] for r in rows])):
        rho = stats.spearmanr(values, gaps).statistic
        print(f"Spearman({label}, certified gap) over {len(gaps)} model x policy pairs: "
              f"{rho:+.2f}")


def _print(header: list[str], rows: list[list[str]]) -> None:
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["width", "verdicts"], required=True)
    ap.add_argument("--models", nargs="+", default=["llama", "gpt2"],
                    choices=["llama", "gpt2", "llama-64", "gpt2-64"])
    ap.add_argument("--threshold", type=float, default=DEFAULT_BIAS_BUDGET,
                    help="(verdicts) the gradient-bias budget to judge beside the rule "
                         f"(default {DEFAULT_BIAS_BUDGET}: chosen on llama and gpt2, tested on "
                         "llama-64 and gpt2-64)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--policies", nargs="+", default=list(VERDICT_POLICIES),
                    choices=[*VERDICT_POLICIES, *EXTRA_POLICIES],
                    help="(verdicts) the policies to certify (default: the nine; also "
                         "fp16:scale-1 and autoprec, the tune's own with --budget-at)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(device_line(), flush=True)
    if args.part == "width":
        width(args.models, args.steps)
    else:
        verdicts(args.models, args.steps, args.threshold, tuple(args.policies))


if __name__ == "__main__":
    main()
