"""RunPod's serverless worker (the `runpod` package's own local API server) serving
the same no-op handler, for bench/overhead.py to measure beside Thaw and the bare app.

    /path/to/python-with-runpod bench/runpod_worker.py PORT

It is what `python handler.py --rp_serve_api` starts (runpod.serverless.start with
that flag builds this `WorkerAPI` and runs it on uvicorn), plus `GET /healthz` for
the benchmark's start-up poll. Its routes: `POST /runsync {"input": ...}` runs the
handler and answers its output; `POST /run` keeps the job in memory and answers
its id; `POST /status/{id}` runs a kept job and answers its output (the local
server's simulation of RunPod's queue). Not a dependency of Thaw: the benchmark
runs it only when given a Python that has `runpod` installed (`--runpod-python`).
"""

from __future__ import annotations

import sys
from typing import Any

from runpod.serverless.modules.rp_fastapi import WorkerAPI  # type: ignore[import-not-found]


async def handler(job: dict[str, Any]) -> Any:
    """`handlers.echo`'s work: the input back."""
    return job["input"]


async def healthz() -> dict[str, str]:
    return {"status": "ok"}


def main() -> None:
    api = WorkerAPI({"handler": handler})
    api.rp_app.add_api_route("/healthz", healthz, methods=["GET"])
    api.start_uvicorn(api_host="127.0.0.1", api_port=int(sys.argv[1]))


if __name__ == "__main__":
    main()
