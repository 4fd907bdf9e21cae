"""Train HF GPT-2 (byte-level, stdlib source) with a policy under Hugging Face Accelerate.

    python examples/train_accelerate.py --policy policies/gpt2_bytes.bf16_fp32_head.yaml --steps 30
    accelerate launch examples/train_accelerate.py --guard        # one process per GPU

The policy is applied *before* ``accelerator.prepare`` and the Accelerator runs with
``mixed_precision="no"``: the policy's regions decide every layer's format, and when a layer
is fp16 the policy's GradScaler scales the loss (``training_kit`` hands it back; with
``mixed_precision="fp16"`` on a GPU it would hand back a pass-through and let Accelerate's own
scaler do it).
"""

from __future__ import annotations

import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autoprec.integrations import training_kit  # noqa: E402
from autoprec.runtime.guard import GuardConfig  # noqa: E402
from examples.data import byte_batches  # noqa: E402
from examples.gpt2_bytes import model_and_policy, training_arg_parser  # noqa: E402


def train(model, policy, batches, *, steps: int, lr: float = 1e-3, guard=None,
          mixed_precision: str = "no", cpu: bool = False, log_every: int = 0) -> dict:
    """Train ``model`` under ``policy`` with an ``Accelerator(mixed_precision=...)`` for
    ``steps`` steps over ``batches`` (cycled). Returns ``{"losses", "step_times", "scaler",
    "guard", "model", "accelerator"}``."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision)
    model.train()
    # Before prepare: Accelerate's autocast (if any) then wraps the policy's regions, not the
    # other way round, and the kit checks the mixed_precision setting.
    model, scaler, guard = training_kit(model, policy, accelerator=accelerator, guard=guard)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loader = DataLoader(batches, batch_size=None, shuffle=False)  # batches are ready dicts
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses, times = [], []
    step = 0
    while step < steps:
        for batch in loader:
            if step == steps:
                break
            t0 = time.perf_counter()
            loss = model(**batch).loss
            accelerator.backward(scaler.scale(loss))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if guard is not None:
                guard.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            if log_every and (step % log_every == 0 or step == steps - 1):
                accelerator.print(f"step {step:4d}  loss {losses[-1]:.4f}  "
                                  f"{times[-1] * 1e3:7.1f} ms")
            step += 1
    return {"losses": losses, "step_times": times, "scaler": scaler, "guard": guard,
            "model": model, "accelerator": accelerator}


def main(argv=None):
    ap = training_arg_parser(__doc__, steps=30, policy=os.path.join(
        ROOT, "policies", "gpt2_bytes.bf16_fp32_head.yaml"))
    ap.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    ap.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU exists")
    ap.add_argument("--guard", action="store_true", help="attach the runtime guard")
    ap.add_argument("--amended", default=None, help="write the guard's amended policy here")
    args = ap.parse_args(argv)

    model, policy = model_and_policy(args)
    guard = GuardConfig(save_to=args.amended) if args.guard else None
    batches = byte_batches(8, args.batch_size, args.seq_len, seed=0)
    out = train(model, policy, batches, steps=args.steps, lr=args.lr, guard=guard,
                mixed_precision=args.mixed_precision, cpu=args.cpu, log_every=5)
    if out["guard"] is not None:
        for event in out["guard"].events:
            out["accelerator"].print(f"guard: {event}")


if __name__ == "__main__":
    main()
