"""Reading a policy file, untrusted input, in bounded size, depth and time.

A policy file is at most MAX_POLICY_BYTES and MAX_POLICY_LINES, parsed once with a safe loader
(``yaml.SafeLoader``, no unsafe tags) that refuses anchors, aliases, duplicate keys, nesting
past MAX_POLICY_DEPTH and more than MAX_POLICY_VALUES values or MAX_PHASES phases as it reads
them (so that any refusal comes in about a second). :func:`read_policy_file` gives the parsed
document and the line of each key; :mod:`autoprec.policy` checks its schema.
"""

from __future__ import annotations

from typing import Any

import yaml

from autoprec._util import quoted, read_bounded, shown
from autoprec.phases import MAX_PHASES

__all__ = [
    "MAX_POLICY_BYTES",
    "MAX_POLICY_VALUES",
    "MAX_POLICY_DEPTH",
    "BOUNDS_WHY",
    "PATH_CHARS",
    "PolicyFileError",
    "read_policy_file",
]


class PolicyFileError(ValueError):
    """A policy file that cannot be read as one (too large, malformed, unsafe YAML); the
    message names the file and says the fix. ``load_policy`` raises it as a PolicyError."""


# Bounds on a policy file: each far above what a real policy needs and below what takes a
# second to parse. PyYAML's pure-Python parser (used whether or not libyaml is installed, so
# that every machine refuses the same files) reads ~30,000 values a second on a 2-core Zen 3,
# and blank lines or long scalars at 0.6-3 MB/s; a refusal comes within a second either way.
# The explicit policy of a 1000-block model (~7,000 layer entries, a 70B Llama's ~560 times
# 12) is ~0.3 MiB, ~7,000 lines and ~14,000 values, and nests 4 deep.
MAX_POLICY_BYTES = 2 ** 20
# Line breaks, counted before parsing: the parser spends ~1 us on a line even when it is blank.
MAX_POLICY_LINES = 2 ** 16
# Values (every scalar, list and mapping: a layer entry is two), counted as the parser hands
# them over, so that a file of many tiny values stops early: 1.7 times that model's ~14,000,
# and refused within ~0.6 s (~1.1 s with both cores busy).
MAX_POLICY_VALUES = 24_000
MAX_POLICY_DEPTH = 24
# What a refusal says of why the bounds exist.
BOUNDS_WHY = ("the explicit policy of a 1000-block model has ~7,000 entries, ~0.3 MiB, and a "
              "larger file would take seconds to parse. Is it the right file?")
# How much of a path a message shows.
PATH_CHARS = 160
_STR_TAG = "tag:yaml.org,2002:str"
_LINE_BREAKS = ("\n", "\x85", "\u2028", "\u2029")


def _line_breaks(text: str) -> int:
    """The line breaks YAML sees in ``text`` (``\\r\\n`` is one), at C speed."""
    return sum(text.count(c) for c in _LINE_BREAKS) + text.count("\r") - text.count("\r\n")


