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


def wide_gpt2_task() -> autoprec.Task:
    """tiny_gpt2_task with the width changed (64 -> 128) under the same task name: an edited
    model."""
    task = tiny_gpt2_task()
    task.model = lambda: make_model(n_layer=2, n_embd=128, n_head=2, seq_len=32)
    return task


def tuple_batches_task() -> autoprec.Task:
    """The most common PyTorch loop: (inputs, labels) batches and a loss_fn that calls
    model(inputs) itself."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    batches = [(torch.randn(16, 32), torch.randint(0, 8, (16,))) for _ in range(3)]

    def loss_fn(m, batch):
        inputs, labels = batch
        return torch.nn.functional.cross_entropy(m(inputs), labels)

    return autoprec.Task(model=model, batches=batches, loss_fn=loss_fn, name="tuples",
                         device="cpu")


def no_layer_task() -> autoprec.Task:
    """A model with nothing to tune: no linear, conv, attention or matmul."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.ReLU())
    return autoprec.Task(model=model, batches=[torch.randn(4, 8)] * 3,
                         loss_fn=lambda m, b: m(b).square().mean(), name="no-layer",
                         device="cpu")


NOT_A_FUNCTION = 42


def tiny_llama_task() -> autoprec.Task:
    """2-layer, 64-wide HF Llama (SwiGLU 192, GQA 4/2 heads) on stdlib bytes, batch 8x64: a
    small LM whose every Linear a format can take (certificates of formats)."""
    from examples.llama_bytes import make_model as llama

    return autoprec.Task(
        model=lambda: llama(n_layer=2, hidden=64, intermediate=192, heads=4, kv_heads=2,
                            seq_len=64),
        batches=byte_batches(4, 8, 64, seed=1), name="tiny-llama", device="cpu",
        train_batches=lambda n, seed: byte_batches(n, 8, 64, seed=seed),
        eval_batches=byte_batches(4, 8, 64, seed=10_000, skip=3_000_000))


def tiny_llama_priced_task() -> autoprec.Task:
    """:func:`tiny_llama_task` priced at a production batch (16x2048 tokens): the cost model
    of a GPU finds bf16 faster than fp32 on its layers, so a priced tune has choices."""
    task = tiny_llama_task()
    task.shape_batch = byte_batches(1, 16, 2048, seed=2)[0]
    task.name = "tiny-llama-priced"
    return task
