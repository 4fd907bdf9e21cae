"""A planted slow drift: one layer's weight grows by a fixed share every optimizer step, so its
fp16 outputs reach FP16's range (65504) around a chosen step.

Late FP8/FP16 trouble in real runs comes from activations that creep up over thousands of
steps (outliers after ~200B tokens, arXiv 2409.12517). This is a reproducible stand-in on the
bundled GPT-2 example: the guard's predictive check, ``autoprec recheck`` and
``benchmarks/bench_drift.py`` are tested on it.

    model = make_model(...)
    policy = drift_policy()                      # the drifting layer in fp16
    drift = plant_drift(model, optimizer, batch, overflow_at=300)
    ...train...; drift.remove()

The weight is first scaled so that, growing by ``rate`` per step, the layer's largest output
on ``batch`` would reach 65504 at step ``overflow_at``; then, after every ``optimizer.step()``,
multiplied by ``1 + rate``. Training moves the outputs too, so the real step differs a little.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

import autoprec

__all__ = ["DRIFT_LAYER", "Drift", "plant_drift", "drift_policy"]

# The layer that drifts: the second block's MLP output projection (an HF Conv1D).
DRIFT_LAYER = "transformer.h.1.mlp.c_proj"
FP16_MAX = float(torch.finfo(torch.float16).max)


@dataclass
class Drift:
    """A planted drift: which layer, how fast, and the hook that drives it."""

    fqn: str
    rate: float
    # the factor the weight was scaled by at the start
    start_scale: float
    # the step at which the outputs were aimed to reach FP16's max
    overflow_at: int
    handle: object

    def remove(self) -> None:
        """Stop the drift (the weight keeps what it has grown to)."""
        self.handle.remove()


def _output_amax(model: nn.Module, layer: nn.Module, batch: dict) -> float:
    seen: list[float] = []
    hook = layer.register_forward_hook(
        lambda m, args, out: seen.append(float(out.detach().abs().max())))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        hook.remove()
    return seen[0]


def plant_drift(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict, *,
                fqn: str = DRIFT_LAYER, rate: float = 0.01, overflow_at: int = 300) -> Drift:
    """Scale ``fqn``'s weight so its outputs on ``batch`` would reach FP16's max after
    ``overflow_at`` steps of ``rate`` growth, and grow it by ``rate`` after every step of
    ``optimizer``. Call before training (in FP32: the policy's regions are not needed)."""
    layer = model.get_submodule(fqn)
    amax = _output_amax(model, layer, batch)
    bias = getattr(layer, "bias", None)
    # the outputs are ~ weight * input + bias; aim the weight's share at the target
    scale = FP16_MAX / (amax * math.pow(1.0 + rate, overflow_at))
    with torch.no_grad():
        layer.weight.mul_(scale)
        if bias is not None:
            bias.mul_(scale)

    def grow(opt, args, kwargs):
        with torch.no_grad():
            layer.weight.mul_(1.0 + rate)
            if bias is not None:
                bias.mul_(1.0 + rate)

    handle = optimizer.register_step_post_hook(grow)
    return Drift(fqn=fqn, rate=rate, start_scale=scale, overflow_at=overflow_at, handle=handle)


def drift_policy(default: str = "fp32", fqn: str = DRIFT_LAYER, *,
                 others: str | None = "fp16") -> autoprec.Policy:
    """A policy for the GPT-2 example with the drifting layer in fp16 and every other block
    Linear in ``others`` (None: the default); the head stays in fp32."""
    layers = {}
    if others is not None:
        layers["transformer.h.*.attn.c_attn"] = others
        layers["transformer.h.*.attn.c_proj"] = others
        layers["transformer.h.*.mlp.c_fc"] = others
        layers["transformer.h.*.mlp.c_proj"] = others
    layers[fqn] = "fp16"
    layers["lm_head"] = "fp32"
    return autoprec.Policy(default=default, layers=layers)
