"""The typed records between a tune's stages (issue 21 items 4 and 5): a trial's record as the
study keeps it (one list of keys, every value checked when read back: a study is a file anyone
may have written), the study handle (failing a trial through the storage's public API), the
files of a tune derived from ``-o`` in one place, and TuneConfig in groups whose defaults the
CLI takes instead of restating them."""

from __future__ import annotations

import math
import subprocess
import sys

import optuna
import pytest

from autoprec.policy import DEFAULT_MAX_LOSS_INCREASE, Budget, Interval
from autoprec.tuning import SearchConfig, StudyConfig, TimingConfig, TuneConfig
from autoprec.tuning.config import TunePaths
from autoprec.tuning.report import TrialRecord, TrialResult
from autoprec.tuning.storage import StudyHandle, open_storage


def _study(tmp_path, name="s"):
    storage, url = open_storage(None, str(tmp_path / "s.study.db"))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=storage,
                                directions=["minimize", "minimize"])
    return StudyHandle(study, storage, url)


def _complete(study, record: TrialRecord, values=(0.5, 0.001)):
    trial = study.ask()
    trial.suggest_categorical("lm_head", ["fp32", "bf16"])
    record.write(trial)
    study.tell(trial, list(values))
    return study.trials[-1]


def test_a_trial_record_round_trips_through_a_real_study(tmp_path):
    handle = _study(tmp_path)
    rec = TrialRecord(constraints=(-0.004, -0.2, -1.0), grad_error=0.05, finite=True,
                      speedup=Interval(1.3, 1.2, 1.4, 4), predicted=0.8, memory=123456,
                      origin="warm:bf16")
    frozen = _complete(handle.study, rec)
    assert TrialRecord.from_trial(frozen) == rec
    # the constraints the sampler sees are the record's
    assert frozen.constraints == {"loss_increase": -0.004, "grad_error": -0.2, "memory": -1.0}
    res = TrialResult.of(frozen, fp32_seconds=0.65)
    assert (res.speedup, res.grad_error, res.feasible, res.origin, res.memory) == \
        (rec.speedup, 0.05, True, "warm:bf16", 123456)
    assert res.step_seconds == 0.5 and res.loss_increase == 0.001


def test_a_record_without_speedup_or_constraints_reads_with_its_defaults(tmp_path):
    # studies written before a key existed: two constraints, no speed-up interval
    handle = _study(tmp_path)
    frozen = _complete(handle.study, TrialRecord(constraints=(-1.0, -1.0), finite=True))
    res = TrialResult.of(frozen, fp32_seconds=1.0)
    assert res.speedup == Interval(2.0, 2.0, 2.0, 0) and res.feasible
    trial = handle.study.ask()
    handle.study.tell(trial, [1.0, 0.0])  # nothing recorded: not feasible, never a crash
    rec = TrialRecord.from_trial(handle.study.trials[-1])
    assert not rec.feasible and math.isnan(rec.grad_error) and rec.origin == "search"


@pytest.mark.parametrize("key,value", [("constraints", "none"), ("constraints", [1]),
                                       ("finite", "yes"), ("grad_error", [0.1]),
                                       ("speedup", {"value": "fast"}), ("memory", -5),
                                       ("memory", 1.5), ("origin", 7), ("predicted", True)])
def test_a_hostile_trial_attribute_is_a_one_line_error_naming_it(tmp_path, key, value):
    handle = _study(tmp_path)
    trial = handle.study.ask()
    TrialRecord(constraints=(-1.0, -1.0), finite=True).write(trial)
    trial.set_user_attr(key, value)
    handle.study.tell(trial, [1.0, 0.0])
    with pytest.raises(ValueError) as e:
        TrialRecord.from_trial(handle.study.trials[-1], "study s")
    msg = str(e.value)
    assert "\n" not in msg and f"`{key}`" in msg and "trial 0" in msg and "--study" in msg, msg


def test_the_study_handle_fails_a_running_trial_through_the_storage(tmp_path):
    handle = _study(tmp_path)
    handle.study.ask()
    running = handle.study.ask()
    handle.fail(running.number)
    states = [t.state for t in handle.study.get_trials(deepcopy=False)]
    assert states == [optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.FAIL]
    assert handle.name == "s" and handle.url.startswith("sqlite:///")


def test_the_files_of_a_tune_are_derived_from_its_output():
    paths = TunePaths.from_output("policies/gpt2.yaml")
    assert (paths.policy, paths.profile, paths.study_db, paths.csv, paths.png) == (
        "policies/gpt2.yaml", "policies/gpt2.profile.json", "policies/gpt2.study.db",
        "policies/gpt2.pareto.csv", "policies/gpt2.pareto.png")
    assert StudyConfig().paths("my task/1").policy == "autoprec-my_task_1.yaml"
    assert StudyConfig(output="a/b.yaml").paths("t").study_db == "a/b.study.db"


def test_tune_config_groups_its_fields_and_keeps_keyword_construction():
    config = TuneConfig(n_trials=7, storage="journal:s.log", max_memory=2 ** 30,
                        timing={"repeats": 3})
    assert config.search == SearchConfig(n_trials=7, max_memory=2 ** 30)
    assert config.study == StudyConfig(storage="journal:s.log")
    assert config.timing == TimingConfig(repeats=3)
    assert (config.n_trials, config.storage, config.max_memory) == (7, "journal:s.log", 2 ** 30)
    grouped = TuneConfig(search=SearchConfig(n_trials=7, max_memory=2 ** 30),
                         study=StudyConfig(storage="journal:s.log"), timing=TimingConfig(repeats=3))
    assert grouped == config
    changed = config.replace(max_loss_increase=0.02, study_name="x", seed=3)
    assert changed.budget == Budget(0.02, config.budget.max_grad_error)
    assert (changed.study_name, changed.seed, changed.n_trials) == ("x", 3, 7)
    with pytest.raises(TypeError, match="n_trails"):
        TuneConfig(n_trails=3)
    with pytest.raises(ValueError, match="n_trials"):
        TuneConfig(n_trials=0)
    with pytest.raises(AttributeError):
        config.n_trails  # noqa: B018


def test_the_cli_takes_its_tune_defaults_from_the_config():
    from autoprec.cli import _parser

    args = _parser().parse_args(["tune", "t.py:task", "-o", "p.yaml"])
    search, study = SearchConfig(), StudyConfig()
    assert args.max_loss_increase == search.budget.max_loss_increase == DEFAULT_MAX_LOSS_INCREASE
    assert args.max_grad_error == search.budget.max_grad_error
    assert (args.n_trials, args.timeout, args.seed, args.sensitivity, args.max_memory) == \
        (search.n_trials, search.timeout, search.seed, search.sensitivity, search.max_memory)
    assert args.groups == str(search.grouping)
    assert (args.storage, args.study) == (study.storage, study.study_name)


def test_tune_help_prints_the_defaults_of_the_config():
    out = subprocess.run(["autoprec", "tune", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert f"(default {SearchConfig().n_trials})" in text
    assert f"(default {DEFAULT_MAX_LOSS_INCREASE:g} = {DEFAULT_MAX_LOSS_INCREASE:.0%})" in text


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
