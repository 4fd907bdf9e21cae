"""Tuning: search a per-layer precision policy for a task.

Parts: :mod:`~autoprec.tuning.config` (what to search for, and the files a tune writes),
:mod:`~autoprec.tuning.space` (units and offered formats), :mod:`~autoprec.tuning.warmstart`
(uniform policies and the integer program), :mod:`~autoprec.tuning.evaluate` (a trial's
numerics and timing), :mod:`~autoprec.tuning.select` (the significant winner),
:mod:`~autoprec.tuning.storage` (Optuna storages, the study handle),
:mod:`~autoprec.tuning.report` (trial records, results, files, provenance),
:mod:`~autoprec.tuning.front` (validation with fallback) and :mod:`~autoprec.tuning.tune`
(the orchestrator). Loads Optuna, SciPy and matplotlib; production never imports it.
"""

from __future__ import annotations

from autoprec.tuning.config import Grouping, SearchConfig, StudyConfig, TimingConfig, TuneConfig
from autoprec.tuning.front import validate_front
from autoprec.tuning.report import TrialResult, TuneResult
from autoprec.tuning.tune import evaluate_policy, tune

# What a user calls: the tune, its settings and results, and the two steps the CLI also runs
# on their own (judge one policy; validate the front with fallback). The parts' own helpers
# (the search space, warm starts, storages) are imported from their modules.
__all__ = ["tune", "TuneConfig", "SearchConfig", "StudyConfig", "TimingConfig", "Grouping",
           "TuneResult", "TrialResult", "evaluate_policy", "validate_front"]
