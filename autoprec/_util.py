"""Plumbing shared by every stage: batches, nested tensors, model snapshots, files, tables.

Nothing here knows about formats or policies; it imports torch and the standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import math
import os
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "Spilled",
    "class_name",
    "own_class",
    "ModelCall",
    "call_model",
    "loss_of",
    "split_batch",
    "tensors",
    "floating",
    "move_to",
    "device_of",
    "free_memory",
    "model_state",
    "spilled",
    "optimizer_step",
    "atomic_write",
    "atomic_write_all",
    "not_a_file",
    "refuse_non_file",
    "unwritable_folder",
    "same_file",
    "distinct_files",
    "file_kind",
    "write_json",
    "read_json",
    "read_bounded",
    "check_keys",
    "fits",
    "TEXT",
    "OPT_TEXT",
    "INT",
    "NUM",
    "OPT_NUM",
    "BOOL",
    "FLOATISH",
    "PAIR",
    "check_schema",
    "text_table",
    "ProgressBar",
    "log",
    "brief",
    "shown",
    "terminal_safe",
    "EscapingStream",
    "quoted",
    "escape_line",
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


def loss_of(out: Any) -> torch.Tensor | None:
    """The loss in a model's output: its ``.loss``, ``["loss"]``, the first element of a
    tuple (HF models called with labels and ``return_dict=False``), or the output itself when
    it is a scalar tensor; None when there is none."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) \
            and out[0].dim() == 0:
        loss = out[0]
    if loss is None and isinstance(out, torch.Tensor) and out.dim() == 0:
        loss = out
    return loss


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


