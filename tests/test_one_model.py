"""A tune holds one model (issue 38, item 1): the step timer and the memory model measure on the
model the numerics are compared on, not on copies of it, and leave it as it was."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from tasks import tiny_gpt2_task
from torch import nn

from autoprec import Policy
from autoprec.memory import memory_model
from autoprec.profiling import profile
from autoprec.tuning.config import TimingConfig
from autoprec.tuning.evaluate import Evaluator


class MovesAtZeroLr(torch.optim.Optimizer):
    """A user's optimizer whose step moves every weight whatever its learning rate (a decay of
    its own): the step timer's learning rate 0 does not keep the weights put."""

    steps = 0  # over every instance: the step timer builds one per timing

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3})

    @torch.no_grad()
    def step(self, closure=None):
        type(self).steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(0.9)


@pytest.fixture
def no_model_copies(monkeypatch):
    """``copy.deepcopy`` of an ``nn.Module`` fails the test (anything else copies as usual)."""
    real = copy.deepcopy

    def deepcopy(x, memo=None, _nil=[]):  # noqa: B006 - copy.deepcopy's own signature
        if isinstance(x, nn.Module):
            raise AssertionError(f"a copy of the whole model ({type(x).__name__})")
        return real(x, memo, _nil)

    monkeypatch.setattr(copy, "deepcopy", deepcopy)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_step_timer_times_the_compared_model_and_puts_back_what_its_steps_moved(
        no_model_copies):
    task = dataclasses.replace(tiny_gpt2_task(), optimizer=MovesAtZeroLr)
    prof = profile(task, target="cpu-amx", progress=False)
    ev = Evaluator(task, task.batches[2:], prof=prof, target=None,
                   timing=TimingConfig(final_rounds=2, trial_rounds=2, recheck_rounds=0))
    model = ev.meter.model
    assert ev.steps.model is model
    assert MovesAtZeroLr.steps > 0  # the fp32 calibration stepped it
    assert ev.steps.optimizer is None  # and its state was dropped after the timing
    before = _params(model)
    fp32 = Policy(default="fp32")
    assert ev.deviation(fp32).loss_rel_change == 0.0
    stepped = MovesAtZeroLr.steps
    ev.time(Policy(default="bf16"))
    assert MovesAtZeroLr.steps > stepped and ev.steps.optimizer is None
    after = _params(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(p.grad is None for p in model.parameters())
    # the reference the trials are compared with is the one before the timing
    dev = ev.deviation(fp32)
    assert dev.loss_rel_change == 0.0 and dev.grad_rel_error == 0.0


def test_the_memory_model_captures_and_measures_on_the_model_it_is_given(no_model_copies):
    task = tiny_gpt2_task()
    task = dataclasses.replace(task, shape_batch=task.batches[0])  # captured again
    model = task.build_model()
    before = _params(model)
    mm = memory_model(task, None, model)
    assert mm.predict(Policy(default="bf16")) > 0
    after = _params(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not model._forward_hooks and not model._forward_pre_hooks


class Watched(MovesAtZeroLr):
    """Records, at each timed step, how many held-out batches' reference gradients the meter
    holds (``meter`` is set by the test once the evaluator exists)."""

    meter = None
    seen: list[int] = []

    @torch.no_grad()
    def step(self, closure=None):
        if Watched.meter is not None:
            Watched.seen.append(len(Watched.meter.reference().grads))
        return super().step(closure)


def test_the_kept_reference_gradients_wait_outside_while_a_step_is_timed(no_model_copies):
    task = dataclasses.replace(tiny_gpt2_task(), optimizer=Watched)
    prof = profile(task, target="cpu-amx", progress=False)
    ev = Evaluator(task, task.batches[2:], prof=prof, target=None,
                   timing=TimingConfig(final_rounds=2, trial_rounds=2, recheck_rounds=0))
    bf16 = Policy(default="bf16")
    first = ev.deviation(bf16)
    ref = ev.meter.reference()
    kept = [[g.clone() for g in batch] for batch in ref.grads]
    assert len(kept) == len(task.batches[2:]) and kept[0]
    Watched.meter, Watched.seen = ev.meter, []
    try:
        ev.time(bf16)
    finally:
        Watched.meter = None
    assert Watched.seen and set(Watched.seen) == {0}  # none alive while a step ran
    # back after, the same values on the same devices, and the comparisons unchanged
    assert len(ref.grads) == len(kept)
    assert all(torch.equal(a, b) and a.device == b.device
               for got, want in zip(ref.grads, kept) for a, b in zip(got, want))
    again = ev.deviation(bf16)
    assert (again.loss_rel_change, again.grad_rel_error, again.grad_bias) == \
        (first.loss_rel_change, first.grad_rel_error, first.grad_bias)
