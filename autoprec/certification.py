"""certify(): does this policy train like its reference? Paired branches from one reference run,
an interval, and a verdict of three: pass, fail, undecided.

Two runs that differ only in precision drift apart by training's own chaos: a perturbation
of the weights grows step by step, so whole runs compared at their end (even from one init,
on one batch order) scatter almost as widely as runs on different batch orders, and a format
can look fine or bad by luck (measured on a byte LM: one NVFP4 pair +2.5%, the next -0.3%).
The certificate limits how far chaos can amplify, and pairs everything else:

1. **One reference run** (BF16 by default) trains ``steps`` steps from the task's init on its
   training stream, with a cosine learning rate. At ``branches`` points spread over the run it
   keeps its state (weights, optimizer, schedule).
2. **A branch** starts the policy from one such state and trains ``horizon`` steps on the
   batches the reference trains on next, with the same per-step seeds (dropout masks,
   stochastic rounding: :func:`autoprec.blockscale.seed_rounding`); the reference's
   own run is the other side of the pair. Both are judged on the same held-out batches; the
   branch's gap is ``(policy - reference) / reference``.
3. **The interval** over the branches' gaps is Student's t: the mean damage of a window of
   ``horizon`` steps, over where in the run the window lies. Branches run in an order that
   covers the run evenly (first, last, middle, ...); the interval is looked at after
   ``min_branches`` and each time the count doubles, and the certificate stops at the first
   look that decides: **pass** when its upper end is within ``tolerance``, **fail** when its
   lower end is beyond it (or the policy's loss is not finite), else, when every branch has
   run, **undecided** (train longer, branch more). Every look is paid for: each interval is at
   ``1 - (1 - confidence) / looks``, so stopping early decides wrongly no more often than one
   look at ``confidence`` would.

The tolerance is relative held-out loss after ``horizon`` steps from a common state. Its
default, :data:`DEFAULT_TOLERANCE` = 0.5%, is the field's mark for a low-precision recipe that
trains like BF16: NVIDIA's NVFP4 study holds its recipe with a BF16 tail to 0.5% (and counts
1.5% without one as a gap worth fixing), DeepSeek-V3 kept its FP8 run within 0.25%. A window
of training accumulates less damage than a whole run (measured on a byte LM: round-to-nearest
NVFP4 +0.8% over 50-step windows, +1.2% over 100-step ones, +5.5% over a whole 250-step run),
so the window is held to the tight end of that range. Name your own where the run you care
about differs.

What it costs: ``steps`` reference steps (plus evaluations) and at most
``branches * horizon`` policy steps, in memory the reference's states at the branch points
(CPU copies of weights and optimizer state) and two models.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import statistics
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autoprec import blockscale
from autoprec._util import log, optimizer_step, shown
from autoprec.certificate import HELD_EQUAL, Certificate, verdict_of
from autoprec.host import slow_16bit_dtypes
from autoprec.policy import Policy, load_policy
from autoprec.runtime.fp8 import emulating
from autoprec.runtime.rewrite import apply
from autoprec.runtime.switcher import PhaseSwitcher
from autoprec.task import Task

__all__ = ["certify", "CertifyConfig", "CertifyResult", "DEFAULT_TOLERANCE", "DEFAULT_STEPS",
           "DEFAULT_BRANCHES", "REFERENCES", "start_run", "train_step", "training_stream",
           "held_out_loss"]

# The largest relative held-out loss gap that passes (see the module docstring for why).
DEFAULT_TOLERANCE = 0.005
DEFAULT_STEPS = 200
DEFAULT_BRANCHES = 8
DEFAULT_MIN_BRANCHES = 4
# References named by a format (every layer in it) rather than by a policy file.
REFERENCES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class CertifyConfig:
    """How a certificate is measured (see the module docstring); every field checked."""

    # Steps of the reference run the branches start from.
    steps: int = DEFAULT_STEPS
    # Steps each branch trains; None: half of `steps`.
    horizon: int | None = None
    # Branch points spread over the run.
    branches: int = DEFAULT_BRANCHES
    # Branches before the first look; then a look each time the count doubles, and at the end.
    min_branches: int = DEFAULT_MIN_BRANCHES
    # The largest relative held-out loss gap that passes (below 0: the policy must beat the
    # reference by that much).
    tolerance: float = DEFAULT_TOLERANCE
    # The verdict's confidence over all its looks.
    confidence: float = 0.95
    # Stop at the first look that decides (False: one look, after every branch).
    sequential: bool = True

    def __post_init__(self):
        for name, least in (("steps", 2), ("branches", 2), ("min_branches", 2)):
            _whole(getattr(self, name), name, least)
        if self.horizon is not None:
            _whole(self.horizon, "horizon", 1)
        if self.window > self.steps:
            raise ValueError(f"certify: a branch of {self.window} steps does not fit in a "
                             f"{self.steps}-step reference run; give horizon <= steps.")
        if self.min_branches > self.branches:
            raise ValueError(f"certify: min_branches ({self.min_branches}) exceeds branches "
                             f"({self.branches}).")
        tol = self.tolerance
        if isinstance(tol, bool) or not (isinstance(tol, (int, float)) and -1 < tol < 1):
            raise ValueError(f"certify needs -1 < tolerance < 1 (a relative loss gap; below 0 "
                             f"the policy must beat the reference), got {tol!r}.")
        if not (isinstance(self.confidence, float) and 0.5 <= self.confidence < 1):
            raise ValueError(f"certify needs 0.5 <= confidence < 1, got {self.confidence!r}.")

    @property
    def window(self) -> int:
        """Steps each branch trains: ``horizon``, or half of ``steps``."""
        return self.horizon if self.horizon is not None else max(1, self.steps // 2)

    def replace(self, **options: Any) -> CertifyConfig:
        """A copy with ``options`` changed (an unknown one is a one-line error)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = [k for k in options if k not in known]
        if unknown:
            raise ValueError(f"certify has no option {unknown[0]!r}; its options are "
                             f"{', '.join(sorted(known))}.")
        return dataclasses.replace(self, **options)


