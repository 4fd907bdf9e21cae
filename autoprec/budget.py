"""The gradient bias: a policy's persistent gradient error at a point of the run, and the rule
that judges it before any branch is trained.

A format's error in a gradient is mostly not noise but a bias: averaged over training batches
it shrinks far less than independent errors would (measured on byte LMs: a persistence of
0.70-0.90 for the scaled formats, where 1 is the same error every batch). A bias is what
training cannot average away, so it is what this measures:

    bias        = ||mean_b (g_policy - g_fp32)|| / ||mean_b g_fp32||
    persistence = ||mean_b (g_policy - g_fp32)|| / mean_b ||g_policy - g_fp32||

over ``batches`` training batches (the gradient of every trainable parameter, FP32 as the
truth), on the model as the certificate's reference run has trained it ``step`` steps in.
Where in the run matters: at initialisation every format reads small against a large
gradient; as the gradient shrinks, a fixed quantisation bias grows against it (on GPT-2,
round-to-nearest NVFP4 reads 0.17 at init, 0.71 halfway through a 200-step run).

The rule, :data:`RULE_RATIO` = 1/sqrt(3): "FP4 All the Way" (Chmiel et al., 2025) finds that
quantised training stops making progress once the gradient's norm falls below sqrt(3) times
the quantisation noise. A policy whose bias is at or above 1/sqrt(3) of the gradient is
predicted not to train like its reference at that point of the run. The ratio is the paper's,
not fitted here; BENCHMARKS.md gives how its prediction agrees with the certificate.
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass

import torch

from autoprec.certification import DEFAULT_STEPS, start_run, train_step, training_stream
from autoprec.formats import slow_16bit_dtypes
from autoprec.measure.numerics import prepare_for_measurement
from autoprec.policy import Policy
from autoprec.runtime import blockscale
from autoprec.runtime.fp8 import emulating
from autoprec.runtime.rewrite import apply, remove
from autoprec.task import Task

__all__ = ["GradientBias", "gradient_bias", "RULE_RATIO"]

# The largest bias (relative to the gradient) the rule admits: 1/sqrt(3), from "FP4 All the
# Way" (see the module docstring).
RULE_RATIO = 1 / math.sqrt(3)
DEFAULT_BATCHES = 8


@dataclass(frozen=True)
class GradientBias:
    """One measurement of a policy's gradient bias (see the module docstring)."""

    bias: float
    # 1: the same error on every batch; 1/sqrt(batches): independent errors; nan: no error
    persistence: float
    batches: int
    # reference steps trained before the measurement, of a run of `run_steps`
    step: int
    run_steps: int
    threshold: float = RULE_RATIO

    @property
    def admits(self) -> bool:
        """Whether the rule predicts the policy trains like its reference here."""
        return math.isfinite(self.bias) and self.bias < self.threshold

    def describe(self) -> str:
        return (f"gradient bias {self.bias:.3f} of the gradient at step {self.step} of "
                f"{self.run_steps} ({self.batches} batches, persistence "
                f"{self.persistence:.2f}): {'within' if self.admits else 'not within'} "
                f"{self.threshold:.3f}")


def gradient_bias(task: Task, policy: Policy, *, step: int = 0, run_steps: int = DEFAULT_STEPS,
                  batches: int = DEFAULT_BATCHES, strict: bool = True) -> GradientBias:
    """The gradient bias of ``policy`` after ``step`` steps of a BF16 reference run of
    ``run_steps`` steps (the run :func:`autoprec.certify` trains: same stream, seeds and
    cosine schedule), measured on ``batches`` batches the run has not trained on."""
    if not 0 <= step <= run_steps or batches < 2:
        raise ValueError(f"gradient_bias: need 0 <= step <= run_steps and batches >= 2, got "
                         f"step={step}, run_steps={run_steps}, batches={batches}")
    with emulating(slow_16bit_dtypes(task.device)):
        run = start_run(task, Policy(default="bf16"), max(1, run_steps), strict)
        for i, batch in enumerate(training_stream(task, step, task.seed + 1000)):
            train_step(task, run, batch, i)
        model = prepare_for_measurement(task.build_model())
        model.load_state_dict(run.model.state_dict())
        del run
        held = training_stream(task, batches, task.seed + 7777)
        sums, norms = _differences(task, model, policy, held, strict)
    mean_ref, mean_diff = sums
    bias = float(mean_diff.norm() / mean_ref.norm()) if mean_ref.norm() > 0 else math.inf
    mean_norm = statistics.fmean(norms)
    persistence = float(mean_diff.norm()) / mean_norm if mean_norm else math.nan
    return GradientBias(bias=bias, persistence=persistence, batches=batches, step=step,
                        run_steps=run_steps)


def _differences(task: Task, model: torch.nn.Module, policy: Policy, held: list,
                 strict: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], list[float]]:
    """The mean FP32 gradient and the mean policy-minus-FP32 difference over ``held``, and
    each batch's difference norm."""
    sum_ref = sum_diff = None
    norms = []
    for k, batch in enumerate(held):
        ref = _gradient(task, model, batch, k)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "fp8 only emulated here": said elsewhere
            apply(model, policy, strict=strict)
        try:
            diff = _gradient(task, model, batch, k) - ref
        finally:
            remove(model)
        sum_ref = ref if sum_ref is None else sum_ref + ref
        sum_diff = diff if sum_diff is None else sum_diff + diff
        norms.append(float(diff.norm()))
    return (sum_ref / len(held), sum_diff / len(held)), norms


def _gradient(task: Task, model: torch.nn.Module, batch, seed: int) -> torch.Tensor:
    """Every trainable parameter's gradient on ``batch``, flat, in float64 (zeros where a
    parameter gets none), with the batch's seeds (stochastic rounding included)."""
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(seed)
    blockscale.seed_rounding(seed)
    grads = torch.autograd.grad(task.loss(model, batch), params, allow_unused=True)
    return torch.cat([g.reshape(-1).double() if g is not None
                      else torch.zeros(p.numel(), dtype=torch.float64)
                      for p, g in zip(params, grads)])
