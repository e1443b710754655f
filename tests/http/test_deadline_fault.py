"""Deadline fault test: no response passes its deadline, whatever the estimates say.

200 requests with random deadlines (0.2-3 s) against eight bundles with random
load times (0-4 s), with the persisted load-time estimates made deliberately
wrong in both directions (some bundles claimed fast but slow, others claimed
slow but fast, and the framework import claimed instant). Every response must
arrive by its deadline + 50 ms; every 202 job must end succeeded; every request
must run exactly once.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.support import ServerProcess, make_bundle

TOLERANCE_S = 0.05


def test_no_response_after_its_deadline(
    servers: list[ServerProcess], server_env: dict[str, str], bundles: Path, tmp_path: Path
) -> None:
    rng = random.Random(20261129)
    ledger = tmp_path / "ledger.txt"
    load_s = [rng.uniform(0.0, 4.0) for _ in range(8)]
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    history = {}
    for index, seconds in enumerate(load_s):
        name = f"fleet{index}"
        make_bundle(bundles, name, config={"sleep_s": seconds, "ledger": str(ledger)})
        # Even bundles claim to be 100x faster than they are, odd ones 100x slower.
        claimed = seconds / 100 if index % 2 == 0 else seconds * 100 + 5
        history[name] = {
            "fetch_bytes_s": 1e12,
            "load_bytes_s": 1e12,
            "init_s": claimed,
            "warmup_s": 0.0,
            "loads": 3,
        }
    runs = {f"fleet{i}": (0.001 if i % 3 else 2.0) for i in range(8)}
    (state / "estimates.json").write_text(
        json.dumps({"bundles": history, "runs": runs, "framework_s": 0.001})
    )
    env = {**server_env, "THAW_HANDLERS": "tests.handlers.fleet", "THAW_STATE_DIR": str(state)}
    server = ServerProcess(env)
    servers.append(server)
    server.start()

    requests: list[dict[str, Any]] = []
    for token in range(200):
        requests.append(
            {
                "token": f"t{token}",
                "bundle": f"fleet{rng.randrange(8)}",
                "deadline_s": rng.uniform(0.2, 3.0),
                "run_s": rng.choice([0.0, 0.0, 0.05, 0.5]),
                "delay_s": rng.uniform(0.0, 6.0),
            }
        )

    async def send(
        client: httpx.AsyncClient, spec: dict[str, Any]
    ) -> tuple[dict[str, Any], int, float, dict[str, Any]]:
        await asyncio.sleep(spec["delay_s"])
        started = time.monotonic()
        response = await client.post(
            f"/invoke/{spec['bundle']}",
            json={"token": spec["token"], "run_s": spec["run_s"]},
            headers={"Prefer": f"wait={spec['deadline_s']:.3f}"},
        )
        elapsed = time.monotonic() - started
        return spec, response.status_code, elapsed, response.json()

    async def send_all() -> list[tuple[dict[str, Any], int, float, dict[str, Any]]]:
        # One event loop in one thread: the client adds little latency of its own.
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client:
            return await asyncio.gather(*(send(client, spec) for spec in requests))

    results = asyncio.run(send_all())

    late = [
        (spec["token"], code, round(elapsed - spec["deadline_s"], 3))
        for spec, code, elapsed, _ in results
        if elapsed > spec["deadline_s"] + TOLERANCE_S
    ]
    worst_s = max(elapsed - spec["deadline_s"] for spec, _, elapsed, _ in results)
    print(f"worst lateness {worst_s * 1000:.1f} ms")
    assert late == [], f"responses past deadline + {TOLERANCE_S} s: {late}"
    statuses = Counter(code for _, code, _, _ in results)
    assert set(statuses) <= {200, 202}, statuses
    assert statuses[200] > 0 and statuses[202] > 0, statuses

    with server.client() as client:
        for _, code, _, body in results:
            if code == 202:
                final = client.get(f"/jobs/{body['id']}", params={"wait": 30}).json()
                assert final["status"] == "succeeded", final
    ran = Counter(ledger.read_text().split())
    assert set(ran) == {f"t{i}" for i in range(200)}, "some request never ran"
    assert max(ran.values()) == 1, f"ran twice: {[t for t, n in ran.items() if n > 1]}"
