"""Lambda's limits and codes in `thaw emulate`, through boto3 and the Function URL, so
that what works locally does not fail once deployed (runtime/aws/limits.py):

- a request over the limit of its invocation type: 413 RequestEntityTooLargeException,
  with the message AWS gives each (Event has its own, and a 1 MB limit);
- a buffered response over 6 MB from any runtime: refused as Lambda refuses it
  (the runtime 413, the caller Function.ResponseSizeTooLarge; the Function URL 502);
  Thaw's own loop says so before Lambda would, and points to a stream, which
  carries it;
- START lines and AWS_LAMBDA_FUNCTION_VERSION name the version invoked;
- a stream cut by the Timeout ends as a buffered timeout does: Sandbox.Timedout.

An emulator of its own, with a template of its own.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from botocore.exceptions import ClientError

from runtime.aws import limits
from tests.emulator.conftest import Emulator, emulator_env, wait_for
from tests.emulator.test_invoke_api import lambda_client

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

TEMPLATE = """
AWSTemplateFormatVersion: "2010-09-09"
Transform: AWS::Serverless-2016-10-31
Resources:
  Thaw:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      Timeout: 60
      MemorySize: 512
      AutoPublishAlias: live
      Environment:
        Variables:
          THAW_HANDLERS: tests.handlers.sized,tests.handlers.ticks
  Short:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      Timeout: 1
      Environment:
        Variables:
          THAW_HANDLERS: tests.handlers.ticks
          THAW_INVOKE_MODE: RESPONSE_STREAM
  Foreign:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      Timeout: 60
      AutoPublishAlias: live
      FunctionUrlConfig: {AuthType: NONE}
      Environment:
        Variables:
          THAW_HANDLERS: tests.emulator.foreign_runtime
          FOREIGN_MODE: serve
  ForeignShort:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      Timeout: 1
      Environment:
        Variables:
          THAW_HANDLERS: tests.emulator.foreign_runtime
          FOREIGN_MODE: serve
