"""Rank agreement: under torch.distributed every rank reaches the same verdict at each step, so
that all demote the same layers at the same step and hold the same amended policy."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Ranks"]


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
              model: nn.Module | None) -> tuple[bool, list[str], bool]:
        """One all_reduce(MAX) of [trained, digest, -digest, poisoned, one flag per watched
        layer]: every rank learns whether any rank trained, whether any rank found the
        parameters poisoned (then none demotes), and which layers any rank blamed. The digest
        of the watched list, reduced as its max and its negated min, tells every rank alike
        when the ranks watch different layers (the flags would then not line up)."""
        watched = sorted(watched)
        digest = int.from_bytes(hashlib.sha256("\n".join(watched).encode()).digest()[:7], "big")
        flags = [0] * (4 + len(watched))
        flags[0], flags[1], flags[2], flags[3] = int(trained), digest, -digest, int(poisoned)
        if blamed is not None and blamed in watched:
            flags[4 + watched.index(blamed)] = 1
        vec = torch.tensor(flags, dtype=torch.int64, device=self.device(model))
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        out = vec.tolist()
        if out[1] != -out[2]:
            raise RuntimeError(
                f"autoprec guard: the ranks watch different layers (rank {dist.get_rank()} "
                f"watches {len(watched)}), so they cannot agree on demotions; apply the same "
                "policy to the same model on every rank, or set GuardConfig(distributed=False) "
                "when the ranks hold different parts of the model.")
        return bool(out[0]), [f for f, flag in zip(watched, out[4:]) if flag], bool(out[3])

    @staticmethod
    def device(model: nn.Module | None) -> torch.device:
        """CPU for gloo; else (NCCL and the like) the device the model trains on."""
        backend = str(dist.get_backend())
        if "gloo" in backend or model is None:
            return torch.device("cpu")
        param = next(model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def gather(self, mine: dict[str, tuple[str, str]]) -> list[dict[str, tuple[str, str]]]:
        """Every rank's (where, description) of the layer it blamed, on the steps that demote
        (rare): all ranks write the same events, told by the lowest rank that saw each."""
        if self.world() == 1:
            return [mine]
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, mine)
        return seen
