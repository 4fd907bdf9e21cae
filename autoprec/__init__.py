"""autoprec: measure each layer's numerics and speed in fp32/bf16/fp16/fp8, tune a per-layer
precision policy, and apply it in training.

The production path (``load_policy`` + ``apply``, the guard, the integrations) imports torch
and yaml only: capture, profiling, tuning (Optuna, SciPy, matplotlib) and validation load on
first use of their names.
"""

from __future__ import annotations

from autoprec.fingerprint import model_fingerprint
from autoprec.formats import Format
from autoprec.host import supported_formats
from autoprec.policy import Budget, LossScaling, Policy, PolicyError, load_policy
from autoprec.runtime import applied_formats, apply, remove
from autoprec.runtime.guard import GuardConfig, get_guard
from autoprec.task import Task, load_task

__version__ = "0.1.0"

# The public API, by stage: what users call (at most 30 names; tests/test_layout.py checks the
# list and its docstrings). The records these return (TuneResult, CertifyResult, RecheckResult,
# the Guard get_guard returns) stay importable from their modules; every name not listed here
# is internal and may change.
__all__ = [
    # task: the model, its batches and its loss
    "Task",
    "load_task",
    # formats
    "Format",
    "supported_formats",
    # capture and profile
    "capture",
    "profile",
    "Profile",
    # tune
    "tune",
    "TuneConfig",
    # certify
    "certify",
    # policy
    "Policy",
    "Budget",
    "LossScaling",
    "PolicyError",
    "load_policy",
    "model_fingerprint",
    # apply and train
    "apply",
    "remove",
    "applied_formats",
    "GuardConfig",
    "get_guard",
    "training_kit",
    "PolicyCallback",
    # re-check (autoprec.recheck.recheck is the function: the module shares its name)
    "Rechecker",
    # export
    "export",
]

_LAZY = {
    "capture": "autoprec.measure.capture",
    "profile": "autoprec.profiling", "Profile": "autoprec.profiling",
    "tune": "autoprec.tuning", "TuneConfig": "autoprec.tuning",
    "certify": "autoprec.certification",
    "training_kit": "autoprec.integrations",
    "PolicyCallback": "autoprec.integrations",
    "export": "autoprec.exporting",
    "Rechecker": "autoprec.recheck",
}


def __getattr__(name: str):
    # Stages beyond apply load on first use, so a training job that only applies a policy
    # never imports Optuna, SciPy or matplotlib.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autoprec' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
