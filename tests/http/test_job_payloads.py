"""Large job payloads through a real `thaw serve`: the memory of finished jobs is
bounded in bytes, not only in records (runtime/jobs/finished.py), as the RSS of
the process shows, and every job still answers its whole output."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import orjson

from tests.pretrained.host_memory import MIB, rss
from tests.support import SAFETY_S, ServerProcess

# About 190 KB of JSON each way: records small enough for the memory to keep.
BODY = orjson.dumps({"values": [i / 7 for i in range(10_000)]})


def echo_jobs(client: httpx.Client, count: int) -> list[str]:
    """`count` jobs of `echo` submitted and each read back once it succeeded."""
    ids = []
    for _ in range(count):
        submitted = client.post("/handlers/echo/jobs", content=BODY)
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["id"]
        done = client.get(f"/jobs/{job_id}", params={"wait": SAFETY_S})
        assert done.json()["status"] == "succeeded", done.text
        ids.append(job_id)
    return ids


def test_finished_jobs_with_large_payloads_do_not_grow_the_process(
    serve: Callable[..., ServerProcess],
) -> None:
    server = serve()
    with httpx.Client(base_url=server.url, timeout=SAFETY_S) as client:
        # Past the memory's 16 MiB of payloads: it holds all it will from here on.
        first = echo_jobs(client, 100)
        filled = rss(server)
        echo_jobs(client, 200)
        grown = rss(server) - filled
        # Kept by count alone, 200 more records of this size held about 150 MiB more.
        assert grown < 48 * MIB, f"RSS grew {grown / MIB:.0f} MiB over 200 finished jobs"
        # The jobs the memory let go are read from the store, whole.
        oldest = client.get(f"/jobs/{first[0]}")
        assert oldest.status_code == 200 and orjson.loads(BODY) == oldest.json()["output"]
