"""A whole tune of a model FSDP2 shards (issue 38, item 4): two gloo ranks shard HF Llama
(each block and the root) and call ``autoprec.tune`` alike. Rank 0 runs the study; every
trial's numerics are FSDP2 passes both ranks run. The trials, their numbers and the policy
must be those of one process tuning the unsharded model, and every rank returns them."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import byte_batches, tiny_llama
from test_fsdp import _free_port, _init, _save_results, _teardown, run_ranks
from test_sensitivity_fsdp import _shard

# a CPU with fast bf16 prices bf16 faster than fp32 on layers 256 wide (tests/tasks.py)
OPTIONS = dict(target="cpu-amx", formats=("fp32", "bf16", "fp16"), n_trials=6, seed=3,
               sensitivity="fast", progress=False, max_grad_error=0.004)

# FP32 norms of a tensor and of its two halves agree to about this (relative)
NORMS = 1e-3


def _llama():
    return tiny_llama(hidden=256, intermediate=512)


def _task():
    import autoprec

    return autoprec.Task(model=_llama, batches=byte_batches(4, 4, 64, seed=5))


def _summary(result) -> dict:
    return {"trials": [(t.number, t.assignment, t.loss_increase, t.step_seconds, t.feasible,
                        t.origin) for t in result.trials],
            # summed over the ranks' parts: to the rounding of FP32 norms (NORMS)
            "grad_error": [t.grad_error for t in result.trials],
            "bias": [t.grad_bias for t in result.trials],
            "winner": result.best.assignment,
            "policy": _policy(result.policy),
            "policy_norms": {k: result.policy.to_dict()["tuned"].get(k) for k in POLICY_NORMS},
            "memory": result.policy.to_dict()["tuned"].get("memory"),
            "profile": [(row.layer.fqn, {f: s.loss_rel_change for f, s in row.sensitivity.items()})
                        for row in result.profile.layers],
            "studies": sorted(f for f in os.listdir(os.path.dirname(result.storage.split(":///")[-1]))
                              if f.endswith(".db"))}


# the policy file's figures summed from norms over the ranks' parts: the same to NORMS
POLICY_NORMS = ("grad_error", "grad_bias")


def _policy(policy) -> dict:
    """The policy file's content but the peak memory one process predicts (not predicted for
    a sharded model) and POLICY_NORMS (written to 4 digits, which a norm's rounding over the
    ranks' parts can tip: 0.00211 against 0.002111 on an Intel Xeon), compared apart."""
    d = policy.to_dict()
    d["tuned"] = {k: v for k, v in d["tuned"].items()
                  if k != "memory" and k not in POLICY_NORMS}
    return d


def _numerics() -> dict:
    """A trial's comparison (``DeviationMeter.compare(bias=True)``), one process and sharded: bf16
    and fp16 (loss-scaled, its bias read after the backward is known finite), the held-out
    reference gradients kept, computed again per batch, or kept outside memory (spilled)."""
    from autoprec.formats import Format
    from autoprec.measure.deviation import DeviationMeter, prepare_for_measurement
    from autoprec.policy import Policy
    from autoprec.task import default_loss

    out = {}
    for fmt in (Format.BF16, Format.FP16):
        for mode in ("kept", "recomputed", "spilled"):
            for sharded in (False, True):
                model = prepare_for_measurement(tiny_llama())
                model = _shard(model, "llama") if sharded else model
                num = DeviationMeter(model, byte_batches(2, 4, 32, seed=7), default_loss, seed=0,
                                     per_batch=mode == "recomputed", spill=mode == "spilled")
                d = num.compare(Policy(default=fmt), bias=True)
                out[fmt.value, mode, sharded] = (d.loss_rel_change, d.grad_rel_error,
                                                 d.finite, d.grad_bias, d.bias_sq)
    return out


def _worker(rank: int, world: int, port: int, out_dir: str, cases: list) -> None:
    _init(rank, world, port)
    from autoprec import tune

    here = os.path.join(out_dir, f"rank{rank}")
    os.makedirs(os.path.join(here, "alone"))
    os.makedirs(os.path.join(here, "sharded"))
    out = {"alone": _summary(tune(_task(), output=os.path.join(here, "alone", "p.yaml"),
                                  **OPTIONS))}
    model = _shard(_llama(), "llama")
    out["sharded"] = _summary(tune(_task(), output=os.path.join(here, "sharded", "p.yaml"),
                                   model=model, **OPTIONS))
    out["numerics"] = _numerics()
    out["written"] = sorted(os.listdir(os.path.join(here, "sharded")))
    out["refused"] = {}
    for how in ({"target": None}, {"max_memory": 10**9}):
        try:
            tune(_task(), model=model, **{**OPTIONS, **how})
        except ValueError as e:
            out["refused"][next(iter(how))] = str(e)
    # rank 0 fails alone (it alone opens the study): the other rank stops in one line too,
    # instead of waiting in a collective rank 0 never runs
    try:
        tune(_task(), model=model, storage="nosuchdb://x", **OPTIONS)
    except (ValueError, RuntimeError) as e:
        out["stopped"] = f"{type(e).__name__}: {e}"
    _save_results(out, out_dir, rank)
    _teardown(rank)


def _same_tune(sharded: dict, alone: dict, rank: int) -> None:
    for key in ("trials", "winner", "policy", "profile"):
        assert sharded[key] == alone[key], (rank, key)
    # each rank sums only its part of the differences and of the bias (the norms summed over
    # the ranks): the same to the rounding of FP32 norms (a whole large tensor's and its
    # halves' round differently: 1e-7 to 2e-4 relative measured)
    assert sharded["bias"] == pytest.approx(alone["bias"], rel=NORMS)
    assert sharded["grad_error"] == pytest.approx(alone["grad_error"], rel=NORMS)
    for k, one in alone["policy_norms"].items():
        assert (sharded["policy_norms"][k] is None) == (one is None), (rank, k)
        assert one is None or sharded["policy_norms"][k] == pytest.approx(one, rel=NORMS), k


@pytest.mark.slow
def test_a_sharded_models_tune_is_the_one_process_tune_on_every_rank(tmp_path):
    ranks = run_ranks(tmp_path, [], timeout=600.0, worker=_worker)
    for rank, got in enumerate(ranks):
        alone, sharded = got["alone"], got["sharded"]
        # not vacuous: several distinct trials, some feasible and some not under the budget
        assert len({str(t[1]) for t in alone["trials"]}) >= 4
        assert {t[4] for t in alone["trials"]} == {True, False}, alone["trials"]
        _same_tune(sharded, alone, rank)
        numerics = got["numerics"]
        for (fmt, mode, is_sharded), (loss, grad, *same, bias, bias_sq) in numerics.items():
            if is_sharded:
                one_loss, one_grad, *one, one_bias, one_sq = numerics[fmt, mode, False]
                assert (loss, same) == (one_loss, one), (fmt, mode)
                assert 0 < grad == pytest.approx(one_grad, rel=NORMS), (fmt, mode)
                assert 0 < bias == pytest.approx(one_bias, rel=NORMS), (fmt, mode)
                assert bias_sq == pytest.approx(one_sq, rel=NORMS), (fmt, mode)
            # the spilled reference's parts, read back, are the kept ones: the same numbers
            if mode == "spilled":
                assert numerics[fmt, mode, is_sharded] == numerics[fmt, "kept", is_sharded]
        assert set(alone["winner"].values()) != {"fp32"}, alone["trials"]
        assert alone["memory"] and sharded["memory"] is None
        assert got["refused"]["target"].startswith("tune(model=...) of a model FSDP2 shards "
                                                   "prices its trials")
        assert "leave max_memory out" in got["refused"]["max_memory"]
    assert "nosuchdb" in ranks[0]["stopped"] and "\n" not in ranks[1]["stopped"]
    assert ranks[1]["stopped"].startswith("RuntimeError: rank 0 of the sharded tune stopped ("), \
        ranks[1]["stopped"]
    # the study lives with rank 0 alone; the other rank returns rank 0's result
    assert ranks[0]["sharded"]["studies"] and not ranks[1]["written"]
    assert ranks[1]["sharded"]["studies"] == ranks[0]["sharded"]["studies"]


def _checkpoint(path) -> dict:
    """A tiny HF Llama saved as a model directory: config.json and a safetensors file."""
    from safetensors.torch import save_file

    model = tiny_llama()
    model.config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(path, "model.safetensors"))
    return state


