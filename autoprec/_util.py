"""Plumbing shared by every stage: batches, nested tensors, model snapshots, files, tables.

Nothing here knows about formats or policies; it imports torch and the standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import socket
import sys
import tempfile
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
    "read_bounded",
    "check_keys",
    "check_schema",
    "text_table",
    "ProgressBar",
    "log",
    "brief",
    "number",
    "MAX_INT",
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
# What a failed write tells the user to do, by errno.
_WRITE_FIXES = {
    errno.ENOSPC: "free some disk space or write elsewhere (another -o path)",
    errno.EDQUOT: "free some of your disk quota or write elsewhere (another -o path)",
    errno.EROFS: "the file system is read-only: write elsewhere (another -o path)",
    errno.EACCES: "you may not write there: pick a folder you can write to",
    errno.EPERM: "you may not write there: pick a folder you can write to",
    errno.ENOTDIR: "a part of the path is a file, not a folder: pick another path",
    errno.EISDIR: "the path is a directory: name a file inside it instead",
    errno.EEXIST: "a part of the path is a file, not a folder: pick another path",
}


def _umask() -> int:
    """The process umask, read without changing it where Linux says it (os.umask can only be
    read by setting it, which races with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, data: str | bytes) -> str:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` so that a reader, a crash or a full
    disk never leaves half a file: into a new temporary file in the same folder, created
    exclusively (``mkstemp``: a random name, ``O_EXCL``, so a link planted where the file will
    be cannot redirect the write), synced, then renamed over ``path``. A symlink at ``path``
    itself is replaced, never followed. Creates the parent folder. Returns the path.

    An OSError (disk full, read-only, no permission, a path under a regular file) becomes a
    one-line ValueError naming the path; whatever was at ``path`` before is left unchanged."""
    path = os.fspath(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    parent = os.path.dirname(path)
    existed = os.path.lexists(path)
    tmp = None
    try:
        if parent:
            os.makedirs(parent, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                   dir=parent or ".")
        try:
            # mkstemp makes the file 0600; what we write (policies, tables) is meant to be read
            os.fchmod(fd, 0o644 & ~_umask())
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        before = ("the file there is unchanged" if existed else "nothing was written")
        fix = _WRITE_FIXES.get(e.errno, "pick another path")
        raise ValueError(f"Cannot write {path}: {e.strerror or e} ({before}); {fix}.") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
    with contextlib.suppress(OSError):  # the rename itself survives a crash once this is done
        dir_fd = os.open(parent or ".", os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def unwritable_folder(path: str | os.PathLike) -> tuple[str, str] | None:
    """Why a file at ``path`` could not be created, found before any work: the nearest
    existing ancestor of its folder and ``"file"`` (it is not a folder) or ``"unwritable"``;
    None when the file can be created there (missing folders are made by atomic_write)."""
    probe = os.path.dirname(os.path.abspath(os.fspath(path)))
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return probe, "file"
    if not os.access(probe, os.W_OK | os.X_OK):
        return probe, "unwritable"
    return None


def escape_line(text: str) -> str:
    """``text`` as the rest of one line of generated Python, YAML or terminal output (a
    comment, a note): every character that is not printable written as its escape (``\\n``,
    ``\\u2028``). That covers what ends a line in Python or YAML (``\\n``, ``\\r``; YAML's
    ``\\x85``, ``\\u2028``, ``\\u2029``) and the control characters neither may contain, so
    text from a user or a model (file and module names) cannot step out of its line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in str(text))


def write_json(path: str | os.PathLike, data: Any) -> str:
    return atomic_write(path, json.dumps(data, indent=1, allow_nan=False) + "\n")


# Bounds on any JSON file we read: far above what autoprec writes (a profile of a 1000-layer
# model is a few MiB, its nesting depth under 10), far below what exhausts memory or the stack.
MAX_JSON_BYTES = 64 * 2 ** 20
MAX_JSON_DEPTH = 64


def read_bounded(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of the file at ``path``, refusing one larger than ``limit`` (checked before it
    is read, and again while reading, for a file that grows or does not say its size)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise ValueError(f"{path} is {size / 2 ** 20:.1f} MiB; a {what} file may be at most "
                             f"{limit / 2 ** 20:g} MiB. Is it the right file?")
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"{path} is larger than {limit / 2 ** 20:g} MiB, the most a {what} file "
                         "may be. Is it the right file?")
    return raw


def json_depth(value: Any) -> int:
    """How deeply lists and dicts nest in ``value`` (0 for a scalar), without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, Mapping):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in children)
    return depth


def read_json(path: str | os.PathLike, what: str, *, max_bytes: int = MAX_JSON_BYTES,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a JSON file; a missing, unreadable, malformed, oversized (``max_bytes``) or too
    deeply nested (``max_depth``) file is a one-line ValueError naming it."""
    path = os.fspath(path)
    try:
        raw = read_bounded(path, max_bytes, what)
    except FileNotFoundError:
        raise ValueError(f"{what} file {path} does not exist.") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a directory, not a {what} file.") from None
    except PermissionError:
        raise ValueError(f"{path} cannot be read (permission denied); it should be a {what} "
                         "file you may read.") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a {what} file: byte {e.start} is not UTF-8 text.") from None
    fix = "Delete it and run the command that writes it again."
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a valid {what} file: {e.msg} at line {e.lineno}. "
                         f"{fix}") from None
    except RecursionError:  # the decoder recurses per nesting level (and stops cleanly)
        raise ValueError(f"{path} is not a {what} file: its lists or objects nest deeper than "
                         f"{max_depth} levels. {fix}") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise ValueError(f"{path} is not a valid {what} file: {' '.join(str(e).split())}. "
                         f"{fix}") from None
    if json_depth(data) > max_depth:
        raise ValueError(f"{path} is not a {what} file: its lists or objects nest deeper than "
                         f"{max_depth} levels. {fix}")
    return data


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


def brief(value: Any) -> str:
    """A value for an error message: its type and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


# Integers beyond this are no count or size anything measures, and overflow a float.
MAX_INT = 2 ** 63


def number(value: Any, what: str) -> float:
    """``value`` as a float: an int (of a sane size) or float, not a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, int) and abs(value) >= MAX_INT):
        raise ValueError(f"{what} must be a number, got {brief(value)}.")
    return float(value)


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
