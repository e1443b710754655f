"""The peers Thaw's server is measured against: a bare Starlette app on uvicorn,
with the same uvicorn settings as `thaw serve` (runtime/http/server.py), serving
the same `echo` function; and RunPod's worker (`--runpod`).

    python bench/bare_app.py PORT
    /path/to/python-with-runpod bench/bare_app.py --runpod PORT

With `--runpod`, the peer instead: RunPod's serverless worker (the `runpod`
package's own local API server, what `python handler.py --rp_serve_api` starts:
runpod.serverless.start with that flag builds its `WorkerAPI` and runs it on
uvicorn), serving the same no-op handler, plus `GET /healthz` for the
benchmark's start-up poll. Its routes: `POST /runsync {"input": ...}` runs the
handler and answers its output; `POST /run` keeps the job in memory and answers
its id; `POST /status/{id}` runs a kept job and answers its output (the local
server's simulation of RunPod's queue). Not a dependency of Thaw: it runs under
a Python that has `runpod` installed (bench/overhead.py `--runpod-python`), and
imports nothing of this repository.

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

import sys
from typing import Any


def runpod_main(port: int) -> None:
    """RunPod's worker on `port`: the one mode that imports nothing of Thaw's."""
    from runpod.serverless.modules.rp_fastapi import WorkerAPI  # type: ignore[import-not-found]

    async def echo(job: dict[str, Any]) -> Any:
        """`handlers.echo`'s work: the input back."""
        return job["input"]

    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    api = WorkerAPI({"handler": echo})
    api.rp_app.add_api_route("/healthz", healthz, methods=["GET"])
    api.start_uvicorn(api_host="127.0.0.1", api_port=port)


if __name__ == "__main__" and sys.argv[1:2] == ["--runpod"]:
    runpod_main(int(sys.argv[2]))
    sys.exit(0)

import asyncio  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import orjson  # noqa: E402
import uvicorn  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

# `python bench/bare_app.py` puts bench/ on sys.path, not the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fixtures import echo_sync  # noqa: E402
from handlers.echo import echo as echo_fn  # noqa: E402

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
