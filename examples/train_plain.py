"""Train HF GPT-2 (byte-level, stdlib source) with a policy in a plain PyTorch loop, optionally
under the runtime guard.

    python examples/train_plain.py --policy policies/gpt2_bytes.bf16_fp32_head.yaml --steps 50
    python examples/train_plain.py --guard --plant-overflow 10 --amended /tmp/amended.yaml

``--plant-overflow STEP`` shows the guard at work: it puts ``transformer.h.1.mlp.c_proj`` in
fp16 and, at STEP, multiplies its weight by 2e6 (the weight itself still fits FP16, its outputs
do not). Without ``--guard`` the loss turns NaN for good; with it the layer is demoted to fp32
after two failing steps and training goes on.

A policy with phases switches at its steps (the run's length is ``--steps``)::

    python examples/train_plain.py --policy policies/gpt2_bytes.phased.yaml --steps 40
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

PLANT_LAYER = "transformer.h.1.mlp.c_proj"
PLANT_FACTOR = 2e6


def plant_overflow(model: torch.nn.Module, fqn: str = PLANT_LAYER, factor: float = PLANT_FACTOR):
    """Scale one layer's weight so that its outputs overflow FP16 (a stand-in for the
    activation growth that makes real fp16 layers overflow mid-run)."""
    with torch.no_grad():
        model.get_submodule(fqn).weight.mul_(factor)


def train(model, policy, batches, *, steps: int, lr: float = 1e-3, guard=None,
          plant_at: int | None = None, log_every: int = 0) -> dict:
    """Train ``model`` under ``policy`` for ``steps`` steps over ``batches`` (cycled).

    Returns ``{"losses", "step_times", "scaler", "guard"}``. ``guard``: as for
    ``autoprec.apply``. ``plant_at``: step at which :func:`plant_overflow` runs.
    """
    model.train()
    kit = training_kit(model, policy, guard=guard, total_steps=steps)
    model, scaler, guard = kit
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times = [], []
    for step in range(steps):
        if kit.phases is not None and kit.phases.at(step) is not None:
            print(f"step {step:4d}  phase {kit.phases.current} in force: "
                  f"{policy.phases[kit.phases.current - 1].describe()}", flush=True)
        if step == plant_at:
            plant_overflow(model)
        batch = batches[step % len(batches)]
        t0 = time.perf_counter()
        loss = model(**batch).loss
        scaler.scale(loss).backward()   # a pass-through unless some layer is fp16
        scaler.step(opt)                # skipped when the gradients hold inf/NaN
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if guard is not None:
            guard.step()                # one host sync; may demote a layer
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {times[-1] * 1e3:7.1f} ms", flush=True)
    return {"losses": losses, "step_times": times, "scaler": scaler, "guard": guard}


def main(argv=None):
    ap = training_arg_parser(__doc__, steps=30, policy=os.path.join(
        ROOT, "policies", "gpt2_bytes.bf16_fp32_head.yaml"))
    ap.add_argument("--guard", action="store_true", help="attach the runtime guard")
    ap.add_argument("--patience", type=int, default=2)
    ap.add_argument("--amended", default=None, help="write the guard's amended policy here")
    ap.add_argument("--plant-overflow", type=int, default=None, metavar="STEP")
    args = ap.parse_args(argv)

    model, policy = model_and_policy(args)
    if args.plant_overflow is not None:
        policy = policy.with_layers({PLANT_LAYER: "fp16"})
    guard = GuardConfig(patience=args.patience, save_to=args.amended) if args.guard else None
    batches = byte_batches(8, args.batch_size, args.seq_len, seed=0)
    print(f"GPT-2 {args.layers}x{args.width}, policy {args.policy}, guard {bool(guard)}",
          flush=True)
    out = train(model, policy, batches, steps=args.steps, lr=args.lr, guard=guard,
                plant_at=args.plant_overflow, log_every=5)
    g = out["guard"]
    if g is not None:
        for event in g.events:
            print(f"guard: {event}")
        if args.amended:
            g.save(args.amended)
            print(f"amended policy written to {args.amended}")


if __name__ == "__main__":
    main()
