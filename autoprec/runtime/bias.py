"""The gradient bias of a policy, measured on a model, and the watch that lets it decide when a
phased run switches to its final phase.

The bias is the part of a format's gradient error that training cannot average away:

    bias        = ||mean_b (g_policy - g_fp32)|| / ||mean_b g_fp32||
    persistence = ||mean_b (g_policy - g_fp32)|| / mean_b ||g_policy - g_fp32||

over a few batches (every trainable parameter's gradient; FP32 is the truth; both sides of a
batch with the same seeds, so dropout masks and stochastic rounding are common). A
persistence near 1 is the same error every batch; ``1/sqrt(batches)``, independent errors.

The budget, :data:`DEFAULT_BIAS_BUDGET` = 0.21, is measured: on 2-layer byte LMs (HF Llama
and GPT-2) the bias halfway through the certificate's BF16 reference run separated the
policies whose certificate passes (at most 0.18) from those it does not (at least 0.25) over
18 model x policy pairs; tested on 18 others (the same families, half as wide) it agreed with
the certificate on 16, both misses rejecting a policy that passed (BENCHMARKS.md). The theory's
figure, :data:`RULE_RATIO` = 1/sqrt(3) from "FP4 All the Way" (Chmiel et al., 2025:
quantised training stops making progress once the gradient's norm falls below sqrt(3) times
the quantisation noise), admitted every one of those 36, including the 8 the certificate did
not pass. The gradient shrinks as a run converges and the LR decays while a format's bias does
not, so the ratio grows over the run (on a byte LM, round-to-nearest NVFP4 reads 0.17 at init,
0.3-0.5 later). :class:`BiasWatch` measures it every ``every`` steps during training and, when
it reaches the budget, brings a phased policy's final phase forward to that step: the
automatic "BF16 before the LR decay".

    phases = PhaseSwitcher(model, policy, total_steps=T)   # its last phase: the fallback
    watch = BiasWatch(model, held_batches, loss_fn, every=100)
    for step in range(T):
        phases.at(step)
        ...forward, backward, optimizer step...
        watch.after_step(step + 1)

What it costs: two forward/backward passes per held batch per measurement (``every=100``
with 4 batches: 8% more compute), two policy switches, no optimizer state. The training RNG
and the model's buffers (BatchNorm statistics) are left as they were.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoprec import blockscale
from autoprec.policy import DEFAULT_BIAS_BUDGET, Policy, PolicyError
from autoprec.runtime import rewrite
from autoprec.runtime.guard import get_guard
from autoprec.runtime.guard.demote import reapply
from autoprec.runtime.switcher import get_phases

__all__ = ["DEFAULT_BIAS_BUDGET", "RULE_RATIO", "GradientBias", "measure_bias", "BiasWatch",
           "FollowBias"]

logger = logging.getLogger(__name__)

# The theory's figure (see the module docstring); the measured budget, DEFAULT_BIAS_BUDGET,
# is the policy Budget's (autoprec.policy)
RULE_RATIO = 1 / math.sqrt(3)
_STATE_VERSION = 1


@dataclass(frozen=True)
class GradientBias:
    """One measurement of a policy's gradient bias (see the module docstring)."""

    bias: float
    # 1: the same error on every batch; 1/sqrt(batches): independent errors; nan: no error
    persistence: float
    batches: int
    # optimizer steps trained before the measurement, of a run of `run_steps` (None: unknown)
    step: int
    run_steps: int | None = None
    threshold: float = DEFAULT_BIAS_BUDGET

    @property
    def admits(self) -> bool:
        """Whether the budget says the policy still trains like its reference here."""
        return math.isfinite(self.bias) and self.bias < self.threshold

    def describe(self) -> str:
        of = f" of {self.run_steps}" if self.run_steps is not None else ""
        return (f"gradient bias {self.bias:.3f} of the gradient at step {self.step}{of} "
                f"({self.batches} batches, persistence {self.persistence:.2f}): "
                f"{'within' if self.admits else 'not within'} {self.threshold:.3f}")


