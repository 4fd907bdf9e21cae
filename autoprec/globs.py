"""Layer-name patterns (globs): compiled once, matched in linear time, ranked by specificity.

``*`` matches within one dotted component, ``**`` across components, ``?`` one character (not
a dot); a pattern is at most MAX_PATTERN_CHARS long. A name's best pattern is the most
specific one that matches (:func:`specificity`). :class:`~autoprec.policy.Policy` names its
layers with them.
"""

from __future__ import annotations

__all__ = ["MAX_PATTERN_CHARS", "Glob", "specificity"]

# The longest layer pattern (module names are rarely a tenth of it).
MAX_PATTERN_CHARS = 512


class Glob:
    """A compiled layer pattern. ``*`` is any run of characters within one dotted component,
    ``**`` any run at all, ``?`` one character other than a dot. Matched as an automaton over
    the pattern's positions (a bit set, one step per character of the name): time linear in
    the name times the pattern, never the exponential backtracking of a regex built from a
    run of wildcards. Cheap checks first (literal prefix and suffix, the count of dots) make
    most non-matches one string comparison."""

    __slots__ = ("exact", "prefix", "suffix", "dots", "min_len", "sized", "lit", "qmark",
                 "star", "any", "accept")

    def __init__(self, pattern: str):
        # one token per literal character; "?"; "*" (within a component); "**" (any run)
        tokens: list[str] = []
        i = 0
        while i < len(pattern):
            if pattern[i] == "*":
                j = i
                while j < len(pattern) and pattern[j] == "*":
                    j += 1
                tokens.append("**" if j - i >= 2 else "*")  # `***` is `**` then `*`: any run
                i = j
            else:
                tokens.append(pattern[i])
                i += 1
        wild = [k for k, t in enumerate(tokens) if t in _WILDCARDS]
        self.exact = None if wild else pattern
        self.prefix = "".join(tokens[:wild[0]]) if wild else pattern
        self.suffix = "".join(tokens[wild[-1] + 1:]) if wild else ""
        # without `**` every dot of a matching name is one of the pattern's literal dots
        self.dots = None if "**" in tokens else tokens.count(".")
        self.min_len = sum(t not in ("*", "**") for t in tokens)
        self.sized = "*" not in tokens and "**" not in tokens  # then the length is min_len
        self.lit: dict[str, int] = {}
        self.qmark = self.star = self.any = 0
        for k, t in enumerate(tokens):
            if t == "?":
                self.qmark |= 1 << k
            elif t == "*":
                self.star |= 1 << k
            elif t == "**":
                self.any |= 1 << k
            else:
                self.lit[t] = self.lit.get(t, 0) | 1 << k
        self.accept = 1 << len(tokens)

    def fullmatch(self, name: str) -> bool:
        if self.exact is not None:
            return name == self.exact
        if len(name) < self.min_len or (self.sized and len(name) != self.min_len) \
                or not name.startswith(self.prefix) or not name.endswith(self.suffix) \
                or (self.dots is not None and name.count(".") != self.dots):
            return False
        lit, qmark, wild = self.lit, self.qmark, self.star | self.any
        state = 1 | (1 & wild) << 1  # a star may match nothing: step over it
        for c in name:
            if c == ".":
                state = (state & lit.get(c, 0)) << 1 | (state & self.any)
            else:
                state = (state & (lit.get(c, 0) | qmark)) << 1 | (state & wild)
            if not state:
                return False
            state |= (state & wild) << 1  # no two stars are adjacent: one step closes it
        return bool(state & self.accept)


_WILDCARDS = ("?", "*", "**")


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?")


def specificity(pattern: str) -> tuple[int, int, int]:
    """How specific a pattern is, for ``max``: an exact fqn beats any glob; among globs,
    more literal characters win, then fewer wildcards."""
    wild = pattern.count("*") + pattern.count("?")
    literal = len(pattern) - wild
    return (0 if _is_glob(pattern) else 1, literal, -wild)
