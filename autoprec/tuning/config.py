"""What a tune searches for and how: :class:`TuneConfig`, grouped into :class:`SearchConfig`
(with :class:`~autoprec.policy.Budget` and :class:`Grouping`), :class:`StudyConfig` and
:class:`TimingConfig`, checked before any work starts; and :class:`TunePaths`, the files a
tune writes beside its policy."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autoprec.formats import FORMAT_ORDER, Format, Support, expand_formats, per_gemm
from autoprec.measure.deviation import check_reference_gradients
from autoprec.measure.sensitivity import check_sensitivity_mode
from autoprec.policy import DEFAULT_BIAS_BUDGET, Budget
from autoprec.pricing import CostSource

__all__ = ["TuneConfig", "SearchConfig", "StudyConfig", "TimingConfig", "Grouping", "TunePaths",
           "per_gemm_candidates"]


class Grouping(str, enum.Enum):
    """How layers become search units."""

    # One unit per layer while there are at most 16 layers, same-role groups beyond.
    AUTO = "auto"
    # One unit per layer.
    LAYER = "layer"
    # Same-role layers share a unit, named by their glob (transformer.h.*.mlp.c_fc).
    ROLE = "role"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TimingConfig:
    """How the search times policies (see :mod:`autoprec.measure.timer`)."""

    # Repetitions per round of the A/A check and the final re-timing (the minimum is kept).
    repeats: int = 2
    # Rounds per trial, the trial's policy against fp32, paired, one step each: a trial's
    # time only guides the sampler; the final re-timing decides.
    trial_rounds: int = 4
    trial_repeats: int = 1
    # Extra rounds a trial gets when its result contradicts the profile's prediction.
    recheck_rounds: int = 3
    # Leading feasible policies re-timed at the end (besides the best warm start).
    finalists: int = 4
    # Rounds of the final re-timing before the first verdict (fewer make the bootstrap
    # interval too narrow), then added four at a time.
    final_rounds: int = 10
    # The final re-timing stops at this many rounds or this many seconds, decided or not.
    max_final_rounds: int = 40
    final_seconds: float = 180.0
    # A/A noise (a true tie measured this far from 1) above which the machine is too noisy to
    # decide a winner by timing.
    noise_limit: float = 0.10
    # Finalists whose ratio to the leader is within this of 1, interval and all, are as fast
    # as it for any purpose: the re-timing stops and the tie-break decides.
    equivalence: float = 0.03
    # How far a measured step-time ratio may lie outside what the per-layer profile predicts,
    # beyond its own interval, before it is re-measured (the profile's own error: casts, the
    # optimizer and elementwise work it does not see).
    model_tolerance: float = 0.15

    def __post_init__(self):
        for name in ("repeats", "trial_rounds", "trial_repeats", "finalists", "final_rounds",
                     "max_final_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TimingConfig.{name} must be a positive integer, got {value!r}.")
        if not isinstance(self.recheck_rounds, int) or self.recheck_rounds < 0:
            raise ValueError(f"TimingConfig.recheck_rounds must be an integer >= 0, got "
                             f"{self.recheck_rounds!r}.")
        for name in ("final_seconds", "noise_limit", "model_tolerance", "equivalence"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ValueError(f"TimingConfig.{name} must be a positive number, got {value!r}.")


@dataclass(frozen=True)
class SearchConfig:
    """What a tune searches for: the formats, the budget and other constraints, the units, the
    number of trials, and how the profile measures sensitivity."""

    # Formats the search may use; fp32 is always added (the reference and the fallback). A
    # group words as in every set of formats (formats.GROUPS): "fp8" every FP8 recipe,
    # "scaled" every scaled format; "fp8:rowwise" (etc.) names one. The default leaves
    # out the block-scaled formats (mxfp8, nvfp4): they run natively on Blackwell only, and a
    # tune for one names them (``formats=(..., "mxfp8", "nvfp4")``).
    formats: tuple[Format, ...] = tuple(f for f in FORMAT_ORDER
                                        if not f.numerics.is_block_scaled)
    # How far the winner may move training from FP32.
    budget: Budget = field(default_factory=Budget)
    # Peak training-step memory the winner may need, in bytes, as autoprec.memory predicts it
    # (None: no limit).
    max_memory: int | None = None
    # Trials in the study, warm starts included; a resumed study runs only the rest.
    n_trials: int = 40
    # Seconds this worker may search (None: until n_trials).
    timeout: float | None = None
    # Price step time with the cost model of this device instead of measuring it here.
    target: str | None = None
    # Seed of the sampler (and of everything random in the measurements).
    seed: int = 0
    # Search units: a Grouping, or unit name -> layer fqns.
    grouping: Grouping | Mapping[str, Sequence[str]] = Grouping.AUTO
    # Sets of sibling layer names that share one choice (the model fuses them), e.g.
    # (("q_proj", "k_proj", "v_proj"),); see autoprec.tuning.space.group_layers.
    couple: tuple[tuple[str, ...], ...] = ()
    # Error budgets of the integer-program warm starts, as fractions of max_loss_increase.
    milp_budgets: tuple[float, ...] = (0.25, 0.5, 1.0)
    # Calibration batches held out to judge trials (the rest are profiled).
    n_holdout: int = 2
    # The FP32 reference's gradients on the held-out batches: "kept" (computed once, all held
    # through the search: n_holdout x the model's parameter bytes), "recomputed" (each
    # batch's computed again beside each trial's and dropped: one batch's held, one more FP32
    # forward and backward per batch per trial; the same numbers), "spilled" (computed once
    # and kept outside the device's memory, in a temporary file beside a CPU model, in host
    # memory beside an accelerator's: each read back as the trial's gradient of the same
    # parameter arrives; none held, none computed again; the same numbers) or "auto"
    # (recomputed when keeping them would take over a quarter of the memory free on the
    # task's device).
    holdout_gradients: str = "auto"
    # How the profile gets each layer x format's sensitivity: "auto" (first-order estimates,
    # those near the budget or doubtful measured exactly), "fast" or "exact".
    sensitivity: str = "auto"
    # Also offer per-GEMM mixes of the scaled formats (per_gemm_candidates): a forward in one,
    # both backward GEMMs in a more precise one or bf16; needs a cost-model target.
    per_gemm: bool = False
    # Measure where the run will be, not on the untrained model: the profile and every trial
    # on the model trained this many steps into a BF16 reference run twice as long (the
    # certificate's run: its stream, seeds and cosine schedule; autoprec.budget.trained_model),
    # trials on BUDGET_BATCHES batches of that stream it has not trained on. The default
    # budget then becomes Budget.trained() (the gradient bias, measured against certificates
    # at this point of the run); a budget of one's own gets the bias limit added. None: at init.
    budget_at: int | None = None

    def __post_init__(self):
        self._check_formats()
        couple = tuple(tuple(names) for names in self.couple)
        if any(isinstance(names, str) or len(names) < 2 for names in self.couple) or \
                any(not isinstance(n, str) or not n for names in couple for n in names):
            raise ValueError(f"TuneConfig.couple must be sets of at least two sibling layer "
                             f"names, e.g. (('q_proj', 'k_proj', 'v_proj'),); got {self.couple!r}.")
        object.__setattr__(self, "couple", couple)
        if isinstance(self.budget, Mapping):
            object.__setattr__(self, "budget", Budget(**self.budget))
        if not isinstance(self.grouping, Mapping):
            try:
                object.__setattr__(self, "grouping", Grouping(str(self.grouping).lower()))
            except ValueError:
                raise ValueError(f"Unknown grouping {self.grouping!r}; expected one of "
                                 f"{', '.join(g.value for g in Grouping)} or a mapping of "
                                 "unit name -> layer fqns.") from None
        check_sensitivity_mode(self.sensitivity)
        _positive_int("n_trials", self.n_trials)
        if self.max_memory is not None:
            _positive_int("max_memory (bytes)", self.max_memory)
        _positive_int("n_holdout", self.n_holdout)
        check_reference_gradients(self.holdout_gradients, "holdout_gradients")
        if self.budget_at is not None:
            _positive_int("budget_at (steps)", self.budget_at)
            budget = Budget.trained() if self.budget == Budget() else self.budget
            if budget.max_grad_bias is None:
                budget = dataclasses.replace(budget, max_grad_bias=DEFAULT_BIAS_BUDGET)
            object.__setattr__(self, "budget", budget)
        if self.timeout is not None and not (isinstance(self.timeout, (int, float))
                                             and self.timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}.")
        if not self.milp_budgets or any(not 0 < b <= 1 for b in self.milp_budgets):
            raise ValueError(f"milp_budgets are fractions of the loss budget in (0, 1], got "
                             f"{self.milp_budgets!r}.")
        # an unknown target fails here, before any work; a known one in the cost model's spelling
        object.__setattr__(self, "target", CostSource.of(self.target).key)
        if self.per_gemm:
            if self.target is None:
                raise ValueError("per_gemm (--per-gemm) needs a cost-model target (--target "
                                 "b200, ...): it offers the mixes whose GEMMs all run natively "
                                 "there, priced per GEMM.")
            mixes = per_gemm_candidates(self.formats, self.target)
            object.__setattr__(self, "formats", tuple(f for f in Format
                                                      if f in {*self.formats, *mixes}))

    def _check_formats(self) -> None:
        fmts = expand_formats(self.formats, where="in TuneConfig.formats")
        if not fmts:
            raise ValueError("TuneConfig.formats is empty; give at least one of "
                             f"{', '.join(f.value for f in Format)}.")
        fmts = [f for f in Format if f in set(fmts) | {Format.FP32}]  # registered ones too
        if fmts == [Format.FP32]:
            raise ValueError("TuneConfig.formats (fp32,) leaves nothing to choose: fp32 is the "
                             "reference every policy is compared with, always included; add "
                             "at least one of bf16, fp16, fp8.")
        object.__setattr__(self, "formats", tuple(fmts))


def per_gemm_candidates(formats, target: str) -> tuple[Format, ...]:
    """The per-GEMM mixes of ``formats`` worth a search on ``target``: the forward in one
    scaled format and both backward GEMMs in another that gives up less precision
    (:attr:`~autoprec.formats.Numerics.precision_rank`) and is itself one scheme (no
    high-precision GEMM of its own), or in bf16 (Transformer Engine's
    ``backward_override="high_precision"``), each part running natively on the target (an
    emulated GEMM cannot pay). Registered with :func:`autoprec.formats.per_gemm`."""
    from autoprec.devices import resolve_target

    _, spec = resolve_target(target)
    scaled = [f for f in formats if f.is_scaled and "/" not in f.value
              and spec.support[f] is Support.NATIVE]
    out = []
    for fwd in scaled:
        for back in (*scaled, Format.BF16):
            if back is not fwd and not back.numerics.high_precision and \
                    back.numerics.precision_rank < fwd.numerics.precision_rank:
                out.append(per_gemm(fwd, back, back))
    return tuple(f for f in dict.fromkeys(out) if f not in formats)


@dataclass(frozen=True)
class StudyConfig:
    """Where a tune keeps its study and writes its policy."""

    # Optuna storage URL, `journal:PATH`, or None for SQLite beside the output.
    storage: str | None = None
    # Study name (share it between workers); None derives one from the task and the model.
    study_name: str | None = None
    # The policy path; the default study lives beside it (`<stem>.study.db`).
    output: str | None = None

    def __post_init__(self):
        if self.study_name is not None and (not isinstance(self.study_name, str)
                                            or not self.study_name.strip()):
            raise ValueError(f"Study name {self.study_name!r} is empty; give a name with at "
                             "least one character other than spaces, or None to derive one "
                             "from the task.")
        if self.storage is not None and self.storage.strip() in ("", "journal:"):
            raise ValueError(f"Storage {self.storage!r} names no database: give a URL "
                             "(sqlite:///PATH, postgresql://...) or journal:PATH.")
        if self.output is not None and os.path.isdir(self.output):
            raise ValueError(f"-o/--output {self.output} is a directory; give the policy's file "
                             "path, e.g. policies/NAME.yaml.")

    def paths(self, task_name: str) -> TunePaths:
        """The files of this tune: beside ``output``, or beside ``autoprec-<task>.yaml``."""
        return TunePaths.from_output(self.output or
                                     f"autoprec-{re.sub(r'[^A-Za-z0-9_.-]', '_', task_name)}.yaml")


# Each group's fields, by flat name: TuneConfig(n_trials=20, storage=...) sets them in their group.
_GROUPS = {"search": SearchConfig, "study": StudyConfig, "timing": TimingConfig}
_BUDGET_FIELDS = ("max_loss_increase", "max_grad_error", "max_grad_bias")
_FLAT = {f.name: group for group in ("search", "study") for f in dataclasses.fields(_GROUPS[group])}


@dataclass(frozen=True, init=False)
class TuneConfig:
    """Everything :func:`autoprec.tune` needs besides the task, in three groups: ``search``
    (:class:`SearchConfig`: formats, budget, memory limit, trials, units), ``study``
    (:class:`StudyConfig`: storage, study name, output) and ``timing`` (:class:`TimingConfig`).

    Built from the groups or from their fields by name, ``TuneConfig(n_trials=20,
    storage="journal:s.log")``; a field reads by name too (``config.n_trials``).

    Args:
        search: formats, budget, memory limit, trials, units; default ``SearchConfig()``.
        study: storage, study name, output; default ``StudyConfig()``.
        timing: a :class:`TimingConfig` or a mapping of its fields; default
            ``TimingConfig()``.
        **fields: any group's field by name, overriding that group's; ``max_loss_increase``,
            ``max_grad_error`` and ``max_grad_bias`` set the budget's.

    Raises:
        TypeError: a field that no group has.
    """

    search: SearchConfig
    study: StudyConfig
    timing: TimingConfig

    def __init__(self, search: SearchConfig | None = None, study: StudyConfig | None = None,
                 timing: TimingConfig | Mapping[str, Any] | None = None, **fields: Any):
        # the budget's own fields by name too (max_grad_bias=0.1), before budget_at's rule
        budget = {k: fields.pop(k) for k in _BUDGET_FIELDS if k in fields}
        if budget:
            base = fields.get("budget", (search or SearchConfig()).budget)
            fields["budget"] = dataclasses.replace(base, **budget)
        unknown = [k for k in fields if k not in _FLAT]
        if unknown:
            raise TypeError(f"Unknown tune option(s) {', '.join(unknown)}; TuneConfig's fields "
                            f"are {', '.join(_FLAT)} and timing, plus max_loss_increase, "
                            "max_grad_error and max_grad_bias.")
        groups = {"search": search or SearchConfig(), "study": study or StudyConfig()}
        for name in groups:
            mine = {k: v for k, v in fields.items() if _FLAT[k] == name}
            if mine:
                groups[name] = dataclasses.replace(groups[name], **mine)
        if timing is None:
            timing = TimingConfig()
        elif isinstance(timing, Mapping):
            timing = TimingConfig(**timing)
        for name, value in (*groups.items(), ("timing", timing)):
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # only called for names that are not attributes: a group's field, by its flat name
        group = _FLAT.get(name)
        if group is None:
            raise AttributeError(f"TuneConfig has no field {name!r}.")
        return getattr(object.__getattribute__(self, group), name)

    def replace(self, **changes: Any) -> TuneConfig:
        """A copy with ``changes`` (fields by name, or whole groups); ``max_loss_increase``,
        ``max_grad_error`` and ``max_grad_bias`` set the budget."""
        groups = {name: changes.pop(name, getattr(self, name)) for name in _GROUPS}
        return TuneConfig(**groups, **changes)


def default(name: str) -> Any:
    """The default of a tune option, by its flat name (``n_trials``), for the CLI's help."""
    fld = next(f for f in dataclasses.fields(_GROUPS[_FLAT[name]]) if f.name == name)
    return fld.default_factory() if fld.default is dataclasses.MISSING else fld.default


@dataclass(frozen=True)
class TunePaths:
    """The files of one tune, all derived from the policy's path (``-o``): the one place that
    names the files beside the policy."""

    policy: str
    profile: str
    study_db: str
    csv: str
    png: str

    @classmethod
    def from_output(cls, path: str | os.PathLike) -> TunePaths:
        path = os.fspath(path)
        stem = os.path.splitext(path)[0]
        return cls(policy=path, profile=f"{stem}.profile.json", study_db=f"{stem}.study.db",
                   csv=f"{stem}.pareto.csv", png=f"{stem}.pareto.png")

    def beside(self) -> dict[str, str]:
        """The files written beside the policy -> what each is (for messages)."""
        return {self.profile: "the profile", self.csv: "the trials' CSV",
                self.png: "the Pareto plot"}


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
