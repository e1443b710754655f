"""A plain Lambda handler that sleeps the event's `sleep_s`, then answers its pid."""

from __future__ import annotations

import os
import time
from typing import Any


def handler(event: Any, context: Any) -> dict[str, Any]:
    time.sleep(float(event.get("sleep_s", 0)))
    return {"pid": os.getpid()}
