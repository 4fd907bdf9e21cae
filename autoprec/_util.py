"""Plumbing shared by every stage: batches, nested tensors, model snapshots, files, tables.

Nothing here knows about formats or policies; it imports torch and the standard library only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelCall",
    "call_model",
    "split_batch",
    "tensors",
    "floating",
    "move_to",
    "device_of",
    "model_state",
    "atomic_write",
    "write_json",
    "read_json",
    "check_keys",
    "check_schema",
    "text_table",
    "ProgressBar",
    "log",
]


# ------------------------------------------------------------------------------ batches
@dataclass(frozen=True)
class ModelCall:
    """The exact arguments a model is called with (what a task's loss function passes it)."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple or list, the arguments
    of a :class:`ModelCall`, else ``model(batch)``: the one convention for what a batch is."""
    args, kwargs = split_batch(batch)
    return model(*args, **kwargs)


def split_batch(batch: Any) -> tuple[tuple, dict]:
    """The positional and keyword arguments :func:`call_model` passes for ``batch``."""
    if isinstance(batch, ModelCall):
        return tuple(batch.args), dict(batch.kwargs)
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (list, tuple)):
        return tuple(batch), {}
    return (batch,), {}


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure (tuples, lists, dicts, HF ModelOutput), in order.
    (Not ``torch.utils._pytree``: it treats unregistered mapping types such as some
    ``ModelOutput`` subclasses as leaves.)"""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        obj = obj.values()
    elif not isinstance(obj, (list, tuple)):
        return []
    return [t for item in obj for t in tensors(item)]


def floating(obj: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a nested structure."""
    return [t for t in tensors(obj) if t.is_floating_point()]


def move_to(batch: Any, device: torch.device | str) -> Any:
    """``batch`` with every tensor in it moved to ``device`` (dicts, lists, tuples)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, ModelCall):
        return ModelCall(move_to(tuple(batch.args), device), move_to(dict(batch.kwargs), device))
    if isinstance(batch, Mapping):
        moved = {k: move_to(v, device) for k, v in batch.items()}
        return type(batch)(moved) if isinstance(batch, dict) else moved
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(v, device) for v in batch)
    return batch


def device_of(model: nn.Module, batch: Any = None) -> torch.device:
    """Where ``model`` computes: its first parameter's device, else the batch's, else CPU."""
    for p in model.parameters():
        return p.device
    for t in tensors(batch):
        return t.device
    return torch.device("cpu")


@contextlib.contextmanager
def model_state(model: nn.Module, *, weights: bool = True) -> Iterator[None]:
    """Restore on exit what a measurement may disturb: training flags, gradients, and buffers
    (and with ``weights`` every parameter value: a timed optimizer step moves them)."""
    flags = [(m, m.training) for m in model.modules()]
    grads = [(p, p.grad) for p in model.parameters()]
    saved = [(t, t.detach().clone()) for t in
             (list(model.parameters()) if weights else []) + list(model.buffers())]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, value in saved:
                t.copy_(value)
        for p, g in grads:
            p.grad = g
        for m, flag in flags:
            m.training = flag


