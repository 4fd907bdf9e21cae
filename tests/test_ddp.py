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
        _quiesce(model)
    finally:
        dist.destroy_process_group()


def _quiesce(ddp) -> None:
    """Before the process group goes: drop DDP's reducer while the group lives, then a barrier
    (it waits without the GIL, so gloo's worker threads finish freeing earlier collectives,
    which takes the GIL). Without it, one CI run hung at exit: ~ProcessGroupGloo, run with the
    GIL held when the reducer was freed, joined a gloo thread waiting for the GIL to free an
    all-gather's tensors."""
    ddp.reducer = None
    dist.barrier()


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


def _guard_worker(rank, world, port, out_dir):
    """Rank 1 alone plants an fp16 overflow before step 3: the ranks agree on the demotion."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import tiny_gpt2

    from autoprec.integrations import training_kit
    from autoprec.runtime.guard import GuardConfig
    from examples.data import byte_batches
    from examples.train_plain import PLANT_LAYER, plant_overflow

    warnings.filterwarnings("ignore", message=".*can only emulate.*")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        policy = Policy(default="bf16", layers={PLANT_LAYER: "fp16", "lm_head": "fp32"},
                        loss_scaling={"init_scale": 1024.0, "growth_interval": 1000})
        model, scaler, guard = training_kit(
            tiny_gpt2(n_layer=3).train(), policy,
            guard=GuardConfig(patience=2, save_to=os.path.join(out_dir, "save_to.yaml")))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        batches = byte_batches(GUARD_STEPS, 4, 32, seed=20 + rank)
        for step, batch in enumerate(batches, 1):
            if step == 3 and rank == 1:
                plant_overflow(model)  # after DDP's broadcast: rank 0's weights stay sane
            scaler.scale(ddp(**batch).loss).backward()
            scaler.step(opt)  # all-reduced gradients are non-finite on both: both skip
            scaler.update()
            opt.zero_grad(set_to_none=True)
            guard.step()
        guard.save(os.path.join(out_dir, f"amended{rank}.yaml"))
        torch.save({"events": [(e.step, e.fqn, e.old.value, e.new.value, e.reason)
                               for e in guard.events],
                    "formats": {k: v.value for k, v in autoprec.applied_formats(model).items()}},
                   os.path.join(out_dir, f"guard{rank}.pt"))
        _quiesce(ddp)
    finally:
        dist.destroy_process_group()


GUARD_STEPS = 6


@pytest.mark.slow
def test_ddp_ranks_demote_the_same_layer_at_the_same_step(tmp_path):
    from examples.train_plain import PLANT_LAYER

    mp.spawn(_guard_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"guard{r}.pt", weights_only=True) for r in (0, 1))
    # rank 0 never saw the overflow itself (the reason says who did), yet demoted with rank 1
    assert [e[:4] for e in r0["events"]] == [(4, PLANT_LAYER, "fp16", "fp32")], r0["events"]
    assert "(seen on rank 1 of 2)" in r0["events"][0][4]
    assert r0["events"] == r1["events"] and r0["formats"] == r1["formats"]
    assert r0["formats"][PLANT_LAYER] == "fp32"
    amended = (tmp_path / "amended0.yaml").read_text()
    assert amended == (tmp_path / "amended1.yaml").read_text()
    assert amended == (tmp_path / "save_to.yaml").read_text()  # written by rank 0 alone
    assert autoprec.load_policy(tmp_path / "save_to.yaml").layers[PLANT_LAYER] is autoprec.Format.FP32
