"""What a handler's output may be: JSON, with every number finite.

orjson writes NaN and +-Infinity as `null` and raises on what it cannot
serialise; either way the caller would get something the handler did not
return, or a bare 500. Every surface that stores or sends an output (the HTTP
answer, which the Lambda loop also goes through; a job's record) checks it
here and fails the call with `invalid-output` instead.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import orjson

from runtime.errors import InvalidOutput

JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def encode_output(handler: str, output: Any) -> bytes:
    """`output` as JSON bytes, or InvalidOutput naming why it cannot be sent."""
    try:
        body = orjson.dumps(output, option=JSON_OPTIONS)
    except TypeError as exc:
        raise InvalidOutput(
            f"handler {handler!r} returned output that is not JSON-serialisable: {exc}",
            handler=handler,
        ) from exc
    # A non-finite number is written as null: look for one only when a null is there,
    # so the warm path of every other output walks nothing.
    if _holds_null(body):
        check_finite(handler, output)
    return body


# `find` of one byte is memchr; of `null`, CPython's own loop, 50x slower: 1 ms on
# an output of 1.5 MB of floats, half the time orjson took to write it. So a `u`
# (in no number, and in few keys) is found first and `null` checked where it
# stands; past this many `u`s (text) one search of `null` does the rest.
_U_TRIES = 8


def _holds_null(body: bytes) -> bool:
    # `find`, not `in`: bytes' `in` tries its operand as an integer first, and raises
    # and drops a TypeError for every bytes operand.
    at = body.find(b"u")
    tries = 0
    while at != -1:
        if tries == _U_TRIES:
            return body.find(b"null", at - 1) != -1
        if body[at - 1 : at + 3] == b"null":  # JSON never starts with `u`: at >= 1
            return True
        tries += 1
        at = body.find(b"u", at + 1)
    return False


def check_finite(handler: str, output: Any) -> None:
    """Raise InvalidOutput when `output` holds a non-finite number."""
    where = non_finite_at(output)
    if where is not None:
        raise InvalidOutput(
            f"handler {handler!r} returned a non-finite number (NaN or Infinity) at {where}; "
            "JSON cannot carry it",
            handler=handler,
            at=where,
        )


_PLAIN = (str, int, type(None))


def non_finite_at(value: Any) -> str | None:
    """Where in `value` a non-finite number (NaN, ±Infinity) sits, as a path like
    `$.result[2]`; None when there is none.

    orjson writes such a number as `null`, which silently changes the output,
    so it is walked only for an output whose serialised form contains `null`
    (`encode_output`), or for a job's output before it is recorded. numpy scalars
    and arrays (orjson serialises them too) are checked as well.
    """
    np = sys.modules.get("numpy")  # an output holds numpy values only once numpy is imported
    stack: list[tuple[Any, str]] = [(value, "$")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, float):
            if not math.isfinite(node):
                return path
        elif isinstance(node, dict):
            for key, child in node.items():
                if isinstance(child, float):
                    if not math.isfinite(child):
                        return f"{path}.{key}"
                elif not isinstance(child, _PLAIN):
                    stack.append((child, f"{path}.{key}"))
        elif isinstance(node, (list, tuple)):
            for index, child in enumerate(node):
                if isinstance(child, float):
                    if not math.isfinite(child):
                        return f"{path}[{index}]"
                elif not isinstance(child, _PLAIN):
                    stack.append((child, f"{path}[{index}]"))
        elif (
            np is not None
            and isinstance(node, (np.ndarray, np.generic))
            and node.dtype.kind in "fc"  # only float and complex dtypes hold NaN/inf
        ):
            bad = ~np.isfinite(node)
            if bad.any():
                first = np.argwhere(bad)[0] if node.ndim else ()
                return path + "".join(f"[{int(i)}]" for i in first)
    return None
