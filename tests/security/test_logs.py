"""No secrets or payloads in logs: the app in-process, JSON logging, requests that carry
distinctive strings in credentials, bodies and outputs (including failing ones),
and a log that must hold none of them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.inproc import captured_logs, serving
from tests.security.conftest import bearer, light_settings

KEY = "KEY-8f3d2a9c4b7e6f10"
WRONG_KEY = "WRONG-KEY-1d9e7c5a3b"
BODY_MARK = "PAYLOAD-MARK-63b1e0d4"
ERROR_MARK = "ERROR-MARK-a4f29c7e"
SECRETS = (KEY, WRONG_KEY, BODY_MARK, ERROR_MARK)
BASE_FIELDS = {"ts", "level", "logger", "msg"}
HANDLERS = ("handlers.echo", "tests.handlers.raises", "tests.handlers.sleepy")

# Where the app kept its state, its log as JSON objects, and as text.
ServerLog = tuple[Path, list[dict[str, Any]], str]


async def requests_with_marks(client: httpx.AsyncClient) -> None:
    auth = bearer(KEY)
    # Successful, with the mark in the body and so in the output.
    assert (await client.post("/invoke/echo", json={"text": BODY_MARK}, headers=auth)).is_success
    # Wrong and malformed credentials.
    wrong = await client.post("/invoke/echo", json={}, headers=bearer(WRONG_KEY))
    assert wrong.status_code == 401
    headers = {"Authorization": f"Basic {WRONG_KEY}"}
    assert (await client.get("/models", headers=headers)).status_code == 401
    # Handler errors whose message is the caller's input, sync and as a job.
    event = {"message": ERROR_MARK}
    assert (await client.post("/invoke/raises", json=event, headers=auth)).status_code == 500
    job = (await client.post("/handlers/raises/jobs", json=event, headers=auth)).json()
    polled = await client.get(f"/jobs/{job['id']}", params={"wait": 10}, headers=auth)
    assert polled.json()["status"] == "failed"
    # Invalid JSON, an over-deep body, a bad Prefer, an unknown handler, all marked.
    bad_json = f'{{"x": "{BODY_MARK}"'.encode()
    assert (await client.post("/invoke/echo", content=bad_json, headers=auth)).status_code == 400
    deep = ("[" * 70 + f'"{BODY_MARK}"' + "]" * 70).encode()
    assert (await client.post("/invoke/echo", content=deep, headers=auth)).status_code == 400
    prefer = {**auth, "Prefer": f"wait={BODY_MARK}"}
    assert (await client.post("/invoke/echo", json={}, headers=prefer)).status_code == 400
    assert (await client.post(f"/invoke/{BODY_MARK}", json={}, headers=auth)).status_code == 404
    # A job cancelled while it runs.
    sleeper = await client.post(
        "/handlers/sleepy/jobs", json={"s": 30, "m": BODY_MARK}, headers=auth
    )
    cancelled = await client.delete(f"/jobs/{sleeper.json()['id']}", headers=auth)
    assert cancelled.status_code == 200


async def serve_and_log(root: Path) -> str:
    """The log of an app (its lifespan included) that served `requests_with_marks`."""
    with captured_logs() as logs:
        async with serving(light_settings(root, api_keys=(KEY,), handlers=HANDLERS)) as served:
            await requests_with_marks(served.client)
            # The job followers write their lines as their jobs end.
            await served.instance.wait_idle()
    return logs.text


@pytest.fixture(scope="module")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> ServerLog:
    root = tmp_path_factory.mktemp("server")
    text = asyncio.run(serve_and_log(root))
    lines = [orjson.loads(line) for line in text.splitlines() if line.strip()]
    return root, lines, text


def test_no_secret_or_payload_reaches_the_log(
    server_log: ServerLog,
) -> None:
    _, _, text = server_log
    for mark in SECRETS:
        assert mark not in text, f"{mark} leaked into the server log:\n{text}"


def test_every_line_is_one_json_object_with_the_base_fields(
    server_log: ServerLog,
) -> None:
    _, lines, text = server_log
    assert len(lines) == len([line for line in text.splitlines() if line.strip()])
    for entry in lines:
        assert set(entry) >= BASE_FIELDS, entry
        assert entry["level"] in {"debug", "info", "warning", "error", "critical"}


def test_failures_are_logged_by_type_and_place_not_message(
    server_log: ServerLog,
) -> None:
    _, lines, _ = server_log
    raised = [e for e in lines if e["logger"] == "thaw.dispatch" and "raised" in e["msg"]]
    assert raised, "a handler error left no log line"
    for entry in raised:
        assert "handler raises raised ValueError at " in entry["msg"]
        assert entry["msg"].rstrip().split(":")[-1].isdigit()  # file:line, never the message
    jobs = [e for e in lines if e["logger"] == "thaw.jobs"]
    assert any(e["msg"].endswith(" failed") for e in jobs), jobs


def test_request_and_job_lines_carry_their_ids_as_fields(
    server_log: ServerLog,
) -> None:
    _, lines, _ = server_log
    raised = [e for e in lines if e["logger"] == "thaw.dispatch" and "raised" in e["msg"]]
    assert raised and all(e.get("handler") == "raises" and e.get("request_id") for e in raised)
    finished = [e for e in lines if e["logger"] == "thaw.jobs"]
    assert finished and all(e.get("job_id") and e.get("status") for e in finished)
