"""Train HF GPT-2 (byte-level) on the standard library's own source with a precision policy.

    python examples/train_with_policy.py --policy policies/gpt2_bytes.yaml --steps 200

Prints the loss and the step time; `--policy none` trains plain FP32, `--autocast bf16` adds an
outer torch.autocast (the anchor the benchmarks compare against).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autoprec  # noqa: E402
from examples.data import byte_batches  # noqa: E402
from examples.gpt2_bytes import make_model, training_arg_parser  # noqa: E402


def train(policy: str | None, *, steps: int = 100, n_layer: int = 4, n_embd: int = 256,
          batch_size: int = 16, seq_len: int = 128, lr: float = 1e-3, autocast: str | None = None,
          seed: int = 0, log_every: int = 10, eval_batches: int = 4, quiet: bool = False):
    """Train and return ``{"losses", "step_times", "eval_loss", "model"}``; same seed = same
    init and data."""
    torch.manual_seed(seed)
    model = make_model(n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64),
                       seq_len=seq_len).train()
    # the policy's loss scaling (a pass-through unless some layer is fp16); without a policy,
    # an outer fp16 autocast's
    scaler = torch.amp.GradScaler("cpu", enabled=autocast == "fp16")
    if policy:
        pol = autoprec.load_policy(policy)
        autoprec.apply(model, pol, strict=False)
        scaler = pol.grad_scaler("cuda" if torch.cuda.is_available() else "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    data = byte_batches(steps, batch_size, seq_len, seed=seed)
    held_out = byte_batches(eval_batches, batch_size, seq_len, seed=10_000, skip=3_000_000)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(autocast or "")
    losses, times = [], []
    for step, batch in enumerate(data):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)  # skipped when an enabled scaler finds inf/NaN gradients
        scaler.update()
        opt.zero_grad(set_to_none=True)
        sched.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if not quiet and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  step {times[-1] * 1e3:7.1f} ms",
                  flush=True)
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        eval_loss = statistics.fmean(model(**b).loss.item() for b in held_out)
    return {"losses": losses, "step_times": times, "eval_loss": eval_loss, "model": model}


def main(argv=None):
    ap = training_arg_parser(__doc__, policy="policies/gpt2_bytes.yaml", steps=100,
                             policy_help="policy YAML, or `none` for plain FP32")
    ap.add_argument("--autocast", choices=["bf16", "fp16"], default=None)
    args = ap.parse_args(argv)
    policy = None if args.policy.lower() == "none" else args.policy
    print(f"training GPT-2 {args.layers}x{args.width} on stdlib bytes, policy={policy}, "
          f"autocast={args.autocast}", flush=True)
    out = train(policy, steps=args.steps, n_layer=args.layers, n_embd=args.width,
                batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                autocast=args.autocast)
    steady = out["step_times"][min(5, len(out["step_times"]) - 1):]
    print(f"done: final train loss {out['losses'][-1]:.4f}, held-out loss "
          f"{out['eval_loss']:.4f}, median step {statistics.median(steady) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
