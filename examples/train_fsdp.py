"""Train HF GPT-2 or Llama (byte-level, stdlib source) with a policy under FSDP2 (``fully_shard``
on each transformer block and the root), one process per device, launched by torchrun.

    torchrun --nproc_per_node 2 examples/train_fsdp.py --steps 20
    torchrun --nproc_per_node 2 examples/train_fsdp.py --model llama --fp8 "model.layers.*.mlp.*"

Several nodes: the same command on each, with ``--nnodes N --node_rank I --rdzv_backend c10d
--rdzv_endpoint HOST:PORT`` (HOST: node 0's address). CUDA devices use NCCL, CPUs gloo.

The policy is applied *before* ``fully_shard``: torchao's ``Float8Linear`` (the fp8
``nn.Linear`` layers on the default engine) must be swapped in while the weights are plain
tensors; applied after sharding, those layers run on autoprec's own FP8 engine instead (the
same numbers). By default ``fully_shard`` gets no ``MixedPrecisionPolicy``: parameters stay
FP32 master weights, gathered in FP32, and the policy's regions decide each layer's compute
format. ``--param-dtype bf16`` gathers in BF16 the weights of the layers the policy runs in
bf16 or fp8, everything else in FP32 (see :func:`shard`): an fp32 layer cannot compute in FP32
from BF16-gathered weights, so a uniform ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``
fails on the first one (and, on a CPU, on GPT-2's first LayerNorm). Each rank trains on its
slice of the global batch; FSDP2 averages the gradients, so the run trains as one process on
the whole batch would.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import autoprec  # noqa: E402
from examples.data import byte_batches  # noqa: E402
from examples.gpt2_bytes import training_arg_parser  # noqa: E402

DEFAULT_POLICY = os.path.join(ROOT, "policies", "gpt2_bytes.bf16_fp32_head.yaml")


def make_model(kind: str, layers: int, width: int, seq_len: int) -> torch.nn.Module:
    """GPT-2 or Llama at ``layers`` x ``width``, the same weights on every rank (seeded)."""
    torch.manual_seed(0)
    if kind == "llama":
        from examples.llama_bytes import make_model as llama

        return llama(layers, width, 4 * width, max(1, width // 64), max(1, width // 128),
                     seq_len=seq_len)
    from examples.gpt2_bytes import make_model as gpt2

    return gpt2(n_layer=layers, n_embd=width, n_head=max(1, width // 64), seq_len=seq_len)


def shard(model: torch.nn.Module, policy: autoprec.Policy | None = None, *,
          param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP2 as torchtitan does it: each transformer block is a unit, then the root.

    ``param_dtype=torch.bfloat16`` (with the ``policy`` applied to ``model``): in each block,
    the linear and conv layers the policy runs in bf16 or fp8 form one more unit, inside the
    block's, whose weights are all-gathered in BF16: the BF16 weights autocast would have made
    from the FP32 ones (bf16 layers then train bit for bit as with FP32 gathering). The rest
    stays FP32: fp32 and fp16 layers (an fp32 layer cannot compute in FP32 from BF16 weights,
    an fp16 one would get weights rounded to BF16), norms (which compute in FP32, some with
    FP32 weights only) and the root (embeddings, often a tied or fp32 head). Gradients are
    reduced in FP32 and inputs are not cast: the policy's regions decide. Not with a runtime
    guard: a layer it demotes to fp32 would then get BF16 weights.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mixed = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                 cast_forward_inputs=False)
    prefix = "model.layers" if hasattr(model, "model") else "transformer.h"
    for i, block in enumerate(model.get_submodule(prefix)):
        low = low_precision_layers(block, f"{prefix}.{i}", policy, param_dtype)
        if low:
            fully_shard(low, mp_policy=mixed)
        fully_shard(block)
    fully_shard(model)
    return model


def low_precision_layers(block: torch.nn.Module, fqn: str, policy: autoprec.Policy | None,
                         param_dtype: torch.dtype | None) -> list[torch.nn.Module]:
    """The layers of ``block`` (named ``fqn``) whose weights may be gathered in
    ``param_dtype``: linear and conv layers the policy runs in a format that rounds their
    weights to it anyway (bf16 and fp8 for BF16)."""
    from autoprec.formats import FP8_FORMATS, Format
    from autoprec.runtime.calls import class_kind

    if param_dtype is None:
        return []
    if param_dtype != torch.bfloat16 or policy is None:
        raise ValueError(f"shard(param_dtype={param_dtype}) takes torch.bfloat16 and the policy "
                         "applied to the model: another dtype would round bf16 layers' weights.")
    rounded = {Format.BF16, *FP8_FORMATS}
    return [m for name, m in block.named_modules() if class_kind(m) in ("linear", "conv")
            and policy.format_for(f"{fqn}.{name}") in rounded]


def local_batch(batch: dict, rank: int, world: int) -> dict:
    """This rank's rows of a global batch (its batch size must divide by ``world``)."""
    n = next(iter(batch.values())).shape[0] // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def setup() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes; returns (rank, world size, device)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def main(argv=None) -> None:
    ap = training_arg_parser(__doc__, steps=20, policy=DEFAULT_POLICY)
    ap.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--fp8", default=None, metavar="PATTERN",
                    help="also put the modules PATTERN matches in fp8 (a policy layer glob)")
    ap.add_argument("--engine", choices=["auto", "torchao", "autoprec"], default=None,
                    help="who runs fp8 nn.Linear layers (default: the policy's)")
    ap.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="dtype FSDP2 gathers weights in: bf16 for the layers the policy runs\n"
                         "in bf16 or fp8, fp32 for everything else")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("train_fsdp.py: error: run it under torchrun, e.g. "
                 "torchrun --nproc_per_node 2 examples/train_fsdp.py")
    rank, world, device = setup()
    if args.batch_size % world:
        sys.exit(f"train_fsdp.py: error: --batch-size {args.batch_size} does not divide by "
                 f"the {world} ranks; use a multiple of {world}.")
    warnings.filterwarnings("ignore", message=".*can only emulate.*")  # FP8 on a CPU: once here
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    model = make_model(args.model, args.layers, args.width, args.seq_len).to(device).train()
    try:
        policy = autoprec.load_policy(args.policy)
        if args.fp8:
            policy = policy.with_layers({args.fp8: "fp8"})
        autoprec.apply(model, policy, engine=args.engine)  # before sharding
    except (autoprec.PolicyError, RuntimeError) as e:
        if rank == 0:  # one line, not one per rank
            print(f"train_fsdp.py: error: {e}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        sys.exit(2)
    shard(model, policy, param_dtype=torch.bfloat16 if args.param_dtype == "bf16" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = byte_batches(8, args.batch_size, args.seq_len, seed=0)
    if rank == 0:
        print(f"{args.model} {args.layers}x{args.width} on {world} ranks ({device.type}), "
              f"policy {args.policy}{' + fp8 ' + args.fp8 if args.fp8 else ''}, weights "
              f"gathered in {args.param_dtype}", flush=True)
    try:
        for step in range(args.steps):
            batch = {k: v.to(device) for k, v in local_batch(batches[step % 8], rank, world).items()}
            t0 = time.perf_counter()
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # the global batch's loss, for the log
            if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {mean.item() / world:.4f}  "
                      f"{(time.perf_counter() - t0) * 1e3:7.1f} ms", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
