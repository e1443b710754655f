"""Readiness and prewarm (in-process), and drain to the process's exit (real
`thaw serve` processes: the exit code is the point)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.settings import Settings
from tests.handlers import loadlog
from tests.inproc import answer_once, serving
from tests.inproc import until as until_async
from tests.support import ServerProcess, make_bundle, until


def queued(client: httpx.Client, handler: str) -> float:
    """The server's `thaw_queue_depth` for `handler`: requests admitted, not yet done."""
    prefix = f'thaw_queue_depth{{handler="{handler}"}} '
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


def load_began(client: httpx.Client, bundle: str) -> bool:
    """Whether `bundle`'s load has begun (or ended): a cold call that began it is
    under way, not only admitted (an admitted call reads its bundle's manifest
    before it starts: a drain that begins then does not wait for it)."""
    models = client.get("/models").json()["models"]
    model = next(m for m in models if m["name"] == bundle)
    return "progress" in model or model["state"] != "stored"


def test_healthz_answers_before_torch_is_imported(
    servers: list[ServerProcess], server_env: dict[str, str], bundles: Path
) -> None:
    """The control plane needs no framework; how fast it answers is bench/coldstart.py's.
    (With the preload off: on, the framework's libraries load beside start-up,
    tests/http/test_preload.py.)"""
    make_bundle(bundles, "alpha")
    server = ServerProcess({**server_env, "THAW_PRELOAD_FRAMEWORK": "0"})
    servers.append(server)
    server.start(wait=False)
    server.wait_healthy()
    assert "libtorch" not in server.maps(), "torch was imported before any model was needed"
    with server.client() as client:
        assert client.get("/readyz").status_code == 200  # empty prewarm set
        assert client.post("/invoke/alpha", json={}, headers={"Prefer": "wait=30"}).is_success
    assert "libtorch" in server.maps()


@pytest.mark.anyio
async def test_readyz_waits_for_prewarm_while_healthz_answers_at_once(
    app_settings: Settings, bundles: Path
) -> None:
    make_bundle(bundles, "alpha", config={"hold": True})
    loadlog.HOLD.clear()  # the builder holds until the probes below have answered
    try:
        async with serving(dataclasses.replace(app_settings, prewarm=("alpha",))) as served:
            client = served.client
            # Not waiting for prewarm: healthz answers while the builder still runs,
            # so readyz still says no (the healthz time is held by bench/coldstart.py).
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get("/readyz")).status_code == 503
            loadlog.HOLD.set()

            async def ready() -> bool:
                return (await client.get("/readyz")).status_code == 200

            await until_async(ready, "prewarm became ready")
            models = (await client.get("/models")).json()["models"]
            alpha = next(m for m in models if m["name"] == "alpha")
            assert alpha["state"] == "ready" and alpha["pinned"] is True
            assert alpha["phase_ms"]["warmup"] >= 0 and alpha["phase_ms"]["init"] > 0
    finally:
        loadlog.HOLD.set()


def test_drain_finishes_in_flight_refuses_new_and_exits_zero(serve: Any, bundles: Path) -> None:
    make_bundle(bundles, "alpha")
    server: ServerProcess = serve(THAW_DRAIN_GRACE_S="10")
    with server.client() as client:
        assert client.post("/invoke/alpha", json={}).status_code == 200

    def long_call() -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            return c.post("/invoke/alpha", json={"sleep_s": 1.5}, headers={"Prefer": "wait=20"})

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        in_flight = [pool.submit(long_call) for _ in range(3)]
        with server.client() as client:
            until(lambda: queued(client, "alpha") == 3, "the three calls admitted")
            job = client.post("/handlers/alpha/jobs", json={"sleep_s": 1.5}).json()
            assert client.post("/drain").status_code == 202
            assert client.get("/readyz").status_code == 503
            refused = client.post("/invoke/alpha", json={})
            assert refused.status_code == 503
            assert refused.json()["type"].endswith("/drained")
        responses = [f.result() for f in in_flight]
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert all(r.json()["bundle"] == "alpha" for r in responses)
    assert server.proc is not None
    assert server.proc.wait(20) == 0
    # The job finished during the drain and its result was recorded (read by an app
    # restarted on the same state, in-process).
    recorded = answer_once(Settings.from_env(server.env), "GET", f"/jobs/{job['id']}")
    assert recorded.json()["status"] == "succeeded"


def test_drain_grace_aborts_the_rest_with_a_retryable_error(
    serve: Any, bundles: Path, tmp_path: Path
) -> None:
    make_bundle(bundles, "alpha")
    hold = tmp_path / "hold"  # the job outlasts any grace: only the drain ends it
    hold.touch()
    server: ServerProcess = serve(THAW_DRAIN_GRACE_S="0.5")
    with server.client() as client:
        job = client.post("/handlers/alpha/jobs", json={"hold_file": str(hold)}).json()
        until(
            lambda: client.get(f"/jobs/{job['id']}").json()["status"] == "running",
            "the job started",
        )
        client.post("/drain")
    assert server.proc is not None and server.proc.wait(20) == 0
    final = answer_once(Settings.from_env(server.env), "GET", f"/jobs/{job['id']}").json()
    assert final["status"] == "failed"
    assert final["error"]["type"] == "drained" and final["error"]["retryable"] is True


def test_sigterm_drains_and_exits_zero(serve: Any, bundles: Path) -> None:
    make_bundle(bundles, "alpha")
    server: ServerProcess = serve()

    def long_call() -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            return c.post("/invoke/alpha", json={"sleep_s": 1.0}, headers={"Prefer": "wait=20"})

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(long_call)
        with server.client() as client:
            until(lambda: load_began(client, "alpha"), "the call began the load")
        assert server.terminate() == 0
        assert future.result().status_code == 200
