"""The gradient bias of a policy at a point of the certificate's reference run: the budget's
measurement, taken where the run will be rather than on the untrained model.

What the bias is and the budget that judges it (:data:`DEFAULT_BIAS_BUDGET`, measured against
certificates; the theory's :data:`RULE_RATIO`): :mod:`autoprec.runtime.bias`, which also
measures it during training. Here the
model is the certificate's own BF16 reference run (:func:`autoprec.certify`: same training
stream, per-step seeds and cosine schedule) trained ``step`` steps in, and the held batches
come from a stream of their own. Where in the run matters: at initialisation every format
reads small against a large gradient; as the gradient shrinks, a fixed quantisation bias grows
against it. How the rule's admissions agree with certificates: BENCHMARKS.md
(benchmarks/bench_certificate.py --part verdicts).
"""

from __future__ import annotations

import warnings

from torch import nn

from autoprec.certification import DEFAULT_STEPS, start_run, train_step, training_stream
from autoprec.host import slow_16bit_dtypes
from autoprec.measure.deviation import prepare_for_measurement
from autoprec.policy import Policy
from autoprec.runtime.bias import DEFAULT_BIAS_BUDGET, RULE_RATIO, GradientBias, measure_bias
from autoprec.runtime.fp8 import emulating
from autoprec.runtime.rewrite import apply, remove
from autoprec.task import Task

__all__ = ["gradient_bias", "trained_model", "held_batches", "DEFAULT_BIAS_BUDGET", "RULE_RATIO",
           "GradientBias", "DEFAULT_BATCHES"]

# Held batches the bias is measured on (the evidence behind DEFAULT_BIAS_BUDGET used 8).
DEFAULT_BATCHES = 8
_HELD_SEED = 7777


def trained_model(task: Task, step: int, run_steps: int | None = None, *,
                  strict: bool = True) -> nn.Module:
    """The task's model (FP32) trained ``step`` steps into the certificate's BF16 reference run
    of ``run_steps`` steps (default ``2 * step``: halfway, where the budget was measured):
    the stream, per-step seeds and cosine schedule of :func:`autoprec.certify`."""
    run_steps = 2 * step if run_steps is None else run_steps
    if not 0 <= step <= run_steps:
        raise ValueError(f"trained_model: need 0 <= step <= run_steps, got step={step}, "
                         f"run_steps={run_steps}")
    with emulating(slow_16bit_dtypes(task.device)):
        run = start_run(task, Policy(default="bf16"), max(1, run_steps), strict)
        for i, batch in enumerate(training_stream(task, step, task.seed + 1000)):
            train_step(task, run, batch, i)
    model = task.build_model()
    model.load_state_dict(run.model.state_dict())
    return model


def held_batches(task: Task, batches: int = DEFAULT_BATCHES) -> list:
    """``batches`` batches of the task's training stream drawn with a seed of their own, apart
    from the ones the reference run trains on (with a task that has no ``train_batches``,
    both come from its calibration batches, so they overlap): where the bias is measured."""
    return list(training_stream(task, batches, task.seed + _HELD_SEED))


def gradient_bias(task: Task, policy: Policy, *, step: int = 0, run_steps: int = DEFAULT_STEPS,
                  batches: int = DEFAULT_BATCHES, strict: bool = True) -> GradientBias:
    """The gradient bias of ``policy`` after ``step`` steps of a BF16 reference run of
    ``run_steps`` steps (the run :func:`autoprec.certify` trains: same stream, seeds and
    cosine schedule), measured on ``batches`` batches the run has not trained on."""
    if not 0 <= step <= run_steps or batches < 2:
        raise ValueError(f"gradient_bias: need 0 <= step <= run_steps and batches >= 2, got "
                         f"step={step}, run_steps={run_steps}, batches={batches}")
    model = prepare_for_measurement(trained_model(task, step, run_steps, strict=strict))

    def use_policy(on: bool) -> None:
        remove(model)
        if on:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "fp8 only emulated here": said elsewhere
                apply(model, policy, strict=strict)

    with emulating(slow_16bit_dtypes(task.device)):
        try:
            bias, persistence = measure_bias(model, task.loss, held_batches(task, batches),
                                             use_policy)
        finally:
            remove(model)
    return GradientBias(bias=bias, persistence=persistence, batches=batches, step=step,
                        run_steps=run_steps)
