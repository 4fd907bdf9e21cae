"""DDP: two processes on gloo train GPT-2 (autoprec's FP8) and Llama (torchao's Float8Linear
for its fp8 nn.Linear layers) with a policy applied, and agree on gradients."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autoprec
from autoprec import Policy

POLICIES = {
    "gpt2": Policy(default="bf16", layers={"transformer.h.*.mlp.*": "fp8", "lm_head": "fp32"}),
    "llama": Policy(default="bf16", layers={"model.layers.*.mlp.*": "fp8:rowwise",
                                            "model.layers.*.self_attn.*": "fp8",
                                            "lm_head": "fp32"}),
}
STEPS = 5


def _shards():
    from examples.data import byte_batches

    batches = byte_batches(STEPS, 8, 32, seed=11)
    # rank r takes rows r*4:(r+1)*4 of every batch
    return [[{k: v[r * 4:(r + 1) * 4] for k, v in b.items()} for b in batches] for r in (0, 1)]


def _model(which: str):
    from conftest import tiny_gpt2, tiny_llama

    warnings.filterwarnings("ignore", message=".*can only emulate.*")
    model = (tiny_gpt2() if which == "gpt2" else tiny_llama()).train()
    autoprec.apply(model, POLICIES[which])
    return model


def _worker(rank, world, port, out_dir, which):
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = torch.nn.parallel.DistributedDataParallel(_model(which))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        first = None
        for batch in _shards()[rank]:
            loss = model(**batch).loss
            loss.backward()
            flat = torch.cat([p.grad.flatten() for p in model.parameters()])
            first = flat.clone() if first is None else first
            gathered = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            grads.append((gathered[0] - gathered[1]).abs().max().item())
            opt.step()
            opt.zero_grad()
        torch.save({"params": {n: p.detach() for n, p in model.module.named_parameters()},
                    "max_grad_diff": torch.tensor(grads), "first_grad": first}, os.path.join(out_dir, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_ddp_two_processes_agree_on_gradients(tmp_path, which):
    if which == "llama":
        pytest.importorskip("torchao", reason="the torchao extra: pip install -e '.[torchao]'")
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), which), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "r0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "r1.pt", weights_only=True)
    # after all-reduce both ranks hold the same gradients, step after step
    assert r0["max_grad_diff"].max() == 0, r0["max_grad_diff"]
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name

    # and those gradients are the average of each shard's gradient under the policy,
    # computed here in one process
    model = _model(which)
    if which == "llama":
        assert type(model.model.layers[0].mlp.up_proj).__name__ == "Float8Linear"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shards = _shards()
    for step in range(STEPS):
        grads = []
        for rank in (0, 1):
            model.zero_grad()
            model(**shards[rank][step]).loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        if step == 0:
            ref = torch.cat([p.grad.flatten() for p in model.parameters()])
            rel = ((ref - r0["first_grad"]).norm() / ref.norm()).item()
            assert rel < 1e-5, f"DDP gradient differs from the shard average by {rel:.2e}"
        opt.step()
    # SGD, not Adam: Adam turns summation-order noise in ~zero gradients (key biases) into ±lr
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), r0["params"][name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
