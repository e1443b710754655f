"""Handlers whose answers are as large as the event asks, for Lambda's payload limits.

`sized`: `{"blob": "x" * bytes}`; `sized_stream` (a generator): `chunks` items of
`{"blob": "x" * bytes}`, joined to the list of them; `version`: the
AWS_LAMBDA_FUNCTION_VERSION the handler's process sees.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from runtime import Context, handler


@handler("sized")
def sized(event: Any, ctx: Context) -> dict[str, Any]:
    return {"blob": "x" * int(event["bytes"])}


@handler("sized_stream")
def sized_stream(event: Any, ctx: Context) -> Iterator[dict[str, Any]]:
    for _ in range(int(event["chunks"])):
        yield {"blob": "x" * int(event["bytes"])}


@handler("version")
def version(event: Any, ctx: Context) -> dict[str, Any]:
    return {"version": os.environ.get("AWS_LAMBDA_FUNCTION_VERSION")}
