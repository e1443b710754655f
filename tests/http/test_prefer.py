"""The Prefer header parser: documented results or InvalidPrefer, nothing else."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.errors import InvalidPrefer
from runtime.http.prefer import Preferences, parse_prefer


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([], Preferences()),
        (["wait=5"], Preferences(wait_s=5.0)),
        (["respond-async, wait=0.25"], Preferences(wait_s=0.25, respond_async=True)),
        (["return=minimal", "Wait=2"], Preferences(wait_s=2.0)),
        (['wait="3"'], Preferences(wait_s=3.0)),
        (["wait=1;foo=bar"], Preferences(wait_s=1.0)),
        (["wait=1, wait=9"], Preferences(wait_s=1.0)),
        # Malformed preferences are ignored like unknown ones; a wait beside them counts.
        (["a b, wait=2"], Preferences(wait_s=2.0)),
        (['"quoted", respond-async'], Preferences(respond_async=True)),
        (["wait 5"], Preferences()),
    ],
)
def test_parses(headers: list[str], expected: Preferences) -> None:
    assert parse_prefer(headers) == expected


@pytest.mark.parametrize(
    "header", ["wait=abc", "wait=-1", "wait", "wait=", "wait=nan", "wait=inf", "x" * 1025]
)
def test_rejects(header: str) -> None:
    with pytest.raises(InvalidPrefer):
        parse_prefer([header])


@given(st.lists(st.text(max_size=200), max_size=4))
def test_arbitrary_headers_parse_or_raise_the_documented_error(headers: list[str]) -> None:
    try:
        result = parse_prefer(headers)
    except InvalidPrefer:
        return
    assert result.wait_s is None or result.wait_s >= 0
