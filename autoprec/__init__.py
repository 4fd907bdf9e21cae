"""autoprec: measure each layer's numerics and speed in fp32/bf16/fp16/fp8, tune a per-layer
precision policy, and apply it in training.

The production path (``load_policy`` + ``apply``, the guard, the integrations) imports torch
and yaml only: capture, profiling, tuning (Optuna, SciPy, matplotlib) and validation load on
first use of their names.
"""

from __future__ import annotations

from autoprec.fingerprint import model_fingerprint
from autoprec.formats import Format, Support, supported_formats
from autoprec.graph import Layer, LayerGraph
from autoprec.policy import (
    Budget,
    LossScaling,
    Policy,
    PolicyError,
    Provenance,
    load_policy,
)
from autoprec.runtime import applied_formats, apply, remove
from autoprec.runtime.guard import Guard, GuardConfig, GuardEvent, get_guard
from autoprec.task import Task, load_task

__version__ = "0.1.0"

__all__ = [
    # task
    "Task",
    "load_task",
    # formats
    "Format",
    "Support",
    "supported_formats",
    # capture
    "capture",
    "Layer",
    "LayerGraph",
    "CaptureError",
    # profile
    "profile",
    "Profile",
    # tune
    "tune",
    "TuneConfig",
    "TuneResult",
    "Grouping",
    # certify
    "certify",
    "Certificate",
    "CertifyResult",
    # policy
    "Policy",
    "Budget",
    "Provenance",
    "LossScaling",
    "PolicyError",
    "load_policy",
    "model_fingerprint",
    # apply
    "apply",
    "remove",
    "applied_formats",
    "Guard",
    "GuardConfig",
    "GuardEvent",
    "get_guard",
    "training_kit",
    "PolicyCallback",
    "PhaseSwitcher",
    "get_phases",
    # re-check (autoprec.recheck.recheck is the function: the module shares its name)
    "Rechecker",
    "RecheckResult",
    # export
    "export",
]

_LAZY = {
    "capture": "autoprec.measure.capture", "CaptureError": "autoprec.measure.capture",
    "profile": "autoprec.profiling", "Profile": "autoprec.profiling",
    "tune": "autoprec.tuning", "TuneConfig": "autoprec.tuning",
    "TuneResult": "autoprec.tuning", "Grouping": "autoprec.tuning",
    "certify": "autoprec.certification", "CertifyResult": "autoprec.certification",
    "Certificate": "autoprec.certificate",
    "training_kit": "autoprec.integrations",
    "PolicyCallback": "autoprec.integrations",
    "export": "autoprec.exporting",
    "PhaseSwitcher": "autoprec.runtime.switcher", "get_phases": "autoprec.runtime.switcher",
    "Rechecker": "autoprec.recheck",
    "RecheckResult": "autoprec.recheck",
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
