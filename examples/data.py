"""Offline training data: the Python standard library's own source files, as bytes.

Every machine with Python has them, so examples and tests need no download.
"""

from __future__ import annotations

import os
import sysconfig

import torch

__all__ = ["stdlib_bytes", "byte_batches"]


def stdlib_bytes(n_bytes: int, *, skip: int = 0) -> bytes:
    """``n_bytes`` bytes of the stdlib's ``.py`` sources in a fixed file order, after the first
    ``skip`` bytes (so training and held-out streams do not overlap)."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(
        os.path.join(d, f) for d, dirs, files in os.walk(root)
        if "site-packages" not in d and "test" not in os.path.relpath(d, root).split(os.sep)
        for f in files if f.endswith(".py"))
    out = bytearray()
    for path in paths:
        with open(path, "rb") as fh:
            data = fh.read()
        if skip >= len(data):
            skip -= len(data)
            continue
        out += data[skip:]
        skip = 0
        if len(out) >= n_bytes:
            return bytes(out[:n_bytes])
    raise RuntimeError(f"The standard library at {root} has fewer than {n_bytes} bytes of source.")


def byte_batches(n_batches: int, batch_size: int, seq_len: int, *, seed: int = 0,
                 skip: int = 0) -> list[dict[str, torch.Tensor]]:
    """Causal-LM batches ``{"input_ids", "labels"}`` of byte tokens (vocab 256), windows drawn
    with a fixed seed from a stream of stdlib source."""
    stream = torch.frombuffer(bytearray(stdlib_bytes(4_000_000, skip=skip)), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_batches):
        starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=gen)
        ids = torch.stack([stream[s:s + seq_len] for s in starts.tolist()]).long()
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return batches
