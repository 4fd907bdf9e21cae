"""HF GPT-2 (random init from a config) trained on the stdlib's source bytes: the bundled
example task, and the README's main job.

    autoprec tune examples/gpt2_bytes.py:task -o policies/gpt2_bytes.yaml
"""

from __future__ import annotations

import argparse

import torch

import autoprec
from examples.data import byte_batches

__all__ = ["gpt2_config", "make_model", "task", "gpu_task", "training_arg_parser"]


def gpt2_config(n_layer: int = 4, n_embd: int = 256, n_head: int = 4, seq_len: int = 128,
                dropout: float = 0.0):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=256, n_positions=seq_len, n_embd=n_embd, n_layer=n_layer,
                      n_head=n_head, bos_token_id=0, eos_token_id=0, use_cache=False,
                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                      loss_type="ForCausalLM")


def make_model(n_layer: int = 4, n_embd: int = 256, n_head: int = 4, seq_len: int = 128,
               attn_implementation: str = "eager"):
    """GPT2LMHeadModel; eager attention so its matmuls are visible to the FP8 router."""
    from transformers import GPT2LMHeadModel

    cfg = gpt2_config(n_layer, n_embd, n_head, seq_len)
    cfg._attn_implementation = attn_implementation
    model = GPT2LMHeadModel(cfg)
    # transformers 5 reads the loss from the model attribute, not the config; set it so it
    # does not warn that it falls back to the same causal-LM loss
    model.loss_type = "ForCausalLM"
    return model


def task(n_layer: int = 4, n_embd: int = 256, batch_size: int = 16, seq_len: int = 128,
         n_batches: int = 4) -> autoprec.Task:
    """The README's main job: 4 layers, 256 wide, batch 16x128, tuned for this machine."""
    return autoprec.Task(
        model=lambda: make_model(n_layer, n_embd, max(1, n_embd // 64), seq_len),
        batches=byte_batches(n_batches, batch_size, seq_len, seed=1),
        name=f"gpt2-{n_layer}x{n_embd}-bytes",
        train_batches=lambda n, seed: byte_batches(n, batch_size, seq_len, seed=seed),
        eval_batches=byte_batches(4, batch_size, seq_len, seed=10_000, skip=3_000_000),
    )


def gpu_task(n_layer: int = 4, n_embd: int = 1024, batch_size: int = 8,
             seq_len: int = 1024) -> autoprec.Task:
    """For tuning on this CPU *for a GPU* (``--target h100``): numerics are measured on small
    calibration batches (2x64 tokens), layers are priced at the production batch (8x1024)."""
    calib_len, calib_batch = 64, 2
    return autoprec.Task(
        model=lambda: make_model(n_layer, n_embd, max(1, n_embd // 64), seq_len),
        batches=byte_batches(4, calib_batch, calib_len, seed=1),
        shape_batch=byte_batches(1, batch_size, seq_len, seed=2)[0],
        name=f"gpt2-{n_layer}x{n_embd}-bytes-gpu",
        train_batches=lambda n, seed: byte_batches(n, calib_batch, calib_len, seed=seed),
        eval_batches=byte_batches(2, calib_batch, calib_len, seed=10_000, skip=3_000_000),
    )


def model_and_policy(args: argparse.Namespace):
    """The model (seeded) and the policy a training example's parsed ``training_arg_parser``
    arguments name."""
    torch.manual_seed(0)
    model = make_model(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                       seq_len=args.seq_len)
    return model, autoprec.load_policy(args.policy)


def training_arg_parser(description: str | None, *, policy: str, steps: int,
                        policy_help: str = "policy YAML") -> argparse.ArgumentParser:
    """The command-line options every GPT-2 training example shares (model size, data, lr);
    each example adds its own."""
    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policy", default=policy, help=policy_help)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    return ap