@dataclass(frozen=True)
class FollowBias:
    """What a training integration's bias watch does (``follow_bias=`` of the HF and Lightning
    callbacks; an int N means ``FollowBias(every=N)``): every ``every`` optimizer steps, a
    reading on the run's first ``batches`` batches, against ``threshold``."""

    every: int = 100
    threshold: float = DEFAULT_BIAS_BUDGET
    batches: int = 4

    def __post_init__(self):
        for name, least in (("every", 1), ("batches", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"follow_bias: `{name}` must be a whole number >= {least}, "
                                 f"got {value!r}")
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            raise ValueError(f"follow_bias: `threshold` must be a positive number (the bias "
                             f"budget, default {DEFAULT_BIAS_BUDGET}), got {t!r}")

    @classmethod
    def coerce(cls, value: Any) -> FollowBias | None:
        if value is None or isinstance(value, FollowBias):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(every=value)
        raise ValueError(f"follow_bias takes a step count or a FollowBias, got "
                         f"{type(value).__name__}")


def measure_bias(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                 batches: Sequence[Any], use_policy: Callable[[bool], None]) -> tuple[float, float]:
    """(bias, persistence) of the policy that ``use_policy(True)`` puts ``model`` in, against
    FP32 (``use_policy(False)``), on ``batches``; the model is left in the policy."""
    sum_ref = sum_diff = None
    norms = []
    for k, batch in enumerate(batches):
        use_policy(False)
        ref = _gradient(model, loss_fn, batch, k)
        use_policy(True)
        diff = _gradient(model, loss_fn, batch, k) - ref
        sum_ref = ref if sum_ref is None else sum_ref + ref
        sum_diff = diff if sum_diff is None else sum_diff + diff
        norms.append(float(diff.norm()))
    if sum_ref is None:
        raise ValueError("measure_bias: no batches to measure on")
    bias = float(sum_diff.norm() / sum_ref.norm()) if sum_ref.norm() > 0 else math.inf
    mean_norm = statistics.fmean(norms)
    persistence = float(sum_diff.norm()) / len(norms) / mean_norm if mean_norm else math.nan
    return bias, persistence


def _gradient(model: nn.Module, loss_fn, batch: Any, seed: int) -> torch.Tensor:
    """Every trainable parameter's gradient on ``batch``, flat, float64 (zeros where one gets
    none), with the batch's seeds; no ``.grad`` is written."""
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(seed)
    blockscale.seed_rounding(seed)
    grads = torch.autograd.grad(loss_fn(model, batch), params, allow_unused=True)
    return torch.cat([g.detach().reshape(-1).double() if g is not None
                      else torch.zeros(p.numel(), dtype=torch.float64, device=p.device)
                      for p, g in zip(params, grads)]).cpu()


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


class BiasWatch:
    """Measures the applied policy's gradient bias every ``every`` optimizer steps on
    ``batches`` (held-out batches, the same every time) and, the first time it reaches
    ``threshold``, brings the model's phased policy to its final phase at that step (see the
    module docstring). Without a later phase it only logs. ``loss_fn(model, batch)`` returns
    the scalar loss. Not with a runtime guard (its watches would be re-made twice per
    measurement)."""

    def __init__(self, model: nn.Module, batches: Sequence[Any],
                 loss_fn: Callable[[nn.Module, Any], torch.Tensor], *, every: int = 100,
                 threshold: float = DEFAULT_BIAS_BUDGET):
        self.model = rewrite.unwrap(model)
        if rewrite.applied_policy(self.model) is None:
            raise PolicyError("BiasWatch: the model has no policy applied; autoprec.apply it "
                              "first (and make its PhaseSwitcher).")
        if get_guard(self.model) is not None:
            raise PolicyError("BiasWatch: not with a runtime guard (apply without guard=True), "
                              "whose watches a measurement would re-make twice.")
        if not (isinstance(every, int) and every >= 1) or not threshold > 0 or len(batches) < 2:
            raise ValueError(f"BiasWatch: need every >= 1, threshold > 0 and at least 2 "
                             f"batches, got every={every!r}, threshold={threshold!r}, "
                             f"{len(batches)} batches")
        self.batches, self.loss_fn = list(batches), loss_fn
        self.every, self.threshold = every, float(threshold)
        self.readings: list[GradientBias] = []
        self.switched_at: int | None = None

    def after_step(self, step: int) -> GradientBias | None:
        """Call after each optimizer step with the steps done; measures when ``step`` is a
        multiple of ``every``, until the final phase is in force. Returns the reading, or
        None."""
        if step % self.every or self.switched_at is not None:
            return None
        phases = get_phases(self.model)
        if phases is not None and len(phases.starts) > 1 and \
                phases.current == len(phases.starts) - 1:
            return None  # the final phase is in force: nothing left to decide
        reading = self._measure(step, phases.total_steps if phases is not None else None)
        self.readings.append(reading)
        logger.info("autoprec: %s", reading.describe())
        if not reading.admits:
            self._bring_final_phase_forward(phases, step, reading)
        return reading

    def _measure(self, step: int, run_steps: int | None) -> GradientBias:
        policy = rewrite.applied_policy(self.model)
        fp32 = Policy(default="fp32")
        current = [policy]

        def use_policy(on: bool) -> None:
            target = policy if on else fp32
            if current[0] is not target:
                reapply(self.model, current[0], target, lambda m, p: None)
                current[0] = target

        buffers = {k: b.detach().clone() for k, b in self.model.named_buffers()}
        with torch.random.fork_rng(devices=_cuda_devices(self.model)), \
                blockscale.forked_rounding():
            try:
                bias, persistence = measure_bias(self.model, self.loss_fn, self.batches,
                                                 use_policy)
            finally:
                use_policy(True)
                self._restore(buffers)
        return GradientBias(bias=bias, persistence=persistence, batches=len(self.batches),
                            step=step, run_steps=run_steps, threshold=self.threshold)

    def _restore(self, buffers: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k, b in self.model.named_buffers():
                if k in buffers:
                    b.copy_(buffers[k])

    def _bring_final_phase_forward(self, phases, step: int, reading: GradientBias) -> None:
        if phases is None or len(phases.starts) < 2 or phases.current == len(phases.starts) - 1:
            logger.warning("autoprec: step %d: %s, and no later phase to switch to",
                           step, reading.describe())
            return
        self.switched_at = step
        phases.bring_final_forward(step)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "switched_at": self.switched_at,
                "readings": [(r.step, r.bias, r.persistence) for r in self.readings]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a checkpoint's readings and switch (the PhaseSwitcher's own state carries
        the moved phase start)."""
        at = state.get("switched_at") if isinstance(state, Mapping) else None
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION \
                or not (at is None or (isinstance(at, int) and at >= 1)):
            raise PolicyError(f"Not an autoprec bias-watch state (version {_STATE_VERSION}): "
                              "resume without it or from its run.")
        try:
            readings = [GradientBias(bias=float(b), persistence=float(p),
                                     batches=len(self.batches), step=int(s),
                                     threshold=self.threshold)
                        for s, b, p in state.get("readings", [])]
        except (TypeError, ValueError):
            raise PolicyError("A bias-watch state whose `readings` are not (step, bias, "
                              "persistence) triples: resume without it or from its run.") from None
        self.switched_at, self.readings = at, readings
