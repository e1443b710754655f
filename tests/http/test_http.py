"""The HTTP contract in-process (tests/inproc.py): cold loads past the deadline,
single flight, problem+json answers, jobs, cancel, models, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from runtime.settings import Settings
from tests.handlers import loadlog
from tests.handlers.runlog import runs
from tests.inproc import serving, until
from tests.support import make_bundle

pytestmark = pytest.mark.anyio

PROBLEM = "application/problem+json"


def timing_phases(header: str) -> dict[str, float]:
    phases = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        phases[name] = float(dur)
    return phases


async def test_cold_load_past_deadline_gets_202_then_job_then_warm_200(
    app_settings: Settings, bundles: Path
) -> None:
    make_bundle(bundles, "alpha", config={"sleep_s": 2.0})
    async with serving(app_settings) as served:
        client = served.client
        response = await client.post("/invoke/alpha", json={}, headers={"Prefer": "wait=1"})
        assert response.status_code == 202, response.text
        job = response.json()
        assert response.headers["location"] == f"/jobs/{job['id']}"
        assert int(response.headers["retry-after"]) >= 1
        # The client asked for `wait`, not `respond-async` (RFC 7240).
        assert "preference-applied" not in response.headers
        assert job["status"] in ("running", "queued") and job["handler"] == "alpha"
        assert len(job["id"]) >= 22  # >= 128 bits, URL-safe
        polled = (await client.get(f"/jobs/{job['id']}", params={"wait": 20})).json()
        assert polled["status"] == "succeeded", polled
        assert polled["output"]["bundle"] == "alpha"
        warm = await client.post("/invoke/alpha", json={})
        assert warm.status_code == 200
        phases = timing_phases(warm.headers["server-timing"])
        assert set(phases) >= {"queue", "run"} and "load" not in phases
        models = (await client.get("/models")).json()["models"]
        alpha = next(m for m in models if m["name"] == "alpha")
        assert alpha["state"] == "ready" and alpha["loads"] == 1
        assert alpha["id"].startswith("alpha@sha256:")
        assert alpha["estimate"]["basis"] == "observed"
        assert set(alpha["phase_ms"]) >= {"fetch", "load", "init", "warmup"}


async def test_first_request_that_fits_pays_load_in_server_timing(
    app_settings: Settings, bundles: Path
) -> None:
    make_bundle(bundles, "alpha", config={"sleep_s": 0.3})
    async with serving(app_settings) as served:
        response = await served.client.post("/invoke/alpha", json={}, headers={"Prefer": "wait=30"})
        assert response.status_code == 200
        phases = timing_phases(response.headers["server-timing"])
        assert {"queue", "fetch", "load", "init", "warmup", "run"} <= set(phases)
        assert phases["init"] >= 300


async def test_64_concurrent_cold_requests_one_load(
    app_settings: Settings, bundles: Path, tmp_path: Path
) -> None:
    loads = tmp_path / "loads.log"
    make_bundle(bundles, "alpha", config={"sleep_s": 2.0, "log_file": str(loads)})
    async with serving(app_settings) as served:
        # All 64 are sent together, in one turn of the loop, well inside the load: a
        # short-deadline request sent after READY would rightly get 200.
        async def one(index: int) -> tuple[float, int]:
            wait = 0.3 if index % 2 else 30.0
            response = await served.client.post(
                "/invoke/alpha", json={}, headers={"Prefer": f"wait={wait}"}
            )
            return wait, response.status_code

        results = await asyncio.gather(*(one(index) for index in range(64)))
    assert {code for wait, code in results if wait == 30.0} == {200}
    assert {code for wait, code in results if wait == 0.3} == {202}
    assert len(loads.read_text().splitlines()) == 1


async def test_bad_input_gets_problem_json_and_server_stays_healthy(
    app_settings: Settings, bundles: Path
) -> None:
    make_bundle(bundles, "alpha")
    settings = dataclasses.replace(app_settings, max_body_bytes=1000, max_queue=2)
    async with serving(settings) as served:
        client = served.client
        cases = [
            (await client.post("/invoke/echo", content=b"{nope"), 400, "invalid-json"),
            (await client.post("/invoke/nope", json={}), 404, "unknown-handler"),
            (await client.get("/jobs/doesnotexist"), 404, "unknown-job"),
            (await client.delete("/jobs/doesnotexist"), 404, "unknown-job"),
            (
                await client.post("/invoke/echo", content=b"[" + b"1," * 1000 + b"1]"),
                413,
                "too-large",
            ),
            (
                await client.post("/invoke/echo", json={}, headers={"Prefer": "wait=soon"}),
                400,
                "prefer",
            ),
            (await client.get("/jobs/x", params={"wait": "x"}), 400, "bad-request"),
            (await client.post("/models/nope/load"), 404, "unknown-bundle"),
            (await client.get("/no/such/route"), 404, "not-found"),
        ]
        for response, status, slug in cases:
            assert response.status_code == status, (slug, response.text)
            assert response.headers["content-type"] == PROBLEM
            body = response.json()
            assert body["status"] == status and slug in body["type"] and body["detail"]

        # A body above the limit without Content-Length (chunked) is cut off while streaming.
        async def pieces() -> AsyncIterator[bytes]:
            yield b"[" + b"0," * 600
            yield b"0]"

        chunked = await client.post("/invoke/echo", content=pieces())
        assert chunked.status_code == 413
        # Queue full: two held runs fill the queue of 2; the third is throttled.
        loadlog.HOLD.clear()
        try:
            async with served.new_client() as other:
                long_runs = [
                    asyncio.ensure_future(other.post("/invoke/alpha", json={"hold": True}))
                    for _ in range(2)
                ]
                await until(
                    lambda: served.instance.dispatcher.pending["alpha"] == 2, "both runs queued"
                )
                throttled = await client.post("/invoke/alpha", json={})
                assert throttled.status_code == 429
                assert throttled.headers["content-type"] == PROBLEM
                assert int(throttled.headers["retry-after"]) >= 1
                loadlog.HOLD.set()
                assert [(await run).status_code for run in long_runs] == [200, 200]
        finally:
            loadlog.HOLD.set()
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.post("/invoke/alpha", json={})).status_code == 200


async def test_handler_error_is_500_problem_and_job_error(
    app_settings: Settings, bundles: Path
) -> None:
    make_bundle(bundles, "alpha")
    async with serving(app_settings) as served:
        client = served.client
        response = await client.post("/invoke/alpha", json={"sleep_s": "not a number"})
        assert response.status_code == 500
        problem = response.json()
        assert problem["type"].endswith("/handler-error") and "ValueError" in problem["detail"]
        job = (await client.post("/handlers/alpha/jobs", json={"sleep_s": "x"})).json()
        final = (await client.get(f"/jobs/{job['id']}", params={"wait": 10})).json()
        assert final["status"] == "failed"
        assert final["error"]["type"] == "handler-error"
        assert (await client.post("/invoke/alpha", json={})).status_code == 200


async def test_respond_async_and_cancel(
    app_settings: Settings, bundles: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_bundle(bundles, "alpha")
    run_log, hold = tmp_path / "runs.log", tmp_path / "hold"
    monkeypatch.setenv("THAW_TEST_RUN_LOG", str(run_log))  # the fixture handler's log
    settings = dataclasses.replace(
        app_settings, handlers=(*app_settings.handlers, "tests.handlers.runlog")
    )
    async with serving(settings) as served:
        client = served.client
        accepted = await client.post("/invoke/alpha", json={}, headers={"Prefer": "respond-async"})
        assert accepted.status_code == 202
        assert accepted.headers["preference-applied"] == "respond-async"
        done = (await client.get(accepted.headers["location"], params={"wait": 20})).json()
        assert done["status"] == "succeeded"
        # Held running until the test lets it go, so the cancel comes mid-run.
        hold.touch()
        event = {"tag": "slow", "hold": str(hold)}
        slow = (await client.post("/handlers/logged/jobs", json=event)).json()
        await until(lambda: runs(run_log, "slow"), "the slow job started")
        cancelled = (await client.delete(f"/jobs/{slow['id']}")).json()
        assert cancelled["status"] == "cancelled"
        hold.unlink()  # the handler's thread now returns its output: nobody takes it
        await until(lambda: "slow end" in run_log.read_text(), "the slow job's run ended")
        await served.instance.wait_idle()
        after = (await client.get(f"/jobs/{slow['id']}")).json()
        assert after["status"] == "cancelled" and "output" not in after
        # Cancelling a finished job changes nothing.
        assert (await client.delete(f"/jobs/{done['id']}")).json()["status"] == "succeeded"


async def test_models_load_unload_and_metrics(app_settings: Settings, bundles: Path) -> None:
    make_bundle(bundles, "alpha")
    async with serving(app_settings) as served:
        client = served.client
        assert (await client.post("/models/alpha/load")).status_code == 202

        async def alpha_state_is(state: str) -> bool:
            models = (await client.get("/models")).json()["models"]
            return bool(next(m for m in models if m["name"] == "alpha")["state"] == state)

        await until(lambda: alpha_state_is("ready"), "alpha became ready")
        assert (await client.post("/invoke/alpha", json={})).status_code == 200
        unloaded = (await client.delete("/models/alpha")).json()
        assert unloaded["state"] == "unloaded"
        reloaded = await client.post("/invoke/alpha", json={}, headers={"Prefer": "wait=30"})
        assert reloaded.json()
        text = (await client.get("/metrics")).text
        for metric in (
            "thaw_load_phase_seconds_bucket",
            'thaw_invocations_total{handler="alpha",outcome="sync"}',
            'thaw_cache_events_total{bundle="alpha",event="hit"}',
            'thaw_cache_events_total{bundle="alpha",event="miss"}',
            "thaw_queue_depth",
            "thaw_estimate_error_seconds",
        ):
            assert metric in text, metric


async def test_a_polls_wait_is_read_from_its_query_as_any_query_parameter(
    app_settings: Settings,
) -> None:
    """`?wait=` on a job poll: a plain query string is read without a multi-dict (the
    poll's fast path), one with escapes as Starlette decodes it; both agree on what
    is a number, blank or repeated (the last one counts)."""
    settings = dataclasses.replace(app_settings, handlers=("handlers.echo",))
    async with serving(settings) as served:
        client = served.client
        job_id = (await client.post("/handlers/echo/jobs", json={"n": 1})).json()["id"]
        cases = {
            "wait=0.5": 200,
            "x=1&wait=0": 200,
            "wait=abc&wait=0": 200,
            "": 200,
            "wait=abc": 400,
            "wait": 400,
            "wait=": 400,
            "wait=-1": 400,
            "wait=nan": 400,
            "wait=0&wait=abc": 400,
            "w%61it=abc": 400,  # escaped: decoded as Starlette decodes it
            "wait=%30": 200,
            "wait=1+": 200,  # "+" is a space, and float() takes " 1 "
        }
        for query, status in cases.items():
            reply = await client.get(f"/jobs/{job_id}?{query}")
            assert reply.status_code == status, (query, reply.text)
            if status == 200:
                assert reply.json()["status"] == "succeeded"
            else:
                assert reply.headers["content-type"] == PROBLEM
