"""Phases under FSDP2 on 2 gloo ranks: a policy applied before ``fully_shard`` switches its fp8
MLPs to bf16 mid-run on autoprec's FP8 engine and on torchao's sharded Float8Linear (each layer
computes in its phase's format, on every rank); a phase that would start a Linear on torchao
after sharding is refused in one line at start-up, and ``engine: auto`` runs it on autoprec's
engine instead."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist

import autoprec
from autoprec import Policy, PolicyError
from autoprec.runtime.switcher import PhaseSwitcher

STEPS, SWITCH = 3, 2
MLP = "model.layers.0.mlp.down_proj"
DOWN = Policy(default="fp32", layers={"model.layers.*.mlp.*": "fp8", "lm_head": "fp32"},
              phases=[{"from_step": SWITCH, "formats": {"fp8": "bf16"}}])
UP = Policy(default="fp32", layers={"model.layers.*.mlp.*": "bf16", "lm_head": "fp32"},
            phases=[{"from_step": SWITCH, "formats": {"bf16": "fp8"}}])


def _observe(model, batch) -> tuple[list[str], int, torch.Tensor]:
    from conftest import ComputeProbe

    with ComputeProbe(model) as probe:
        loss = model(**batch).loss
    return sorted(str(d) for d in probe.matmul_dtypes(MLP)), probe.fp8_casts.get(MLP, 0), loss


def _phased_run(policy: Policy, engine: str, rank: int) -> dict:
    from test_fsdp import _batches, _half, _model, _shard

    model = _model("llama")
    policy = dataclasses.replace(policy, engine=engine)
    autoprec.apply(model, policy)
    _shard(model)
    phases = PhaseSwitcher(model, policy, total_steps=STEPS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen, losses = [], []
    for step, batch in enumerate(_batches(STEPS)):
        phases.at(step)
        dtypes, casts, loss = _observe(model, _half(batch, rank))
        seen.append((dtypes, casts))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    classes = sorted({type(m).__name__ for m in model.modules()})
    return {"seen": seen, "losses": losses, "classes": classes,
            "formats": {k: str(v) for k, v in autoprec.applied_formats(model).items()}}


def _refusal(rank: int) -> str:
    from test_fsdp import _model, _shard

    model = _model("llama")
    policy = dataclasses.replace(UP, engine="torchao")
    autoprec.apply(model, policy)
    _shard(model)
    try:
        PhaseSwitcher(model, policy, total_steps=STEPS)
    except PolicyError as e:
        return str(e)
    return ""


def _worker(rank: int, world: int, port: int, out_dir: str, cases: list) -> None:
    from test_fsdp import _init, _save_results, _teardown

    _init(rank, world, port)
    warnings.filterwarnings("ignore")
    results = {f"{name}/{engine}": _phased_run(DOWN if name == "down" else UP, engine, rank)
               for name, engine in cases}
    results["refusal"] = _refusal(rank)
    dist.barrier()
    _save_results(results, out_dir, rank)
    _teardown(rank)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from test_fsdp import run_ranks

    cases = [("down", "autoprec"), ("down", "torchao"), ("up", "auto")]
    return run_ranks(tmp_path_factory.mktemp("phases-fsdp"), cases, worker=_worker)


@pytest.mark.parametrize("engine", ["autoprec", "torchao"])
def test_fp8_layers_switch_to_bf16_after_sharding_on_both_engines(runs, engine):
    for rank, r in enumerate(runs):
        got = r[f"down/{engine}"]
        before, after = got["seen"][:SWITCH], got["seen"][SWITCH:]
        assert all(casts >= 2 for _, casts in before), (rank, before)
        assert all(d == ["torch.bfloat16"] and casts == 0 for d, casts in after), (rank, after)
        assert got["formats"][MLP] == "bf16"
        assert all(map(lambda x: x == x, got["losses"])), got["losses"]
    if engine == "torchao":  # the sharded Float8Linear stays; it runs as nn.Linear in bf16
        assert any("Float8Linear" in c for c in runs[0]["down/torchao"]["classes"])
    assert runs[0][f"down/{engine}"]["losses"] != runs[1][f"down/{engine}"]["losses"]  # halves


def test_starting_fp8_on_torchao_after_sharding_is_refused_and_auto_runs_it_on_autoprec(runs):
    for r in runs:
        assert "Phase 1 (from step 2) puts `model.layers.0.mlp.gate_proj` in fp8" in \
            r["refusal"], r["refusal"]
        assert "cannot start after sharding" in r["refusal"] and "\n" not in r["refusal"]
        up = r["up/auto"]
        assert all(d == ["torch.bfloat16"] for d, _ in up["seen"][:SWITCH]), up["seen"]
        assert all(casts >= 2 for _, casts in up["seen"][SWITCH:]), up["seen"]
        assert not any("Float8Linear" in c for c in up["classes"])
