"""The measurements' settings travel as one frozen options object, and every keyword callers
used before still works: ``budget_s`` is ``time_budget_s``, a keyword overrides the options'
field, an unknown one is the TypeError Python gives, and measure_sensitivity's reasons come
back with its results instead of through an output parameter."""

from __future__ import annotations

import pytest
import torch
from tasks import tiny_gpt2_task

from autoprec import Format
from autoprec.measure.options import SensitivityOptions, TimingOptions
from autoprec.measure.sensitivity import measure_sensitivity
from autoprec.measure.timing import measure_layers
from autoprec.policy import Budget
from autoprec.pricing import CostSource
from autoprec.profiling import ProfileOptions, profile
from autoprec.reporter import Reporter


def test_profile_options_accept_the_old_keywords_and_name_what_is_wrong():
    opts = ProfileOptions.of(None, {"budget_s": 0.5, "repeats": 2})
    assert (opts.time_budget_s, opts.repeats, opts.sensitivity) == (0.5, 2, "auto")
    base = ProfileOptions(repeats=3, sensitivity="fast")
    assert ProfileOptions.of(base, {"repeats": 4}) == ProfileOptions(repeats=4, sensitivity="fast")
    with pytest.raises(TypeError, match="both budget_s and time_budget_s"):
        ProfileOptions.of(None, {"budget_s": 1.0, "time_budget_s": 2.0})
    with pytest.raises(TypeError, match="unexpected keyword argument 'repeat'"):
        ProfileOptions.of(None, {"repeat": 2})
    with pytest.raises(ValueError, match=r"profile\(n_batches=...\) must be a positive integer"):
        ProfileOptions.of(None, {"n_batches": 0})
    with pytest.raises(ValueError, match="Unknown sensitivity mode 'quick'"):
        ProfileOptions.of(None, {"sensitivity": "quick"})


def test_profile_refuses_an_unknown_keyword_or_target_before_building_the_model():
    built = []
    task = tiny_gpt2_task()
    model = task.model
    task.model = lambda: built.append(1) or model()
    with pytest.raises(TypeError, match="unexpected keyword argument 'budget_seconds'"):
        profile(task, budget_seconds=1.0)
    with pytest.raises(ValueError, match="Unknown cost-model target 'h900'"):
        profile(task, target="h900")
    assert built == []


def test_a_cost_source_is_measured_or_priced():
    measured, priced = CostSource.of(None), CostSource.of(" H100 ")
    assert measured.measured and not measured.priced and measured.key is None
    assert priced.priced and priced.key == "h100" and priced.target == " H100 "
    assert measured.label("cpu (x)") == "measured on cpu (x)"
    assert priced.label("cpu (x)") == "cost model  H100 "
    assert CostSource.of(priced) is priced
    with pytest.raises(ValueError, match="needs a cost-model target"):
        measured.price_step([], {})
    assert Reporter.of(False) == Reporter(False) and Reporter.of(Reporter(True)).enabled
    quiet = Reporter.of(Reporter(False))
    assert not quiet.enabled and not Reporter.of(quiet).enabled


def test_measure_layers_keywords_override_the_options():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    x = torch.randn(4, 16)
    opts = TimingOptions(warmup=0, repeats=2)
    by_options = measure_layers(model, x, ["0"], ("fp32",), options=opts)["0"][Format.FP32]
    by_keyword = measure_layers(model, x, ["0"], ("fp32",), options=opts,
                                repeats=3)["0"][Format.FP32]
    old_style = measure_layers(model, x, ["0"], ("fp32",), warmup=0, repeats=1)["0"][Format.FP32]
    assert (by_options.repeats, by_keyword.repeats, old_style.repeats) == (2, 3, 1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'rounds'"):
        measure_layers(model, x, ["0"], ("fp32",), rounds=2)


def test_measure_sensitivity_returns_why_it_measured_exactly(gpt2, gpt2_batch):
    layers = ["transformer.h.0.mlp.c_fc", "lm_head"]
    # a gradient budget every estimate breaks: each pair is measured exactly
    tight = Budget(max_loss_increase=1.0, max_grad_error=1e-12)
    legacy: dict = {}
    old = measure_sensitivity(gpt2, layers, ["bf16"], batches=[gpt2_batch], mode="auto",
                              budget=tight, exact_why=legacy)
    new = measure_sensitivity(gpt2, layers, ["bf16"], batches=[gpt2_batch],
                              options=SensitivityOptions(mode="auto", budget=tight))
    assert set(new.exact_why) == set(layers), new.exact_why
    assert "gradient error" in new.exact_why["lm_head"][Format.BF16][0]
    assert legacy == new.exact_why == old.exact_why
    assert {n: {f: s.to_dict() for f, s in r.items()} for n, r in old.items()} == \
        {n: {f: s.to_dict() for f, s in r.items()} for n, r in new.items()}
    assert all(new[n][Format.BF16].source == "measured" for n in layers)
    with pytest.raises(TypeError, match="unexpected keyword argument 'budgets'"):
        measure_sensitivity(gpt2, layers, ["bf16"], batches=[gpt2_batch], budgets=tight)
