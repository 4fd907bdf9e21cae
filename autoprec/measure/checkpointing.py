"""What activation checkpointing means to a measurement.

A model trained with ``torch.utils.checkpoint`` (HF's ``gradient_checkpointing_enable``,
torch's ``checkpoint_wrapper``, torchtitan's activation checkpointing) runs a checkpointed
region's forward again during the backward, to get back the tensors it did not keep. The
measurements' forward hooks (a layer's recorded calls, its outputs for the SQNR, the probe
passes' records) would take that replay for new calls of the same layers: a layer's outputs
counted twice, a probe pass's records out of step with the reference's calls. The replay
computes what the forward already did, so they ignore it (:func:`recomputing`).

A reentrant checkpoint (``use_reentrant=True``) cannot give the gradient of chosen inputs,
which every measurement takes (``torch.autograd.grad``): :func:`refuse_reentrant` turns
torch's error into one line that says what to change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["recomputing", "refuse_reentrant"]

# the prefix of the pack hook torch.utils.checkpoint installs while it recomputes a region
# (torch 2.4 to 2.13: a closure of ``_recomputation_hook.__init__``)
_RECOMPUTATION = "_recomputation_hook."


def recomputing() -> bool:
    """Whether a non-reentrant checkpoint is recomputing its region's forward now: the
    innermost saved-tensor hooks are the ones it installs for that."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    except (AttributeError, RuntimeError):  # pragma: no cover - a torch without it
        return False
    if not hooks:
        return False
    pack = getattr(hooks[0], "__wrapped__", hooks[0])
    return getattr(pack, "__qualname__", "").startswith(_RECOMPUTATION)


@contextlib.contextmanager
def refuse_reentrant() -> Iterator[None]:
    """Around a gradient computation: torch's error for a reentrant checkpoint becomes a
    ValueError that says how to checkpoint instead."""
    try:
        yield
    except RuntimeError as e:
        if "use_reentrant=True" not in str(e):
            raise
        raise ValueError(
            "The model checkpoints activations with use_reentrant=True, which cannot give the "
            "gradients of chosen tensors that autoprec measures; checkpoint with "
            "use_reentrant=False (HF: model.gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False})).") from None