def _loader(rank: int, world: int, port: int, out_dir: str, cases: list) -> None:
    _init(rank, world, port)
    from examples.tune_sharded import build_sharded, config_of

    (path,) = cases
    model = build_sharded(config_of(path), path)
    _save_results({"loaded": {k: v.full_tensor() for k, v in model.state_dict().items()},
                   "local": {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()}},
                  out_dir, rank)
    _teardown(rank)


@pytest.mark.slow
def test_the_sharded_example_loads_a_checkpoint_slice_by_slice_and_tunes(tmp_path):
    """examples/tune_sharded.py: each rank's shards filled from a safetensors checkpoint hold
    the saved weights; under torchrun on 2 gloo ranks it tunes and rank 0 writes the policy,
    named for the model's own class and fingerprint."""
    import subprocess
    import sys

    import autoprec

    ckpt = tmp_path / "ckpt"
    saved = _checkpoint(ckpt)
    ranks = run_ranks(tmp_path, [str(ckpt)], timeout=300.0, worker=_loader)
    for got in ranks:
        assert got["loaded"].keys() == saved.keys()
        for k, v in saved.items():
            assert torch.equal(got["loaded"][k], v), k
    # each rank held its part only (FSDP2 splits dim 0 of every weight over the 2 ranks)
    embed = "model.embed_tokens.weight"
    assert [got["local"][embed][0] for got in ranks] == [saved[embed].shape[0] // 2] * 2
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "out" / "policy.yaml"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), os.path.join(root, "examples", "tune_sharded.py"),
         "--model-dir", str(ckpt), "--target", "cpu-amx", "--formats", "fp32", "bf16",
         "--trials", "3", "--seq-len", "32", "-o", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("wrote ") == 1, run.stdout  # rank 0 alone
    policy = autoprec.load_policy(out)
    model = tiny_llama()
    assert policy.model_name == "LlamaForCausalLM"
    assert policy.fingerprint == autoprec.fingerprint.model_fingerprint(model)