"""
OVER = limits.MAX_RESPONSE_BYTES + 1000
_START = re.compile(r"^START RequestId: (\S+) Version: (\S+)$", re.M)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    root = tmp_path_factory.mktemp("emulator-limits")
    template = root / "template.yaml"
    template.write_text(TEMPLATE)
    emu = Emulator(root, emulator_env(root), "--max-sandboxes", "2", template=template)
    yield emu
    emu.stop()


def invoke(emulator: Emulator, function: str, event: Any, **kw: Any) -> dict[str, Any]:
    answer: dict[str, Any] = lambda_client(emulator).invoke(
        FunctionName=function, Payload=orjson.dumps(event), **kw
    )
    answer["body"] = orjson.loads(answer["Payload"].read())
    return answer


def json_of_size(size: int) -> bytes:
    """A JSON document (a string) of exactly `size` bytes."""
    return b'"' + b"x" * (size - 2) + b'"'


# ---- requests ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("invocation_type", "size", "message"),
    [
        (
            "RequestResponse",
            limits.MAX_SYNC_REQUEST_BYTES + 1,
            "Request must be smaller than 6291456 bytes for the InvokeFunction operation",
        ),
        (
            "Event",
            limits.MAX_EVENT_REQUEST_BYTES + 1,
            "1048577 byte payload is too large for the Event invocation type (limit 1048576 bytes)",
        ),
    ],
)
def test_a_request_over_its_limit_is_refused_with_the_words_aws_uses(
    emulator: Emulator, invocation_type: str, size: int, message: str
) -> None:
    with pytest.raises(ClientError) as refused:
        lambda_client(emulator).invoke(
            FunctionName="Foreign", InvocationType=invocation_type, Payload=json_of_size(size)
        )
    error = refused.value.response
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 413
    assert error["Error"]["Code"] == "RequestEntityTooLargeException"
    assert error["Error"]["Message"] == message


def test_a_request_at_its_limit_is_taken(emulator: Emulator) -> None:
    client = lambda_client(emulator)
    event = client.invoke(
        FunctionName="Foreign",
        InvocationType="Event",
        Payload=json_of_size(limits.MAX_EVENT_REQUEST_BYTES),
    )
    assert event["StatusCode"] == 202
    # Past Event's limit, but within a synchronous one's.
    sync = client.invoke(
        FunctionName="Foreign", Payload=json_of_size(limits.MAX_EVENT_REQUEST_BYTES + 1)
    )
    assert sync["StatusCode"] == 200 and "FunctionError" not in sync


# ---- responses ---------------------------------------------------------------


def test_a_foreign_runtimes_oversized_response_is_refused_as_lambda_refuses_it(
    emulator: Emulator,
) -> None:
    answer = invoke(emulator, "Foreign", {"pad_bytes": OVER}, LogType="Tail")
    assert answer["StatusCode"] == 200
    assert answer["FunctionError"] == "Unhandled"
    assert answer["body"]["errorType"] == "Function.ResponseSizeTooLarge"
    assert re.fullmatch(
        r"Response payload size \(\d+ bytes\) exceeded maximum allowed payload size "
        r"\(6291556 bytes\)\.",
        answer["body"]["errorMessage"],
    )
    # The runtime was told as Lambda's Runtime API tells it.
    log = base64.b64decode(answer["LogResult"]).decode()
    refused = orjson.loads(log.split("response post: 413 ", 1)[1].splitlines()[0])
    assert refused == {
        "errorMessage": "Exceeded maximum allowed payload size (6291556 bytes).",
        "errorType": "RequestEntityTooLarge",
    }


def test_a_response_within_the_limit_is_answered_whole(emulator: Emulator) -> None:
    answer = invoke(emulator, "Foreign", {"pad_bytes": 5 * 1024 * 1024})
    assert "FunctionError" not in answer
    assert len(answer["body"]["pad"]) == 5 * 1024 * 1024


def test_the_function_url_answers_an_oversized_buffered_response_with_a_502(
    emulator: Emulator,
) -> None:
    with emulator.client() as client:
        response = client.get("/anything", params={"pad_bytes": OVER})
    assert response.status_code == 502
    assert response.json() == {"Message": "Internal Server Error"}
    assert response.headers["x-amz-function-error"] == "Function.ResponseSizeTooLarge"


def test_thaws_loop_refuses_an_oversized_buffered_answer_and_names_the_stream(
    emulator: Emulator,
) -> None:
    answer = invoke(emulator, "Thaw", {"handler": "sized", "input": {"bytes": OVER}})
    assert answer["FunctionError"] == "Unhandled"
    assert answer["body"]["errorType"] == "response-too-large"
    message = answer["body"]["errorMessage"]
    assert str(limits.MAX_RESPONSE_BYTES) in message and '"stream": true' in message
    # Within the limit, the same handler answers.
    small = invoke(emulator, "Thaw", {"handler": "sized", "input": {"bytes": 10}})
    assert small["body"] == {"output": {"blob": "x" * 10}}


def test_a_stream_carries_what_a_buffered_answer_cannot(emulator: Emulator) -> None:
    event = {"handler": "sized_stream", "input": {"bytes": 2 * 1024 * 1024, "chunks": 4}}
    answer = lambda_client(emulator).invoke_with_response_stream(
        FunctionName="Thaw", Payload=orjson.dumps({**event, "stream": True})
    )
    chunks, complete = [], {}
    for message in answer["EventStream"]:
        if "PayloadChunk" in message:
            chunks.append(message["PayloadChunk"]["Payload"])
        else:
            complete = message.get("InvokeComplete", {})
    streamed = b"".join(chunks)
    assert len(streamed) > limits.MAX_RESPONSE_BYTES
    assert "ErrorCode" not in complete
    lines = [orjson.loads(line) for line in streamed.splitlines() if line]
    assert len(lines[-1]["output"]) == 4
    # A plain Invoke of the same stream is buffered, and held to the buffered limit.
    buffered = invoke(emulator, "Thaw", {**event, "stream": True})
    assert buffered["FunctionError"] == "Unhandled"
    assert buffered["body"]["errorType"] == "Function.ResponseSizeTooLarge"


# ---- versions ----------------------------------------------------------------


def _start_versions(log_result: str) -> dict[str, str]:
    return dict(_START.findall(base64.b64decode(log_result).decode()))


@pytest.mark.parametrize(
    ("kw", "version"),
    [({}, "$LATEST"), ({"Qualifier": "live"}, "1"), ({"Qualifier": "1"}, "1")],
)
def test_the_version_invoked_is_the_one_named_everywhere(
    emulator: Emulator, kw: dict[str, str], version: str
) -> None:
    answer = invoke(emulator, "Thaw", {"handler": "version", "input": {}}, LogType="Tail", **kw)
    assert answer["ExecutedVersion"] == version
    assert answer["body"] == {"output": {"version": version}}
    request_id = answer["ResponseMetadata"]["HTTPHeaders"]["x-amzn-requestid"]
    assert _start_versions(answer["LogResult"]) == {request_id: version}


def test_the_function_url_runs_the_version_its_alias_names(emulator: Emulator) -> None:
    # SAM puts the URL of a function with AutoPublishAlias on that alias.
    with emulator.client() as client:
        response = client.get("/which")
    assert response.status_code == 200
    assert response.json()["version"] == "1"
    # The URL's request id is the invocation's, as its REPORT shows.
    request_id = response.headers["x-amzn-requestid"]
    wait_for(lambda: request_id in emulator.reports())


# ---- timeouts ----------------------------------------------------------------


def test_a_stream_cut_by_the_timeout_ends_as_a_buffered_timeout_does(emulator: Emulator) -> None:
    buffered = invoke(emulator, "ForeignShort", {"sleep_s": 5})
    assert buffered["FunctionError"] == "Unhandled"
    assert buffered["body"]["errorType"] == "Sandbox.Timedout"
    assert buffered["body"]["errorMessage"].endswith("Task timed out after 1.00 seconds")

    event = {"handler": "ticks", "input": {"n": 1000, "gap_s": 0.05}, "stream": True}
    answer = lambda_client(emulator).invoke_with_response_stream(
        FunctionName="Short", Payload=orjson.dumps(event)
    )
    request_id = answer["ResponseMetadata"]["HTTPHeaders"]["x-amzn-requestid"]
    chunks, complete = [], {}
    for message in answer["EventStream"]:
        if "PayloadChunk" in message:
            chunks.append(message["PayloadChunk"]["Payload"])
        else:
            complete = message.get("InvokeComplete", {})
    assert chunks  # it streamed before the timeout cut it
    assert complete["ErrorCode"] == "Sandbox.Timedout"
    assert complete["ErrorDetails"] == f"{request_id} Task timed out after 1.00 seconds"
    assert emulator.report(request_id).fields["Status"] == "timeout"

    # A plain Invoke of the same stream: the function error of a buffered timeout.
    plain = invoke(emulator, "Short", event)
    assert plain["FunctionError"] == "Unhandled"
    assert plain["body"]["errorType"] == "Sandbox.Timedout"
    assert plain["body"]["errorMessage"].endswith("Task timed out after 1.00 seconds")
