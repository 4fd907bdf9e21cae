"""The demoter: one layer one step safer (``Format.demoted()``), by re-applying the policy
amended with it, leaving every other layer's computation as it was."""

from __future__ import annotations

import dataclasses

import warnings
from collections.abc import Callable, Iterable, Mapping

from torch import nn

from autoprec.formats import Format
from autoprec.policy import Policy
from autoprec.runtime import rewrite

__all__ = ["amend", "demotion_reason", "merge", "reapply", "safer"]


def demotion_reason(described: str, streak: int | None, ranks: list[int], world: int) -> str:
    """The event's reason: what was measured, for how many steps (``streak``; None: said in
    ``described``), on which ranks."""
    reason = described if streak is None else f"{described}; {streak} steps in a row"
    if world > 1:
        reason += (f" (seen on rank{'s' if len(ranks) > 1 else ''} "
                   f"{', '.join(map(str, ranks))} of {world})")
    return reason


def amend(policy: Policy, fqn: str, new: Format, layers: Iterable[str]) -> dict[str, Format]:
    """Layer entries that change ``fqn``'s own computation to ``new`` and nothing else: the
    computing descendants (among ``layers``) that inherited its format are pinned to their
    current one."""
    updates = {fqn: new}
    amended = policy.with_layers(updates)
    prefix = fqn + "."
    for name in layers:
        if name.startswith(prefix):
            before = policy.format_for(name)
            if amended.format_for(name) is not before:
                updates[name] = before
    return updates


def safety(fmt: Format) -> int:
    """Rank of ``fmt`` by safety (lower: safer): fp32, then bf16 and fp16 (a tie: one has
    range, the other precision), then every fp8 recipe."""
    if fmt is Format.FP32:
        return 0
    return 2 if fmt.is_fp8 else 1


def safer(new: Format, demoted: Format) -> Format:
    """The safer of a policy's ``new`` format and a guard's ``demoted`` one; on a tie,
    ``new``."""
    return demoted if safety(demoted) < safety(new) else new


def merge(policy: Policy, demoted: Mapping[str, Format], layers: Iterable[str]) -> Policy:
    """``policy`` with each layer of ``demoted`` (fqn -> the format the guard demoted it to)
    computing in the safer of the two (see safer), amended as one demotion each (amend)."""
    layers = list(layers)
    out = policy
    for fqn, fmt in demoted.items():
        keep = safer(out.format_for(fqn), fmt)
        if keep is not out.format_for(fqn):
            out = out.with_layers(amend(out, fqn, keep, layers))
    return out


def merge_phases(policy: Policy, demoted: Mapping[str, Format], layers: Iterable[str]) -> Policy:
    """``policy`` with its phases, every phase amended as :func:`merge` amends one: the first
    phase's entries get the demotions, and each later phase's own ``layers`` the entries that
    keep a demoted layer in the safer format there too (a phase's map alone could lower it
    again, e.g. ``formats: {bf16: fp8}`` for a layer demoted to bf16)."""
    layers = list(layers)
    first = merge(policy.phase(0), demoted, layers)
    phases = []
    for i, phase in enumerate(policy.phases, start=1):
        flat = policy.phase(i)
        amended = merge(flat, demoted, layers)
        extra = {p: f for p, f in amended.layers.items() if flat.layers.get(p) is not f}
        phases.append(dataclasses.replace(phase, layers={**phase.layers, **extra}))
    return dataclasses.replace(first, phases=tuple(phases))


def reapply(model: nn.Module, before: Policy, after: Policy,
            reattach: Callable[[nn.Module, Policy], None]) -> None:
    """Apply ``after`` in place of ``before`` to ``model``; ``reattach`` then watches the model
    under ``after``."""
    names = {id(m): n for n, m in model.named_modules()}
    # Wrappers installed around a region after apply (Accelerate's autocast and FP32 output
    # cast around the root's forward when its mixed_precision is not "no") would be dropped
    # by re-applying; put them back where the module's format does not change (the root's
    # never does: a demotion only adds entries for named layers).
    foreign = {}
    for region in rewrite.regions(model):
        fwd = region.module.__dict__.get("forward")
        fqn = names.get(id(region.module))
        if fwd is not None and not isinstance(fwd, rewrite.Region) and fqn is not None \
                and after.format_for(fqn) is before.format_for(fqn):
            foreign[region.module] = fwd
    from autoprec.runtime import engines

    # keeping_sharded_swaps: under FSDP2, torchao's Float8Linear layers swapped in before
    # fully_shard stay (FSDP gathers into them); a demoted one computes as nn.Linear in its
    # new format inside its region, where a plain re-apply would refuse to put it back
    with warnings.catch_warnings(), engines.keeping_sharded_swaps():
        # the policy was checked when first applied; its warnings need not repeat
        warnings.simplefilter("ignore")
        rewrite.apply(model, after, strict=False)
    reattach(model, after)
    for module, fwd in foreign.items():
        module.forward = fwd
