"""autoprec: measure each layer's numerics and speed in fp32/bf16/fp16/fp8, tune a per-layer
precision policy, and apply it in training.

The production path (``load_policy`` + ``apply``) imports neither Optuna nor SciPy: the
search (``tune``) and validation load on first use.
"""

from __future__ import annotations

from autoprec.formats import Format, Support, supported_formats
from autoprec.policy import LossScaling, Policy, PolicyError, load_policy, model_fingerprint
from autoprec.rewrite import applied_formats, apply, remove
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
    "TuneResult",
    "validate",
    "ValidationResult",
    # policy
    "Policy",
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
]

_LAZY = {
    "capture": "autoprec.graph", "Layer": "autoprec.graph", "LayerGraph": "autoprec.graph",
    "CaptureError": "autoprec.graph",
    "profile": "autoprec.profile", "Profile": "autoprec.profile",
    "tune": "autoprec.search", "TuneResult": "autoprec.search",
    "validate": "autoprec.validate", "ValidationResult": "autoprec.validate",
    "Guard": "autoprec.guard", "GuardConfig": "autoprec.guard", "GuardEvent": "autoprec.guard",
    "get_guard": "autoprec.guard",
    "training_kit": "autoprec.integrations", "PolicyCallback": "autoprec.integrations",
}


def __getattr__(name: str):
    # Stages beyond apply load on first use, so a training job that only applies a policy
    # never imports Optuna or SciPy.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autoprec' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
