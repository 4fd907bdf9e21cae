"""Train HF GPT-2 (byte-level, stdlib source) with a policy under the Hugging Face Trainer.

    python examples/train_hf_trainer.py --policy policies/gpt2_bytes.bf16_fp32_head.yaml --steps 30

``PolicyCallback(policy)`` goes in ``Trainer(callbacks=[...])``: it applies the policy when the
Trainer is built, before the Trainer's Accelerator prepares the model, and steps the runtime
guard after every optimizer step. ``bf16`` and ``fp16`` stay False: the policy decides the
formats (see ``autoprec.integrations`` for fp16 layers on a GPU).
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autoprec.runtime.guard import GuardConfig  # noqa: E402
from examples.data import byte_batches  # noqa: E402
from examples.gpt2_bytes import model_and_policy, training_arg_parser  # noqa: E402


def as_dataset(batches: list[dict]) -> list[dict]:
    """Per-example dicts, as a Trainer dataset (its collator stacks them again)."""
    return [{k: v[i] for k, v in b.items()} for b in batches for i in range(len(b["input_ids"]))]


def train(model, policy, dataset, *, steps: int, output_dir: str, batch_size: int = 4,
          lr: float = 1e-3, guard=None, bf16: bool = False, **training_args):
    """Train ``model`` under ``policy`` with a ``transformers.Trainer`` for ``steps`` optimizer
    steps. Returns ``(trainer, callback)``; ``callback.guard`` is the guard (or None)."""
    from transformers import Trainer, TrainingArguments

    from autoprec.integrations import PolicyCallback

    args = TrainingArguments(output_dir=output_dir, max_steps=steps,
                             per_device_train_batch_size=batch_size, learning_rate=lr,
                             bf16=bf16, fp16=False, report_to=[], save_strategy="no",
                             logging_steps=1, disable_tqdm=True, **training_args)
    callback = PolicyCallback(policy, guard=guard)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback])
    trainer.train()
    return trainer, callback


def main(argv=None):
    ap = training_arg_parser(__doc__, steps=30, policy=os.path.join(
        ROOT, "policies", "gpt2_bytes.bf16_fp32_head.yaml"))
    ap.add_argument("--output-dir", default="runs/trainer")
    ap.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU exists")
    ap.add_argument("--guard", action="store_true", help="attach the runtime guard")
    ap.add_argument("--amended", default=None, help="write the guard's amended policy here")
    args = ap.parse_args(argv)

    model, policy = model_and_policy(args)
    guard = GuardConfig(save_to=args.amended) if args.guard else None
    dataset = as_dataset(byte_batches(8, args.batch_size, args.seq_len, seed=0))
    trainer, callback = train(model, policy, dataset, steps=args.steps,
                              output_dir=args.output_dir, batch_size=args.batch_size,
                              lr=args.lr, guard=guard, use_cpu=args.cpu)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"done: first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")
    if callback.guard is not None:
        for event in callback.guard.events:
            print(f"guard: {event}")


if __name__ == "__main__":
    main()
