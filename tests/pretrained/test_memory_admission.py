"""Memory planning beyond weights: `generate` driven past its memory budget.

The budget admits the SmolLM2 weights plus two requests' KV cache and
activations. Ten concurrent generations must not run out of memory: at most
two run at once, the others wait in the handler's bounded queue (6) or get
429, and the server's peak RSS stays under the budget plus a stated margin
for the interpreter and torch's own libraries.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from tests.support import ServerProcess

# Interpreter, torch's shared libraries and allocator slack: what the process
# holds beyond the model plan. Measured at ~430 MiB on this machine.
MARGIN_BYTES = 640 * 1024 * 1024


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_generate_past_the_budget_queues_or_throttles_without_oom(
    smollm2_bundle: Path, thaw_env: dict[str, str]
) -> None:
    manifest = json.loads((smollm2_bundle / "bundle.json").read_text())
    weights = manifest["memory"]["weights_bytes"]
    per_request = manifest["memory"]["per_request_bytes"]
    assert per_request > 0, "the smollm2 bundle declares no per-request memory"
    budget = weights + 2 * per_request
    env = {
        **thaw_env,
        "THAW_BUNDLE_SOURCE": str(smollm2_bundle.parent),
        "THAW_HANDLERS": "handlers.generate",
        "THAW_MEMORY_BUDGET": str(budget),
        "THAW_MAX_QUEUE": "6",
        "THAW_PREWARM": "smollm2",
    }
    server = ServerProcess(env)
    try:
        server.start()
        with server.client(timeout=300) as client:
            deadline = time.monotonic() + 240
            while client.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.2)
            plan = client.get("/models").json()["models"][0]["memory"]
            assert plan["admitted_concurrency"] == 2  # weights + two requests fill the budget

            in_flight_seen: list[int] = []
            stop = threading.Event()

            def watch() -> None:
                with httpx.Client(base_url=server.url, timeout=30) as watcher:
                    while not stop.is_set():
                        model = watcher.get("/models").json()["models"][0]
                        in_flight_seen.append(model["in_flight"])
                        time.sleep(0.02)

            # All ten are sent together: each client is made first (an httpx client
            # builds an SSL context, tens of ms under the GIL), then a barrier.
            clients = [httpx.Client(base_url=server.url, timeout=300) for _ in range(10)]
            together = threading.Barrier(10)

            def generate(index: int) -> int:
                together.wait()
                response = clients[index].post(
                    "/invoke/generate",
                    json={"prompt": f"Count to {index + 3}:", "max_tokens": 24},
                    headers={"Prefer": "wait=300"},
                )
                return response.status_code

            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                with concurrent.futures.ThreadPoolExecutor(10) as pool:
                    codes = Counter(pool.map(generate, range(10)))
            finally:
                stop.set()
                watcher.join()
                for each in clients:
                    each.close()
            assert set(codes) <= {200, 429}, codes
            assert codes[200] >= 6 and codes[429] >= 1, codes
            assert max(in_flight_seen) <= 2, f"admitted past the budget: {max(in_flight_seen)}"
            assert client.get("/healthz").status_code == 200
            assert server.proc is not None
            peak = peak_rss_bytes(server.proc.pid)
            assert peak < budget + MARGIN_BYTES, (
                f"peak RSS {peak / 2**20:.0f} MiB over budget {budget / 2**20:.0f} MiB "
                f"+ margin {MARGIN_BYTES / 2**20:.0f} MiB"
            )
    finally:
        server.kill()
