"""The HTTP contract against a real `thaw serve` process on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support import ServerProcess, make_bundle

PROBLEM = "application/problem+json"


def timing_phases(header: str) -> dict[str, float]:
    phases = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        phases[name] = float(dur)
    return phases


def test_cold_load_past_deadline_gets_202_then_job_then_warm_200(serve: Any, bundles: Path) -> None:
    make_bundle(bundles, "alpha", config={"sleep_s": 2.0})
    server: ServerProcess = serve()
    with server.client() as client:
        response = client.post("/invoke/alpha", json={}, headers={"Prefer": "wait=1"})
        assert response.status_code == 202, response.text
        job = response.json()
        assert response.headers["location"] == f"/jobs/{job['id']}"
        assert int(response.headers["retry-after"]) >= 1
        # The client asked for `wait`, not `respond-async` (RFC 7240).
        assert "preference-applied" not in response.headers
        assert job["status"] in ("running", "queued") and job["handler"] == "alpha"
        assert len(job["id"]) >= 22  # >= 128 bits, URL-safe
        polled = client.get(f"/jobs/{job['id']}", params={"wait": 20}).json()
        assert polled["status"] == "succeeded", polled
        assert polled["output"]["bundle"] == "alpha"
        warm = client.post("/invoke/alpha", json={})
        assert warm.status_code == 200
        phases = timing_phases(warm.headers["server-timing"])
        assert set(phases) >= {"queue", "run"} and "load" not in phases
        models = client.get("/models").json()["models"]
        alpha = next(m for m in models if m["name"] == "alpha")
        assert alpha["state"] == "ready" and alpha["loads"] == 1
        assert alpha["id"].startswith("alpha@sha256:")
        assert alpha["estimate"]["basis"] == "observed"
        assert set(alpha["phase_ms"]) >= {"fetch", "load", "init", "warmup"}


def test_first_request_that_fits_pays_load_in_server_timing(serve: Any, bundles: Path) -> None:
    make_bundle(bundles, "alpha", config={"sleep_s": 0.3})
    server: ServerProcess = serve()
    with server.client() as client:
        response = client.post("/invoke/alpha", json={}, headers={"Prefer": "wait=30"})
        assert response.status_code == 200
        phases = timing_phases(response.headers["server-timing"])
        assert {"queue", "fetch", "load", "init", "warmup", "run"} <= set(phases)
        assert phases["init"] >= 300


def test_64_concurrent_cold_requests_one_load(serve: Any, bundles: Path, tmp_path: Path) -> None:
    make_bundle(bundles, "alpha", config={"sleep_s": 2.0})
    server: ServerProcess = serve()
    # All 64 are sent together, well inside the load: each client is made first
    # (an httpx client builds an SSL context, tens of ms under the GIL), then a
    # barrier. A short-deadline request sent after READY would rightly get 200.
    clients = [httpx.Client(base_url=server.url, timeout=60) for _ in range(64)]
    together = threading.Barrier(64)

    def one(index: int) -> tuple[float, int]:
        wait = 0.3 if index % 2 else 30.0
        together.wait()
        response = clients[index].post("/invoke/alpha", json={}, headers={"Prefer": f"wait={wait}"})
        return wait, response.status_code

    try:
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            results = list(pool.map(one, range(64)))
    finally:
        for client in clients:
            client.close()
    assert {code for wait, code in results if wait == 30.0} == {200}
    assert {code for wait, code in results if wait == 0.3} == {202}
    assert len((tmp_path / "loads.log").read_text().splitlines()) == 1


def test_bad_input_gets_problem_json_and_server_stays_healthy(serve: Any, bundles: Path) -> None:
    make_bundle(bundles, "alpha")
    server: ServerProcess = serve(THAW_MAX_BODY_BYTES="1000", THAW_MAX_QUEUE="2")
    with server.client() as client:
        cases = [
            (client.post("/invoke/echo", content=b"{nope"), 400, "invalid-json"),
            (client.post("/invoke/nope", json={}), 404, "unknown-handler"),
            (client.get("/jobs/doesnotexist"), 404, "unknown-job"),
            (client.delete("/jobs/doesnotexist"), 404, "unknown-job"),
            (client.post("/invoke/echo", content=b"[" + b"1," * 1000 + b"1]"), 413, "too-large"),
            (client.post("/invoke/echo", json={}, headers={"Prefer": "wait=soon"}), 400, "prefer"),
            (client.get("/jobs/x", params={"wait": "x"}), 400, "bad-request"),
            (client.post("/models/nope/load"), 404, "unknown-bundle"),
            (client.get("/no/such/route"), 404, "not-found"),
        ]
        for response, status, slug in cases:
            assert response.status_code == status, (slug, response.text)
            assert response.headers["content-type"] == PROBLEM
            body = response.json()
            assert body["status"] == status and slug in body["type"] and body["detail"]
        # A body above the limit without Content-Length (chunked) is cut off while streaming.
        chunked = client.post("/invoke/echo", content=iter([b"[" + b"0," * 600, b"0]"]))
        assert chunked.status_code == 413
        # Queue full: two long runs fill the queue of 2; the third is throttled.
        with (
            httpx.Client(base_url=server.url, timeout=30) as other,
            concurrent.futures.ThreadPoolExecutor(2) as pool,
        ):
            futures = [
                pool.submit(other.post, "/invoke/alpha", json={"sleep_s": 1.5}) for _ in range(2)
            ]
            time.sleep(0.7)
            throttled = client.post("/invoke/alpha", json={})
            assert throttled.status_code == 429
            assert throttled.headers["content-type"] == PROBLEM
            assert int(throttled.headers["retry-after"]) >= 1
            assert [f.result().status_code for f in futures] == [200, 200]
        assert client.get("/healthz").status_code == 200
        assert client.post("/invoke/alpha", json={}).status_code == 200


def test_handler_error_is_500_problem_and_job_error(serve: Any, bundles: Path) -> None:
    make_bundle(bundles, "alpha")
    server: ServerProcess = serve()
    with server.client() as client:
        response = client.post("/invoke/alpha", json={"sleep_s": "not a number"})
        assert response.status_code == 500
        problem = response.json()
        assert problem["type"].endswith("/handler-error") and "ValueError" in problem["detail"]
        job = client.post("/handlers/alpha/jobs", json={"sleep_s": "x"}).json()
        final = client.get(f"/jobs/{job['id']}", params={"wait": 10}).json()
        assert final["status"] == "failed"
        assert final["error"]["type"] == "handler-error"
        assert client.post("/invoke/alpha", json={}).status_code == 200


def test_respond_async_and_cancel(serve: Any, bundles: Path) -> None:
    make_bundle(bundles, "alpha")
    server: ServerProcess = serve()
    with server.client() as client:
        accepted = client.post("/invoke/alpha", json={}, headers={"Prefer": "respond-async"})
        assert accepted.status_code == 202
        assert accepted.headers["preference-applied"] == "respond-async"
        done = client.get(accepted.headers["location"], params={"wait": 20}).json()
        assert done["status"] == "succeeded"
        slow = client.post("/handlers/alpha/jobs", json={"sleep_s": 2}).json()
        cancelled = client.delete(f"/jobs/{slow['id']}").json()
        assert cancelled["status"] == "cancelled"
        time.sleep(2.5)
        after = client.get(f"/jobs/{slow['id']}").json()
        assert after["status"] == "cancelled" and "output" not in after
        # Cancelling a finished job changes nothing.
        assert client.delete(f"/jobs/{done['id']}").json()["status"] == "succeeded"


def test_models_load_unload_and_metrics(serve: Any, bundles: Path) -> None:
    make_bundle(bundles, "alpha")
    server: ServerProcess = serve()
    with server.client() as client:
        assert client.post("/models/alpha/load").status_code == 202
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            models = {m["name"]: m for m in client.get("/models").json()["models"]}
            if models["alpha"]["state"] == "ready":
                break
            time.sleep(0.05)
        assert models["alpha"]["state"] == "ready"
        assert client.post("/invoke/alpha", json={}).status_code == 200
        unloaded = client.delete("/models/alpha").json()
        assert unloaded["state"] == "unloaded"
        assert client.post("/invoke/alpha", json={}, headers={"Prefer": "wait=30"}).json()
        text = client.get("/metrics").text
        for metric in (
            "thaw_load_phase_seconds_bucket",
            'thaw_invocations_total{handler="alpha",outcome="sync"}',
            'thaw_cache_events_total{bundle="alpha",event="hit"}',
            'thaw_cache_events_total{bundle="alpha",event="miss"}',
            "thaw_queue_depth",
            "thaw_estimate_error_seconds",
        ):
            assert metric in text, metric
