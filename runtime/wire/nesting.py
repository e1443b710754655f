"""How deep a parsed JSON document nests: `nests_deeper`, decided from its text where
that is exact, so a wide document costs a small fraction of its parse.

A walk of the parsed value visits every element: a body of 100 vectors of
384 floats took 3x its parse to check, and one of 50,000 coordinate pairs 5x
(BENCHMARKS.md, "Large payloads on the warm path"). The text says the same in
C: brackets outside strings are the document's structure, and `bytes` methods
(memchr, translate, replace) walk them without a Python step per element.

1. No more opening brackets than the limit: not too deep. Past 4 KiB, `find`
   of one byte (memchr) counts them, stopping at the first past the limit.
2. Otherwise the structure is kept (`translate`: brackets and quotes, after
   escaped quotes and backslashes are paired off as JSON pairs them), each
   string's brackets are dropped, and the innermost pairs (`[]`, `{}`) are
   peeled until nothing is left. One peel of one kind of pair removes at most
   one level, so the number of peels that removed anything bounds the depth
   from above: at most the limit, the document is not too deep.
3. Past the limit by that bound (a document at or near the limit, or one
   where a peel of `{}` removed only shallower objects and still counted),
   the parsed value is walked: exact.

The text must be the document the value was parsed from, valid JSON: the
caller parsed it first.
"""

from __future__ import annotations

from itertools import chain, compress, repeat
from operator import is_
from typing import Any

_CONTAINERS = frozenset((dict, list))
# A body this small is counted whole: two counts cost less than the calls of
# the search that stops early (the warm path's events are tens of bytes).
_COUNT_UP_TO = 4096
# The structure: brackets and quotes.
_NOT_STRUCTURE = bytes(set(range(256)) - set(b'[]{}"'))
# The structure and every byte an escape is made of, so that each backslash is
# still followed by the byte it escapes (JSON escapes: \" \\ \/ \b \f \n \r \t \uXXXX).
_ESCAPES = b"\\/bfnrtu"
_NOT_STRUCTURE_OR_ESCAPE = bytes(set(range(256)) - set(b'[]{}"' + _ESCAPES))


def nests_deeper(text: bytes, value: Any, max_depth: int) -> bool:
    """True when `value`, parsed from `text`, nests arrays/objects more than
    `max_depth` levels deep."""
    if not _opens_over(text, max_depth):
        return False
    if _peels_within(text, max_depth):
        return False
    return _walk_deeper(value, max_depth)


def _opens_over(text: bytes, limit: int) -> bool:
    if len(text) <= _COUNT_UP_TO:
        return text.count(b"[") + text.count(b"{") > limit
    seen = 0
    for bracket in (b"[", b"{"):
        at = text.find(bracket)
        while at != -1:
            seen += 1
            if seen > limit:
                return True
            at = text.find(bracket, at + 1)
    return False


def _peels_within(text: bytes, limit: int) -> bool:
    """Whether the structure of `text` empties in at most `limit` peels (step 2)."""
    if text.find(b"\\") == -1:
        structure = text.translate(None, _NOT_STRUCTURE)
    else:
        # Escapes pair from the left, as JSON's reading pairs them: `\\` first, then
        # every escaped quote, which ends no string; then the escapes' other bytes go.
        kept = text.translate(None, _NOT_STRUCTURE_OR_ESCAPE)
        structure = kept.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _ESCAPES)
    structure = structure.replace(b'""', b"")
    if structure.find(b'"') != -1:
        # Strings that hold brackets. Removing `""` only ever joined two strings with
        # nothing structural between them, so the quotes left still pair: every
        # other part is inside a string.
        structure = b"".join(structure.split(b'"')[::2])
    peels = 0
    while structure:
        before = len(structure)
        for pair in (b"[]", b"{}"):
            peeled = structure.replace(pair, b"")
            if len(peeled) != len(structure):
                peels += 1
                if peels > limit:
                    return False
                structure = peeled
        if len(structure) == before:
            return False  # unbalanced, which valid JSON never is: the walk decides
    return True


def _walk_deeper(value: Any, max_depth: int) -> bool:
    """The exact answer from the parsed value: one level at a time, each level's
    elements sorted by iterators written in C rather than a Python step each."""
    level = [value] if type(value) in _CONTAINERS else []
    depth = 1
    while level:
        if depth > max_depth:
            return True
        kinds = list(map(type, level))
        children = list(
            chain(
                chain.from_iterable(compress(level, map(is_, kinds, repeat(list)))),
                chain.from_iterable(
                    map(dict.values, compress(level, map(is_, kinds, repeat(dict))))
                ),
            )
        )
        if _CONTAINERS.isdisjoint(map(type, children)):
            return False
        level = list(compress(children, map(_CONTAINERS.__contains__, map(type, children))))
        depth += 1
    return False
