"""Tune a model too big for one process on the sharding it trains with (issue 38, item 5).

Every rank of a ``torchrun`` builds an HF causal LM from its config on the meta device; FSDP2
shards it as torchtitan does (the embedding, each block, the head, then the root); each rank
gets memory for its own shards only and fills them from a safetensors checkpoint (DCP's
``HuggingFaceStorageReader`` reads each rank's slices of each tensor, never a whole one, and
unpickles nothing) or from HF's random initialisation. Then every rank calls
``autoprec.tune(task, model=...)`` on the same byte batches, and rank 0 writes the policy::

    torchrun --nproc-per-node 2 examples/tune_sharded.py --preset llama3-8b --layers 2 \\
        --target h100 -o policies/llama3_8b_2layers.yaml            # random init
    torchrun --nproc-per-node 8 examples/tune_sharded.py --model-dir /ckpt/Meta-Llama-3-8B \\
        --target h100 -o policies/llama3_8b.yaml                    # config.json + *.safetensors
    torchrun --nproc-per-node 8 examples/tune_sharded.py --torchtitan 8B --layers 2 \\
        --target h100 --formats fp32 bf16 fp8 -o policies/titan_8b_2layers.yaml

``--torchtitan FLAVOR`` builds torchtitan's Llama 3 of that flavor as its trainer does, sharded
by torchtitan's own FSDP2 units in FP32 (:func:`autoprec.torchtitan.build_model` with
``shard=True``) and initialised by its ``init_weights``, so the policy's names and fingerprint
are the trainer's model's (no fp16: torchtitan's trainer scales no loss).

CUDA devices use NCCL, CPUs gloo. Trials are priced for ``--target`` (a sharded tune does not
time steps); numerics are measured in FP32 on the ranks' devices. The byte tokens (0..255) are
valid ids of any vocabulary.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import autoprec  # noqa: E402
from autoprec._util import shown  # noqa: E402
from examples.data import byte_batches  # noqa: E402
from examples.train_fsdp import setup  # noqa: E402

__all__ = ["PRESETS", "config_of", "build_sharded"]

# Meta's params.json of Llama-3-8B (dim 4096, 32 layers, n_heads 32, n_kv_heads 8, ffn 14336,
# rope_theta 500000, norm_eps 1e-5, vocabulary 128,256) as an HF LlamaConfig
PRESETS = {"llama3-8b": dict(vocab_size=128_256, hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
                             max_position_embeddings=8192, tie_word_embeddings=False)}


def config_of(model_dir: str | None = None, preset: str | None = None,
              layers: int | None = None):
    """The model's HF config: ``model_dir``'s config.json (read locally, no remote code), or a
    preset; ``layers`` keeps only the first that many blocks."""
    from transformers import AutoConfig, LlamaConfig

    if model_dir is not None:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True,
                                            trust_remote_code=False)
    else:
        config = LlamaConfig(**PRESETS[preset])
    if layers is not None:
        config.num_hidden_layers = layers
    # eager attention: its matmuls are layers the policy can set; no KV cache in training
    config._attn_implementation = "eager"
    config.use_cache = False
    return config


def build_sharded(config, checkpoint: str | None = None, device: str | torch.device = "cpu",
                  seed: int = 0) -> torch.nn.Module:
    """The causal LM of ``config`` sharded by FSDP2 over the default process group, no rank
    ever holding it whole: built on the meta device, sharded, given memory shard by shard,
    then filled from ``checkpoint`` (a directory of safetensors files with the model's HF
    names) or initialised by HF's ``init_weights`` (the same weights on every rank: seeded)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    inner = model.base_model
    fully_shard(inner.embed_tokens)
    for block in inner.layers:
        fully_shard(block)
    if not config.tie_word_embeddings:
        fully_shard(model.get_output_embeddings())
    fully_shard(model)
    model.to_empty(device=device)
    if checkpoint is not None:
        state = model.state_dict()
        dcp_load(state, storage_reader=HuggingFaceStorageReader(checkpoint))
    else:
        torch.manual_seed(seed)
        model.init_weights()
    if config.tie_word_embeddings:
        model.tie_weights()
    # buffers computed at construction (rotary frequencies) were meta: compute them again
    for name, module in model.named_modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, type(module)(config=config).to(device))
    return model.train()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--model-dir", help="a directory with config.json and *.safetensors")
    where.add_argument("--preset", choices=sorted(PRESETS), help="a config, random weights")
    where.add_argument("--torchtitan", metavar="FLAVOR",
                       help="torchtitan's Llama 3 of this flavor (debugmodel, 8B, ...), random "
                            "weights")
    ap.add_argument("--layers", type=int, help="keep only the first LAYERS blocks")
    ap.add_argument("--random-init", action="store_true",
                    help="with --model-dir: its config, random weights")
    ap.add_argument("--target", default="h100", help="the GPU trials are priced for")
    ap.add_argument("--formats", nargs="+", default=["fp32", "bf16", "fp8"])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--batches", type=int, default=4, help="calibration batches (2 held out)")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("-o", "--output", required=True, help="the policy file (rank 0 writes)")
    args = ap.parse_args(argv)
    if args.model_dir is not None:
        files = os.listdir(args.model_dir) if os.path.isdir(args.model_dir) else []
        if "config.json" not in files:
            ap.error(f"--model-dir {shown(args.model_dir)} holds no config.json: give the "
                     "directory of an HF model (config.json and *.safetensors).")
        if not args.random_init and not any(f.endswith(".safetensors") for f in files):
            ap.error(f"--model-dir {shown(args.model_dir)} holds no *.safetensors weights: give "
                     "them, or pass --random-init for the config with random weights.")
    _, _, device = setup()  # the process group torchrun describes (NCCL or gloo)
    rank = dist.get_rank()
    if args.torchtitan is not None:
        from autoprec.torchtitan import build_model
        from autoprec.torchtitan import task as titan_task

        model = build_model("llama3", args.torchtitan, n_layers=args.layers, device=device,
                            shard=True)
        tokens = [b["input_ids"] for b in byte_batches(args.batches, args.batch_size,
                                                       args.seq_len, seed=1)]
        task = titan_task(tokens, "llama3", args.torchtitan, n_layers=args.layers, device=device)
    else:
        config = config_of(args.model_dir, args.preset, args.layers)
        checkpoint = None if args.random_init or args.model_dir is None else args.model_dir
        model = build_sharded(config, checkpoint, device)
        # the task's name is printed and written into the policy: the directory's name, with
        # anything but letters, digits, '.', '_' and '-' made '_'
        name = re.sub(r"[^\w.-]", "_", os.path.basename(os.path.normpath(args.model_dir
                                                                          or args.preset)))
        task = autoprec.Task(model=model, name=name, device=device,
                             batches=byte_batches(args.batches, args.batch_size, args.seq_len,
                                                  seed=1))
    result = autoprec.tune(task, target=args.target, formats=tuple(args.formats),
                           n_trials=args.trials, output=args.output, model=model,
                           progress=rank == 0)
    if rank == 0:
        print(result.summary())
        written = result.save(args.output)
        print("wrote " + ", ".join(map(shown, written)))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
