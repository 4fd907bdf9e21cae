"""FSDP2 step time with a policy against the same FSDP2 run without one, at the same world size.

HF GPT-2 (4 layers, 256 wide), global batch 16x128 split over 2 ranks (gloo, one thread each on
a CPU; NCCL on GPUs when there are 2), ``fully_shard`` on each block and the root, AdamW
training steps. Every variant is a sharded model of its own on both ranks, timed round-robin in
one run with the tune's protocol (benchmarks/_common.py; both ranks draw the same order):

    FSDP2, no policy (fp32)            the anchor
    FSDP2, no policy (fp32), again     an A/A copy of the anchor: the noise of this machine
    FSDP2, torch.autocast(bf16)        the usual one-precision alternative
    FSDP2, POLICY                      applied before fully_shard (default: the main job's)

each ratio with its 95% interval, as rank 0 measured it (the ranks wait for each other in every
collective, so its step is the job's step).

    python benchmarks/bench_fsdp.py [--rounds 10] [--policy policies/gpt2_bytes.yaml]
"""

from __future__ import annotations

import argparse
import os

import _common  # noqa: F401  (sets up sys.path)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import ROOT, device_line, free_port, interleaved, print_table, ratio_cell

import autoprec
from examples.data import byte_batches
from examples.train_fsdp import local_batch, make_model, shard

WORLD = 2
ANCHOR = "FSDP2, no policy (fp32)"
AUTOCAST = "FSDP2, torch.autocast(bf16)"


def step_fn(model, batch, *, autocast: bool = False):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    device = batch["input_ids"].device.type

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    return step


def variants(policy_path: str, batch, device) -> dict:
    def sharded(policy=None):
        model = make_model("gpt2", 4, 256, 128).to(device).train()
        if policy is not None:
            autoprec.apply(model, policy)  # before sharding, as examples/train_fsdp.py does
        return shard(model)

    policy = autoprec.load_policy(policy_path)
    return {ANCHOR: step_fn(sharded(), batch),
            f"{ANCHOR}, again": step_fn(sharded(), batch),
            AUTOCAST: step_fn(sharded(), batch, autocast=True),
            f"FSDP2, {os.path.relpath(policy_path, ROOT)}": step_fn(sharded(policy), batch)}


def _worker(rank: int, port: int, rounds: int, policy_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.device_count() >= WORLD
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or WORLD) // WORLD))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=WORLD)
    batch = {k: v.to(device) for k, v in
             local_batch(byte_batches(1, 16, 128, seed=0)[0], rank, WORLD).items()}
    times = interleaved(variants(policy_path, batch, device), warmup=3, rounds=rounds,
                        device=device.type)
    if rank == 0:
        print(device_line() + f"; {WORLD} ranks, {'nccl' if cuda else 'gloo'}")
        pairs = [(name, ANCHOR) for name in times.active if name != ANCHOR]
        pairs.append((pairs[-1][0], AUTOCAST))  # the policy against one-precision bf16
        rows = [[f"{a} / {b}", ratio_cell(times.ratio(a, b)), f"{times.seconds(a) * 1e3:.1f} ms"]
                for a, b in pairs]
        print_table(rows, ["step-time ratio", "value [95% interval]", "step"])
        print(f"anchor step {times.seconds(ANCHOR) * 1e3:.1f} ms; {rounds} interleaved rounds, "
              "each keeps the faster of 2 steps per variant", flush=True)
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - teardown only: the figures are printed
        print(f"rank {rank}: teardown failed after the run: {e!r}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--policy", default=os.path.join(ROOT, "policies", "gpt2_bytes.yaml"))
    args = ap.parse_args()
    try:
        mp.spawn(_worker, args=(free_port(), args.rounds, os.path.abspath(args.policy)), nprocs=WORLD)
    except mp.ProcessExitedException as e:
        # gloo sometimes aborts a process at shutdown after its work is done
        print(f"note: a rank exited abnormally ({e}); the figures stand only if rank 0 "
              "printed its table above")


if __name__ == "__main__":
    main()
