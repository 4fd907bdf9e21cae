"""torchtitan's Llama 3 (its registry's ``debugmodel`` flavor: 6 blocks, dim 256, vocab 2048)
on the stdlib's source bytes, for tuning the model torchtitan's trainer trains::

    autoprec tune examples/torchtitan_llama3.py:task --formats fp32 bf16 fp8 \
        -o policies/torchtitan_llama3_debug.yaml
    torchrun --nproc_per_node 8 -m torchtitan.train --module autoprec.torchtitan \\
        --config llama3_debugmodel --autoprec.policy policies/torchtitan_llama3_debug.yaml

Byte tokens (0..255) are valid ids of any torchtitan vocabulary; the model is built from
torchtitan's registry with its own initialisation (:func:`autoprec.torchtitan.build_model`),
so the policy's names and fingerprint are those of the model the trainer builds. No fp16:
torchtitan's trainer scales no loss, and refuses a policy with fp16 layers.
"""

from __future__ import annotations

import autoprec
from examples.data import byte_batches

__all__ = ["task", "gpu_task"]


def _tokens(n: int, batch: int, seq: int, *, seed: int, skip: int = 0) -> list:
    return [b["input_ids"] for b in byte_batches(n, batch, seq, seed=seed, skip=skip)]


def task() -> autoprec.Task:
    """The debug flavor on 4 x 4 x 64 tokens: a tune of seconds per trial on a CPU."""
    from autoprec.torchtitan import task as titan_task

    return titan_task(_tokens(4, 4, 64, seed=3), "llama3", "debugmodel",
                      train_batches=lambda n, seed: _tokens(n, 4, 64, seed=seed),
                      eval_batches=_tokens(2, 4, 64, seed=99, skip=3_000_000))


def gpu_task(n_layers: int = 2, batch_size: int = 1, seq_len: int = 8192) -> autoprec.Task:
    """Llama-3-8B's blocks (torchtitan's ``8B`` flavor, its first ``n_layers``) measured on
    2 x 64 tokens and priced at the production batch (``--target h100``): its policy is the
    shorter model's (fingerprint), for the 8B's per-block choices."""
    import torch

    from autoprec.torchtitan import task as titan_task

    return titan_task(_tokens(4, 2, 64, seed=1), "llama3", "8B", n_layers=n_layers,
                      shape_batch=torch.zeros(batch_size, seq_len, dtype=torch.long,
                                              device="meta"),
                      eval_batches=_tokens(2, 2, 64, seed=10_000, skip=3_000_000))