def free_memory(device: torch.device | str) -> int | None:
    """Bytes free on ``device`` now: the CUDA allocator's device's free memory, or the host's
    ``MemAvailable`` (Linux) for the CPU; None where it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_of(model: nn.Module, batch: Any = None) -> torch.device:
    """Where ``model`` computes: its first parameter's device, else the batch's, else CPU."""
    for p in model.parameters():
        return p.device
    for t in tensors(batch):
        return t.device
    return torch.device("cpu")


def optimizer_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler | None = None) -> None:
    """Backward, step and zero the gradients, through ``scaler`` when one is given (fp16)."""
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def model_state(model: nn.Module, *, weights: bool = True, spill: bool = False) -> Iterator[None]:
    """Restore on exit what a measurement may disturb: training flags, gradients, and buffers
    (and with ``weights`` every parameter value: a timed optimizer step moves them).

    ``spill``: the values wait outside the model's device memory rather than beside the model
    (an unnamed temporary file for a model on the CPU, host memory for one on an accelerator),
    one tensor at a time each way: the measurement runs on the model with no second copy of it
    alive."""
    flags = [(m, m.training) for m in model.modules()]
    grads = [(p, p.grad) for p in model.parameters()]
    values = (list(model.parameters()) if weights else []) + list(model.buffers())
    store = Spilled.holding(values) if spill else [t.detach().clone() for t in values]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, value in zip(values, store):
                t.copy_(value)
        for p, g in grads:
            p.grad = g
        for m, flag in flags:
            m.training = flag


@contextlib.contextmanager
def spilled(groups: list[list[torch.Tensor]]) -> Iterator[None]:
    """Empty ``groups`` (a list of lists of tensors) meanwhile, their values waiting outside
    device memory as :func:`model_state`'s ``spill`` keeps them, and fill it again after with
    tensors of the same values on the same devices, one at a time. The caller holds no other
    reference to them, or they stay alive beside the spill."""
    sizes = [len(g) for g in groups]
    store = Spilled.holding([t for g in groups for t in g])
    groups.clear()
    try:
        yield
    finally:
        values = iter(store)
        for n in sizes:
            groups.append([next(values) for _ in range(n)])


class Spilled:
    """Tensors written out as they come, in any order, and read back by index, each when it is
    asked for: a CPU tensor's bytes in an unnamed temporary file, an accelerator's tensor in
    host memory. Nothing of them waits in the device's memory meanwhile. A sum can be kept
    this way too (:meth:`add`). True once anything is in it."""

    def __init__(self, n: int):
        self.file: Any = None
        self.host: dict[int, torch.Tensor] = {}
        # index -> (offset in the file, shape, dtype, device)
        self.where: list[tuple | None] = [None] * n

    @classmethod
    def holding(cls, tensors: Sequence[torch.Tensor]) -> Spilled:
        """``tensors`` written out now, read back by index (or in order) when asked for."""
        out = cls(len(tensors))
        for i, t in enumerate(tensors):
            out.put(i, t)
        return out

    def put(self, i: int, t: torch.Tensor) -> None:
        t = t.detach()
        if t.device.type != "cpu":
            self.host[i] = t.to("cpu", copy=True)
            self.where[i] = (None, t.shape, t.dtype, t.device)
            return
        if self.file is None:
            self.file = tempfile.TemporaryFile()
        offset = self.file.seek(0, os.SEEK_END)
        self.file.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self.where[i] = (offset, t.shape, t.dtype, t.device)

    def add(self, i: int, t: torch.Tensor) -> None:
        """Tensor ``i`` becomes itself + ``t`` (``t`` itself, the first time)."""
        if self.where[i] is None:
            self.put(i, t)
        elif self.where[i][0] is None:
            self.host[i].add_(t.detach().to("cpu"))
        else:
            total = self[i].add_(t.detach())
            self.file.seek(self.where[i][0])
            self.file.write(total.reshape(-1).view(torch.uint8).numpy().data)

    def __len__(self) -> int:
        return len(self.where)

    def __bool__(self) -> bool:
        return any(w is not None for w in self.where)

    def __getitem__(self, i: int) -> torch.Tensor:
        offset, shape, dtype, device = self.where[i]
        if offset is None:
            return self.host[i].to(device)
        buf = torch.empty(shape, dtype=dtype).reshape(-1)
        self.file.seek(offset)
        if self.file.readinto(buf.view(torch.uint8).numpy().data) != buf.nbytes:
            raise OSError("a spilled tensor came back short")
        return buf.reshape(shape)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))


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


def not_a_file(path: str | os.PathLike) -> str | None:
    """Why ``path`` may not be an output: ``"a character device"``, ``"a link to a FIFO"``, ...
    when something other than a regular file (or a link to one) is there; None when nothing is
    there, a regular file is, or a link to a regular file or to nothing (a link is replaced,
    never followed). autoprec writes every output as a regular file replaced atomically: it
    never writes into a device, a pipe or a socket, nor replaces one with a file (``-o
    /dev/null`` as root would replace the system's /dev/null; ``-o`` a link into ``/proc``
    would write wherever that descriptor leads)."""
    path = os.fspath(path)
    try:
        st = os.lstat(path)
    except OSError:  # nothing there, or a path the OS refuses: the write says which, in one line
        return None
    link = stat.S_ISLNK(st.st_mode)
    if link:
        system = _system_link(path)
        if system is not None:
            return f"a link into {system}"
        try:
            st = os.stat(path)
        except OSError:  # a dangling link (or a loop): replaced like any planted link
            return None
    kind = file_kind(st.st_mode)
    if kind is None:
        return None
    return f"a link to {kind}" if link else kind


def _system_link(path: str) -> str | None:
    """``/proc`` or ``/dev`` when a hop of the link chain at ``path`` leads there: such links
    (``/dev/stdout``, ``/proc/self/fd/1``) name descriptors and devices, not files, whatever
    the descriptor happens to be open on."""
    path = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on a chain of links
        for root in ("/proc", "/dev"):
            if path == root or path.startswith(root + "/"):
                return root
        try:
            target = os.readlink(path)
        except OSError:
            return None
        path = os.path.normpath(os.path.join(os.path.dirname(path), target))
    return None


_NOT_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
              (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
              (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str | None:
    """What a file of ``mode`` (``st_mode``) is when it is not a regular file, in words
    (``"a FIFO (named pipe)"``, ``"a character device"``, ...); None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _NOT_FILES if test(mode)), "not a regular file")