# ------------------------------------------------------------------------------ files
def atomic_write(path: str | os.PathLike, text: str) -> str:
    """Write ``text`` to ``path`` through a temporary file and a rename, so that a reader (or
    a crash) never sees half a file. Creates the parent folder. Returns the path."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def write_json(path: str | os.PathLike, data: Any) -> str:
    return atomic_write(path, json.dumps(data, indent=1, allow_nan=False) + "\n")


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Parse a JSON file; a missing, unreadable or malformed file is a ValueError naming it."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{what} file {path} does not exist.") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a {what} file: it is not UTF-8 text.") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a valid {what} file: {e.msg} at line {e.lineno}. "
                         "Delete it and run the command that writes it again.") from None


def check_keys(data: Any, what: str, *, known: Sequence[str],
               required: Sequence[str] = ()) -> None:
    """A record read from a file must be a mapping with no unknown and no missing keys."""
    if not isinstance(data, Mapping):
        raise ValueError(f"A {what} record must be a mapping, got {type(data).__name__}.")
    unknown = [k for k in data if k not in known]
    missing = [k for k in required if k not in data]
    problems = []
    if unknown:
        problems.append(f"unknown key(s) {', '.join(map(repr, unknown))}")
    if missing:
        problems.append(f"missing key(s) {', '.join(map(repr, missing))}")
    if problems:
        raise ValueError(f"A {what} record has {' and '.join(problems)}; its keys are "
                         f"{', '.join(known)}.")


def check_schema(data: Any, key: str, version: int, what: str, *,
                 readable: Sequence[int] = ()) -> int:
    """Every file autoprec writes starts with ``{key}: <version>``. Returns the version found
    (``version`` or one of the older ``readable`` ones, which the caller migrates)."""
    if not isinstance(data, Mapping) or key not in data:
        raise ValueError(f"Not an autoprec {what} (no `{key}` version key).")
    found = data[key]
    if found != version and found not in readable:
        raise ValueError(f"{what} has schema version {found!r}; this autoprec reads version "
                         f"{version}. Regenerate it with this version of autoprec.")
    return found


# ------------------------------------------------------------------------------ output
def text_table(header: Sequence[str], rows: Sequence[Sequence[Any]], *,
               right: Sequence[int] = (), indent: str = "", rule: bool = True) -> str:
    """A plain-text table: columns padded to their widest cell, ``right`` ones right-aligned,
    a rule under the header."""
    cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return indent + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                  for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    out = [line(cells[0])]
    if rule:
        out.append(indent + "-" * (len(out[0]) - len(indent)))
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def log(msg: str, enabled: bool = True) -> None:
    """Progress output of long work: one line on stderr."""
    if enabled:
        print(msg, file=sys.stderr, flush=True)


class ProgressBar:
    """A progress bar on stderr: ``[#####-----] 12/63 label`` redrawn in place on a terminal;
    elsewhere (logs, CI) a plain line per tenth of the work and none of the redraws."""

    def __init__(self, title: str, *, enabled: bool = True, width: int = 28,
                 stream: Any = None):
        self.title, self.enabled, self.width = title, enabled, width
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()

    def __call__(self, done: int, total: int, label: str = "") -> None:
        if not self.enabled or total <= 0:
            return
        out = self.stream
        elapsed = time.perf_counter() - self.t0
        if not getattr(out, "isatty", lambda: False)():
            step = max(1, total // 10)
            if done < total and done % step:
                return
            tail = f" ({elapsed:.0f} s)" if done >= total else f" {label}"
            out.write(f"{self.title}: {done}/{total}{tail}\n")
            out.flush()
            return
        filled = int(self.width * done / total)
        eta = elapsed / done * (total - done) if done else math.nan
        eta_s = f" eta {eta:4.0f}s" if math.isfinite(eta) else ""
        out.write(f"\r{self.title} [{'#' * filled}{'-' * (self.width - filled)}] "
                  f"{done}/{total}{eta_s} {label[:48]:<48}")
        if done >= total:
            out.write(f"\r{self.title}: {total} done in {elapsed:.1f}s{' ' * 60}\n")
        out.flush()


ProgressFn = Callable[[int, int, str], None]


_NONFINITE_NAMES = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def encode_float(value: Any) -> Any:
    """A float for JSON: inf and NaN become "inf", "-inf", "nan" (JSON has no literal for
    them, and ``json.dumps(allow_nan=False)`` must accept the result); anything else as is."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def decode_float(value: Any, what: str) -> Any:
    """Inverse of :func:`encode_float` for a field of a ``what`` record (None and bools pass
    through); an unknown string is a ValueError naming it."""
    if isinstance(value, str):
        try:
            return _NONFINITE_NAMES[value.strip().lower()]
        except KeyError:
            raise ValueError(f"Expected a number or one of 'inf', '-inf', 'nan' in a "
                             f"{what}, got the string {value!r}.") from None
    if value is None or isinstance(value, bool):
        return value
    return float(value)


def worker_id() -> str:
    """This process, as shared work records who did it: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"
