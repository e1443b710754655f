"""THAW_MAX_JSON_DEPTH decided from a body's text (runtime/wire/nesting.py), against
the depth of the parsed value, on documents made to mislead a reading of the
text: strings full of brackets, quotes and backslashes, escapes next to the
structure, wide and deep at once. The HTTP answers are in test_limits.py."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.wire.nesting import nests_deeper

# Text whose every character could fool a scan of the raw bytes.
TRICKY_TEXT = st.text(alphabet='[]{}"\\/bfnrtu ,:x\n\t', max_size=12)
DOCUMENTS = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | TRICKY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY_TEXT, inner, max_size=4),
    max_leaves=60,
)


def depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


def nested(value: Any, levels: int) -> Any:
    for index in range(levels):
        value = [value] if index % 3 else {'k[\\"': value, "]]": "}}"}
    return value


@settings(max_examples=400, deadline=None)
@given(DOCUMENTS, st.integers(1, 10))
def test_the_text_decides_as_the_parsed_value_does(value: Any, max_depth: int) -> None:
    text = orjson.dumps(value)
    assert nests_deeper(text, orjson.loads(text), max_depth) is (depth(value) > max_depth)


@settings(max_examples=200, deadline=None)
@given(DOCUMENTS, st.integers(0, 8), st.integers(60, 68))
def test_a_deep_document_hidden_among_tricky_strings_is_found(
    filler: Any, extra: int, levels: int
) -> None:
    value = [filler, nested(filler, levels), ["]" * 70, "\\" * extra + '"']]
    text = orjson.dumps(value)
    assert nests_deeper(text, orjson.loads(text), 64) is (depth(value) > 64)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["", '"', "\\", '\\"', "\\\\", "x"]), st.integers(62, 67))
def test_strings_that_would_hide_the_depth_from_a_scan_of_the_text(lead: str, levels: int) -> None:
    """Closing brackets in a string before the deepest point, and as many opening
    ones in a string after it: counted as structure, they would hide ten levels;
    escaped quotes and backslashes ahead of them would flip what is inside a string."""
    value: Any = 1
    for level in range(levels):
        if level == levels // 2:
            value = [lead + "]" * 10, value]
        elif level == levels // 4:
            value = [value, lead + "[" * 10]
        elif level == 5:
            value = {lead + "k": value}
        else:
            value = [value]
    text = orjson.dumps(value)
    assert nests_deeper(text, orjson.loads(text), 64) is (levels > 64)


@pytest.mark.parametrize("before", ["", '"', "\\", '\\"'])
@pytest.mark.parametrize("after", ["", '"', "\\", "\\\\"])
def test_escapes_do_not_turn_structure_into_string(before: str, after: str) -> None:
    """An escaped quote read as a string's end, or an escaped backslash read as
    escaping the quote after it, would swap what is inside a string with what is
    outside: the deep chain between these strings would vanish, and what is left
    would balance."""
    for levels, too_deep in ((65, True), (63, False)):
        chain: Any = 1
        for _ in range(levels):
            chain = [chain]
        value = [before + after, chain, before + "[]" + after]
        text = orjson.dumps(value)
        assert nests_deeper(text, orjson.loads(text), 64) is too_deep, text


def test_wide_shallow_documents_past_the_bracket_count_are_not_too_deep() -> None:
    """More opening brackets than the limit, every one shallow: the shapes a
    batch takes (vectors, point pairs, records whose strings hold brackets)."""
    shapes = [
        {"vectors": [[0.5] * 16 for _ in range(200)]},
        [[1.5, 2.5]] * 500,
        [{"text": f'see [{i}] \\" {{x}}', "tags": ["a"]} for i in range(300)],
    ]
    for value in shapes:
        text = orjson.dumps(value)
        assert not nests_deeper(text, orjson.loads(text), 3)
        assert nests_deeper(text, orjson.loads(text), 1)


def test_depth_is_counted_through_whitespace_and_scalars_at_the_top() -> None:
    assert nests_deeper(b" [ [ [ ] ] ] ", [[[]]], 2)
    assert not nests_deeper(b" [ [ [ ] ] ] ", [[[]]], 3)
    text = orjson.dumps("[" * 100)
    assert not nests_deeper(text, orjson.loads(text), 1)


@pytest.mark.parametrize("padding", [0, 10_000])
def test_a_chain_at_the_limit_passes_and_one_deeper_fails_in_any_size_of_body(
    padding: int,
) -> None:
    """Bodies past 4 KiB count their brackets by memchr, stopping past the limit;
    smaller ones count them whole: both decide the same."""
    for levels, too_deep in ((64, False), (65, True)):
        value: Any = ["x" * padding]
        for _ in range(levels - 1):
            value = [value]
        text = orjson.dumps(value)
        assert nests_deeper(text, orjson.loads(text), 64) is too_deep
