"""Event field checks for the shipped handlers (torch-free).

Each check raises `InvalidInput` naming the offending field, which the
runtime renders as a 400 problem.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

from runtime import InvalidInput


def check_event(event: Any, allowed: Collection[str]) -> Mapping[str, Any]:
    """The event as a mapping; an unknown field is refused, so typos do not pass silently."""
    if not isinstance(event, Mapping):
        raise InvalidInput("event", "must be a JSON object")
    for key in event:
        if key not in allowed:
            raise InvalidInput(str(key), f"unknown field (allowed: {', '.join(sorted(allowed))})")
    return event


def get_int(event: Mapping[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = event.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(name, "must be an integer")
    if not low <= value <= high:
        raise InvalidInput(name, f"must be between {low} and {high}, got {value}")
    return value


def get_float(
    event: Mapping[str, Any], name: str, default: float, low: float, high: float
) -> float:
    value = event.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidInput(name, "must be a number")
    if not low <= value <= high:
        raise InvalidInput(name, f"must be between {low} and {high}, got {value}")
    return float(value)


def get_str(value: Any, name: str, max_chars: int) -> str:
    if not isinstance(value, str):
        raise InvalidInput(name, "must be a string")
    if len(value) > max_chars:
        raise InvalidInput(name, f"is {len(value)} characters; the limit is {max_chars}")
    return value


def get_str_list(value: Any, name: str, max_items: int, max_chars: int) -> list[str]:
    """A non-empty list of strings, each checked under the name `name[i]`."""
    if not isinstance(value, list) or not value:
        raise InvalidInput(name, "must be a non-empty list of strings")
    if len(value) > max_items:
        raise InvalidInput(name, f"has {len(value)} items; the limit is {max_items}")
    return [get_str(item, f"{name}[{i}]", max_chars) for i, item in enumerate(value)]


def require(event: Mapping[str, Any], name: str) -> Any:
    if name not in event:
        raise InvalidInput(name, "is required")
    return event[name]
