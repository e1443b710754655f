"""`nonfinite`: returns a non-finite number (or none) where the event says.

Event: `{"value": "nan" | "inf" | "-inf" | "1.5" | "none", "as": "float" |
"numpy_scalar" | "numpy_float32" | "numpy_array", "depth": N}`; the value is
put `depth` levels deep in nested lists and objects, beside ordinary
finite numbers and a null, so the runtime has to look everywhere.
"""

from __future__ import annotations

from typing import Any

from runtime import Context, handler


def _value(kind: str, form: str) -> Any:
    if kind == "none":
        return None
    number = float(kind)
    if form == "float":
        return number
    import numpy as np

    if form == "numpy_scalar":
        return np.float64(number)
    if form == "numpy_float32":
        return np.float32(number)
    if form == "numpy_array":
        return np.array([[1.0, 2.0], [3.0, number]], dtype=np.float32)
    raise ValueError(f"unknown form {form!r}")


@handler("nonfinite")
def nonfinite(event: Any, ctx: Context) -> Any:
    value = _value(str(event.get("value", "nan")), str(event.get("as", "float")))
    for level in range(int(event.get("depth", 1))):
        value = [1.0, None, {"level": level, "x": value}] if level % 2 else {"y": [0.5, value]}
    return {"ok": True, "result": value}