def _whole(value: Any, name: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"certify needs {name} >= {least} (a whole number), got {value!r}.")


@dataclass
class CertifyResult:
    """What :func:`certify` measured: the certificate and the numbers behind it."""

    certificate: Certificate
    # branch start step -> (reference held-out loss, policy held-out loss) at its end
    losses: dict[int, tuple[float, float]] = field(default_factory=dict)
    # the reference run's training losses, step by step
    reference_curve: list[float] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return self.certificate.verdict

    @property
    def passed(self) -> bool:
        return self.certificate.verdict == "pass"

    def report(self) -> str:
        """A table of the branches, then the verdict line."""
        c = self.certificate
        lines = [f"certificate: {c.branches} branches of {c.horizon} steps from a {c.steps}-step "
                 f"{shown(c.reference)} run"]
        lines.append("  from step  reference   policy     gap")
        for start in sorted(self.losses):
            ref, pol = self.losses[start]
            lines.append(f"  {start:9d}  {ref:9.4f}  {pol:9.4f}  {_gap(pol, ref):+7.2%}")
        lines.append("  " + c.describe())
        if c.verdict == "undecided":
            lines.append("  undecided: the interval straddles the tolerance; more branches "
                         "(--branches) or a longer run (--steps) would narrow it")
        return "\n".join(lines)


def _reference_policy(reference: str | Policy | os.PathLike) -> tuple[str, Policy | None]:
    """The reference as (its name in the certificate, the policy it trains under): ``"bf16"``
    (every layer in bf16), ``"fp32"`` (no policy), a :class:`Policy` or a policy file."""
    if isinstance(reference, Policy):
        return f"policy {reference.digest()[:19]}", reference
    text = os.fspath(reference)
    if text in REFERENCES:  # fp32 is the model as it is: no policy
        return text, None if text == "fp32" else Policy(default=text)
    policy = load_policy(text)
    return f"policy {policy.digest()[:19]}", policy


def certify(task: Task, policy: Policy, config: CertifyConfig | None = None, *,
            reference: str | Policy = "bf16", strict: bool = True, progress: bool = True,
            **options: Any) -> CertifyResult:
    """Train ``policy`` against ``reference`` in paired branches and judge the held-out loss
    gap (see the module docstring).

    Args:
        task: the model, its training stream (``train_batches``, else the calibration batches
            in a seeded order), held-out ``eval_batches`` and optimizer.
        policy: the policy to certify.
        config: how (:class:`CertifyConfig`); ``options`` override its fields.
        reference: ``"bf16"`` (default), ``"fp32"``, or a policy (object or file).
        strict: a policy made for another model is an error (as in ``apply``).
        progress: one line per branch on stderr.
        **options: ``config``'s fields by name (``steps=400``, ``tolerance=0.01``,
            ``sequential=False``, ...), overriding it.

    Returns:
        A :class:`CertifyResult`; its ``certificate`` goes into the policy's provenance
        (``policy.with_certificate(...)``).
    """
    cfg = (config or CertifyConfig()).replace(**options)
    ref_name, ref_policy = _reference_policy(reference)
    starts = _branch_points(cfg.steps, cfg.window, cfg.branches)
    looks = _looks(len(starts), min(cfg.min_branches, len(starts)), cfg.sequential)
    level = 1 - (1 - cfg.confidence) / len(looks)
    batches = training_stream(task, cfg.steps, task.seed + 1000)
    eval_batches = list(task.eval_batches if task.eval_batches is not None else task.batches[-2:])
    log(f"certify: {ref_name} reference run of {cfg.steps} steps, then up to {len(starts)} "
        f"branches of {cfg.window} steps", progress)
    pairs = _Pairs(task, policy, batches, eval_batches, cfg.window, strict)
    # hosts without 16-bit matmul units train the 16-bit GEMMs emulated: the same values
    with emulating(slow_16bit_dtypes(task.device)):
        curve = pairs.reference(ref_policy, starts)
        pairs.branches(_spread(starts), looks, level, cfg.tolerance, progress)
    cert = _certificate(pairs, policy, ref_name, cfg, level, len(starts))
    return CertifyResult(certificate=cert, losses=pairs.losses, reference_curve=curve)


