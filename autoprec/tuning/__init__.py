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
from autoprec.tuning.space import SearchSpace, assignment_policy, group_layers
from autoprec.tuning.storage import open_storage
from autoprec.tuning.tune import evaluate_policy, tune
from autoprec.tuning.warmstart import milp_assignments, warm_starts

__all__ = ["tune", "TuneConfig", "SearchConfig", "StudyConfig", "TimingConfig", "Grouping",
           "TuneResult", "TrialResult", "evaluate_policy", "validate_front", "group_layers",
           "SearchSpace", "assignment_policy", "milp_assignments", "warm_starts", "open_storage"]
