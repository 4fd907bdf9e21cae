"""The sensitivity measurement on a model FSDP2 shards (issue 38, item 4): two gloo ranks
shard HF Llama and GPT-2 (tied embedding) with ``fully_shard`` (each block and the root),
every forward and backward an FSDP2 pass on the same calibration batch, and each rank
re-runs only its share of the layers in the first-order estimate. Every number must be the
one a single process computes on the unsharded model, bit for bit: the same passes, the
parameters moved by the probes shard by shard, the same local re-runs. The same with the
Llama's blocks checkpointed and then sharded (torchtitan's order): FSDP2 gathers a block
again for the checkpoint's replay, which the measurement hooks ignore."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import byte_batches, tiny_gpt2, tiny_llama
from test_fsdp import _init, _save_results, _teardown, run_ranks
from test_sensitivity import matmul_layers

FORMATS = ["bf16", "fp8", "fp8:rowwise"]
FIELDS = ("loss_rel_change", "grad_rel_error", "layer_grad_rel_error", "output_sqnr_db",
          "act_overflow", "act_underflow", "grad_overflow", "grad_underflow", "finite")


def _model(which: str):
    """"llama-ac": the Llama trained with activation checkpointing (HF's, non-reentrant),
    which FSDP2 then shards, as torchtitan applies them."""
    if which == "llama-ac":
        model = tiny_llama()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    return tiny_llama() if which == "llama" else tiny_gpt2()


def _shard(model, which: str, **kw):
    from torch.distributed.fsdp import fully_shard

    blocks = model.model.layers if which.startswith("llama") else model.transformer.h
    for block in blocks:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def _numbers(results) -> dict:
    return {f"{layer}/{fmt}": tuple(getattr(s, k) for k in FIELDS)
            for layer, row in results.items() for fmt, s in row.items()}


def _measure(model, layers, mode: str, seen: list | None = None):
    from autoprec.measure.sensitivity import measure_sensitivity

    def progress(done, total, label):
        if seen is not None and "first-order estimate" in label:
            seen.append(label.split(" ")[0])

    return measure_sensitivity(model, layers, FORMATS, batches=byte_batches(1, 4, 32, seed=3),
                               mode=mode, in_place=True, progress=progress)


def _worker(rank: int, world: int, port: int, out_dir: str, cases: list) -> None:
    _init(rank, world, port)
    out = {}
    for which, mode in cases:
        model = _model(which)
        layers = matmul_layers(model)
        if mode == "exact":  # exact pairs: every rank runs every pair's passes; two suffice
            layers = layers[:2]
        alone = _numbers(_measure(model, layers, mode))  # this process, unsharded
        seen: list = []
        sharded = _numbers(_measure(_shard(model, which), layers, mode, seen))
        out[f"{which}/{mode}"] = {"alone": alone, "sharded": sharded, "seen": seen}
    out["profile"] = _profiles()
    out["refused"] = _refused()
    _save_results(out, out_dir, rank)
    _teardown(rank)


def _profiles() -> dict:
    """``autoprec.profile`` (priced for an H100, fast numerics) of the same Llama, one process
    and sharded (each block, the head, the root: a watched layer that is its own unit)."""
    import autoprec

    task = autoprec.Task(model=tiny_llama, batches=byte_batches(2, 4, 32, seed=5))

    def rows(model):
        prof = autoprec.profile(task, ("fp32", *FORMATS), target="h100", sensitivity="fast",
                                progress=False, model=model)
        return {f"{row.layer.fqn}/{fmt}": tuple(getattr(s, k) for k in FIELDS)
                for row in prof.layers for fmt, s in row.sensitivity.items()}

    from torch.distributed.fsdp import fully_shard

    from autoprec._util import own_class

    model = task.build_model()
    alone = rows(model)
    fully_shard(model.lm_head)
    out = {"alone": alone, "sharded": rows(_shard(model, "llama")),
           # the head, FSDP2's class of nn.Linear, is still linear in its parameters: its
           # probes' re-runs need no moved copy of it (estimate._LINEAR_IN_PARAMS)
           "head": [type(model.lm_head).__name__, own_class(model.lm_head).__name__]}
    for how in ({"target": None}, {"share": lambda units, work: None}):
        try:
            autoprec.profile(task, ("fp32", "bf16"), progress=False, model=model,
                             **{"target": "h100", **how})
        except ValueError as e:
            out[next(iter(how))] = str(e)
    return out


def _refused() -> str:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = _shard(tiny_llama(), "llama",
                   mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    try:
        _measure(model, matmul_layers(model)[:1], "fast")
    except ValueError as e:
        return str(e)
    return ""


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a)
                      and math.isnan(b))


# FIELDS' gradient errors: an exact comparison keeps each rank's part of the reference's
# gradients and sums the squared norms of its parts' differences over the ranks, so these
# equal one process's to the rounding of FP32 norms (a tensor's and its halves' differ by
# 1e-7 to 2e-4 relative); the first-order estimate's are bit for bit
GRAD_FIELDS = (1, 2)


def _close(a, b, exact: bool) -> bool:
    return _same(a, b) or (not exact and isinstance(a, float) and isinstance(b, float)
                           and abs(a - b) <= 1e-3 * abs(b))


def _all_close(sharded: tuple, alone: tuple, mode: str) -> bool:
    return all(_close(a, b, mode != "exact" or i not in GRAD_FIELDS)
               for i, (a, b) in enumerate(zip(sharded, alone)))


@pytest.mark.slow
def test_a_sharded_models_sensitivity_is_the_one_process_numbers_and_each_rank_estimates_its_share(
        tmp_path):
    cases = [("llama", "fast"), ("gpt2", "fast"), ("llama", "exact"), ("llama-ac", "fast"),
             ("llama-ac", "exact")]
    ranks = run_ranks(tmp_path, cases, timeout=600.0, worker=_worker)
    for which, mode in cases:
        key = f"{which}/{mode}"
        for rank, got in enumerate(ranks):
            alone, sharded = got[key]["alone"], got[key]["sharded"]
            assert sharded.keys() == alone.keys(), key
            for pair, numbers in alone.items():
                assert _all_close(sharded[pair], numbers, mode), \
                    f"{key} rank {rank} {pair}: sharded {sharded[pair]} alone {numbers}"
            # not vacuous: the estimates are finite and differ between layers
            assert all(v[-1] for v in sharded.values()), key
            assert len({v[1] for v in sharded.values()}) > 1, key
        if mode == "fast":  # each layer re-run by exactly one rank, both ranks working
            shares = [set(got[key]["seen"]) for got in ranks]
            layers = {pair.split("/")[0] for pair in ranks[0][key]["alone"]}
            assert set().union(*shares) == layers, key
            assert not shares[0] & shares[1] and all(shares), (key, shares)
    for rank, got in enumerate(ranks):
        alone, sharded = got["profile"]["alone"], got["profile"]["sharded"]
        assert got["profile"]["head"] == ["FSDPLinear", "Linear"]
        assert sharded.keys() == alone.keys() and len(alone) >= 3 * 9
        for pair, numbers in alone.items():
            assert all(map(_same, sharded[pair], numbers)), \
                f"profile rank {rank} {pair}: sharded {sharded[pair]} alone {numbers}"
        assert "pass target=" in got["profile"]["target"], got["profile"]
        assert "leave share out" in got["profile"]["share"], got["profile"]
    for got in ranks:
        assert "all-gathers `" in got["refused"] and "torch.bfloat16" in got["refused"] \
            and "\n" not in got["refused"], got["refused"]


def _reading_worker(rank: int, world: int, port: int, out_dir: str, cases: list) -> None:
    """A spilled comparison with its bias sum on a sharded Llama, one process and sharded:
    the results of each, and per batch what reading the largest parameter's gradient
    allocated at most, in that parameter's whole bytes (traced allocations)."""
    import itertools

    from torch.profiler import ProfilerActivity, profile

    from autoprec import Format, Policy, memory
    from autoprec.measure import deviation

    _init(rank, world, port)
    read = deviation._Reading.read
    peaks: list = []

    def compared(model, big: str | None = None):
        meter = deviation.DeviationMeter(model, byte_batches(2, 2, 32, seed=3),
                                         lambda m, b: m(**b).loss, spill=True)
        meter.reference()
        index = dict(zip((n for n, p in model.named_parameters() if p.requires_grad),
                         range(len(meter.params))))

        def traced(self, i, g):
            if big is None or i != index[big] or self.ref is None:
                return read(self, i, g)
            with memory._quiet_kineto(), profile(activities=[ProfilerActivity.CPU],
                                                 profile_memory=True) as prof:
                read(self, i, g)
            steps = [n for _, n in memory._allocations(prof.profiler.kineto_results.events())]
            peaks.append(max(itertools.accumulate(steps)) / g.nbytes)

        deviation._Reading.read = traced
        try:
            dev = meter.compare(Policy(default=Format.BF16), bias=True)
        finally:
            deviation._Reading.read = read
        return (dev.loss_rel_change, dev.grad_rel_error, dev.grad_bias)

    def model():
        from examples import llama_bytes

        torch.manual_seed(0)
        return llama_bytes.make_model(1, 256, 688, 4, 2, seq_len=128)

    alone = compared(model())
    big = max(((n, p.numel()) for n, p in model().named_parameters()), key=lambda x: x[1])[0]
    sharded = compared(_shard(model(), "llama"), big)
    _save_results({"alone": alone, "sharded": sharded, "peaks": peaks, "big": big},
                  out_dir, rank)
    _teardown(rank)


@pytest.mark.slow
def test_a_sharded_comparison_reads_its_part_of_a_gradient_in_the_whole_ones_memory(tmp_path):
    """Each rank's part of a candidate's gradient is read, differenced and written into the
    spilled bias sum in the memory of the gradient autograd handed over (half of it here):
    what the read allocates is the reference's part read back, then the sum's (half the
    parameter each), not a copy of the part besides (the read peaked at the whole parameter
    before). The numbers are one process's: the loss change bit for bit, the gradient error
    and bias to the rounding of norms over halves."""
    ranks = run_ranks(tmp_path, [], timeout=600.0, worker=_reading_worker)
    for rank, got in enumerate(ranks):
        assert ".mlp." in got["big"], got["big"]  # a block's weight, larger than the head
        assert len(got["peaks"]) == 2, got["peaks"]  # one read per calibration batch
        assert max(got["peaks"]) < 0.75, (rank, got["peaks"])
        (loss, err, bias), alone = got["sharded"], got["alone"]
        assert loss == alone[0] and err > 0 and bias > 0, (got["sharded"], alone)
        assert err == pytest.approx(alone[1], rel=1e-3)
        assert bias == pytest.approx(alone[2], rel=1e-3)
