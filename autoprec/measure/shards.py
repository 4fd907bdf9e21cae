"""A model sharded with FSDP2 (``fully_shard``), as the measurement sees it.

At rest each parameter is a shard (a ``DTensor``); while its unit computes, FSDP2 puts an
unsharded ``nn.Parameter`` in its place, the same object every time (its storage is freed and
all-gathered again). Autograd sees that one, so the measurement hooks and differentiates the
unsharded parameters and changes values in the shards. One unit is unsharded at a time here,
as in a training step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

__all__ = ["is_sharded", "unsharded", "local", "like", "ranks", "divide", "gathered",
           "broadcast", "part", "part_view", "own", "summed_each"]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or a module inside it."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


def unsharded(model: nn.Module) -> dict[int, nn.Parameter]:
    """``id(shard) -> the unsharded parameter`` FSDP2 computes with, for every parameter of
    ``model`` that ``fully_shard`` manages. Each unit is all-gathered once, alone, and left
    sharded; a unit that all-gathers in another dtype (``MixedPrecisionPolicy(param_dtype=...)``)
    is refused: the reference is FP32."""
    out: dict[int, nn.Parameter] = {}
    for name, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        m.reshard()  # the root stays unsharded after a forward: its shards first
        before = dict(m.named_parameters())
        m.unshard()
        try:
            for n, p in m.named_parameters():
                q = before.get(n)
                if q is None or p is q:
                    continue
                if p.dtype != q.dtype:
                    where = f"{name}.{n}" if name else n
                    raise ValueError(
                        f"FSDP2 all-gathers `{where}` in {p.dtype}, but candidates are compared "
                        f"with an FP32 reference; shard the model for measurement without a "
                        f"MixedPrecisionPolicy (or with param_dtype=torch.float32).")
                out[id(q)] = p
        finally:
            m.reshard()
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (``t`` itself unless it is a ``DTensor``)."""
    return t.to_local() if isinstance(t, DTensor) else t


def summed_each(values: torch.Tensor, over: Sequence[torch.Tensor]) -> torch.Tensor:
    """``values[i]``, a sum over this rank's part of ``over[i]``, summed over the ranks holding
    the rest of it (``values[i]`` itself where ``over[i]`` is not a ``DTensor``): one
    all-reduce for all of them."""
    split = [isinstance(t, DTensor) and t.device_mesh.size() > 1 for t in over]
    if not any(split):
        return values
    group = next(t.device_mesh.get_group() for t, s in zip(over, split) if s)
    mask = torch.tensor(split, device=values.device)
    mine = torch.where(mask, values, torch.zeros_like(values))
    dist.all_reduce(mine, group=group)
    return torch.where(mask, mine, values)


def part(full: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` (a tensor of ``shard``'s whole shape, e.g. a gradient of
    the unsharded parameter), in memory of its own, so ``full`` can go: what a rank keeps of
    something every rank computed whole (``full`` itself for a plain tensor)."""
    if not isinstance(shard, DTensor):
        return full
    return own(part_view(full, shard))


def part_view(full: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` in ``full``'s own memory where its placement allows (one
    mesh dimension, sharded along a dim: FSDP2's), as ``torch.chunk`` cuts it, which is how a
    ``Shard`` placement cuts: to read, change in place or write out at once without a copy
    (``distribute_tensor`` copies it). What is kept takes :func:`own` (or :func:`part`), or it
    keeps all of ``full``. Any other placement: ``distribute_tensor``'s copy."""
    if not isinstance(shard, DTensor):
        return full
    mesh, placements, mine = shard.device_mesh, shard.placements, shard.to_local()
    if mesh.ndim == 1 and len(placements) == 1 and isinstance(placements[0], Shard):
        pieces = torch.chunk(full, mesh.size(), dim=placements[0].dim)
        rank = mesh.get_local_rank()
        if rank < len(pieces) and pieces[rank].shape == mine.shape:
            return pieces[rank]
    return local(like(full, shard))


def own(t: torch.Tensor) -> torch.Tensor:
    """``t`` in memory of its own: copied where it is a view of a larger tensor (a part of a
    whole gradient), which keeping it would keep whole."""
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


def like(full: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``full``, a tensor of ``shard``'s whole shape (the same on every rank), placed as
    ``shard`` is: this rank's part of it, sliced locally (``full`` itself for a plain tensor)."""
    if not isinstance(shard, DTensor):
        return full
    return distribute_tensor(full, shard.device_mesh, shard.placements, src_data_rank=None)


def ranks(model: nn.Module) -> tuple[int, int]:
    """``(rank, ranks)`` of the processes measuring ``model`` together: every rank of the
    default process group when FSDP2 shards ``model`` (each forward and backward is then a
    collective all of them run); ``(0, 1)`` otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or not is_sharded(model):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def divide(groups: Sequence[Sequence[str]], costs: Mapping[str, float], n: int) -> list[list[str]]:
    """``groups`` of names dealt to ``n`` ranks, each group whole, the costliest first to the
    rank with the least so far (ties to the lowest rank): the same on every rank."""
    load, out = [0.0] * n, [[] for _ in range(n)]
    order = sorted(range(len(groups)), key=lambda g: (-sum(costs[x] for x in groups[g]), g))
    for g in order:
        r = min(range(n), key=lambda r: (load[r], r))
        out[r].extend(groups[g])
        load[r] += sum(costs[x] for x in groups[g])
    return out


def gathered(mine: dict, model: nn.Module) -> dict:
    """The union of every rank's ``mine`` (disjoint keys), on every rank."""
    if ranks(model)[1] == 1:
        return mine
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def broadcast(value, model: nn.Module):
    """Rank 0's ``value`` on every rank measuring ``model`` (``value`` itself when one process
    measures it): what one rank decides alone (a stored profile, a choice), the others follow."""
    if ranks(model)[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
