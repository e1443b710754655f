"""A plain Lambda handler that raises: awslambdaric posts it as the function's error."""

from __future__ import annotations

from typing import Any


def handler(event: Any, context: Any) -> Any:
    raise ValueError(f"raised on purpose: {event.get('why', 'no reason')}")
