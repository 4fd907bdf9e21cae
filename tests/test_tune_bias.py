"""The tune's budget that predicts the certificate (issue 37 item 2): each trial measures its
gradient bias, and with ``budget_at`` the profile and the trials measure on the model trained
that far into the certificate's BF16 reference run, where the bias budget was measured against
certificates (benchmarks/bench_certificate.py). On a real HF Llama byte LM: a trial's bias is
the one autoprec.budget.gradient_bias measures; round-to-nearest NVFP4 on every Linear (whose
certificate fails, tests/test_certify.py) is admitted at init and rejected halfway; a tune
keeps to a bias limit and writes where it measured; bad settings are one line."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys

import optuna
import pytest
from tasks import tiny_llama_task

from autoprec import Policy, load_policy
from autoprec.budget import gradient_bias
from autoprec.policy import DEFAULT_BIAS_BUDGET, Budget
from autoprec.tuning import TuneConfig
from autoprec.tuning.tune import evaluate_policy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "tasks.py")
LINEARS = ("model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj", "lm_head")


@pytest.fixture(scope="module")
def task(one_thread):
    return tiny_llama_task()


def test_a_trial_at_budget_at_measures_the_bias_and_the_point_of_the_run_decides(task):
    rtn = Policy(default="bf16", layers=dict.fromkeys(LINEARS, "nvfp4:plain"))
    kw = dict(formats=("bf16", "nvfp4"), target="b200")
    halfway = evaluate_policy(task, rtn, config=TuneConfig(budget_at=60, **kw), target="b200")
    # the trial's bias is gradient_bias's: same trained state, same 8 held batches, same
    # definition (the tune in float32 sums, gradient_bias in float64)
    direct = gradient_bias(task, rtn, step=60, run_steps=120)
    assert math.isclose(halfway.grad_bias, direct.bias, rel_tol=1e-4), (halfway, direct)
    assert halfway.grad_bias > DEFAULT_BIAS_BUDGET and not halfway.feasible
    # the same budget at init admits it: where the run is decides, not the budget alone
    at_init = evaluate_policy(task, rtn, config=TuneConfig(budget=Budget.trained(), **kw),
                              target="b200")
    assert 0 < at_init.grad_bias < DEFAULT_BIAS_BUDGET and at_init.feasible, at_init
    # bf16 halfway: a small bias, admitted
    bf16 = evaluate_policy(task, Policy(default="bf16"), config=TuneConfig(budget_at=60, **kw),
                           target="b200")
    assert 0 < bf16.grad_bias < 0.05 and bf16.feasible, bf16


def test_budget_at_makes_the_default_budget_the_bias_and_adds_it_to_ones_own():
    assert TuneConfig().budget == Budget() and Budget().max_grad_bias is None
    assert TuneConfig(budget_at=50).budget == Budget.trained() == \
        Budget(max_grad_error=None, max_grad_bias=DEFAULT_BIAS_BUDGET)
    own = TuneConfig(budget_at=50, max_grad_error=0.3).budget
    assert (own.max_grad_error, own.max_grad_bias) == (0.3, DEFAULT_BIAS_BUDGET)
    assert TuneConfig(budget_at=50, max_grad_bias=0.1).budget.max_grad_bias == 0.1
    # a bias limit judges only a measured bias
    limit = Budget(max_grad_bias=0.1)
    assert limit.allows(0.0, 0.01, 0.05) and not limit.allows(0.0, 0.01, 0.2)
    assert not limit.allows(0.0, 0.01) and not limit.allows(0.0, 0.01, math.nan)
    assert Budget().allows(0.0, 0.01)


@pytest.mark.parametrize("kwargs", [{"budget_at": 0}, {"budget_at": 2.5},
                                    {"max_grad_bias": -1.0}, {"max_grad_bias": math.inf}])
def test_bad_bias_settings_are_one_line_errors(kwargs):
    with pytest.raises(ValueError) as e:
        TuneConfig(**kwargs)
    assert "\n" not in str(e.value) and ("budget_at" in str(e.value)
                                         or "max_grad_bias" in str(e.value)), e.value


def _cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "autoprec.cli", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=600)


@pytest.mark.slow
def test_a_tune_at_budget_at_keeps_to_its_bias_limit_and_says_where_it_measured(tmp_path, task):
    out = tmp_path / "p.yaml"
    # a limit all-bf16 cannot meet (its bias is ~0.002) but a few bf16 layers can
    r = _cli("tune", f"{TASKS}:tiny_llama_priced_task", "-o", str(out), "--target", "b200",
             "--formats", "bf16", "--groups", "role", "--n-trials", "8", "--budget-at", "30",
             "--max-grad-bias", "0.001", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "training 30 steps of a 60-step bf16 reference run" in r.stderr
    tuned = load_policy(out)
    prov = tuned.provenance
    assert prov.budget == Budget(max_grad_bias=0.001)
    bias = prov.extra["bias"]
    assert (bias["step"], bias["run_steps"], bias["batches"]) == (30, 60, 8)
    assert bias["grad_bias"] <= 0.001
    # the written figure is the winner's own, as gradient_bias measures it independently
    direct = gradient_bias(task, tuned, step=30, run_steps=60).bias
    assert math.isclose(bias["grad_bias"], direct, rel_tol=1e-3, abs_tol=1e-4), (bias, direct)
    # every trial over the limit is infeasible, all-bf16 among them; the sampler saw the limit
    rows = list(csv.DictReader(open(tmp_path / "p.pareto.csv")))
    assert rows and all((row["feasible"] == "True") == (float(row["grad_bias"]) <= 0.001)
                        for row in rows), rows
    assert any(row["origin"] == "warm:bf16" and row["feasible"] == "False" for row in rows)
    study = optuna.load_study(study_name=prov.extra["study"]["name"],
                              storage=f"sqlite:///{tmp_path / 'p.study.db'}")
    assert all(len(t.constraints) == 4 and "grad_bias" in t.constraints
               for t in study.trials if t.state.is_finished())
    show = _cli("show", str(out), cwd=tmp_path)
    assert show.returncode == 0, show.stderr
    assert "gradient bias <= 0.001" in show.stdout
    assert "measured at step 30 of a 60-step bf16 reference run" in show.stdout, show.stdout


def test_budget_at_on_the_command_line_is_checked_before_any_work(tmp_path):
    r = _cli("tune", f"{TASKS}:tiny_llama_task", "-o", str(tmp_path / "p.yaml"),
             "--budget-at", "0", cwd=tmp_path)
    assert r.returncode == 2 and "--budget-at" in r.stderr and "at least 1" in r.stderr
    assert not (tmp_path / "p.yaml").exists()
