"""The baseline server: a bare Starlette app on uvicorn, the same uvicorn
settings as `thaw serve` (runtime/http/server.py), serving the same `echo` function.

    python bench/bare_app.py PORT

Routes:
    GET  /healthz          200, like the runtime's
    POST /invoke/echo      the event back, awaiting handlers.echo.echo (async)
                           inline, as Thaw runs an async handler
    POST /thread/echo      the event back, calling bench.fixtures.echo_sync (a
                           plain def) in a worker thread of a pool as large as
                           Thaw's, as Thaw runs a sync handler
    POST /fanout           waits on one shared asyncio.Event; the first request
                           arms a timer that sets it after `?after=S` seconds.
                           Answers {"set_at": time.time() of the set, "ran_at":
                           when the waiter ran, stamped as it wakes, or with
                           `?thread=1` in a worker thread of that pool}: the
                           fan-out of many waiters with no runtime in between.
"""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

# `python bench/bare_app.py` puts bench/ on sys.path, not the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fixtures import echo_sync
from handlers.echo import echo as echo_fn

_fanout: dict[str, Any] = {}
# As many threads as Thaw's handler threads (runtime/dispatch/calls.py, sized in
# runtime/instance.py), so the fan-out to threads is the same hand-off.
_POOL = ThreadPoolExecutor(64, "bare")


def _json(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json")


async def healthz(request: Request) -> Response:
    return _json({"status": "ok"})


async def invoke_echo(request: Request) -> Response:
    body = await request.body()
    event = orjson.loads(body) if body.strip() else {}
    return _json(await echo_fn(event, None))  # type: ignore[arg-type]  # the function ignores ctx


async def thread_echo(request: Request) -> Response:
    body = await request.body()
    event = orjson.loads(body) if body.strip() else {}
    loop = asyncio.get_running_loop()
    return _json(await loop.run_in_executor(_POOL, echo_sync, event, None))  # type: ignore[arg-type]


async def fanout(request: Request) -> Response:
    if "event" not in _fanout:
        event = asyncio.Event()
        _fanout["event"] = event
        after_s = float(request.query_params.get("after", "0.5"))

        def fire() -> None:
            _fanout["set_at"] = time.time()
            event.set()

        asyncio.get_running_loop().call_later(after_s, fire)
    await _fanout["event"].wait()
    if request.query_params.get("thread"):
        ran_at = await asyncio.get_running_loop().run_in_executor(_POOL, time.time)
    else:
        ran_at = time.time()
    return _json({"set_at": _fanout["set_at"], "ran_at": ran_at})


async def fanout_reset(request: Request) -> Response:
    _fanout.clear()
    return _json({"status": "reset"})


app = Starlette(
    routes=[
        Route("/healthz", healthz, methods=["GET"]),
        Route("/invoke/echo", invoke_echo, methods=["POST"]),
        Route("/thread/echo", thread_echo, methods=["POST"]),
        Route("/fanout", fanout, methods=["POST"]),
        Route("/fanout", fanout_reset, methods=["DELETE"]),
    ]
)


def main() -> None:
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        log_level="info",
        access_log=False,
        lifespan="on",
        log_config=None,
        timeout_keep_alive=5,
        h11_max_incomplete_event_size=64 * 1024,
    )
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