def _certificate(pairs: _Pairs, policy: Policy, ref_name: str, cfg: CertifyConfig,
                 level: float, planned: int) -> Certificate:
    gaps = pairs.gaps
    finite = all(map(math.isfinite, gaps))
    mean = statistics.fmean(gaps) if finite else math.inf
    low, high = _interval(gaps, level) if finite else (math.inf, math.inf)
    losses = pairs.losses
    return Certificate(
        reference=ref_name, digest=policy.digest(), design="branches", steps=cfg.steps,
        horizon=cfg.window, branches=len(gaps), tokens=_tokens(pairs.batches[:cfg.window]),
        policy_steps=len(gaps) * cfg.window, gap=mean, low=low, high=high,
        confidence=round(level, 6), tolerance=cfg.tolerance,
        verdict=verdict_of(low, high, cfg.tolerance, finite=finite), held_equal=HELD_EQUAL,
        gaps=tuple(_gap(losses[s][1], losses[s][0]) for s in sorted(losses)),
        stopped_early=len(gaps) < planned)


def _looks(n: int, first: int, sequential: bool) -> set[int]:
    """After how many branches the interval is looked at: ``first``, doubling, and ``n``."""
    if not sequential:
        return {n}
    looks, k = {n}, first
    while k < n:
        looks.add(k)
        k *= 2
    return looks


def _branch_points(steps: int, horizon: int, branches: int) -> list[int]:
    """``branches`` distinct start steps spread evenly over ``[0, steps - horizon]``."""
    last = steps - horizon
    points = sorted({round(k * last / (branches - 1)) for k in range(branches)})
    return points


def _spread(starts: Sequence[int]) -> list[int]:
    """``starts`` in an order whose every prefix covers the run evenly: first, last, then the
    middles of the widest gaps (a sequential stop judges the whole run, not its beginning)."""
    if len(starts) <= 2:
        return list(starts)
    order = [0, len(starts) - 1]
    intervals = [(0, len(starts) - 1)]
    while len(order) < len(starts):
        intervals.sort(key=lambda ab: ab[0] - ab[1])  # widest first
        a, b = intervals.pop(0)
        if b - a < 2:
            continue
        mid = (a + b) // 2
        order.append(mid)
        intervals += [(a, mid), (mid, b)]
    return [starts[i] for i in order]


def _interval(gaps: Sequence[float], level: float) -> tuple[float, float]:
    from scipy import stats

    n = len(gaps)
    mean = statistics.fmean(gaps)
    if n < 2:
        return -math.inf, math.inf
    half = stats.t.ppf(0.5 + level / 2, n - 1) * statistics.stdev(gaps) / math.sqrt(n)
    return mean - half, mean + half


def _gap(policy_loss: float, reference_loss: float) -> float:
    if not math.isfinite(policy_loss):
        return math.inf
    return (policy_loss - reference_loss) / abs(reference_loss)


# ------------------------------------------------------------------------------ training
@dataclass
class Run:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    # a phased policy's switch, called before each step (None: no phases)
    phases: PhaseSwitcher | None = None


def start_run(task: Task, policy: Policy | None, total_steps: int, strict: bool) -> Run:
    """A fresh model from ``task`` with ``policy`` applied (None: FP32), its optimizer, the
    cosine schedule of a ``total_steps`` run, a loss scaler where the policy needs one."""
    model = task.build_model().train()
    scaler = phases = None
    if policy is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "fp8 only emulated here": said by the tune
            apply(model, policy, strict=strict)
        scaler = policy.grad_scaler(task.device)
        scaler = scaler if scaler.is_enabled() else None
        if policy.phases:
            phases = PhaseSwitcher(model, policy, total_steps=total_steps)
    opt = task.make_optimizer(model.parameters())
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps)
    return Run(model, opt, schedule, scaler, phases)


def train_step(task: Task, run: Run, batch: Any, step: int) -> float:
    """One training step with the step's own seeds (the same in every run at this step)."""
    if run.phases is not None:
        run.phases.at(step)
    seed = task.seed * 1_000_003 + step
    torch.manual_seed(seed)
    blockscale.seed_rounding(seed)
    loss = task.loss(run.model, batch)
    optimizer_step(loss, run.optimizer, run.scaler)
    with warnings.catch_warnings():
        # a loss scaler skips the steps whose gradients overflow (the first ones, while its
        # scale comes down); the schedule still counts them, as in the reference run
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        run.schedule.step()
    return float(loss.detach())