class _PolicyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses, as the parser hands over each event (before the
    recursive composer descends), anchors and aliases (a small file could otherwise expand
    into gigabytes: an alias bomb), nesting deeper than MAX_POLICY_DEPTH, more than
    MAX_POLICY_VALUES values and more than MAX_PHASES entries under ``phases``; and refuses
    duplicate keys (YAML would keep the last silently)."""

    def __init__(self, stream: str, source: str):
        super().__init__(stream)
        self.source = source
        self.depth = 0
        self.values = 0
        # the root mapping's children so far (keys and values alternate) and its last key
        self.root_items, self.root_key, self.root_is_mapping = 0, None, False
        # the phases so far while inside the top-level `phases:` list (None: not inside)
        self.phases: int | None = None

    def _fail(self, event: yaml.Event, what: str) -> None:
        raise PolicyFileError(f"{shown(self.source, PATH_CHARS)} line {event.start_mark.line + 1}"
                              f": {what}")

    def get_event(self):
        event = super().get_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            self._fail(event, "uses a YAML anchor or alias (& or *); policy files do not: write "
                              "the values out (and quote a glob that starts with `*`).")
        if isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
            self._count(event)
        if isinstance(event, yaml.CollectionStartEvent):
            self.depth += 1
            if self.depth > MAX_POLICY_DEPTH:
                self._fail(event, f"lists or mappings nest deeper than {MAX_POLICY_DEPTH} "
                                  "levels; a policy needs a few. Is it the right file?")
        elif isinstance(event, yaml.CollectionEndEvent):
            self.depth -= 1
            if self.depth < 2:
                self.phases = None
        return event

    def _count(self, event: yaml.NodeEvent) -> None:
        """Count a value (``event`` starts one) before it is composed."""
        self.values += 1
        if self.values > MAX_POLICY_VALUES:
            self._fail(event, f"the file holds more than {MAX_POLICY_VALUES} values (scalars, "
                              f"lists, mappings), the most a policy may: {BOUNDS_WHY}")
        if self.depth == 1 and self.root_is_mapping:
            self.root_items += 1
            if self.root_items % 2:  # a key
                self.root_key = event.value if isinstance(event, yaml.ScalarEvent) else None
            elif self.root_key == "phases" and isinstance(event, yaml.SequenceStartEvent):
                self.phases = 0
        elif self.depth == 2 and self.phases is not None:
            self.phases += 1
            if self.phases > MAX_PHASES:
                self._fail(event, f"`phases` lists more than {MAX_PHASES} phases; a policy may "
                                  f"have at most {MAX_PHASES} (a run with more is a schedule of "
                                  "another kind, and every step checks the boundaries).")
        elif self.depth == 0:
            self.root_is_mapping = isinstance(event, yaml.MappingStartEvent)

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader says so with its line
                break
            if first is not None:
                raise PolicyFileError(f"{shown(self.source, PATH_CHARS)}: Duplicate key "
                                      f"{quoted(key)} at lines {first} and {line}: a policy names "
                                      "each key once; delete one of them.")
            seen[key] = line
        return super().construct_mapping(node, deep)


def _check_layer_keys(root: yaml.Node, path: str) -> None:
    """A layer pattern YAML reads as something other than text (`0:`, `1.10:`, `true:`) is
    a string the user meant: say how to quote it, with the text as written."""
    if not isinstance(root, yaml.MappingNode):
        return
    for key_node, value_node in root.value:
        if key_node.value != "layers" or not isinstance(value_node, yaml.MappingNode):
            continue
        for k, v in value_node.value:
            if isinstance(k, yaml.ScalarNode) and k.tag != _STR_TAG and k.value.strip() \
                    and k.value not in ("~", "null", "Null", "NULL"):
                fmt = v.value if isinstance(v, yaml.ScalarNode) else "fp32"
                kind = k.tag.rpartition(":")[2]
                raise PolicyFileError(f"Layer pattern {shown(k.value)} in {shown(path, PATH_CHARS)} "
                                      f"line {k.start_mark.line + 1} is read by YAML as a {kind}, "
                                      f'not a module name: quote it, e.g. `"{shown(k.value)}": '
                                      f"{shown(fmt, 40)}`.")


def read_policy_file(path: str) -> tuple[Any, dict[str, int]]:
    """The parsed document of the policy file at ``path`` and the line of each top-level key,
    layer pattern and ``tuned`` field (:func:`~autoprec.policy.load_policy` checks the
    schema). Every bound of the module docstring is enforced; a refusal is a one-line
    PolicyFileError naming the file."""
    name = shown(path, PATH_CHARS)
    try:
        raw = read_bounded(path, MAX_POLICY_BYTES, "policy")
    except FileNotFoundError:
        raise PolicyFileError(f"Policy file {name} does not exist; `autoprec tune TASK -o {name}` "
                              "writes one.") from None
    except IsADirectoryError:
        raise PolicyFileError(f"{name} is a directory, not a policy file.") from None
    except ValueError as e:  # too large
        raise PolicyFileError(f"{str(e).removesuffix(' Is it the right file?')[:-1]}: "
                              f"{BOUNDS_WHY}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolicyFileError(f"{name} is not a policy file: byte {e.start} is not UTF-8 text (a "
                              "policy is a YAML text file).") from None
    if _line_breaks(text) > MAX_POLICY_LINES:
        raise PolicyFileError(f"{name} has more than {MAX_POLICY_LINES} lines, the most a policy may "
                              f"have: {BOUNDS_WHY}")
    loader = _PolicyLoader(text, path)
    try:
        root = loader.get_single_node()
        if root is not None:
            _check_layer_keys(root, path)
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise PolicyFileError(f"Malformed YAML in {name}{line}: {shown(problem, 200)}. Fix the "
                              "syntax (indentation, quotes around globs with `*`).") from None
    finally:
        loader.dispose()
    return data, _line_map(root)


def _line_map(root: yaml.Node) -> dict[str, int]:
    """1-based line of each top-level key, each `layers` pattern and each `tuned` field (as
    ``tuned.<key>``), from the composed document."""
    lines: dict[str, int] = {}
    if not isinstance(root, yaml.MappingNode):
        return lines
    for key_node, value_node in root.value:
        key = key_node.value
        if not isinstance(key, str):  # a complex key (`? [a, b]`): the schema check names it
            continue
        lines[key] = key_node.start_mark.line + 1
        if key in ("layers", "tuned") and isinstance(value_node, yaml.MappingNode):
            for k, _ in value_node.value:
                if isinstance(k.value, str):
                    name = k.value if key == "layers" else f"tuned.{k.value}"
                    lines.setdefault(name, k.start_mark.line + 1)
    return lines
