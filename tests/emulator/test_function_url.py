"""The HTTP contract through the emulator's Function URL paths."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.emulator.conftest import Emulator

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)


def test_invoke_echo_through_the_function_url(emulator: Emulator) -> None:
    with emulator.client() as client:
        response = client.post(
            "/invoke/echo?lang=en",
            json={"text": "hi"},
            headers={"x-request-id": "url-1", "cookie": "a=1; b=2"},
        )
    assert response.status_code == 200
    assert response.json() == {"text": "hi"}
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"] == "url-1"
    assert "run;dur=" in response.headers["server-timing"]


def test_contract_errors_keep_their_status_and_problem(emulator: Emulator) -> None:
    with emulator.client() as client:
        missing = client.post("/invoke/no-such-handler", json={})
        healthy = client.get("/healthz")
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/problem+json"
    assert missing.json()["type"].endswith("/unknown-handler")
    assert healthy.status_code == 200


def poll_job(client: httpx.Client, location: str, timeout_s: float = 30.0) -> dict[str, object]:
    """GET the job until it is final; a poll may land on any sandbox, or be throttled."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = client.get(location, params={"wait": "2"})
        if response.status_code == 429:
            time.sleep(0.2)
            continue
        assert response.status_code == 200, response.text
        job: dict[str, object] = response.json()
        if job["status"] in {"succeeded", "failed", "cancelled"}:
            return job
    raise AssertionError(f"job {location} did not finish")


def test_cold_model_answers_202_and_the_job_completes(emulator: Emulator) -> None:
    with emulator.client() as client:
        accepted = client.post("/invoke/predict", json={"x": 3}, headers={"prefer": "wait=0.1"})
        assert accepted.status_code == 202, accepted.text
        location = accepted.headers["location"]
        assert location == f"/jobs/{accepted.json()['id']}"
        assert int(accepted.headers["retry-after"]) >= 1
        job = poll_job(client, location)
    assert job["status"] == "succeeded", job
    assert isinstance(job["output"], dict) and "y" in job["output"]
