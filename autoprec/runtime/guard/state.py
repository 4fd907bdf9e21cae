"""The guard's checkpointed state: what ``Guard.state_dict`` writes, the check of a state read
back (untrusted: a checkpoint may be hand-edited or another model's), and the amended policy.

Everything a state says is checked before anything changes: a state naming what the model
lacks would otherwise run a demoted layer in its old format again without a word.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autoprec._util import atomic_write, brief, escape_line, shown
from autoprec.formats import Format
from autoprec.policy import Policy, PolicyError, check_bounds
from autoprec.runtime.guard.forecast import MAX_STATE_POINTS, NAMES
from autoprec.runtime.guard.terms import INPUT, GuardEvent, check_where, watched

__all__ = ["Ledger", "Restored"]

# Version of Guard.state_dict()'s layout.
STATE_VERSION = 1
STATE_KEYS = ("policy", "formats", "step", "layers", "events", "counts", "suspects", "warned")
# Keys a state may lack (written since): the forecaster's history, and the policy the run had
# switched to with Guard.replace_policy (None: none).
OPTIONAL_KEYS = ("forecast", "phase")
EVENT_KEYS = ("step", "layer", "from", "to", "reason", "where")


def identity(policy: Policy) -> dict[str, Any]:
    """What makes two policies the same for a guard: everything but the provenance."""
    out = policy.to_dict()
    out.pop("tuned", None)
    return out


def difference(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> str:
    """The first difference between two policy identities, in words."""
    for key in ("default", "fp8", "model", "loss_scaling"):
        if saved.get(key) != mine.get(key):
            return f"`{key}` is {shown(saved.get(key))} there, {shown(mine.get(key))} here"
    a, b = saved.get("layers", {}), mine.get("layers", {})
    for name in [*a, *(n for n in b if n not in a)]:
        if a.get(name) != b.get(name):
            return (f"layer `{shown(name)}` is {shown(a.get(name, 'not listed'))} there, "
                    f"{shown(b.get(name, 'not listed'))} here")
    return "layer entries in another order"


class _StateCheck:
    """The checks of one state's values; each failure is a one-line PolicyError naming the
    key at fault."""

    def __init__(self, modules: set[str] | None):
        self.modules = modules

    @staticmethod
    def fail(key: str, what: str) -> None:
        raise PolicyError(f"Guard state `{key}` {what}; load what Guard.state_dict() returned "
                          "for this model and policy, or start the guard afresh.")

    def integer(self, key: str, v: Any) -> None:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            self.fail(key, f"is {brief(v)}, not a count (an integer >= 0)")

    def format(self, key: str, v: Any) -> Format:
        if isinstance(v, str):
            try:
                return Format.parse(v)
            except ValueError:
                pass
        self.fail(key, f"is {brief(v)}, not a format (one of "
                       f"{', '.join(f.value for f in Format.registered())}, or fwd/dgrad/wgrad "
                       "of three)")

    def layer(self, key: str, v: Any, *, none_ok: bool = False) -> None:
        if v is None and none_ok:
            return
        if not isinstance(v, str):
            self.fail(key, f"holds {brief(v)}, not a module name")
        if self.modules is not None and v not in self.modules and not (none_ok and v == INPUT):
            self.fail(key, f"names `{shown(v)}`, which is not a module of this model")

    def kind(self, key: str, v: Any, kind: type) -> None:
        if not isinstance(v, kind):
            self.fail(key, f"is {type(v).__name__}, not a {kind.__name__}")

    def event(self, key: str, e: Any) -> None:
        self.kind(key, e, Mapping)
        for k in EVENT_KEYS:
            if k not in e:
                self.fail(f"{key}.{k}", "is missing")
        self.integer(f"{key}.step", e["step"])
        self.layer(f"{key}.layer", e["layer"])
        old = self.format(f"{key}.from", e["from"])
        if self.format(f"{key}.to", e["to"]) is not old.demoted() or old is Format.FP32:
            self.fail(key, f"demotes {shown(e['from'])} to {shown(e['to'])}, which the guard "
                           "never does")
        if not isinstance(e["reason"], str):
            self.fail(f"{key}.reason", f"is {brief(e['reason'])}, not text")
        wrong = check_where(e["where"])
        if wrong is not None:
            self.fail(f"{key}.where", f"is {wrong}")

    def number(self, key: str, v: Any, *, none_ok: bool = False) -> None:
        if v is None and none_ok:
            return
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            self.fail(key, f"is {brief(v)}, not a finite number")

    def forecast(self, key: str, state: Any) -> None:
        """The forecaster's history: fqn -> {"format", "streak", kind: [[step, amax,
        kurtosis, underflow], ...]}, bounded."""
        self.kind(key, state, Mapping)
        for fqn, entry in state.items():
            self.layer(key, fqn)
            at = f"{key}.{shown(fqn)}"
            self.kind(at, entry, Mapping)
            extra = [k for k in entry if k not in ("format", "streak", *NAMES)]
            if extra or "format" not in entry or "streak" not in entry:
                self.fail(at, f"has keys {shown(sorted(map(str, entry)))}, not format, "
                              f"streak and the kinds {', '.join(NAMES)}")
            self.format(f"{at}.format", entry["format"])
            self.integer(f"{at}.streak", entry["streak"])
            for kind in NAMES:
                points = entry.get(kind, [])
                self.kind(f"{at}.{kind}", points, list)
                if len(points) > MAX_STATE_POINTS:
                    self.fail(f"{at}.{kind}", f"holds {len(points)} points, more than "
                                              f"{MAX_STATE_POINTS}")
                for p in points:
                    if not isinstance(p, list) or len(p) != 4:
                        self.fail(f"{at}.{kind}", f"holds {brief(p)}, not [step, amax, "
                                                  "kurtosis, underflow]")
                    self.integer(f"{at}.{kind} step", p[0])
                    self.number(f"{at}.{kind} amax", p[1])
                    if not p[1] > 0:
                        self.fail(f"{at}.{kind} amax", f"is {brief(p[1])}, not positive")
                    self.number(f"{at}.{kind} kurtosis", p[2], none_ok=True)
                    self.number(f"{at}.{kind} underflow", p[3], none_ok=True)


def check_state(state: Mapping[str, Any], modules: set[str] | None = None) -> None:
    """A one-line PolicyError naming the key of ``state`` (a guard state) that is not as
    :meth:`Guard.state_dict` writes it: a missing key, a wrong type, an unknown format, and
    (``modules``: the model's module fqns) a layer the model does not have."""
    c = _StateCheck(modules)
    for key in STATE_KEYS:
        if key not in state:
            c.fail(key, "is missing")
    c.integer("step", state["step"])
    c.kind("policy", state["policy"], Mapping)
    # the policies a state embeds are held to a policy file's bounds before anything else
    check_bounds(state["policy"], "Guard state `policy`")
    if state.get("phase") is not None:
        c.kind("phase", state["phase"], Mapping)
        check_bounds(state["phase"], "Guard state `phase`")
    c.kind("formats", state["formats"], list)
    for v in state["formats"]:
        c.format("formats", v)
    c.kind("layers", state["layers"], Mapping)
    for k, v in state["layers"].items():
        c.layer("layers", k)
        c.format(f"layers.{shown(k)}", v)
    c.kind("events", state["events"], list)
    for i, e in enumerate(state["events"]):
        c.event(f"events[{i}]", e)
    c.kind("counts", state["counts"], Mapping)
    for k, v in state["counts"].items():
        c.layer("counts", k)
        c.integer(f"counts.{shown(k)}", v)
    c.kind("suspects", state["suspects"], list)
    for v in state["suspects"]:
        c.layer("suspects", v)
    c.kind("warned", state["warned"], list)
    for v in state["warned"]:
        c.layer("warned", v, none_ok=True)
    if state.get("forecast") is not None:
        c.forecast("forecast", state["forecast"])


def check_version(state: Any) -> None:
    """That ``state`` is a guard state of the layout this autoprec writes (before the model is
    known: its layout and types)."""
    if not isinstance(state, Mapping) or "autoprec_guard" not in state:
        raise PolicyError(f"Not an autoprec guard state ({type(state).__name__} without the "
                          "key `autoprec_guard`); pass what Guard.state_dict() returned.")
    if state["autoprec_guard"] != STATE_VERSION:
        raise PolicyError(f"Guard state version {brief(state['autoprec_guard'])} is not one this "
                          f"autoprec reads ({STATE_VERSION}); resume with the autoprec "
                          "version that wrote it.")
    check_state(state)


@dataclass
class Restored:
    """A checked state, as the guard takes it up. ``amended``: the policy to re-apply (None:
    the guard's policy is already the state's)."""

    step: int
    events: list[GuardEvent]
    streaks: dict[str, int]
    suspects: set[str]
    warned: set[str | None]
    amended: Policy | None
    # the forecaster's history (None: the state has none)
    forecast: Mapping[str, Any] | None = None
    # the policy the checkpointed run had switched to (replace_policy; None: none), and
    # whether this guard was attached with it (then ``base`` is the run's first policy and
    # ``amended`` is None: the guard merges the demotions into the attached policy)
    phase: Mapping[str, Any] | None = None
    attached_to_phase: bool = False
    base: Policy | None = None


class Ledger:
    """What a checkpoint carries: the policy first attached, the demotions, the step count,
    and the blame streaks in progress (fqn -> consecutive steps blamed)."""

    def __init__(self):
        self.base: Policy | None = None
        self.events: list[GuardEvent] = []
        self.step = 0
        self.streaks: dict[str, int] = {}

    def amended_policy(self, policy: Policy) -> Policy:
        """``policy`` (the one in force) with the demotions listed under ``tuned.guard``."""
        if not self.events:
            return policy
        tuned = dict(policy.tuned or {})
        tuned["guard"] = [e.to_dict() for e in self.events]
        return policy.with_layers({}, tuned=tuned)

    def save(self, path: str | os.PathLike, amended: Policy) -> None:
        """Write ``amended`` (see amended_policy) with the demotions as comments."""
        # an event names modules of the model: one escaped comment line each
        lines = [f"# amended by the autoprec runtime guard: {escape_line(e)}\n"
                 for e in self.events]
        atomic_write(path, "".join(lines) + amended.to_yaml())

    def state_dict(self, policy: Policy, formats: tuple[Format, ...], suspects: set[str],
                   warned: set[str | None], *, forecast: Mapping[str, Any] | None = None,
                   phase: Policy | None = None) -> dict[str, Any]:
        """``policy``: the base policy with the demotions in it (the policy in force, unless
        the run switched to ``phase``); ``forecast``: the forecaster's state_dict()."""
        base = self.base
        return {
            "autoprec_guard": STATE_VERSION,
            "policy": identity(base),
            "formats": [f.value for f in formats],
            "step": self.step,
            "layers": {k: v.value for k, v in policy.layers.items()
                       if base.layers.get(k) is not v},
            "events": [dict(e.to_dict(), where=e.where) for e in self.events],
            "counts": dict(self.streaks),
            "suspects": sorted(suspects),
            "warned": sorted(warned, key=lambda w: (w is not None, w or "")),
            "forecast": dict(forecast or {}),
            "phase": None if phase is None else identity(phase),
        }

    def plan(self, state: Mapping[str, Any], formats: tuple[Format, ...],
             modules: set[str]) -> Restored:
        """``state`` checked against this model (``modules``), the watched ``formats`` and the
        base policy; what taking it up changes. Nothing changes here. The state must come from
        a guard attached with the same policy, or the base policy must be that policy amended
        by the state's demotions (a run resumed from the amended file), and watch the same
        formats: otherwise a PolicyError. So is a state not as ``state_dict`` writes it (a
        missing key, a wrong type, an unknown format, a layer run in a format that is no
        demotion of its policy's) or naming a module the model lacks. A run that switched
        policies (``phase``) resumes attached with its first policy (then replace_policy), or
        attached with the policy it had switched to."""
        check_state(state, modules=modules)
        names = [f.value for f in formats]
        # an older autoprec listed the per-GEMM mixes made before its config (this one
        # watches them by their parts): those this guard watches are no difference
        saved = [n for n in state["formats"] if n in names or not watched(Format.parse(n), formats)]
        if set(saved) != set(names):  # the same formats, in whatever order they were listed
            raise PolicyError(
                f"Guard state watched formats {shown(', '.join(state['formats']))} but this "
                f"guard watches {', '.join(names)}; use GuardConfig(formats=...) as in the "
                "checkpointed run.")
        layers = {k: Format.parse(v) for k, v in state["layers"].items()}
        phase = state.get("phase")
        on_phase = phase is not None and phase == identity(self.base) != state["policy"]
        base = Policy.from_dict(state["policy"]) if on_phase else self.base
        amended = None if on_phase else self._amended(state, layers)
        for name, fmt in layers.items():
            # a demotion only ever makes a layer safer than the policy it started from
            start = base.format_for(name)
            if fmt not in (start, start.demoted(), start.demoted().demoted()):
                raise PolicyError(
                    f"Guard state `layers` runs `{shown(name)}` in {fmt}, which is no demotion of its "
                    f"{start} under the policy (fp8 -> bf16 -> fp32, fp16 -> fp32); load the "
                    "state the checkpointed run saved, or start the guard afresh.")
        events = [GuardEvent(step=int(e["step"]), fqn=e["layer"], old=Format.parse(e["from"]),
                             new=Format.parse(e["to"]), reason=e["reason"], where=e["where"])
                  for e in state["events"]]
        return Restored(step=int(state["step"]), events=events,
                        streaks={k: int(v) for k, v in state["counts"].items()},
                        suspects=set(state["suspects"]), warned=set(state["warned"]),
                        amended=amended, forecast=state.get("forecast"), phase=phase,
                        attached_to_phase=on_phase, base=base if on_phase else None)

    def _amended(self, state: Mapping[str, Any], layers: dict[str, Format]) -> Policy | None:
        mine = identity(self.base)
        if state["policy"] == mine:
            return self.base.with_layers(layers) if layers else None
        if identity(Policy.from_dict(state["policy"]).with_layers(layers)) == mine:
            return None  # attached with the amended policy already: nothing to re-apply
        raise PolicyError(
            f"Guard state was saved for another policy ({difference(state['policy'], mine)}"
            "); load it into a guard attached with the policy the checkpointed run started "
            "from (or its amended policy), or start the guard afresh.")

    def take(self, restored: Restored) -> None:
        self.step, self.events, self.streaks = restored.step, restored.events, restored.streaks
