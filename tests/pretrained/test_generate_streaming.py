"""`generate` streamed over real HTTP from a real `thaw serve` with SmolLM2.

The budget admits one request at a time, so the memory slot a stream holds is
visible (`in_flight`) and a second request can run only once it is freed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.http.test_streaming import SSE, collect, read_events
from tests.support import ServerProcess

PROMPT = {"messages": [{"role": "user", "content": "Tell me about Paris."}], "max_tokens": 24}


@pytest.fixture(scope="module")
def server(
    smollm2_bundle: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    import os

    root = tmp_path_factory.mktemp("generate-streaming")
    memory = json.loads((smollm2_bundle / "bundle.json").read_text())["memory"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "AWS_LAMBDA"))}
    env.update(
        {
            "THAW_CACHE_DIR": str(root / "cache"),
            "THAW_STATE_DIR": str(root / "state"),
            "THAW_JOB_STORE": f"sqlite:///{root / 'jobs.sqlite3'}",
            "THAW_BUNDLE_SOURCE": str(smollm2_bundle.parent),
            "THAW_HANDLERS": "handlers.generate",
            "THAW_MEMORY_BUDGET": str(memory["weights_bytes"] + memory["per_request_bytes"]),
            "THAW_PREWARM": "smollm2",
            "PYTHONUNBUFFERED": "1",
        }
    )
    with ServerProcess(env) as started, started.client(timeout=300) as client:
        for _ in range(2400):
            if client.get("/readyz").status_code == 200:
                break
            time.sleep(0.1)
        yield started


def in_flight(server: ServerProcess) -> int:
    with server.client() as client:
        count: int = client.get("/models").json()["models"][0]["in_flight"]
        return count


def test_token_deltas_join_to_the_answer_a_plain_call_gets(server: ServerProcess) -> None:
    with server.client(timeout=300) as client:
        plain = client.post("/invoke/generate", json=PROMPT)
        with client.stream("POST", "/invoke/generate", json=PROMPT, headers=SSE) as response:
            assert response.status_code == 200
            events = collect(response)
    assert plain.status_code == 200
    answer = plain.json()
    deltas = [orjson.loads(e["data"]) for e in events if "id" in e]
    assert all(set(d) == {"text"} for d in deltas[:-1])
    assert "".join(d["text"] for d in deltas) == answer["text"]
    assert deltas[-1]["finish_reason"] == answer["finish_reason"]
    assert events[-1]["event"] == "result"
    assert orjson.loads(events[-1]["data"]) == answer


def test_a_stream_holds_its_memory_slot_until_its_client_goes(server: ServerProcess) -> None:
    # Counting never stops early: 256 tokens are seconds of work on a CPU.
    long = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 256}
    with (
        server.client(timeout=300) as client,
        client.stream("POST", "/invoke/generate", json=long, headers=SSE) as response,
    ):
        # Held, not dropped: closing the line iterator would close the response.
        events = read_events(response.iter_lines())
        assert [next(e for e in events if "id" in e) for _ in range(2)]
        assert in_flight(server) == 1
    # Disconnected: the slot is freed, and the one-request budget admits the next call.
    for _ in range(3000):
        if in_flight(server) == 0:
            break
        time.sleep(0.01)
    assert in_flight(server) == 0
    with server.client(timeout=300) as client:
        assert client.post("/invoke/generate", json={**PROMPT, "max_tokens": 4}).status_code == 200
