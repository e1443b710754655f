"""The example handler, invoked in-process as `thaw invoke hello` runs it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from runtime.errors import InvalidInput


def test_hello_greets(invoke: Callable[..., Any]) -> None:
    output = invoke("hello", {"name": "Ada"})
    assert output["greeting"] == "hello, Ada"


def test_hello_refuses_an_event_without_a_name(invoke: Callable[..., Any]) -> None:
    with pytest.raises(InvalidInput):
        invoke("hello", {})
