"""Discovery: on the first training forward, the modules that compute by what they run (an
attention core running ``q @ k.T`` has no layer class to know it by)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from autoprec.runtime import calls
from autoprec.runtime.attribution import CallAttribution

__all__ = ["Discovery"]


class Discovery(CallAttribution):
    """Each registered call (``autoprec.runtime.calls``) is attributed to the innermost module
    running it (``autoprec.runtime.attribution``), and
    :func:`~autoprec.runtime.calls.layer_kind` judges each module by its own calls.
    ``known``: fqn -> kind of the modules known to compute (by class; read live, the guard
    adds the finds); ``found(fqn, module, own_calls)`` is told of each find and returns the
    watch that checks this forward's output, if any; ``done(handles)`` is told once the
    forward is over and the hooks are removed."""

    def __init__(self, modules: dict[str, nn.Module], known: Mapping[str, str],
                 found: Callable[[str, nn.Module, set[str]], Any],
                 done: Callable[[list], None]):
        super().__init__()
        self.known, self.found, self.done = known, found, done
        self.calls: dict[str, set[str]] = {}
        self.active = False
        root = modules[""]
        # Every module is on the stack (a call belongs to the innermost one); only those not
        # yet known to compute are judged.
        self.handles = [root.register_forward_pre_hook(self._start),
                        *self.track(modules.items(), self._judge),
                        root.register_forward_hook(self._finish, always_call=True)]

    def tracking(self) -> bool:
        return self.active  # the first training forward only

    def attribute(self, call: calls.Call, func, args, kwargs):
        owner = self.owner()
        if self.running and owner not in self.known:
            # only what is new is written: a write made inside a higher-order op that
            # torch.compile traces (an FP8 autograd function, a checkpointed block) is a graph
            # break; the modules known by their class need no record
            seen = self.calls.get(owner)
            if seen is None or call.name not in seen:
                self.calls.setdefault(owner, set()).add(call.name)
        return func(*args, **kwargs)

    def _start(self, module, args):
        if torch.is_grad_enabled() and not self.active:
            self.active = True
            self.__enter__()

    def _judge(self, fqn: str, module, args, kwargs, output):
        own = self.calls.get(fqn, set())
        if fqn not in self.known and calls.layer_kind(module, own) in calls.COMPUTING_KINDS:
            watch = self.found(fqn, module, own)
            if watch is not None:
                return watch.forward_hook(module, args, kwargs, output)
        return None

    def _finish(self, module, args, output):
        if not self.active:
            return None
        self.__exit__(None, None, None)
        self.active = False
        for h in self.handles:
            h.remove()
        self.done(self.handles)
        return None
