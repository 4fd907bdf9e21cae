"""torchtitan's Llama 3 (its registry's ``debugmodel`` flavor: 6 blocks, dim 256, vocab 2048)
on the stdlib's source bytes, for tuning the model torchtitan's trainer trains::

    autoprec tune examples/torchtitan_llama3.py:task --formats fp32 bf16 fp8 \\
        -o policies/torchtitan_llama3_debug.yaml
    torchrun --nproc_per_node 8 -m torchtitan.train --module autoprec.torchtitan \\
        --config llama3_debugmodel --autoprec.policy policies/torchtitan_llama3_debug.yaml

Byte tokens (0..255) are valid ids of any torchtitan vocabulary; the model is built from
torchtitan's registry with its own initialisation (:func:`autoprec.torchtitan.build_model`),
so the policy's names and fingerprint are those of the model the trainer builds. Larger
flavors are ``autoprec.torchtitan.task(batches, "llama3", "8B", n_layers=2, shape_batch=...)``
priced with ``--target h100``, on a machine with room for them: Llama-3-8B's 128,256-token
embedding and output layer alone are 4.2 GB in fp32, and such a tune was killed at 24 GB here
during profiling. No fp16: torchtitan's trainer scales no loss, and refuses a policy with
fp16 layers.
"""

from __future__ import annotations

import autoprec
from examples.data import byte_batches

__all__ = ["task"]


def _tokens(n: int, batch: int, seq: int, *, seed: int, skip: int = 0) -> list:
    return [b["input_ids"] for b in byte_batches(n, batch, seq, seed=seed, skip=skip)]


def task() -> autoprec.Task:
    """The debug flavor on 4 x 4 x 64 tokens: a tune of seconds per trial on a CPU."""
    from autoprec.torchtitan import task as titan_task

    return titan_task(_tokens(4, 4, 64, seed=3), "llama3", "debugmodel",
                      train_batches=lambda n, seed: _tokens(n, 4, 64, seed=seed),
                      eval_batches=_tokens(2, 4, 64, seed=99, skip=3_000_000))

