"""Diagnosis: where non-finite values start when no layer the guard can demote made them.

A :class:`Diagnosis` watches, for one training forward, the first input and output of many
modules (every module, or the unwatched descendants of a suspect) and names the first whose
output went non-finite from a finite input. :class:`Diagnostician` decides when to run one
and warns, once per culprit; :class:`Poisoning` tells and warns about non-finite parameters.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from autoprec._util import tensors
from autoprec.formats import Format
from autoprec.runtime.guard.record import first_tensor, read_host
from autoprec.runtime.guard.terms import INPUT

__all__ = ["Diagnosis", "Diagnostician", "Poisoning", "params_poisoned"]

logger = logging.getLogger("autoprec.runtime.guard")


class Diagnosis:
    """For one training forward, every module's first input and output, reduced on the device:
    the first module (in the order modules finish) whose output is non-finite while its input
    was finite is where non-finite values start."""

    def __init__(self, model: nn.Module, *, under: str | None = None,
                 skip: frozenset[str] = frozenset()):
        """Every module, or (``under``) the strict descendants of one, less ``skip``."""
        self.records: list[tuple[str, torch.Tensor | None, torch.Tensor]] = []
        prefix = None if under is None else (f"{under}." if under else "")
        self.handles = [m.register_forward_hook(partial(self.hook, fqn), with_kwargs=True)
                        for fqn, m in model.named_modules()
                        if fqn not in skip and (prefix is None or (fqn.startswith(prefix)
                                                                   and fqn != under))]

    def hook(self, fqn: str, module, args, kwargs, output):
        if not torch.is_grad_enabled():
            return None
        out = first_tensor(output)
        if out is None or not out.is_floating_point() or out.numel() == 0:
            return None
        if fqn:
            x = first_tensor((args, kwargs))
        else:  # the root: its first floating input (the batch's pixels, embeddings, features)
            x = next((t for t in tensors((args, kwargs)) if t.is_floating_point()), None)
        x_sum = x.detach().float().sum() if x is not None and x.is_floating_point() else None
        self.records.append((fqn, x_sum, out.detach().float().sum()))
        return None

    def culprit(self) -> str | None:
        """The first module whose output is non-finite while its input was finite; else
        ``INPUT`` when the root's input was non-finite (the batch); else None."""
        values = read_host([t for _, x, o in self.records for t in (o, x) if t is not None])
        it = (v[0] for v in values)
        batch_ok = True
        for fqn, x, _ in self.records:
            out_ok = math.isfinite(next(it))
            in_ok = True if x is None else math.isfinite(next(it))
            if not out_ok and in_ok:
                return fqn
            if fqn == "":
                batch_ok = in_ok
        return None if batch_ok else INPUT

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def params_poisoned(model: nn.Module) -> bool:
    """Whether non-finite values have spread into the parameters of more than one module:
    what an optimizer step on non-finite gradients does (into every weight it updates; the
    optimizer's state, such as Adam's moments, goes non-finite with them, so the parameters
    tell). One non-finite parameter of one module (a bad checkpoint entry, a planted fault) is
    that module's failure, judged as any other. One max-abs reduction per parameter and one
    host sync per device: asked on failing steps only."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    seen: set[int] = set()
    for fqn, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue  # a tied weight counts once, for its first owner
            seen.add(id(p))
            t = p.detach()
            t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2: this rank's shard
            if t.is_floating_point() and t.element_size() < 2:
                t = t.float()  # FP8 storage: no norm kernel of its own
            if t.is_floating_point() and t.numel() and t.device.type != "meta":
                groups.setdefault((t.device, t.dtype), []).append((fqn, t))
    owners = [fqn for group in groups.values() for fqn, _ in group]
    norms = [n for group in groups.values()
             for n in torch._foreach_norm([t for _, t in group], math.inf)]
    bad = {fqn for fqn, v in zip(owners, read_host(norms)) if not math.isfinite(v[0])}
    return len(bad) > 1


class Diagnostician:
    """Runs the diagnoses and warns, once per culprit, about failures nothing can demote."""

    def __init__(self):
        # the one-step watch of every module after an unexplained failure
        self.pending: Diagnosis | None = None
        # suspect -> the diagnosis of its unwatched descendants (children the policy keeps in
        # fp32), run on the step after it was blamed
        self.subtrees: dict[str, Diagnosis] = {}
        # culprits warned about (a module fqn, INPUT, or None: the loss or the data)
        self.warned: set[str | None] = set()

    def take_pending(self) -> Diagnosis | None:
        pending, self.pending = self.pending, None
        return pending

    def subtree_faults(self) -> dict[str, str]:
        """suspect -> the descendant its diagnosis named, where it named one."""
        return {fqn: c for fqn, d in self.subtrees.items() if (c := d.culprit()) is not None}

    def watch_subtrees(self, model: nn.Module | None, suspects: set[str],
                       skip: frozenset[str]) -> None:
        """Watch, next step, the descendants of each suspect not in ``skip`` (the watched)."""
        for d in self.subtrees.values():
            d.close()
        self.subtrees = {}
        if model is None:
            return
        found = {fqn: Diagnosis(model, under=fqn, skip=skip) for fqn in suspects}
        self.subtrees = {f: d for f, d in found.items() if d.handles}

    def close(self) -> None:
        if self.pending is not None:
            self.pending.close()
            self.pending = None
        self.watch_subtrees(None, set(), frozenset())

    def explain(self, diagnosis: Diagnosis | None, origin: str | None, *, failed: bool,
                model: nn.Module | None, step: int, format_of) -> None:
        """A step went non-finite and nothing the guard can demote caused it (``failed``):
        name where the non-finite values start (a WARNING: nothing will fix itself), from
        ``origin`` (a suspect's descendant) or ``diagnosis`` (this step's), or else by
        watching every module once on the next step. ``format_of``: fqn -> its format."""
        culprit = origin
        if diagnosis is not None:
            culprit = culprit if culprit is not None else diagnosis.culprit()
            diagnosis.close()
        if not failed:
            return
        if culprit is None and diagnosis is None:
            if model is not None:
                self.pending = Diagnosis(model)
            return
        if culprit not in self.warned:
            self.warned.add(culprit)
            logger.warning("autoprec guard: step %d: %s", step,
                           unexplained(culprit, model, format_of))


def unexplained(culprit: str | None, model: nn.Module | None, format_of) -> str:
    head = ("the training step is non-finite and no layer the guard can demote made it "
            "so (nothing to demote)")
    if culprit is None:
        return (f"{head}: no module's output was non-finite, so the loss computation or "
                "the data is; check the batch and the loss function.")
    if culprit == INPUT:
        return (f"{head}: the input batch held non-finite values (the model's first "
                "floating input), so every layer computing from it is; check the data and "
                "how the batch is made.")
    module = model.get_submodule(culprit)
    return (f"{head}: the first non-finite values come out of `{culprit or '(root)'}` "
            f"({type(module).__name__}, {format_of(culprit)} under the policy) while its "
            "inputs were finite; check its weights and inputs.")


class Poisoning:
    """Non-finite parameters: since when, where the failing stretch began, warned once."""

    def __init__(self):
        # the first step of the failing stretch in which the parameters were non-finite, and
        # the layer whose output went non-finite first then (None when the guard cannot tell
        # which); both None while the parameters are finite
        self.since: int | None = None
        self.first: str | None = None
        # the failing stretch in progress: (its first step, that layer, where it began)
        self.stretch: tuple[int, str | None, str] | None = None

    def clear(self) -> None:
        self.since = self.first = self.stretch = None

    def check(self, step: int, failed: bool, model: nn.Module | None,
              origin: Callable[[], tuple[str | None, str]]) -> bool:
        """Whether ``model``'s parameters are poisoned, asked on a ``failed`` step only (never
        a healthy one: it costs a reduction per parameter). The first failing step after a
        clean one starts a stretch, placed by ``origin()`` (the layer and words)."""
        if not failed:
            self.stretch = None
            return False
        if self.stretch is None:
            self.stretch = (step, *origin())
        return model is not None and params_poisoned(model)

    def warn(self, step: int, watched: dict[str, Format]) -> None:
        """Once per stretch of poisoned parameters: since when, where it began, what to do."""
        if self.since is not None:
            return
        since, self.first, where = self.stretch or (step, None, "on another rank: see its log")
        self.since = since
        fmt = watched.get(self.first)
        hint = "" if fmt is None else (
            f" (if `{self.first}`'s {fmt} is at fault, run it in {fmt.demoted()}: "
            "amend the policy, or use a GradScaler for fp16)")
        logger.warning(
            "autoprec guard: step %d: the model's parameters are non-finite since step %d (an "
            "optimizer step took in non-finite gradients; %s), so every layer now computes "
            "from non-finite weights and demoting a layer cannot help: restore a checkpoint "
            "(model and optimizer) from before step %d and see what made that step "
            "non-finite%s; nothing is demoted until the parameters are finite again.",
            step, since, where, since, hint)
