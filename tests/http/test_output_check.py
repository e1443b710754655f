"""The output check of every surface (runtime/wire/outputs.py): a non-finite number
anywhere fails the call, whatever text surrounds it, and a `null` that is a
None or a string's text passes. The HTTP answers are in test_errors.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.errors import InvalidOutput
from runtime.wire.outputs import encode_output

# Text with many of the bytes the search for `null` looks at first.
TEXT = st.text(alphabet='nulu l"\\x', max_size=40)
OUTPUTS = st.recursive(
    st.none() | st.floats() | st.integers(-(2**53), 2**53) | TEXT,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=40,
)


def non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, list):
        return any(map(non_finite, value))
    if isinstance(value, dict):
        return any(map(non_finite, value.values()))
    return False


@settings(max_examples=400, deadline=None)
@given(OUTPUTS)
def test_an_output_fails_exactly_when_it_holds_a_non_finite_number(output: Any) -> None:
    if non_finite(output):
        with pytest.raises(InvalidOutput):
            encode_output("h", output)
    else:
        encode_output("h", output)


@pytest.mark.parametrize("before", [*range(12), 500])
def test_a_nan_after_any_number_of_u_is_found(before: int) -> None:
    """Past a few `u`s the search finishes with one scan for `null`: the NaN is
    found wherever it sits, in text that would stop a cheaper search."""
    output = {"usual": ["u"] * before, "value": [1.5, math.nan]}  # 3 + before `u`s first
    with pytest.raises(InvalidOutput):
        encode_output("h", output)
    assert encode_output("h", {**output, "value": [1.5, None]}).endswith(b"[1.5,null]}")