def refuse_non_file(path: str | os.PathLike, what: str | None = None) -> None:
    """A one-line ValueError when ``path`` may not be an output (:func:`not_a_file`), naming
    it as ``what`` (default: the path), escaped."""
    kind = not_a_file(path)
    if kind is not None:
        raise ValueError(f"{what or shown(os.fspath(path))} is {kind}, not a file: autoprec "
                         "writes its outputs as regular files (replaced atomically) and never "
                         "writes into or replaces a device, pipe or socket. Give a file path.")


def atomic_write(path: str | os.PathLike, data: str | bytes) -> str:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` so that a reader, a crash or a full
    disk never leaves half a file: into a new temporary file in the same folder, created
    exclusively (``mkstemp``: a random name, ``O_EXCL``, so a link planted where the file will
    be cannot redirect the write), synced, then renamed over ``path``. A symlink at ``path``
    itself is replaced, never followed. Creates the parent folder. Returns the path.

    A device, pipe or socket at ``path`` (or a link to one: ``/dev/stdout``, a link into
    ``/proc``) is refused (:func:`refuse_non_file`): neither written into nor replaced. An
    OSError (disk full, read-only, no permission, a path under a regular file) becomes a
    one-line ValueError naming the path; whatever was at ``path`` before is left unchanged."""
    return atomic_write_all([(path, data)])[0]


def atomic_write_all(items: Sequence[tuple[str | os.PathLike, str | bytes]]) -> list[str]:
    """Write every ``(path, data)`` of ``items``, or none of them: first each into a new
    temporary file in its own folder as :func:`atomic_write` writes one (created exclusively,
    the same permissions, synced), then, once all are written, each renamed over its path.
    A write that fails (a full disk, an unwritable folder) removes every temporary, so
    nothing was written and whatever was at each path is unchanged. A rename that fails after
    others succeeded puts back what those replaced (kept as a hard link until the end) or
    removes what they created. Errors are atomic_write's one-line ValueErrors naming the
    path; a device, pipe or socket at a path is refused before anything is written. Returns
    the paths."""
    items = [(os.fspath(p), d.encode("utf-8") if isinstance(d, str) else bytes(d))
             for p, d in items]
    if len({os.path.abspath(p) for p, _ in items}) < len(items):
        raise ValueError(f"Cannot write {', '.join(shown(p) for p, _ in items)}: a path is "
                         "named twice, and one file cannot hold two outputs; give each its own.")
    existed = any(os.path.lexists(p) for p, _ in items)
    temps: dict[str, str] = {}
    backups: dict[str, str | None] = {}  # path -> a link to what was there ("": none kept)
    done: list[str] = []
    try:
        for path, _ in items:
            refuse_non_file(path)
        for path, payload in items:
            temps[path] = _temporary(path, payload)
        for path, _ in items[:-1]:  # what a rename replaced before a later one fails
            backups[path] = _backup(path)
        for path, _ in items:
            refuse_non_file(path)  # again: what is there now is what the rename replaces
            os.replace(temps[path], path)
            del temps[path]
            done.append(path)
    except BaseException as e:
        lost = _roll_back(done, backups)
        if not isinstance(e, OSError):
            raise
        before = (f"{', '.join(map(shown, lost))} already replaced, the rest unchanged"
                  if lost else "the file there is unchanged" if existed and len(items) == 1
                  else "nothing was written" + ("; the files there are unchanged"
                                                if existed else ""))
        raise ValueError(f"Cannot write {shown(path)}: {e.strerror or e} ({before}); "
                         f"{_WRITE_FIXES.get(e.errno, 'pick another path')}.") from None
    finally:
        for leftover in [*temps.values(), *(b for b in backups.values() if b)]:
            with contextlib.suppress(OSError):
                os.remove(leftover)
    for parent in dict.fromkeys(os.path.dirname(p) or "." for p, _ in items):
        with contextlib.suppress(OSError):  # the renames survive a crash once this is done
            dir_fd = os.open(parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    return [p for p, _ in items]


def _temporary(path: str, payload: bytes) -> str:
    """A new temporary file beside ``path`` holding ``payload``, as atomic_write makes one."""
    parent = os.path.dirname(path)
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
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.close(fd)
    return tmp


def _backup(path: str) -> str | None:
    """A hard link to what is at ``path`` (the link itself for a symlink), to put it back if
    a later rename fails; None when nothing is there, "" when no link could be made."""
    if not os.path.lexists(path):
        return None
    folder, name = os.path.split(path)
    backup = os.path.join(folder, f".{name}.{os.urandom(8).hex()}.old")
    try:
        os.link(path, backup, follow_symlinks=False)  # fails rather than replace a file there
    except (OSError, NotImplementedError):  # no hard links there: nothing to put back
        return ""
    return backup


def _roll_back(done: list[str], backups: Mapping[str, str | None]) -> list[str]:
    """Undo the renames of ``done``; the paths that could not be put back."""
    lost = []
    for path in reversed(done):
        backup = backups.get(path)
        try:
            if backup is None:
                os.remove(path)
            elif backup:
                os.replace(backup, path)
            else:
                lost.append(path)
        except OSError:
            lost.append(path)
    return lost


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


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file: the same resolved path (links followed), or the same
    inode (hard links, and anything else realpath cannot see through)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def distinct_files(files: Sequence[tuple[str | None, str, bool]]) -> None:
    """Refuse, before any work, one file in two roles where one role writes it (an output is
    never one of the inputs, nor another output): ``files`` are (path, what it is in this
    command, whether the command writes it); a path of None is left out. A one-line
    ValueError names both roles."""
    files = [f for f in files if f[0]]
    for i, (a, what_a, writes_a) in enumerate(files):
        for b, what_b, writes_b in files[i + 1:]:
            if (writes_a or writes_b) and same_file(a, b):
                written, other = (what_a, what_b) if writes_a else (what_b, what_a)
                role = ("an input of this command" if not (writes_a and writes_b)
                        else "a file this command also writes")
                raise ValueError(f"{written} is {other}: writing it would destroy {role}. "
                                 "Choose another path.")

def escape_line(text: str) -> str:
    """``text`` as the rest of one line of generated Python, YAML or terminal output (a
    comment, a note): every character that is not printable written as its escape (``\\n``,
    ``\\u2028``). That covers what ends a line in Python or YAML (``\\n``, ``\\r``; YAML's
    ``\\x85``, ``\\u2028``, ``\\u2029``) and the control characters neither may contain, so
    text from a user or a model (file and module names) cannot step out of its line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in str(text))


def shown(value: Any, limit: int = 120) -> str:
    """``value`` as it may appear on a terminal, in a log or in an error message, when it came
    from a file, a study, a model or a user: at most ``limit`` characters of it (the rest
    counted, not shown), every character that is not printable written as its escape
    (:func:`escape_line`: ESC, CR, newlines, bidi overrides, zero-width and other control or
    format characters). The one function such text goes through: a field cannot move the
    cursor, rewrite a line already printed, start a line of its own or fill the screen."""
    text = str(value)
    extra = len(text) - limit
    if extra > 0:
        return f"{escape_line(text[:limit])}... ({extra} more characters)"
    return escape_line(text)


def terminal_safe(text: str) -> str:
    """What a terminal stream may pass on of ``text``: line feeds, tabs and carriage returns
    as they are (a progress bar redraws its line with one), every other character that is
    not printable escaped (:func:`escape_line`). The console script's stdout and stderr go
    through it (:class:`EscapingStream`), a second line of defence behind :func:`shown`:
    whatever a field or a library's message holds, no escape sequence reaches the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t\r" else escape_line(c) for c in text)


class EscapingStream:
    """A text stream that writes through :func:`terminal_safe` to ``raw``, and is ``raw`` in
    everything else (its encoding, ``isatty()``, ``fileno()``, ``flush()``)."""

    def __init__(self, raw: Any):
        self.raw = raw

    def write(self, text: str) -> int:
        self.raw.write(terminal_safe(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def quoted(value: Any, limit: int = 120) -> str:
    """``value`` quoted for an error message (``'...'``), bounded and escaped (:func:`shown`)."""
    return f"'{shown(value, limit)}'"


def write_json(path: str | os.PathLike, data: Any) -> str:
    return atomic_write(path, json.dumps(data, indent=1, allow_nan=False) + "\n")


# Bounds on any JSON file we read: far above what autoprec writes (a profile of a 1000-layer
# model is a few MiB, its nesting depth under 10), far below what exhausts memory or the stack.
MAX_JSON_BYTES = 64 * 2 ** 20
MAX_JSON_DEPTH = 64
# ... and on its values (each list, object, number or string; counted as its commas and
# brackets before parsing, which over-counts those inside strings): a profile holds ~125 per
# layer, so 4M is a 30,000-layer model, while 64 MiB of tiny objects is ~20M and takes
# json seconds and gigabytes to build.
MAX_JSON_VALUES = 4_000_000


def read_bounded(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of the file at ``path``, refusing one larger than ``limit`` (checked before it
    is read, and again while reading, for a file that grows or does not say its size)."""
    path = os.fspath(path)
    # without blocking: a FIFO with no writer would block open() forever; then only a regular
    # file is read (a FIFO, device or socket given as a policy, profile or guard state is not)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        if file_kind(st.st_mode) is not None:
            raise ValueError(f"{shown(path, 160)} is not a regular file (a FIFO, device or "
                             f"socket); give the {what} file itself.")
        size = st.st_size
        if size > limit:
            raise ValueError(f"{shown(path, 160)} is {size / 2 ** 20:.1f} MiB; a {what} file may "
                             f"be at most {limit / 2 ** 20:g} MiB. Is it the right file?")
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"{shown(path, 160)} is larger than {limit / 2 ** 20:g} MiB, the most a "
                         f"{what} file may be. Is it the right file?")
    return raw


# What JSON holds that is not a list or an object: skipped by their exact type, the cheapest
# test there is (a file may hold tens of millions of them).
_JSON_LEAVES = (str, int, float, bool, type(None))


def json_depth(value: Any) -> int:
    """How deeply lists and dicts nest in ``value`` (0 for a scalar), without recursion: one
    level at a time, each a list of the containers found in the one above (no per-item tuples:
    a state of a million four-number lists takes a fraction of a second)."""
    depth, level = 0, [value]
    while True:
        level = [x for x in level if type(x) not in _JSON_LEAVES
                 and isinstance(x, (dict, list, tuple, Mapping))]
        if not level:
            return depth
        depth += 1
        children: list[Any] = []
        for item in level:
            kind = type(item)
            if kind is list or kind is tuple:
                children.extend(item)
            else:
                children.extend(item.values())
        level = children


class _DuplicateKey(Exception):
    """A JSON object names a key twice (``key``)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key it names twice (``json`` keeps the last)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The cyclic garbage collector off for a block that builds many objects and no cycles."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def read_json(path: str | os.PathLike, what: str, *, max_bytes: int = MAX_JSON_BYTES,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a JSON file; a missing, unreadable, malformed, oversized (``max_bytes``) or too
    deeply nested (``max_depth``) file, or one with an object that names a key twice (``json``
    would keep the last silently), is a one-line ValueError naming it."""
    path = os.fspath(path)
    name = shown(path, 160)
    try:
        raw = read_bounded(path, max_bytes, what)
    except FileNotFoundError:
        raise ValueError(f"{what} file {name} does not exist.") from None
    except IsADirectoryError:
        raise ValueError(f"{name} is a directory, not a {what} file.") from None
    except PermissionError:
        raise ValueError(f"{name} cannot be read (permission denied); it should be a {what} "
                         "file you may read.") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} is not a {what} file: byte {e.start} is not UTF-8 text.") from None
    fix = "Delete it and run the command that writes it again."
    values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if values > MAX_JSON_VALUES:
        raise ValueError(f"{name} is not a {what} file autoprec would write: it holds about "
                         f"{values:,} values, more than the {MAX_JSON_VALUES:,} a {what} of a "
                         f"30,000-layer model holds. {fix}")
    try:
        with _no_gc():  # millions of new objects: the collector would walk them over and over
            data = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise ValueError(f"{name} is not a valid {what} file: an object names the key "
                         f"{quoted(e.key, 60)} twice. {fix}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not a valid {what} file: {e.msg} at line {e.lineno}. "
                         f"{fix}") from None
    except RecursionError:  # the decoder recurses per nesting level (and stops cleanly)
        raise ValueError(f"{name} is not a {what} file: its lists or objects nest deeper than "
                         f"{max_depth} levels. {fix}") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise ValueError(f"{name} is not a valid {what} file: {shown(' '.join(str(e).split()), 200)}"
                         f". {fix}") from None
    if json_depth(data) > max_depth:
        raise ValueError(f"{name} is not a {what} file: its lists or objects nest deeper than "
                         f"{max_depth} levels. {fix}")
    return data


# The kinds of field a record read from a file may have, each as the words a message says it
# must be (:func:`fits`).
TEXT, OPT_TEXT, INT, NUM, OPT_NUM, BOOL = "text", "text or null", "an integer", "a number", \
    "a number or null", "true or false"
FLOATISH = "a number, null, or one of 'inf', '-inf', 'nan'"
PAIR = "two numbers"


def fits(value: Any, kind: str) -> bool:
    """Whether ``value``, as parsed from a file, is of the field kind ``kind``: TEXT a str,
    BOOL a bool, INT an int (not a bool) below MAX_INT in size, NUM such an int or a float,
    PAIR a list of two NUMs; OPT_TEXT and OPT_NUM also null, FLOATISH a NUM, null or one of
    the strings "inf", "-inf", "nan"."""
    if kind == PAIR:
        return isinstance(value, list) and len(value) == 2 and all(fits(v, NUM) for v in value)
    if kind in (TEXT, OPT_TEXT):
        return isinstance(value, str) or (value is None and kind == OPT_TEXT)
    if kind == BOOL:
        return isinstance(value, bool)
    if value is None:
        return kind in (OPT_NUM, FLOATISH)
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) < MAX_INT
    if isinstance(value, float):
        return kind != INT
    return kind == FLOATISH and isinstance(value, str) and \
        value.strip().lower() in ("inf", "-inf", "nan")


def check_keys(data: Any, what: str, *, known: Sequence[str],
               required: Sequence[str] = ()) -> None:
    """A record read from a file must be a mapping with no unknown and no missing keys."""
    if not isinstance(data, Mapping):
        raise ValueError(f"A {what} record must be a mapping, got {type(data).__name__}.")
    unknown = [k for k in data if k not in known]
    missing = [k for k in required if k not in data]
    problems = []
    if unknown:  # a file's keys: three of them, each bounded, and how many more
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        problems.append(f"unknown key(s) {', '.join(quoted(k, 60) for k in unknown[:3])}{more}")
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
    text = escape_line(repr(value)[:200])
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
            tail = f" ({elapsed:.0f} s)" if done >= total else f" {shown(label)}"
            out.write(f"{self.title}: {done}/{total}{tail}\n")
            out.flush()
            return
        filled = int(self.width * done / total)
        eta = elapsed / done * (total - done) if done else math.nan
        eta_s = f" eta {eta:4.0f}s" if math.isfinite(eta) else ""
        out.write(f"\r{self.title} [{'#' * filled}{'-' * (self.width - filled)}] "
                  f"{done}/{total}{eta_s} {shown(label, 48)[:48]:<48}")
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


def own_class(module: nn.Module) -> type:
    """The class ``module`` had before ``fully_shard`` (FSDP2) made it a subclass of its own
    (``FSDPLinear`` of ``nn.Linear``); its class itself where nothing sharded it."""
    for cls in type(module).__mro__:
        if not (cls.__name__.startswith("FSDP") and cls.__module__.startswith("torch.distributed")):
            return cls
    return type(module)


def class_name(module: nn.Module) -> str:
    """The module's own class name: past the subclass ``fully_shard`` (FSDP2) makes of a module
    it shards (:func:`own_class`) and past torchao's ``Float8Linear``, ``MXFP8Linear`` and
    ``NVFP4Linear`` (torchtitan's subclasses included), each the ``Linear`` it replaced:
    sharding, or building the low-precision layers so (torchtitan's converters), leaves the
    name (a policy's model name, the fingerprint of its layers) as it was."""
    for cls in own_class(module).__mro__:
        if cls.__name__ in ("Float8Linear", "MXFP8Linear", "NVFP4Linear") and \
                cls.__module__.startswith(("torchao.", "torchtitan.")):
            continue
        return cls.__name__
    return type(module).__name__
