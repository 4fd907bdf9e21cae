"""Coverage: which modules of the model compute, and which of them the recorder watches."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch
from torch import nn

from autoprec.formats import Format
from autoprec.policy import Policy
from autoprec.runtime import calls
from autoprec.runtime.guard.discovery import Discovery
from autoprec.runtime.guard.record import Recorder, Watch, owners
from autoprec.runtime.guard.terms import watched

__all__ = ["Coverage"]


class Coverage:
    """The modules that compute (``calls.class_kind`` by class at once, ``calls.layer_kind``
    by what they run on the first training forward) and, among them, those whose format under
    the policy is one of ``formats``, which ``recorder`` watches."""

    def __init__(self, recorder: Recorder, formats: tuple[Format, ...]):
        self.recorder = recorder
        self.formats = formats
        # fqn -> kind of every module of the model that computes (None: not attached yet)
        self.layers: dict[str, str] | None = None
        self.discovery_done = False
        # modules found to compute during a compiled first forward, watched at the next step
        self.unhooked: list[str] = []
        self.model: nn.Module | None = None
        self.policy: Policy | None = None

    def forget(self) -> None:
        """Another model: what computes is found afresh."""
        self.layers, self.discovery_done = None, False

    def attach(self, model: nn.Module, policy: Policy) -> None:
        """Watch the computing modules of ``model`` that ``policy`` puts in a watched format."""
        self.model, self.policy = model, policy
        modules = dict(model.named_modules())
        if self.layers is None:
            self.layers = {fqn: kind for fqn, m in modules.items()
                           if (kind := calls.class_kind(m)) in calls.COMPUTING_KINDS}
        if not self.discovery_done:
            found = Discovery(modules, self.layers, self.discovered, self.discovery_over)
            self.recorder.handles.extend(found.handles)
        counts = owners(model)
        for fqn in self.layers:
            self.watch(fqn, modules[fqn], lambda: counts)

    def unwatched(self) -> list[str]:
        """The computing modules not watched (their format is not one of ``formats``)."""
        return [f for f in self.layers or {} if f not in self.recorder.watches]

    def watch(self, fqn: str, module: nn.Module,
              owned: Callable[[], Mapping[int, int]]) -> Watch | None:
        fmt = self.policy.format_for(fqn)
        if not watched(fmt, self.formats):
            return None
        param = next(module.parameters(), None)
        param = param if param is not None else next(self.model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        return self.recorder.watch(fqn, module, fmt, device, owned)

    def discovered(self, fqn: str, module: nn.Module, own_calls: set[str]) -> Watch | None:
        """The first training forward found that ``module`` computes by what it runs: watch
        it from now on (the caller checks this forward's output with the watch returned).
        While torch.compile traces that forward, it is watched from the next step on
        (registering a hook there is a graph break; this one forward goes unchecked)."""
        self.layers[fqn] = calls.layer_kind(module, own_calls)
        if torch.compiler.is_compiling():
            self.unhooked.append(fqn)
            return None
        return self.watch(fqn, module, partial(owners, self.model))

    def discovery_over(self, handles: list) -> None:
        self.discovery_done = True
        self.recorder.forget_handles(handles)

    def hook_found(self) -> None:
        """Watch the modules a compiled first forward found to compute (see discovered)."""
        found, self.unhooked = self.unhooked, []
        if found and self.model is not None:
            modules = dict(self.model.named_modules())
            for fqn in found:
                if fqn in modules and fqn not in self.recorder.watches:
                    self.watch(fqn, modules[fqn], partial(owners, self.model))
