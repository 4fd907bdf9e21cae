"""Small tasks for CLI and search tests (loaded as `tests/tasks.py:NAME`)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import autoprec  # noqa: E402
from examples.data import byte_batches  # noqa: E402
from examples.gpt2_bytes import make_model  # noqa: E402


def tiny_gpt2_task() -> autoprec.Task:
    """2-layer, 64-wide GPT-2 on stdlib bytes, batch 4x32: seconds per trial."""
    return autoprec.Task(model=lambda: make_model(n_layer=2, n_embd=64, n_head=2, seq_len=32),
                         batches=byte_batches(4, 4, 32, seed=5), name="tiny-gpt2",
                         device="cpu",
                         train_batches=lambda n, seed: byte_batches(n, 4, 32, seed=seed),
                         eval_batches=byte_batches(2, 4, 32, seed=99, skip=3_000_000))


def overflow_gpt2_task() -> autoprec.Task:
    """tiny GPT-2 with one layer planted to overflow FP16 (its weights x1e7; FP32 is fine:
    ln_f rescales what follows), like T5's `wo` in transformers#5651."""

    def model():
        m = make_model(n_layer=2, n_embd=64, n_head=2, seq_len=32)
        with torch.no_grad():
            m.transformer.h[1].mlp.c_proj.weight.mul_(1e7)
        return m

    task = tiny_gpt2_task()
    task.model = model
    task.name = "overflow-gpt2"
    return task


def small_gpt2_task() -> autoprec.Task:
    """2-layer, 256-wide GPT-2, batch 4x64: layers large enough that the cost model of a
    device with fast bf16 (``target="cpu-amx"``) prefers bf16 on some of them."""
    return autoprec.Task(model=lambda: make_model(n_layer=2, n_embd=256, n_head=4, seq_len=64),
                         batches=byte_batches(4, 4, 64, seed=6), name="small-gpt2",
                         device="cpu",
                         train_batches=lambda n, seed: byte_batches(n, 4, 64, seed=seed),
                         eval_batches=byte_batches(2, 4, 64, seed=98, skip=3_000_000))
