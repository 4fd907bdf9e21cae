"""The one comparison against FP32 (autoprec.measure.deviation), shared by the profile and the
trials of the search."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import autoprec
from autoprec import Format, Policy
from autoprec.measure.deviation import DeviationMeter, prepare_for_measurement
from autoprec.measure.sensitivity import measure_sensitivity
from autoprec.profiling import profile
from autoprec.tuning import evaluate_policy
from examples.data import byte_batches
from examples.gpt2_bytes import make_model

LAYER = "transformer.h.0.mlp.c_fc"


def _tiny_loss_task() -> autoprec.Task:
    # A loss scaled down by 1e-7 (as a sum over a huge batch, or a small auxiliary loss, would
    # be): the gradients reaching the layers sit below FP16's smallest subnormal (6e-8) unless
    # the loss is scaled up first, as GradScaler does.
    return autoprec.Task(model=lambda: make_model(n_layer=1, n_embd=64, n_head=2, seq_len=32),
                         batches=byte_batches(3, 4, 32, seed=5), name="tiny-loss",
                         loss_fn=lambda m, b: m(**b).loss * 1e-7, device="cpu")


def test_trial_and_profile_agree_on_fp16_gradients_that_underflow_unscaled():
    task = _tiny_loss_task()
    batches = task.batches[:1]
    head = "lm_head"  # every gradient upstream flows through its backward
    policy = Policy(default="fp32", layers={head: "fp16"})
    # the profile's own measurement (profile() would skip fp16 here: too small to win on any
    # device, so it would not measure it)
    in_profile = measure_sensitivity(task, [head], ["fp16"], batches=batches)[head][Format.FP16]
    prof = profile(task, formats=("fp32", "bf16"), target="h100", batches=batches,
                   layers=[head], progress=False)
    trial = evaluate_policy(task, policy, prof=prof, target="h100", holdout=batches)
    assert trial.grad_error == in_profile.grad_rel_error
    assert trial.loss_increase == in_profile.loss_rel_change
    # both are loss-scaled: a small error. Unscaled, the same policy loses its gradients.
    assert trial.grad_error < 0.05, trial.grad_error
    meter = DeviationMeter(prepare_for_measurement(task.build_model()), batches, task.loss_fn)
    unscaled = meter.compare(Policy(default="fp32", layers={head: "fp16"},
                                       loss_scaling={"init_scale": 1.0}))
    assert unscaled.grad_rel_error > 0.9, unscaled.grad_rel_error


def test_compare_is_deterministic_and_fp32_against_itself_is_exact(gpt2_batch):
    torch.manual_seed(0)
    model = prepare_for_measurement(make_model(n_layer=1, n_embd=64, n_head=2, seq_len=32))
    meter = DeviationMeter(model, [gpt2_batch], lambda m, b: m(**b).loss)
    same = meter.compare(Policy(default="fp32"))
    assert same.loss_rel_change == 0.0 and same.grad_rel_error == 0.0 and same.finite
    a = meter.compare(Policy(default="bf16"))
    b = meter.compare(Policy(default="bf16"))
    assert a == b and 0 < a.grad_rel_error < 0.1
    own = meter.index_of(model.get_submodule(LAYER).parameters())
    assert len(own) == 2 and 0 < a.grad_error_of(own) and a.grad_error_of([]) is None
    assert autoprec.applied_formats(model) == {}, "compare must leave no policy applied"


def test_a_reference_without_its_gradients_runs_again_to_the_same_bias(gpt2_batch):
    torch.manual_seed(0)
    model = prepare_for_measurement(make_model(n_layer=1, n_embd=64, n_head=2, seq_len=32))
    loss = lambda m, b: m(**b).loss  # noqa: E731
    batches = [gpt2_batch, {k: v.flip(0) for k, v in gpt2_batch.items()}]
    kept, lazy = DeviationMeter(model, batches, loss), DeviationMeter(model, batches, loss, keep_grads=False)
    # without its gradients the reference holds what the estimates read: losses and norms
    assert lazy.reference().grads == [] and len(lazy.reference().grad_sq) == len(batches)
    assert lazy.reference().losses == kept.reference().losses
    a, b = kept.compare(Policy(default="bf16"), bias=True), \
        lazy.compare(Policy(default="bf16"), bias=True)
    assert a == b and 0 < a.grad_bias < 0.1 and 0 < a.grad_rel_error < 0.1
    # the bias of two batches: the error of the summed gradients, per parameter too
    own = kept.index_of(model.get_submodule(LAYER).parameters())
    assert 0 < a.grad_bias_of(own) and a.grad_bias_of([]) is None
    # without bias=True it is not measured
    assert math.isnan(kept.compare(Policy(default="bf16")).grad_bias)


def test_bad_inputs_are_clear_errors(gpt2_batch):
    model = prepare_for_measurement(make_model(n_layer=1, n_embd=64, n_head=2, seq_len=32))
    with pytest.raises(ValueError, match="at least one batch"):
        DeviationMeter(model, [], lambda m, b: m(**b).loss)
    with pytest.raises(ValueError, match="scalar tensor"):
        DeviationMeter(model, [gpt2_batch], lambda m, b: m(**b).logits).compare(Policy())
    half = make_model(n_layer=1, n_embd=64, n_head=2, seq_len=32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="FP32 master weights"):
        DeviationMeter(half, [gpt2_batch], lambda m, b: m(**b).loss)


class _SharedGradient(torch.nn.Module):
    """Two parameters added before a Linear: autograd hands both the same gradient tensor; a
    third summed into the loss: its gradient is one value expanded (no element of its own)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(1, 8))
        self.b = torch.nn.Parameter(torch.randn(1, 8))
        self.proj = torch.nn.Linear(8, 8)
        self.c = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return self.proj(x + self.a + self.b).square().mean() + self.c.sum()


