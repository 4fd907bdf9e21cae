"""Train HF GPT-2 (byte-level, stdlib source) with a policy under PyTorch Lightning.

    python examples/train_lightning.py --policy policies/gpt2_bytes.bf16_fp32_head.yaml --steps 30
    python examples/train_lightning.py --guard --plant-overflow 5 --amended /tmp/amended.yaml

``AutoprecCallback(policy)`` goes in ``L.Trainer(callbacks=[...], precision="32-true")``: it
applies the policy to the LightningModule's HF model in ``setup``, before the strategy moves
it and configures the optimizer, steps the runtime guard after every optimizer step, keeps the
guard's state in Lightning checkpoints and writes the amended policy when ``fit`` ends.
``"32-true"``: the policy decides every layer's format.

``--plant-overflow STEP`` shows the guard at work, as in ``train_plain.py``: it puts
``transformer.h.1.mlp.c_proj`` in fp16 and multiplies its weight by 2e6 at STEP. Lightning on a
CPU has no loss scaling, so the LightningModule skips a step whose loss is not finite
(``training_step`` returns None) instead of letting NaN gradients reach AdamW; the guard demotes
the layer to fp32 after two failing steps and training goes on.
"""

from __future__ import annotations

import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autoprec.runtime.guard import GuardConfig  # noqa: E402
from examples.data import byte_batches  # noqa: E402
from examples.gpt2_bytes import model_and_policy, training_arg_parser  # noqa: E402
from examples.train_plain import PLANT_LAYER, plant_overflow  # noqa: E402


def lit_module(model: torch.nn.Module, *, lr: float = 1e-3, plant_at: int | None = None):
    """A LightningModule training an HF causal LM (``model(**batch).loss``) with AdamW; the HF
    model is its ``model`` attribute. ``losses`` keeps every step's loss (NaN included)."""
    import lightning as L

    class LitCausalLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.losses: list[float] = []
            self.planted = False

        def on_train_batch_start(self, batch, batch_idx):
            # global_step counts optimizer steps across epochs (skipped ones included)
            if self.trainer.global_step == plant_at and not self.planted:
                plant_overflow(self.model)
                self.planted = True

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.losses.append(loss.item())
            # No GradScaler under precision="32-true": a non-finite loss would put NaN in every
            # weight through AdamW, so skip the step (Lightning skips backward and the update)
            return loss if math.isfinite(self.losses[-1]) else None

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)

    return LitCausalLM()


def train(model, policy, batches, *, steps: int, lr: float = 1e-3, guard=None,
          plant_at: int | None = None, amended_to: str | None = None,
          module: str | None = "model", root_dir: str = "runs/lightning", callbacks=(),
          ckpt_path: str | None = None, recheck_every: int | None = None, follow_bias=None,
          **trainer_args):
    """Train ``model`` under ``policy`` with ``L.Trainer(precision="32-true")`` for ``steps``
    optimizer steps over ``batches`` (ready dicts, cycled by epochs). Returns
    ``(trainer, lit, callback)``; ``lit.losses`` are the step losses, ``callback.guard`` the
    guard (or None). ``module``: where the LightningModule holds the HF model (None: let the
    callback find it). ``recheck_every``: re-check the policy's layers every N steps;
    ``follow_bias``: the bias watch that may bring the final phase forward."""
    import lightning as L

    from autoprec.lightning import AutoprecCallback

    lit = lit_module(model.train(), lr=lr, plant_at=plant_at)
    callback = AutoprecCallback(policy, guard=guard, module=module, amended_to=amended_to,
                                recheck_every=recheck_every, follow_bias=follow_bias)
    trainer = L.Trainer(max_steps=steps, precision="32-true", accelerator="cpu", devices=1,
                        callbacks=[callback, *callbacks], default_root_dir=root_dir,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        **{"enable_checkpointing": False, **trainer_args})
    # batches are ready dicts: a DataLoader with batch_size=None hands them over as they are
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    trainer.fit(lit, loader, ckpt_path=ckpt_path)
    return trainer, lit, callback


def main(argv=None):
    ap = training_arg_parser(__doc__, steps=30, policy=os.path.join(
        ROOT, "policies", "gpt2_bytes.bf16_fp32_head.yaml"))
    ap.add_argument("--guard", action="store_true", help="attach the runtime guard")
    ap.add_argument("--amended", default=None, help="write the guard's amended policy here "
                    "(default: runs/lightning/autoprec.amended.yaml)")
    ap.add_argument("--plant-overflow", type=int, default=None, metavar="STEP")
    args = ap.parse_args(argv)

    model, policy = model_and_policy(args)
    if args.plant_overflow is not None:
        policy = policy.with_layers({PLANT_LAYER: "fp16"})
    guard = GuardConfig() if args.guard else None
    batches = byte_batches(8, args.batch_size, args.seq_len, seed=0)
    trainer, lit, callback = train(model, policy, batches, steps=args.steps, lr=args.lr,
                                   guard=guard, plant_at=args.plant_overflow,
                                   amended_to=args.amended)
    print(f"done: first loss {lit.losses[0]:.4f}, last loss {lit.losses[-1]:.4f}")
    if callback.guard is not None:
        for event in callback.guard.events:
            print(f"guard: {event}")


if __name__ == "__main__":
    main()
