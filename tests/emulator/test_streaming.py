"""Response streaming through `thaw emulate`: boto3's InvokeWithResponseStream, the
Function URL in RESPONSE_STREAM mode, and the Runtime API's chunked responses with
error trailers, from Thaw's own Lambda loop and from a hand-written stdlib runtime.

An emulator of its own: a template whose functions stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from tests.emulator.conftest import Emulator, emulator_env
from tests.emulator.test_invoke_api import lambda_client
from tests.http.test_streaming import SSE, collect

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

TEMPLATE = """
AWSTemplateFormatVersion: "2010-09-09"
Transform: AWS::Serverless-2016-10-31
Resources:
  Streamer:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      Timeout: 30
      FunctionUrlConfig: {AuthType: NONE, InvokeMode: RESPONSE_STREAM}
      Environment:
        Variables:
          THAW_HANDLERS: tests.handlers.ticks
          THAW_INVOKE_MODE: RESPONSE_STREAM
  HandWritten:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      Timeout: 30
      Environment:
        Variables:
          THAW_HANDLERS: tests.emulator.streaming_runtime
          STREAMING_RUNTIME: serve
"""


@pytest.fixture(scope="module")
def streaming_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    root = tmp_path_factory.mktemp("emulator-streaming")
    template = root / "template.yaml"
    template.write_text(TEMPLATE)
    emu = Emulator(root, emulator_env(root), "--max-sandboxes", "2", template=template)
    yield emu
    emu.stop()


def read_stream(
    emulator: Emulator, function: str, event: Any
) -> tuple[list[bytes], dict[str, Any]]:
    """boto3's InvokeWithResponseStream: the PayloadChunk payloads, and InvokeComplete."""
    answer = lambda_client(emulator).invoke_with_response_stream(
        FunctionName=function, Payload=orjson.dumps(event)
    )
    assert answer["StatusCode"] == 200
    chunks: list[bytes] = []
    complete: dict[str, Any] | None = None
    for event_ in answer["EventStream"]:
        assert complete is None, "InvokeComplete is the last event"
        if "PayloadChunk" in event_:
            chunks.append(event_["PayloadChunk"]["Payload"])
        else:
            complete = event_["InvokeComplete"]
    assert complete is not None
    return chunks, complete


def lines(chunks: list[bytes]) -> list[Any]:
    return [orjson.loads(line) for line in b"".join(chunks).splitlines()]


def test_boto3_reads_each_item_then_the_output(streaming_emulator: Emulator) -> None:
    event = {"handler": "ticks", "input": {"n": 3, "gap_s": 0.2}, "stream": True}
    chunks, complete = read_stream(streaming_emulator, "Streamer", event)
    assert lines(chunks) == [
        {"text": "t0 "},
        {"text": "t1 "},
        {"text": "t2 "},
        {"output": {"text": "t0 t1 t2 ", "ticks": 3}},
    ]
    # Streamed as made: the ticks did not arrive as one buffered payload.
    assert len(chunks) >= 3
    assert "ErrorCode" not in complete


def test_boto3_reads_a_failure_midway_as_invoke_complete_error(
    streaming_emulator: Emulator,
) -> None:
    event = {"handler": "ticks", "input": {"n": 5, "fail_at": 2}, "stream": True}
    chunks, complete = read_stream(streaming_emulator, "Streamer", event)
    assert lines(chunks) == [{"text": "t0 "}, {"text": "t1 "}]
    # errorType of an exception raised by the handler's own code: its class (render.py).
    assert complete["ErrorCode"] == "RuntimeError"
    assert "tick 2 failed" in complete["ErrorDetails"]


def test_boto3_reads_an_answer_that_did_not_stream_as_one_chunk(
    streaming_emulator: Emulator,
) -> None:
    chunks, complete = read_stream(
        streaming_emulator, "Streamer", {"handler": "ticks", "input": {"n": 2}}
    )
    assert lines(chunks) == [{"output": {"text": "t0 t1 ", "ticks": 2}}]
    assert "ErrorCode" not in complete


def test_a_plain_invoke_of_a_streamed_answer_gets_it_whole(streaming_emulator: Emulator) -> None:
    event = {"handler": "ticks", "input": {"n": 2}, "stream": True}
    answer = streaming_emulator.invoke("Streamer", orjson.dumps(event))
    assert answer.status_code == 200
    assert [orjson.loads(line) for line in answer.content.splitlines()][-1] == {
        "output": {"text": "t0 t1 ", "ticks": 2}
    }


def test_the_function_url_streams_server_sent_events(streaming_emulator: Emulator) -> None:
    with (
        streaming_emulator.client() as client,
        client.stream("POST", "/invoke/ticks", json={"n": 3, "gap_s": 0.1}, headers=SSE) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert "x-amzn-requestid" in r.headers
        events = collect(r)
    assert [e.get("id") for e in events] == ["0", "1", "2", None]
    assert orjson.loads(events[-1]["data"]) == {"text": "t0 t1 t2 ", "ticks": 3}


def test_the_function_url_answers_plain_requests_through_the_stream_too(
    streaming_emulator: Emulator,
) -> None:
    with streaming_emulator.client() as client:
        answer = client.post("/invoke/ticks", json={"n": 2})
        missing = client.post("/invoke/nope", json={})
    assert answer.status_code == 200
    assert answer.json() == {"text": "t0 t1 ", "ticks": 2}
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/problem+json"


def test_the_runtime_api_takes_chunks_and_error_trailers(streaming_emulator: Emulator) -> None:
    """A stdlib runtime's chunked response, its chunks as PayloadChunks, its trailers
    as InvokeComplete's error; a plain invoke of it gets the chunks joined, or the error."""
    chunks, complete = read_stream(
        streaming_emulator, "HandWritten", {"chunks": ["one ", "two ", "three"], "gap_s": 0.1}
    )
    assert chunks == [b"one ", b"two ", b"three"]
    assert "ErrorCode" not in complete
    chunks, complete = read_stream(
        streaming_emulator, "HandWritten", {"chunks": ["half"], "error": "Boom"}
    )
    assert chunks == [b"half"]
    assert complete["ErrorCode"] == "Boom"
    assert complete["ErrorDetails"] == "Boom midway"
    plain = streaming_emulator.invoke("HandWritten", orjson.dumps({"chunks": ["a", "b"]}))
    assert plain.status_code == 200
    assert plain.content == b"ab"
    failed = streaming_emulator.invoke(
        "HandWritten", orjson.dumps({"chunks": ["a"], "error": "Boom"})
    )
    assert failed.headers["x-amz-function-error"] == "Unhandled"
    assert failed.json() == {"errorType": "Boom", "errorMessage": "Boom midway"}
