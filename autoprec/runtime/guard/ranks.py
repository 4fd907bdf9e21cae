"""Rank agreement: under torch.distributed every rank reaches the same verdict at each step, so
that all demote the same layers at the same step and hold the same amended policy."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Agreed", "Ranks"]


class Agreed(NamedTuple):
    """What the ranks agreed on for one step (see Ranks.agree); on one rank, its own view."""

    trained: bool
    blamed: list[str]
    poisoned: bool
    foreseen: list[str]
    requested: list[str]


class Ranks:
    """The ranks that decide together (one, when torch.distributed is not initialized or
    ``enabled`` is False)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def world(self) -> int:
        if not self.enabled or not dist.is_available() or not dist.is_initialized():
            return 1
        return dist.get_world_size()

    def writes(self) -> bool:
        """Whether this rank writes the files every rank would write alike (rank 0 does)."""
        return self.world() == 1 or dist.get_rank() == 0

    def agree(self, trained: bool, blamed: str | None, poisoned: bool, watched: list[str],
              model: nn.Module | None, *, foreseen: Iterable[str] = (),
              requested: Iterable[str] = ()) -> Agreed:
        """One all_reduce(MAX) of [trained, digest, -digest, poisoned, then three flags per
        watched layer: blamed, forecast to hit its range (``foreseen``), demotion requested
        (``requested``)]: every rank learns whether any rank trained, whether any rank found
        the parameters poisoned (then none demotes for blame), and which layers any rank
        blamed, foresaw or was asked to demote (an OR over ranks). The digest of the watched
        list, reduced as its max and its negated min, tells every rank alike when the ranks
        watch different layers (the flags would then not line up)."""
        watched = sorted(watched)
        n = len(watched)
        digest = int.from_bytes(hashlib.sha256("\n".join(watched).encode()).digest()[:7], "big")
        flags = [0] * (4 + 3 * n)
        flags[0], flags[1], flags[2], flags[3] = int(trained), digest, -digest, int(poisoned)
        index = {f: i for i, f in enumerate(watched)}
        for at, fqns in ((4, [blamed] if blamed is not None else []), (4 + n, foreseen),
                         (4 + 2 * n, requested)):
            for f in fqns:
                if f in index:
                    flags[at + index[f]] = 1
        vec = torch.tensor(flags, dtype=torch.int64, device=self.device(model))
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        out = vec.tolist()
        if out[1] != -out[2]:
            raise RuntimeError(
                f"autoprec guard: the ranks watch different layers (rank {dist.get_rank()} "
                f"watches {len(watched)}), so they cannot agree on demotions; apply the same "
                "policy to the same model on every rank, or set GuardConfig(distributed=False) "
                "when the ranks hold different parts of the model.")
        return Agreed(bool(out[0]), [f for f, flag in zip(watched, out[4:4 + n]) if flag],
                      bool(out[3]), [f for f, flag in zip(watched, out[4 + n:4 + 2 * n]) if flag],
                      [f for f, flag in zip(watched, out[4 + 2 * n:]) if flag])

    @staticmethod
    def device(model: nn.Module | None) -> torch.device:
        """CPU for gloo; else (NCCL and the like) the device the model trains on."""
        backend = str(dist.get_backend())
        if "gloo" in backend or model is None:
            return torch.device("cpu")
        param = next(model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def gather(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's evidence of the layers it blamed, foresaw or was asked to demote
        (source -> fqn -> (where, description)), on the steps that demote (rare): all ranks
        write the same events, told by the lowest rank that saw each."""
        if self.world() == 1:
            return [mine]
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, mine)
        return seen
