"""The demoter: one layer one step safer (``Format.demoted()``), by re-applying the policy
amended with it, leaving every other layer's computation as it was."""

from __future__ import annotations

import dataclasses

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence

from torch import nn

from autoprec.formats import Format
from autoprec.policy import Policy
from autoprec.runtime import rewrite

__all__ = ["amend", "amend_phases", "demotion_reason", "merge", "reapply", "safer"]


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


def safety(fmt: Format) -> float:
    """Rank of ``fmt`` by safety (lower: safer): its precision rank (``precision_rank`` of its
    numerics): fp32, then bf16 and fp16 (a tie: one has range, the other precision), then the
    scaled formats by the precision of their GEMMs (mxfp8 before fp8 tensorwise, nvfp4 last),
    so that a layer demoted nvfp4 -> mxfp8 is not put back into nvfp4 by a later phase."""
    return fmt.numerics.precision_rank


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
    """``policy`` with its phases, every phase amended as :func:`merge` amends one: in each
    phase a demoted layer computes in the safer of the phase's format and its demoted one
    (:func:`amend_phases` writes it so that neither a phase's map nor its own ``layers`` can
    lower it again, e.g. ``formats: {bf16: fp8}`` for a layer demoted to bf16)."""
    wanted = []
    for i in range(len(policy.phases) + 1):
        flat = policy.phase(i)
        wanted.append({fqn: safer(flat.format_for(fqn), fmt) for fqn, fmt in demoted.items()})
    return amend_phases(policy, wanted, layers)


def amend_phases(policy: Policy, wanted: Sequence[Mapping[str, Format]],
                 layers: Iterable[str]) -> Policy:
    """``policy`` with its phases amended so that during phase ``i`` each layer of
    ``wanted[i]`` (fqn -> format) computes in that format, each change touching that layer's
    own computation only: every other computing layer (of ``layers``) computes in every phase
    as before. The first phase's changes go into its ``layers`` (:func:`amend`); a later phase
    gets entries in its own ``layers`` wherever the amended first phase, mapped through the
    phase's ``formats``, would compute otherwise (a changed first-phase entry maps on, and a
    phase's map or patterns could undo a change)."""
    layers = list(layers)
    before = [policy.phase(i) for i in range(len(policy.phases) + 1)]
    first = before[0]
    for fqn, fmt in (wanted[0] if wanted else {}).items():
        if first.format_for(fqn) is not fmt:
            first = first.with_layers(amend(first, fqn, fmt, layers))
    phases = []
    for i, phase in enumerate(policy.phases, start=1):
        target = {name: before[i].format_for(name) for name in layers}
        target.update(wanted[i] if i < len(wanted) else {})
        got = dataclasses.replace(first, phases=(phase,)).phase(1)
        extra: dict[str, Format] = {}
        # parents first: an entry for a parent changes what its children inherit
        for name in sorted(target, key=lambda n: n.count(".")):
            if got.format_for(name) is not target[name]:
                extra[name] = target[name]
                got = got.with_layers({name: target[name]})
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
