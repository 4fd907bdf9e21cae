"""Checkpoints read as untrusted files: the weights ``autoprec recheck --checkpoint`` loads.

A checkpoint comes from wherever its user found it. Reading one runs no code, takes bounded
memory and bounded time whatever the file holds (Ctrl-C works throughout), and whatever is
wrong with it is one line naming the file (:func:`load_checkpoint`):

- Only regular files are read. Each is opened read-only without blocking (``O_NONBLOCK``) and
  what was opened is checked (``fstat``), so a FIFO, a device or a socket is refused, never
  read, with no race between the check and the open; torch and safetensors then read that
  same file (``/proc/self/fd``). A file of an HF checkpoint folder (the weights, the index,
  each shard) must lie inside the folder: a link that leads out of it is refused unread.
- The files together are at most :data:`CHECKPOINT_FACTOR` times the model's weights, plus
  :data:`CHECKPOINT_SLACK`.
- A torch file must be the zip archive torch.save has written since PyTorch 1.6; the legacy
  format is refused (its loader allocates each storage at whatever size the pickle claims
  before reading it, and it went out of use in 2020). The archive's records must be stored
  (uncompressed, as torch.save writes them), and its directory must be where its end record
  says (so Python's ``zipfile`` and torch's reader see the same records). Its pickle
  (``data.pkl``) is scanned before torch sees it (:func:`scan_pickle`): instructions the
  weights-only unpickler does not run, Python globals it would refuse, objects nested deeper
  than :data:`MAX_PICKLE_DEPTH`, objects that expand, through shared references, past
  :data:`MAX_EXPANDED` parts (a tuple key nested 40 deep, each level holding the one below
  twice, makes ``torch.load`` hash 2**40 items in C, where no signal is seen), more than
  :data:`MAX_PICKLE_OPS` instructions, or composite dict keys that could be made to collide
  (:data:`MAX_KEY_WORK`) are refused. Only then ``torch.load(weights_only=True)`` reads it.
- What was loaded must be dense tensors with data (no meta, sparse, quantized or nested
  ones) under string names, fit the model (names, shapes) and be finite.

Text from the file (names, keys, what a loader said about it) reaches a message only through
:func:`autoprec._util.shown` / :func:`~autoprec._util.quoted`: bounded and escaped.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import itertools
import json
import os
import pickle
import pickletools
import reprlib
import struct
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import torch
from torch import nn

from autoprec._util import MAX_JSON_DEPTH, file_kind, json_depth, quoted, shown

__all__ = [
    "CHECKPOINT_FACTOR",
    "CHECKPOINT_SLACK",
    "STATE_DICT_KEYS",
    "WRAPPER_COMPONENTS",
    "MAX_PICKLE_OPS",
    "MAX_PICKLE_DEPTH",
    "MAX_EXPANDED",
    "MAX_KEY_WORK",
    "load_checkpoint",
    "read_state_dict",
    "scan_pickle",
]

# A checkpoint file may be at most this many times the model's weights (AdamW's two moments
# and the weights make 3x), plus CHECKPOINT_SLACK: anything larger is another model's.
CHECKPOINT_FACTOR = 5
CHECKPOINT_SLACK = 64 * 2 ** 20
# Keys of a training checkpoint that hold the model's state dict, tried in this order.
STATE_DICT_KEYS = ("model", "state_dict", "model_state_dict", "module")
# What wrappers put in front of (or inside) parameter names: torch.compile, DDP/DataParallel.
WRAPPER_COMPONENTS = ("_orig_mod", "module")
# The pickle scan's bounds. torch.save writes about 35 instructions per tensor (a 70B
# model's weights and AdamW moments: ~2k tensors), so 4M (over 100k tensors) is generous and
# scans in about 3 s (torch.load itself takes longer); objects nest about 10 deep (a tensor
# in a training checkpoint's optimizer state); what is shared is strings and globals, so
# nothing expands much past the instruction count.
MAX_PICKLE_OPS = 4_000_000
MAX_PICKLE_DEPTH = 64
MAX_EXPANDED = 16_000_000
# Hashing a tuple (or an int wider than 64 bits) as a dict key costs its size, and such keys
# can be built to share one hash, which makes each insertion compare with all before it:
# their sizes together are bounded (2**15: at worst a few seconds). State dicts key by
# strings and small ints, which cost nothing here.
MAX_KEY_WORK = 2 ** 15
# How many names an error lists before "and N more".
_SHOWN = 3
# What a legacy (pre-1.6) torch.save file starts with: pickle protocol 2, then its magic number
# as a 10-byte long.
_LEGACY_START = b"\x80\x02\x8a\x0a"
# A zip's end-of-central-directory record (the last 22 bytes of what torch.save writes), and
# the zip64 locator and record it points through in an archive past 4 GiB.
_END, _END64_LOCATOR, _END64 = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06"
# Read-only file descriptors reopened by path (torch's mmap and safetensors want a path).
_PROC_FD = "/proc/self/fd"
# A bounded repr for a non-string key in a message.
_KEY_REPR = reprlib.Repr()
_KEY_REPR.maxlevel, _KEY_REPR.maxtuple, _KEY_REPR.maxother = 2, 4, 40


# ------------------------------------------------------------------------------ loading
def load_checkpoint(model: nn.Module, path: str | os.PathLike) -> None:
    """Load the weights of the checkpoint at ``path`` into ``model`` in place (cast to its
    dtypes): a ``.safetensors`` file, a torch state dict (``.pt``, ``.bin``, ...), a training
    checkpoint holding one under one of :data:`STATE_DICT_KEYS`, or an HF checkpoint folder.
    Names carrying torch.compile's ``_orig_mod.`` or DDP's ``module.`` are matched without
    them; a tied weight (GPT-2's ``lm_head.weight``) may be left out.

    Args:
        model: the module to load into; unchanged unless the whole checkpoint is accepted.
        path: the checkpoint, read as untrusted (see the module's docstring): at most
            :data:`CHECKPOINT_FACTOR` times the model's weights (plus
            :data:`CHECKPOINT_SLACK`), scanned before torch reads it, never unpickling code.

    Raises:
        ValueError: one line naming the file and the first few tensors at fault: it does not
            fit the model (missing tensors, others' names, other shapes), holds non-finite
            values, or is not a checkpoint that may be read (see :func:`read_state_dict`).
        FileNotFoundError: nothing is at ``path``.
    """
    path = os.fspath(path)
    expected = model.state_dict()
    limit = CHECKPOINT_FACTOR * _state_bytes(expected) + CHECKPOINT_SLACK
    state = _match_names(read_state_dict(path, max_bytes=limit), expected, path)
    _check_fit(state, expected, path, type(model).__name__)
    _check_finite(state, path)
    model.load_state_dict(state, strict=False)


def read_state_dict(path: str | os.PathLike, *, max_bytes: int) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint at ``path`` (a file or an HF folder, see
    :func:`load_checkpoint`), on the CPU.

    Args:
        path: the checkpoint file or HF checkpoint folder.
        max_bytes: the most its files may hold together; larger is refused before reading.

    Returns:
        Parameter names -> dense tensors with data, as the file names them.

    Raises:
        ValueError: one line naming the file: not a regular file, a link out of its folder,
            too large, not a checkpoint torch.load or safetensors can read, refused by the
            pickle scan, not a state dict, or holding meta, sparse, quantized or nested
            tensors.
        FileNotFoundError: nothing is at ``path``.
    """
    path = os.fspath(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"Checkpoint {_shown_path(path)} does not exist; give a "
                                ".safetensors or .pt/.bin file, or an HF checkpoint folder.")
    folder = path if os.path.isdir(path) else None
    files = _folder_files(path) if folder else [path]
    size = 0
    for f in files:
        with _opened(f, folder) as (_, _, nbytes):
            size += nbytes
    _check_size(path, size, max_bytes)
    state: dict[str, torch.Tensor] = {}
    read = 0
    for f in files:
        with _opened(f, folder) as (file, reopen, nbytes):
            read += nbytes  # again: a file that grew since it was measured
            _check_size(path, read, max_bytes)
            part = _read_file(file, reopen, nbytes, f)
        twice = [k for k in part if k in state]
        if twice:
            raise ValueError(f"Checkpoint {_shown_path(path)}: {_names(twice)} appear in two "
                             "of its shards; each tensor must be in one.")
        state.update(part)
    return state


def _check_size(path: str, size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise ValueError(f"Checkpoint {_shown_path(path)} is {size / 2 ** 20:.1f} MiB, more than "
                         f"the {max_bytes / 2 ** 20:.1f} MiB a checkpoint of this model may be "
                         f"({CHECKPOINT_FACTOR}x its weights, plus "
                         f"{CHECKPOINT_SLACK // 2 ** 20} MiB): is it another model's?")


# ------------------------------------------------------------------------------ files
@contextlib.contextmanager
def _opened(path: str, folder: str | None) -> Iterator[tuple[BinaryIO, str, int]]:
    """``path`` open for reading, as (file, a path that reopens that same file, its size).
    Opening never blocks (``O_NONBLOCK``: a FIFO without a writer would block ``open``
    forever) and what was opened must be a regular file. A file of the checkpoint ``folder``
    must resolve inside it, and is opened by that resolved path without following a link
    (``O_NOFOLLOW``: a link swapped in after the check is refused, not followed)."""
    where = _shown_path(path)
    target = path if folder is None else _inside(path, folder)
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0)
                     | (getattr(os, "O_NOFOLLOW", 0) if folder is not None else 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"Checkpoint file {where} does not exist (or is a link to "
                                "nothing).") from None
    except OSError as e:
        raise ValueError(f"Checkpoint file {where} cannot be opened for reading "
                         f"({shown(e.strerror or type(e).__name__)}); give a readable "
                         "regular file.") from None
    try:
        kind = file_kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise ValueError(f"Checkpoint file {where} is {kind}, not a regular file: "
                             "it was not read (a pipe or a device can block or never end). "
                             "Give the checkpoint's file.")
        file = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with file:
        reopen = f"{_PROC_FD}/{fd}" if os.path.isdir(_PROC_FD) else target
        yield file, reopen, os.fstat(fd).st_size


def _inside(path: str, folder: str) -> str:
    """``path`` resolved, when that lies inside ``folder`` (itself resolved): a file of an HF
    checkpoint folder may be a link to another file of it, never out of it."""
    real, home = os.path.realpath(path), os.path.realpath(folder)
    if os.path.commonpath([real, home]) != home:
        raise ValueError(f"Checkpoint file {_shown_path(path)} is a link that leads out of "
                         f"the checkpoint folder {_shown_path(folder)}; it was not followed. "
                         "Give a folder that holds its files (cp -rL copies the files links "
                         "point to).")
    return real


def _folder_files(folder: str) -> list[str]:
    """The weight files of an HF checkpoint folder: one file, or the shards its index names."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.lexists(os.path.join(folder, name)):
            return [os.path.join(folder, name)]
    for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = os.path.join(folder, name)
        if os.path.lexists(index):
            return _shards(folder, index)
    raise FileNotFoundError(f"Checkpoint folder {_shown_path(folder)} holds none of "
                            "model.safetensors, pytorch_model.bin or their .index.json; give "
                            "the folder an HF model's save_pretrained() wrote, or a weight file.")


def _shards(folder: str, index: str) -> list[str]:
    where = _shown_path(index)
    data = _read_index(index, folder)
    weight_map = data.get("weight_map") if isinstance(data, Mapping) else None
    if not isinstance(weight_map, Mapping) or not weight_map:
        raise ValueError(f"{where} has no `weight_map` (tensor name -> shard file); it is not "
                         "an HF checkpoint index.")
    shards = []
    for name in dict.fromkeys(weight_map.values()):
        # a shard is a file of this folder: no path may lead out of it
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            shown_name = quoted(name) if isinstance(name, str) else f"a {type(name).__name__}"
            raise ValueError(f"{where} names the shard {shown_name}; a shard must be a plain "
                             "file name inside the checkpoint folder.")
        shard = os.path.join(folder, name)
        if not os.path.lexists(shard):
            raise FileNotFoundError(f"{where} names the shard {quoted(name)}, which is not in "
                                    f"{_shown_path(folder)}.")
        shards.append(shard)
    return shards


def _read_index(index: str, folder: str) -> Any:
    """The JSON of an HF checkpoint index: at most CHECKPOINT_SLACK bytes and
    MAX_JSON_DEPTH levels, read as every other file of the folder (:func:`_opened`)."""
    where = _shown_path(index)
    with _opened(index, folder) as (file, _, size):
        raw = file.read(CHECKPOINT_SLACK + 1) if size <= CHECKPOINT_SLACK else b""
    if max(size, len(raw)) > CHECKPOINT_SLACK:
        raise ValueError(f"{where} is larger than {CHECKPOINT_SLACK // 2 ** 20} MiB, the most "
                         "a checkpoint index may be; it is not an HF checkpoint index.")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not a checkpoint index: byte {e.start} is not UTF-8 "
                         "text.") from None
    except RecursionError:
        data = None
    except ValueError as e:  # malformed JSON, an integer of more than 4300 digits
        raise ValueError(f"{where} is not valid JSON ({shown(_first_line(e), 160)}); it is not "
                         "an HF checkpoint index.") from None
    if data is None or json_depth(data) > MAX_JSON_DEPTH:
        raise ValueError(f"{where} nests deeper than {MAX_JSON_DEPTH} levels; it is not an HF "
                         "checkpoint index.")
    return data


def _read_file(file: BinaryIO, reopen: str, size: int, path: str) -> dict[str, torch.Tensor]:
    """The state dict in one open checkpoint file (``reopen`` opens that same file again)."""
    where = _shown_path(path)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            return _state_dict_of(load_file(reopen, device="cpu"), where)
        except Exception as e:  # the file is untrusted: whatever fails is its fault
            raise ValueError(f"{where} is not a readable safetensors file "
                             f"({shown(_first_line(e), 160)}).") from None
    _check_torch_file(file, size, where)
    try:
        obj = torch.load(reopen, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{where} is not a checkpoint the weights-only loader accepts "
                         f"({_unpickler_says(e)}); give a .safetensors file or what "
                         "torch.save wrote of a state dict.") from None
    except Exception as e:
        raise ValueError(f"{where} is not a checkpoint torch.load can read "
                         f"({shown(_first_line(e), 160)}); give a .safetensors file or what "
                         "torch.save wrote.") from None
    return _state_dict_of(obj, where)


# ------------------------------------------------------------------------------ torch's zip
def _check_torch_file(file: BinaryIO, size: int, where: str) -> None:
    """Refuse, before torch reads it, a torch file that is not torch.save's zip archive as it
    writes it, or whose pickle :func:`scan_pickle` refuses."""
    file.seek(0)
    start = file.read(4)
    if start == _LEGACY_START:
        raise ValueError(f"{where} was written in torch's legacy format (before PyTorch 1.6, or "
                         "with _use_new_zipfile_serialization=False), which autoprec does not "
                         "read from an untrusted file: its loader allocates each tensor at "
                         "whatever size the file claims. Re-save it with torch.save today, or "
                         "as .safetensors.")
    if start != b"PK\x03\x04":
        raise ValueError(f"{where} is not a checkpoint torch.load can read (neither the zip "
                         "archive torch.save writes nor a .safetensors file); give a "
                         ".safetensors file or what torch.save wrote.")
    directory = _directory_offset(file, size)
    try:
        with zipfile.ZipFile(file) as archive:
            infos = archive.infolist()
            refusal = _refusal(infos, size, where, directory == archive.start_dir)
            pickles = [] if refusal else [archive.read(i) for i in infos
                                          if _named(i.filename, "data.pkl")]
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError,
            OSError, struct.error, RuntimeError, ValueError) as e:
        raise ValueError(f"{where} is a damaged zip archive ({shown(_first_line(e), 160)}); "
                         "give what torch.save wrote.") from None
    if refusal:
        raise ValueError(refusal)
    for data in pickles:
        scan_pickle(data, where)


def _named(record: str, name: str) -> bool:
    """Whether the archive's ``record`` is its ``name`` (torch's reader ignores case and
    looks under the archive's first folder)."""
    record = record.lower()
    return record == name or record.endswith("/" + name)


def _directory_offset(file: BinaryIO, size: int) -> int | None:
    """Where the archive's end record, the file's last 22 bytes as torch.save writes it (no
    comment), says its central directory starts; None when the file does not end so."""
    if size < 22:
        return None
    file.seek(size - 22)
    end = file.read(22)
    if end[:4] != _END or end[-2:] != b"\0\0":
        return None
    offset = struct.unpack("<I", end[16:20])[0]
    if offset != 0xFFFFFFFF or size < 22 + 20:
        return offset
    file.seek(size - 22 - 20)  # zip64: the locator just before, then the record it names
    locator = file.read(20)
    if locator[:4] != _END64_LOCATOR:
        return None
    file.seek(struct.unpack("<Q", locator[8:16])[0])
    record = file.read(56)
    return struct.unpack("<Q", record[48:56])[0] if record[:4] == _END64 else None


def _refusal(infos: Sequence[zipfile.ZipInfo], size: int, where: str,
             directory_ok: bool) -> str | None:
    """Why the archive is not what torch.save writes, if it is not: its directory must be
    where its end record says (a reader that trusts the record and one that corrects for data
    before the archive would read different records), each record there once (torch's reader
    looks names up without regard to case), stored uncompressed inside the file, and a
    pickle, not TorchScript's code."""
    problem = None
    names = [i.filename.lower() for i in infos]
    if any(_named(n, "constants.pkl") for n in names):
        return (f"{where} is a TorchScript archive (torch.jit.save), which holds code; give a "
                "state dict torch.save wrote, or a .safetensors file.")
    if not directory_ok:
        problem = "its central directory is not where its end record says"
    elif len(set(names)) != len(names):
        problem = "it holds two records of one name"
    elif any(i.compress_type != zipfile.ZIP_STORED or i.file_size != i.compress_size
             or i.header_offset + i.compress_size > size for i in infos):
        problem = "its records are compressed or reach past its end (torch.save stores them)"
    elif not any(_named(n, "data.pkl") for n in names):
        problem = "it holds no data.pkl"
    if problem is None:
        return None
    return (f"{where} is not the zip archive torch.save writes: {problem}. Give a .safetensors "
            "file or what torch.save wrote.")


# ------------------------------------------------------------------------------ the pickle scan
class _Node:
    """What the scan knows of one object: how deeply it nests, how many parts it has with
    every shared part counted each time it is referenced, whether a second reference to it
    exists (then it may no longer change), whether hashing it is cheap, and the global it
    is, if one."""

    __slots__ = ("depth", "size", "shared", "flat", "name")

    def __init__(self, depth: int = 1, size: int = 1, *, flat: bool = False,
                 name: str | None = None):
        self.depth, self.size, self.shared, self.flat, self.name = depth, size, False, flat, name


# strings, small ints, floats, None, bools: a leaf, whose hash is cached or cheap; an int of
# more than 64 bits hashes as cheaply but can be made to collide with others
_LEAF = _Node(0, 1, flat=True)
_WIDE = _Node(0, 1)
_LEAVES = frozenset({"NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "BINFLOAT",
                     "BINUNICODE", "SHORT_BINSTRING"})
# the globals whose call hashes what it is given (a set or dict built from items)
_HASHING = frozenset({"collections.OrderedDict", "collections.Counter", "builtins.set",
                      "builtins.frozenset", "builtins.dict"})


def scan_pickle(data: bytes, where: str) -> None:
    """Refuse, in bounded time and before any of it is unpickled, a pickle that torch's
    weights-only unpickler should not be given. The scan interprets the instructions
    abstractly (a stack and memo of :class:`_Node`), knowing of each object only how deeply
    it nests and how many parts it expands to; it refuses, as a one-line ValueError naming
    ``where``: an instruction the weights-only unpickler does not run, a Python global it
    would refuse, more than :data:`MAX_PICKLE_OPS` instructions, an object nested deeper than
    :data:`MAX_PICKLE_DEPTH` or expanding past :data:`MAX_EXPANDED` parts, composite dict keys
    past :data:`MAX_KEY_WORK`, a container changed after a second reference to it exists
    (torch.save never writes one; it would make the counts stale), and a malformed stream.

    Args:
        data: the pickle (the ``data.pkl`` record of torch.save's archive).
        where: the file it came from, as its messages name it (bounded and escaped here).
    """
    _PickleScan(shown(where, 200)).run(data)


class _PickleScan:
    """One scan: the abstract stack, marks and memo, and the hashing work counted so far."""

    def __init__(self, where: str):
        self.where = where
        self.stack: list[_Node] = []
        self.marks: list[list[_Node]] = []
        self.memo: dict[int, _Node] = {}
        self.key_work = 0
        self.current = ""
        self.allowed = _torch_globals()
        self.steps: dict[str, Callable[[Any], None]] = {
            "GLOBAL": self.global_, "REDUCE": self.reduce, "NEWOBJ": self.newobj,
            "BUILD": self.build, "APPEND": self.append, "APPENDS": self.appends,
            "SETITEM": self.setitem, "SETITEMS": self.setitems, "MARK": self.mark,
            "TUPLE": self.tuple_, "TUPLE1": self.tuple_, "TUPLE2": self.tuple_,
            "TUPLE3": self.tuple_, "EMPTY_TUPLE": self.tuple_, "EMPTY_LIST": self.empty,
            "EMPTY_DICT": self.empty, "EMPTY_SET": self.empty, "LONG1": self.long1,
            "BINPERSID": self.persid, "BINGET": self.get, "LONG_BINGET": self.get,
            "BINPUT": self.put, "LONG_BINPUT": self.put}

    def refuse(self, why: str) -> None:
        raise ValueError(f"Checkpoint {self.where} was refused unread: its pickle {why}. A "
                         "state dict or training checkpoint torch.save wrote never does; give "
                         "one, or a .safetensors file.")

    def run(self, data: bytes) -> None:
        ops = pickletools.genops(data)
        for count in itertools.count(1):
            try:
                op, arg, _ = next(ops)
            except (ValueError, struct.error, EOFError, IndexError, StopIteration) as e:
                self.refuse(f"is malformed ({shown(_first_line(e), 100)})")
            if count > MAX_PICKLE_OPS:
                self.refuse(f"has more than {MAX_PICKLE_OPS:,} instructions (it would take "
                            "too long to read)")
            if op.name in _LEAVES:
                self.stack.append(_LEAF)
            elif op.name == "PROTO":
                continue
            elif op.name == "STOP":
                self.pop(1)
                return
            elif op.name in self.steps:
                self.current = op.name
                self.steps[op.name](arg)
            else:
                self.refuse(f"uses the instruction {op.name}, which torch's weights-only "
                            "unpickler does not run")

    # -- the stack
    def pop(self, n: int) -> list[_Node]:
        if len(self.stack) < n:
            self.refuse("is malformed (it takes from an empty stack)")
        items = self.stack[len(self.stack) - n:]
        del self.stack[len(self.stack) - n:]
        return items

    def pop_mark(self) -> list[_Node]:
        if not self.marks:
            self.refuse("is malformed (it closes a mark it never set)")
        items, self.stack = self.stack, self.marks.pop()
        return items

    def top(self) -> _Node:
        if not self.stack:
            self.refuse("is malformed (it takes from an empty stack)")
        return self.stack[-1]

    def made(self, parts: Iterable[_Node], *, flat: bool = False) -> _Node:
        """A new object holding ``parts``."""
        node = _Node(flat=flat)
        self.add(node, parts)
        return node

    def add(self, node: _Node, parts: Iterable[_Node]) -> None:
        for part in parts:
            part.shared = True
            node.depth = max(node.depth, part.depth + 1)
            node.size += part.size
        if node.depth > MAX_PICKLE_DEPTH:
            self.refuse(f"nests objects deeper than {MAX_PICKLE_DEPTH} levels")
        if node.size > MAX_EXPANDED:
            self.refuse(f"builds an object of more than {MAX_EXPANDED:,} parts out of shared "
                        "references (it would take hours to read)")

    def change(self, parts: list[_Node], keys: Iterable[_Node] = ()) -> None:
        """The container under ``parts`` takes them in (keys: hashed as it does)."""
        target = self.top()
        if target.flat or target is _WIDE:  # a string, number, global or storage
            self.refuse("adds to an object that is not a container")
        if target.shared:
            self.refuse("changes an object after referring to it elsewhere")
        self.hashed(keys)
        self.add(target, parts)

    def hashed(self, keys: Iterable[_Node]) -> None:
        self.key_work += sum(k.size for k in keys if not k.flat)
        if self.key_work > MAX_KEY_WORK:
            self.refuse(f"keys dicts by tuples or wide integers of more than {MAX_KEY_WORK:,} "
                        "parts in all (which can be made to collide)")

    # -- the instructions
    def global_(self, arg: str) -> None:
        module, _, name = arg.partition(" ")
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        full = f"{module}.{name}"
        if self.allowed is not None and (full not in self.allowed[0]
                                         or module in self.allowed[1]):
            raise ValueError(f"Checkpoint {self.where} holds Python objects other than "
                             f"tensors and plain containers: it refers to {quoted(full, 80)}, "
                             "which a checkpoint read as untrusted may not (nothing of it was "
                             "run). Save the weights alone, e.g. torch.save(model.state_dict(), "
                             "path), or as .safetensors.")
        self.stack.append(_Node(0, 1, flat=True, name=full))

    def reduce(self, _: Any) -> None:
        args, func = self.pop(1)[0], self.top()
        if func.name in _HASHING:
            self.key_work += args.size - 1
            self.hashed(())
        self.stack[-1] = self.made([args])

    def newobj(self, _: Any) -> None:
        args = self.pop(2)[1]
        self.stack.append(self.made([args]))

    def build(self, _: Any) -> None:
        self.change(self.pop(1))

    def append(self, _: Any) -> None:
        self.change(self.pop(1))

    def appends(self, _: Any) -> None:
        self.change(self.pop_mark())

    def setitem(self, _: Any) -> None:
        key, value = self.pop(2)
        self.change([key, value], [key])

    def setitems(self, _: Any) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            self.refuse("is malformed (a key without a value)")
        self.change(items, items[0::2])

    def mark(self, _: Any) -> None:
        if len(self.marks) >= MAX_PICKLE_DEPTH:
            self.refuse(f"nests objects deeper than {MAX_PICKLE_DEPTH} levels")
        self.marks.append(self.stack)
        self.stack = []

    def tuple_(self, _: Any) -> None:
        n = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "EMPTY_TUPLE": 0}.get(self.current)
        node = self.made(self.pop_mark() if n is None else self.pop(n))
        self.stack.append(node)  # after pop_mark, which replaces self.stack

    def empty(self, _: Any) -> None:
        self.stack.append(_Node())

    def long1(self, arg: int) -> None:
        self.stack.append(_WIDE if arg.bit_length() > 64 else _LEAF)

    def persid(self, _: Any) -> None:
        self.made(self.pop(1))  # a storage: its id is only checked for size here
        self.stack.append(_Node(0, 1, flat=True))

    def get(self, arg: int) -> None:
        node = self.memo.get(arg)
        if node is None:
            self.refuse("is malformed (it refers to an object it never stored)")
        node.shared = True
        self.stack.append(node)

    def put(self, arg: int) -> None:
        self.memo[arg] = self.top()


def _torch_globals() -> tuple[set[str], set[str]] | None:
    """The globals torch's weights-only unpickler allows, and the modules it blocks; None when
    this torch does not say (torch itself still refuses what it does not allow)."""
    try:
        from torch import _weights_only_unpickler as wo

        allowed = set(wo._get_allowed_globals()) | set(wo._get_user_allowed_globals())
        return allowed, set(getattr(wo, "_blocklisted_modules", ()))
    except Exception:  # a private API of torch's: absent or changed in another version
        return None


# ------------------------------------------------------------------------------ the tensors
def _state_dict_of(obj: Any, where: str) -> dict[str, torch.Tensor]:
    """The state dict in what a file held: itself, or a training checkpoint's entry."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where} holds a {type(obj).__name__}, not a state dict (parameter "
                         "names -> tensors); save model.state_dict().")
    at, state = where, obj
    for key in STATE_DICT_KEYS:
        if isinstance(obj.get(key), Mapping):
            at, state = f"{where}[{key!r}]", obj[key]
            break
    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad or not state:
        keys = ", ".join(_label(k) for k in itertools.islice(obj, 6)) or "nothing"
        found = (f"its entries {_names(bad)} are not named tensors" if bad and len(bad) < len(state)
                 else f"it holds {keys}")
        raise ValueError(f"{at} is not a state dict: {found}. Expected parameter names -> "
                         f"tensors, or a training checkpoint with them under one of "
                         f"{', '.join(map(repr, STATE_DICT_KEYS))}.")
    for key, t in state.items():
        odd = _odd(t)
        if odd:
            raise ValueError(f"{at} holds {odd} at `{shown(key, 80)}`: a checkpoint to load "
                             "holds dense tensors with their values. Save the trained model's "
                             "state_dict() (on a real device, dense).")
    return dict(state)


def _odd(t: torch.Tensor) -> str | None:
    """What a loaded tensor is that a model's weights cannot be loaded from, if anything."""
    if t.is_meta:
        return "a meta tensor (a shape without values)"
    if t.layout != torch.strided:
        return f"a sparse tensor ({str(t.layout).removeprefix('torch.')})"
    if t.is_quantized:
        return "a quantized tensor"
    if t.is_nested:
        return "a nested tensor"
    return None


def _check_finite(state: Mapping[str, torch.Tensor], path: str) -> None:
    """Refuse weights holding NaN or inf: the run that saved them had already diverged, and
    measuring a policy on them would blame the model or the batch."""
    for key, t in state.items():
        if not (t.is_floating_point() or t.is_complex()):
            continue
        try:
            finite = bool(torch.isfinite(t).all())
        except (RuntimeError, NotImplementedError):  # float8: no isfinite kernel
            finite = bool(torch.isfinite(t.float()).all())
        if not finite:
            raise ValueError(f"Checkpoint {_shown_path(path)} holds non-finite values (NaN or "
                             f"inf) in `{shown(key, 80)}`: the run that saved it had diverged. "
                             "Re-check a checkpoint saved before that.")


def _strip_wrappers(name: str) -> str:
    """``name`` without torch.compile's ``_orig_mod`` components (anywhere: a compiled block
    adds one inside) and leading DDP/DataParallel ``module`` ones."""
    parts = [p for p in name.split(".") if p != "_orig_mod"]
    while parts and parts[0] in WRAPPER_COMPONENTS:
        parts.pop(0)
    return ".".join(parts)


def _match_names(state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                 path: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for key, value in state.items():
        name = key if key in expected else _strip_wrappers(key)
        if name in out:
            raise ValueError(f"Checkpoint {_shown_path(path)} holds both "
                             f"`{shown(origin[name], 80)}` and `{shown(key, 80)}`, which name "
                             f"the same tensor `{shown(name, 80)}` once wrapper prefixes "
                             "(_orig_mod., module.) are removed; keep one.")
        out[name], origin[name] = value, key
    return out


def _check_fit(state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
               path: str, model_name: str) -> None:
    aliases: dict[tuple, list[str]] = {}
    for key, t in expected.items():
        aliases.setdefault(_storage_key(t), []).append(key)
    missing = [k for k, t in expected.items()
               if not any(a in state for a in aliases[_storage_key(t)])]
    unexpected = [k for k in state if k not in expected]
    wrong = [k for k, v in state.items() if k in expected and (
        v.shape != expected[k].shape
        or v.is_floating_point() != expected[k].is_floating_point())]
    problems = []
    if missing:
        problems.append(f"{len(missing)} of the model's tensors are missing ({_names(missing)})")
    if unexpected:
        problems.append(f"{len(unexpected)} are not the model's ({_names(unexpected)})")
    if wrong:
        shapes = [f"`{shown(k, 80)}`: checkpoint {list(state[k].shape)} {state[k].dtype}, model "
                  f"{list(expected[k].shape)} {expected[k].dtype}" for k in wrong[:_SHOWN]]
        problems.append(f"{len(wrong)} have another shape or kind "
                        f"({_listed(shapes, len(wrong))})")
    if problems:
        raise ValueError(f"Checkpoint {_shown_path(path)} does not fit the task's "
                         f"{shown(model_name, 80)}: {'; '.join(problems)}. Give a checkpoint of "
                         "this task's model (the same layers and sizes).")


def _storage_key(t: torch.Tensor) -> tuple:
    """Tensors with the same key are one tensor under two names (tied weights)."""
    if t.device.type == "meta":
        return (id(t),)
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def _state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    seen = {_storage_key(t): t.numel() * t.element_size() for t in state.values()}
    return sum(seen.values())


# ------------------------------------------------------------------------------ messages
def _shown_path(path: str) -> str:
    return shown(path, 200)


def _label(key: Any) -> str:
    """A key for a message: a string as it is, anything else as a bounded repr (a key from a
    file may be a tuple of a million parts)."""
    return key if isinstance(key, str) else _KEY_REPR.repr(key)


def _names(keys: Sequence[Any]) -> str:
    return _listed([f"`{shown(_label(k), 80)}`" for k in keys[:_SHOWN]], len(keys))


def _listed(shown_items: Sequence[str], total: int) -> str:
    return ", ".join(shown_items) + (f" and {total - _SHOWN} more" if total > _SHOWN else "")


def _first_line(e: BaseException) -> str:
    return " ".join((str(e).strip().splitlines() or [type(e).__name__])[0].split())[:400]


def _unpickler_says(e: BaseException) -> str:
    """What the weights-only unpickler refused, bounded and escaped: its own first sentence,
    none of torch's advice around it (which is to load the file unsafely, or to allowlist
    what it names)."""
    text = str(e)
    said = text.rpartition("WeightsUnpickler error:")[2] if "WeightsUnpickler error:" in text \
        else text.strip().split("\n\n")[-1]
    sentence = " ".join(said.split()).split(". ")[0]
    if not sentence or any(w in sentence for w in ("weights_only", "safe_globals", "allowlist")):
        return "it refused an object of the file"
    return shown(sentence, 160)
