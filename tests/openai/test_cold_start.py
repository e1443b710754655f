"""The deadline rule for clients that cannot take a 202: an unmodified `openai` client,
at its defaults but with a timeout shorter than the load, ends a cold call in a
successful answer. The server answers each attempt before the client's timeout
(503 `warming-up` with Retry-After / retry-after-ms, which the client waits out
and retries by itself), the load goes on between attempts, and it runs once.

Every attempt the client sends is seen answered (event hooks on its own HTTP
client): none timed out. The deadline the server applies is the client's own
X-Stainless-Read-Timeout, which these tests set below the load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from tests.inproc import listening
from tests.openai.conftest import openai_settings
from tests.support import make_bundle

pytestmark = pytest.mark.anyio

LOAD_S = 4.0


class Attempts:
    """What the client sent and what came back, attempt by attempt."""

    def __init__(self) -> None:
        self.sent: list[dict[str, str]] = []
        self.answers: list[tuple[int, dict[str, str]]] = []

    async def request(self, request: httpx2.Request) -> None:
        self.sent.append(dict(request.headers))

    async def response(self, response: httpx2.Response) -> None:
        self.answers.append((response.status_code, dict(response.headers)))

    def client(self, url: str, timeout_s: float) -> openai.AsyncOpenAI:
        hooks: Any = {"request": [self.request], "response": [self.response]}
        return openai.AsyncOpenAI(
            base_url=f"{url}/v1",
            api_key="k",
            timeout=timeout_s,
            http_client=openai.DefaultAsyncHttpxClient(event_hooks=hooks),
        )


def cold_settings(root: Path, **overrides: Any) -> Any:
    load_log = root / "loads.log"
    make_bundle(root / "bundles", "lexicon", config={"sleep_s": LOAD_S, "load_log": str(load_log)})
    return openai_settings(root, **overrides), load_log


def check_attempts(attempts: Attempts, timeout_s: float) -> None:
    statuses = [status for status, _ in attempts.answers]
    # Every attempt answered (none timed out), the last with the answer.
    assert len(attempts.answers) == len(attempts.sent) >= 2, statuses
    assert statuses[-1] == 200 and set(statuses[:-1]) == {503}, statuses
    for sent in attempts.sent:
        assert float(sent["x-stainless-read-timeout"]) == timeout_s
    for _status, headers in attempts.answers[:-1]:
        assert float(headers["retry-after-ms"]) > 0 and int(headers["retry-after"]) >= 1
        assert headers["x-request-id"]


@pytest.mark.slow  # waits out the client's timeout
async def test_a_cold_embedding_past_the_clients_timeout_ends_in_its_answer(
    tmp_path: Path,
) -> None:
    # The estimate before any load (THAW's default init time) says the load outlasts
    # the timeout: the first attempt is answered at once.
    settings, load_log = cold_settings(tmp_path, default_init_s=LOAD_S)
    attempts = Attempts()
    async with listening(settings) as served, attempts.client(served.url, 1.5) as oa:
        done = await oa.embeddings.create(model="fake_embed", input="cold start")
        first = attempts.answers[0]
    assert done.data[0].embedding == [10.0, 2.0, 0.5]
    check_attempts(attempts, 1.5)
    assert first[1]["content-type"] == "application/json"
    assert len(load_log.read_text().splitlines()) == 1  # loaded once, for every attempt


async def test_a_wrong_estimate_is_cut_off_before_the_clients_timeout(tmp_path: Path) -> None:
    # The estimate says the load fits, so the first attempt waits: for as long as the
    # client's timeout allows, and no longer.
    settings, load_log = cold_settings(tmp_path, default_init_s=0.01)
    attempts = Attempts()
    async with listening(settings) as served, attempts.client(served.url, 2.5) as oa:
        done = await oa.chat.completions.create(
            model="fake_chat", messages=[{"role": "user", "content": "warm now"}]
        )
    assert done.choices[0].message.content == "warm now"
    check_attempts(attempts, 2.5)
    assert len(load_log.read_text().splitlines()) == 1


@pytest.mark.slow  # waits out the client's timeout
async def test_a_cold_stream_is_retried_the_same_way(tmp_path: Path) -> None:
    settings, _load_log = cold_settings(tmp_path, default_init_s=LOAD_S)
    attempts = Attempts()
    async with listening(settings) as served, attempts.client(served.url, 1.5) as oa:
        stream = await oa.chat.completions.create(
            model="fake_chat", messages=[{"role": "user", "content": "a b"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "a b"
    check_attempts(attempts, 1.5)


async def test_without_a_declared_timeout_thaws_default_wait_applies(tmp_path: Path) -> None:
    settings, _load_log = cold_settings(tmp_path, default_init_s=LOAD_S, wait_s=1.0)
    async with listening(settings) as served, served.client() as http:
        refused = await http.post("/v1/embeddings", json={"model": "fake_embed", "input": "x"})
        # A Prefer: wait (the Lambda loop's deadline) bounds it too.
        waited = await http.post(
            "/v1/embeddings",
            json={"model": "fake_embed", "input": "x"},
            headers={"Prefer": "wait=0.5", "X-Stainless-Read-Timeout": "600"},
        )
        # X-Stainless-Timeout (the whole call's, as Stainless clients send it) as well.
        timed = await http.post(
            "/v1/embeddings",
            json={"model": "fake_embed", "input": "x"},
            headers={"X-Stainless-Timeout": "0.25"},
        )
    for answer in (refused, waited, timed):
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "warming_up"
        assert answer.json()["error"]["type"] == "server_error"
        assert "retry-after-ms" in answer.headers
    assert "1 s deadline" in refused.json()["error"]["message"]
    assert "0.5 s deadline" in waited.json()["error"]["message"]
    assert "0.25 s deadline" in timed.json()["error"]["message"]
