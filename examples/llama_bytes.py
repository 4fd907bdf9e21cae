"""HF Llama (random init from a config) on the stdlib's source bytes: Llama-3-8B's layer shapes
(hidden 4096, SwiGLU 14336, 32 heads, 8 KV heads of 128) with as few layers as fit a small
machine, for tuning *for a GPU* and for the peer benchmark (benchmarks/bench_peers.py).

    autoprec tune examples/llama_bytes.py:gpu_task --target h100 -o policies/llama8b_shapes_h100.yaml

The vocabulary is the 256 byte values, not Llama-3's 128,256 tokens: its embedding and output
layer would be 525M parameters each, more than this example's transformer layers.
"""

from __future__ import annotations

import autoprec
from examples.data import byte_batches

__all__ = ["LLAMA3_8B", "make_model", "gpu_task"]

# Llama-3-8B's layer shapes (Meta's params.json: dim 4096, n_heads 32, n_kv_heads 8,
# ffn_dim 14336, rope_theta 500000, norm_eps 1e-5)
LLAMA3_8B = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8)


def make_model(n_layer: int = 2, hidden: int = 4096, intermediate: int = 14336, heads: int = 32,
               kv_heads: int = 8, seq_len: int = 4096):
    """LlamaForCausalLM with a byte vocabulary; eager attention so its matmuls are visible to
    the FP8 router."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=n_layer, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         attn_implementation="eager", use_cache=False)
    return LlamaForCausalLM(config)


def gpu_task(n_layer: int = 4, batch_size: int = 8, seq_len: int = 4096, calib_len: int = 64,
             calib_batches: int = 4, **shape) -> autoprec.Task:
    """Numerics measured here on ``calib_batches`` batches of 2 x ``calib_len`` tokens; layers
    priced at the production batch (``batch_size`` x ``seq_len``). ``shape`` overrides
    LLAMA3_8B's widths."""
    widths = {**LLAMA3_8B, **shape}
    name = "llama-{n}x{hidden}-bytes-gpu".format(n=n_layer, **widths)
    return autoprec.Task(
        model=lambda: make_model(n_layer, seq_len=seq_len, **widths),
        batches=byte_batches(calib_batches, 2, calib_len, seed=1),
        shape_batch=byte_batches(1, batch_size, seq_len, seed=2)[0],
        name=name,
        train_batches=lambda n, seed: byte_batches(n, 2, calib_len, seed=seed),
        eval_batches=byte_batches(2, 2, calib_len, seed=10_000, skip=3_000_000),
    )