def held_out_loss(task: Task, model: torch.nn.Module, batches: Sequence[Any]) -> float:
    """The mean loss of ``model`` on ``batches``, in eval mode, without gradients."""
    model.eval()
    try:
        with torch.no_grad():
            return statistics.fmean(float(task.loss(model, b)) for b in batches)
    finally:
        model.train()


def _snapshot(run: Run) -> dict[str, Any]:
    return {"model": {k: v.detach().to("cpu", copy=True) for k, v in
                      run.model.state_dict().items()},
            "optimizer": copy.deepcopy(run.optimizer.state_dict()),
            "schedule": run.schedule.state_dict()}


class _Pairs:
    """The reference run and the policy's branches from it, with what they measured."""

    def __init__(self, task, policy, batches, eval_batches, horizon, strict):
        self.task, self.policy, self.batches = task, policy, batches
        self.eval_batches, self.horizon, self.strict = eval_batches, horizon, strict
        self.states: dict[int, dict[str, Any]] = {}
        self.ref_evals: dict[int, float] = {}
        # branch start -> (reference, policy) held-out loss; the gaps in the order run
        self.losses: dict[int, tuple[float, float]] = {}
        self.gaps: list[float] = []

    def reference(self, ref_policy: Policy | None, starts: Sequence[int]) -> list[float]:
        """Train the reference, keeping its state at each branch start and its held-out loss
        ``horizon`` steps after each; its training curve."""
        task, batches = self.task, self.batches
        run = start_run(task, ref_policy, len(batches), self.strict)
        ends: dict[int, list[int]] = {}
        for s in starts:
            ends.setdefault(s + self.horizon, []).append(s)
        curve = []
        for step in range(len(batches) + 1):  # `step` steps done
            if step in ends:
                loss = held_out_loss(task, run.model, self.eval_batches)
                if not math.isfinite(loss):
                    raise ValueError(f"certify: the reference's own held-out loss is {loss} "
                                     f"after {step} steps: the reference diverges, so nothing "
                                     "can be judged against it. Give another --reference, or "
                                     "a task whose optimizer trains it stably.")
                self.ref_evals.update(dict.fromkeys(ends[step], loss))
            if step in starts:
                self.states[step] = _snapshot(run)
            if step < len(batches):
                curve.append(train_step(task, run, batches[step], step))
        return curve

    def branches(self, order: Sequence[int], looks: set[int], level: float, tolerance: float,
                 progress: bool) -> None:
        """Run the branches in ``order`` until a look decides or a branch diverges."""
        for n, start in enumerate(order, start=1):
            pol, ref = self._branch(start), self.ref_evals[start]
            self.losses[start] = (ref, pol)
            self.gaps.append(_gap(pol, ref))
            log(f"certify: branch {n}/{len(order)} from step {start}: held-out loss {pol:.4f} "
                f"vs {ref:.4f}, gap {self.gaps[-1]:+.3%}", progress)
            if not math.isfinite(self.gaps[-1]):
                return
            if n in looks and verdict_of(*_interval(self.gaps, level), tolerance) != "undecided":
                return

    def _branch(self, start: int) -> float:
        """The policy trained ``horizon`` steps from the reference's state at ``start``, on
        the batches the reference trained on next; its held-out loss (inf: it diverged)."""
        state = self.states.pop(start)
        run = start_run(self.task, self.policy, len(self.batches), self.strict)
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.schedule.load_state_dict(state["schedule"])
        for step in range(start, start + self.horizon):
            if not math.isfinite(train_step(self.task, run, self.batches[step], step)):
                return math.inf
        return held_out_loss(self.task, run.model, self.eval_batches)


def training_stream(task: Task, steps: int, order_seed: int) -> list[Any]:
    """``steps`` training batches: the task's stream, else its calibration batches in an
    order seeded by ``order_seed``."""
    if task.train_batches is not None:
        return list(task.train_batches(steps, order_seed))
    gen = torch.Generator().manual_seed(order_seed)
    n, out = len(task.batches), []
    while len(out) < steps:
        out.extend(task.batches[i] for i in torch.randperm(n, generator=gen).tolist())
    return out[:steps]


def _tokens(batches: Sequence[Any]) -> int | None:
    """Token ids trained on in ``batches``: the first integer tensor of each (input ids)."""
    total = 0
    for batch in batches:
        ids = next((t for t in _tensors(batch) if not t.is_floating_point()), None)
        if ids is None:
            return None
        total += ids.numel()
    return total


def _tensors(batch: Any):
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)
