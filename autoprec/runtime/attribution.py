"""Innermost-module call attribution: each registered call (``autoprec.runtime.calls``) belongs
to the innermost module running when it is made.

Capture's hook tracer (which module's op is this call) and the guard's discovery (which modules
compute by what they run) both need it; :class:`CallAttribution` keeps the stack of running
modules with a forward pre-hook and an always-called forward hook on each, and hands every
registered call, with its owner, to :meth:`CallAttribution.attribute`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode

from autoprec.runtime import calls

__all__ = ["CallAttribution"]


class CallAttribution(TorchFunctionMode):
    """A torch function mode that attributes each registered call to the innermost running
    module of those :meth:`track` hooked. Subclasses override :meth:`attribute` (which runs
    the call) and, to keep the stack only at times, :meth:`tracking`."""

    def __init__(self):
        super().__init__()
        # fqns of the tracked modules running now, innermost last
        self.running: list[str] = []

    def owner(self) -> str:
        """The innermost running module ("" outside every tracked module: the root's name).
        A method, not a property: dynamo cannot trace a property of a torch function mode."""
        return self.running[-1] if self.running else ""

    def tracking(self) -> bool:
        """Whether module entries and exits are kept now."""
        return True

    def track(self, modules: Iterable[tuple[str, nn.Module]],
              left: Callable[..., Any] | None = None) -> list:
        """Hook ``modules`` (fqn, module) to keep the stack; ``left(fqn, module, args, kwargs,
        output)``, if given, is told after each tracked module's forward (its value replaces
        the output, as a forward hook's). Bound methods in partials, not closures, so that
        ``copy.deepcopy`` of a hooked model rebinds them to the copy's mode. Returns the
        handles."""
        handles = []
        for fqn, module in modules:
            handles.append(module.register_forward_pre_hook(partial(self._enter, fqn)))
            handles.append(module.register_forward_hook(partial(self._leave, fqn, left),
                                                        with_kwargs=True, always_call=True))
        return handles

    def _enter(self, fqn: str, module, args):
        if self.tracking():
            self.running.append(fqn)

    def _leave(self, fqn: str, left, module, args, kwargs, output):
        if not self.tracking():
            return None
        self.running.pop()
        return None if left is None else left(fqn, module, args, kwargs, output)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        call = calls.lookup(func)
        if call is None:
            return func(*args, **(kwargs or {}))
        return self.attribute(call, func, args, kwargs or {})

    def attribute(self, call: calls.Call, func: Callable, args: tuple, kwargs: dict) -> Any:
        """Run registered ``call`` (``func``), made in module :meth:`owner`."""
        return func(*args, **kwargs)
