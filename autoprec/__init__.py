"""autoprec: measure each layer's numerics and speed in fp32/bf16/fp16/fp8, tune a per-layer
precision policy, and apply it in training.

The production path (``load_policy`` + ``apply``) imports neither Optuna nor SciPy.
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
]