def test_parameters_sharing_a_gradient_tensor_are_each_compared_with_their_own_reference():
    torch.manual_seed(0)
    model = _SharedGradient()
    x = torch.randn(1, 8)
    g = torch.autograd.grad(model(x), [model.a, model.b, model.c])
    assert g[0].data_ptr() == g[1].data_ptr() and g[2].stride() == (0, 0)  # the cases here
    meter = DeviationMeter(model, [x], lambda m, batch: m(batch))
    same = meter.compare(Policy(default="fp32"), bias=True)
    # subtracting a's reference in place from the shared tensor used to leak into b's (and
    # the expanded one could not be written in place)
    assert same.diff_sq == (0.0,) * 5 and same.grad_rel_error == 0.0 and same.grad_bias == 0.0
    bf16 = meter.compare(Policy(default="bf16"))
    own = meter.index_of([model.a, model.b])
    assert bf16.diff_sq[own[0]] == bf16.diff_sq[own[1]] > 0  # the same gradient, the same error


def test_gradients_read_as_they_arrive_give_the_numbers_a_whole_set_gives(gpt2_batch):
    # compare() no longer holds a batch's whole gradient set: each gradient is compared with
    # the reference as autograd finishes it. The numbers are those of the whole set, exactly.
    from autoprec.runtime import rewrite
    from autoprec.runtime.fp8 import emulating

    torch.manual_seed(0)
    model = prepare_for_measurement(make_model(n_layer=2, n_embd=64, n_head=2, seq_len=32))
    loss_fn = lambda m, b: m(**b).loss  # noqa: E731
    batches = [gpt2_batch, {k: v.flip(0) for k, v in gpt2_batch.items()}]
    meter = DeviationMeter(model, batches, loss_fn, seed=3)
    ref = meter.reference()
    for fmt in ("bf16", "fp8"):
        policy = Policy(default="fp32", layers={"transformer.h.*": fmt})
        got = meter.compare(policy, bias=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # emulated fp8 is slow: numerics are what we read
            rewrite.apply(model, policy, strict=False)
        diff_sq, total = torch.zeros(len(meter.params), dtype=torch.float64), None
        try:
            for b, batch in enumerate(batches):
                with torch.random.fork_rng(devices=[]), emulating(meter.emulated):
                    torch.manual_seed(3 + b)
                    grads = torch.autograd.grad(loss_fn(model, batch), meter.params,
                                                allow_unused=True)
                diff = [(torch.zeros_like(p) if g is None else g) - r
                        for g, p, r in zip(grads, meter.params, ref.grads[b])]
                diff_sq += torch.stack(torch._foreach_norm(diff)).double().square()
                total = diff if total is None else [t + d for t, d in zip(total, diff)]
        finally:
            rewrite.remove(model)
        assert got.diff_sq == tuple(diff_sq.tolist())
        assert got.bias_sq == tuple(torch.stack(torch._foreach_norm(total)).double().square()
                                    .tolist())
        assert 0 < got.grad_rel_error < 0.5 and 0 < got.grad_bias < 0.5


def test_fp16_gradients_read_as_they_arrive_back_off_as_the_whole_set_did(gpt2_batch):
    # An fp16 comparison also reads each gradient as it arrives: an overflowed backward is
    # dropped and run again at half the scale (GradScaler's back-off), and the sum over the
    # batches (the bias) takes only the finite backward's part. The numbers are those of the
    # whole set, unscaled after the scale that did not overflow was found.
    from autoprec.policy import LossScaling
    from autoprec.runtime import rewrite
    from autoprec.runtime.fp8 import emulating

    torch.manual_seed(0)
    model = prepare_for_measurement(make_model(n_layer=2, n_embd=64, n_head=2, seq_len=32))
    loss_fn = lambda m, b: m(**b).loss  # noqa: E731
    batches = [gpt2_batch, {k: v.flip(0) for k, v in gpt2_batch.items()},
               {k: v.roll(1, 0) for k, v in gpt2_batch.items()}]
    meter = DeviationMeter(model, batches, loss_fn, seed=5)
    ref = meter.reference()
    policy = Policy(default="fp32", layers={"transformer.h.*": "fp16"},
                    loss_scaling=LossScaling(init_scale=2.0 ** 30))
    got = meter.compare(policy, bias=True)
    rewrite.apply(model, policy, strict=False)
    diff_sq, total, scales = torch.zeros(len(meter.params), dtype=torch.float64), None, []
    try:
        for b, batch in enumerate(batches):
            # the 16-bit GEMMs emulated where compare emulates them (fp16 on a CPU without
            # fp16 units: a native CPU fp16 matmul rounds differently)
            with torch.random.fork_rng(devices=[]), emulating(meter.emulated):
                torch.manual_seed(5 + b)
                loss = loss_fn(model, batch)
            scale = 2.0 ** 30
            while True:
                grads = torch.autograd.grad(loss * scale, meter.params, allow_unused=True,
                                            retain_graph=True)
                grads = [torch.zeros_like(p) if g is None else g
                         for g, p in zip(grads, meter.params)]
                if all(bool(torch.isfinite(g).all()) for g in grads):
                    break
                scale /= 2
            scales.append(scale)
            diff = [g / scale - r for g, r in zip(grads, ref.grads[b])]
            diff_sq += torch.stack(torch._foreach_norm(diff)).double().square()
            total = diff if total is None else [t + d for t, d in zip(total, diff)]
    finally:
        rewrite.remove(model)
    assert max(scales) < 2.0 ** 30  # every batch overflowed first: the back-off ran
    assert got.finite
    assert got.diff_sq == tuple(diff_sq.tolist())
    assert got.bias_sq == tuple(torch.stack(torch._foreach_norm(total)).double().square()
                                .tolist())
    assert 0 < got.grad_rel_error < 0.5 and 0 < got.grad_bias < 0.5


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp16"])
def test_a_reference_recomputed_per_batch_gives_the_numbers_a_kept_one_gives(gpt2_batch, fmt,
                                                                            monkeypatch):
    # per_batch: no comparison holds every held-out batch's reference gradients; each batch's
    # are computed again beside the candidate's (the same seeds, so the same values), and an
    # fp16 candidate's part of the bias sum is read in a second backward at the scale that did
    # not overflow rather than held. Every number must be the kept reference's, bitwise.
    from autoprec.measure import deviation
    from autoprec.policy import LossScaling

    backwards = []
    read = deviation._as_they_arrive
    monkeypatch.setattr(deviation, "_as_they_arrive",
                        lambda *a, **k: (backwards.append(1), read(*a, **k))[1])
    torch.manual_seed(0)
    model = prepare_for_measurement(make_model(n_layer=2, n_embd=64, n_head=2, seq_len=32))
    loss_fn = lambda m, b: m(**b).loss  # noqa: E731
    batches = [gpt2_batch, {k: v.flip(0) for k, v in gpt2_batch.items()},
               {k: v.roll(1, 0) for k, v in gpt2_batch.items()}]
    # 2**30 overflows every fp16 batch first: the back-off runs before the second backward
    policy = Policy(default="fp32", layers={"transformer.h.*": fmt},
                    loss_scaling=LossScaling(init_scale=2.0 ** 30))
    kept = DeviationMeter(model, batches, loss_fn, seed=5)
    kept.reference()
    backwards.clear()
    want = kept.compare(policy, bias=True)
    n_kept = len(backwards)
    del kept
    lean = DeviationMeter(model, batches, loss_fn, seed=5, per_batch=True)
    assert not lean.reference().grads  # only the norms are kept
    backwards.clear()
    got = lean.compare(policy, bias=True)
    assert got == want
    # fp16: the batches after the first read their part of the sum in a second backward
    assert len(backwards) == n_kept + (len(batches) - 1 if fmt == "fp16" else 0)
    assert 0 < got.grad_rel_error < 0.5 and 0 < got.grad_bias < 0.5
    # fp32 against itself, per batch too, is exactly 0
    same = lean.compare(Policy(default="fp32"), bias=True)
    assert same.grad_rel_error == 0 and same.grad_bias == 0 and same.loss_rel_change == 0
    del lean

    # spill: the reference's gradients computed once, each written out as it arrives and read
    # back as the candidate's arrives, the bias sum kept the same way; nothing held, no
    # backward more than the kept reference's but for fp16, whose every batch reads its part of
    # the sum in a second backward (an overflow would void what the first added)
    from autoprec._util import Spilled

    spilled = DeviationMeter(model, batches, loss_fn, seed=5, spill=True)
    ref = spilled.reference()
    assert len(ref.grads) == len(batches) and all(isinstance(g, Spilled) for g in ref.grads)
    assert all(g.file is not None and not g.host for g in ref.grads)  # on disk, not in memory
    backwards.clear()
    assert spilled.compare(policy, bias=True) == want
    assert len(backwards) == n_kept + (len(batches) if fmt == "fp16" else 0)
    same = spilled.compare(Policy(default="fp32"), bias=True)
    assert same.grad_rel_error == 0 and same.grad_bias == 0 and same.loss_rel_change == 0
    with pytest.raises(ValueError, match="pick one"):
        DeviationMeter(model, batches, loss_fn, per_batch=True, spill=True)
