"""The model fingerprint: which architecture a policy was made for, as one hash.

A policy names the model it was tuned on (``model.fingerprint``); ``Policy.check_model``
compares it with the model it is applied to.
"""

from __future__ import annotations

import hashlib

from torch import nn

from autoprec._util import class_name

__all__ = ["model_fingerprint"]


def model_fingerprint(model: nn.Module) -> str:
    """``sha256:<hex>`` of the model's layer list: fqn, class name and parameter shapes of every
    module that owns parameters. Same architecture and sizes -> same fingerprint; weights and
    dtypes do not enter it.

    Args:
        model: the model.

    Returns:
        ``"sha256:<hex>"``, what a policy's ``fingerprint`` holds.
    """
    h = hashlib.sha256()
    for fqn, module in model.named_modules():
        params = [(n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False)]
        if not params:
            continue
        h.update(f"{fqn}|{class_name(module)}|{params}\n".encode())
    return f"sha256:{h.hexdigest()}"