def _titan(rank: int, world: int, port: int, out_dir: str, cases: list) -> None:
    """torchtitan's debug Llama sharded by torchtitan's own FSDP2 units (build_model(shard=True))
    and tuned, against one process tuning the whole model with the same weights."""
    _init(rank, world, port)
    from autoprec import tune
    from autoprec.measure import shards
    from autoprec.torchtitan import build_model
    from autoprec.torchtitan import task as titan_task

    task = titan_task([b["input_ids"] for b in byte_batches(4, 4, 64, seed=3)], "llama3",
                      "debugmodel", n_layers=2)
    options = {**OPTIONS, "formats": ("fp32", "bf16"), "max_grad_error": None}
    here = os.path.join(out_dir, f"rank{rank}")
    out = {"alone": _summary(tune(task, output=os.path.join(here, "alone", "p.yaml"),
                                  **options))}
    model = build_model(n_layers=2, shard=True)
    own = {n: p.full_tensor() for n, p in model.named_parameters()}
    out["own_init"] = all(bool(t.isfinite().all()) and float(t.std()) > 0
                          for n, t in own.items() if "norm" not in n)
    out["units"] = sum(type(m).__name__.startswith("FSDP") for m in model.modules())
    whole = dict(build_model(n_layers=2).named_parameters())
    with torch.no_grad():  # the one process's weights, each rank its part
        for n, p in model.named_parameters():
            p.to_local().copy_(shards.local(shards.like(whole[n].detach(), p)))
    out["sharded"] = _summary(tune(task, output=os.path.join(here, "sharded", "p.yaml"),
                                   model=model, **options))
    _save_results(out, out_dir, rank)
    _teardown(rank)


@pytest.mark.slow
def test_torchtitans_own_sharding_tunes_as_one_process(tmp_path):
    ranks = run_ranks(tmp_path, [], timeout=600.0, worker=_titan)
    for rank, got in enumerate(ranks):
        alone, sharded = got["alone"], got["sharded"]
        assert len({str(t[1]) for t in alone["trials"]}) >= 2, alone["trials"]
        _same_tune(sharded, alone, rank)
        # torchtitan's units: embedding, norm + head, 2 blocks, the root
        assert got["own_init"] and got["units"] >= 5, got["units"]
