"""The Invoke API as boto3 and the AWS CLI use it, against a real `thaw emulate`."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest
from botocore.exceptions import ClientError

from tests.emulator.conftest import Emulator, lambda_client, wait_for

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)


def test_request_response_returns_the_payload(emulator: Emulator) -> None:
    client = lambda_client(emulator)
    for name, qualifier in [
        ("ThawFunction", {}),
        ("ThawFunction", {"Qualifier": "$LATEST"}),
        ("arn:aws:lambda:us-east-1:123456789012:function:ThawFunction:$LATEST", {}),
        ("thaw-short", {}),  # by FunctionName
    ]:
        answer = client.invoke(
            FunctionName=name, Payload=b'{"handler": "echo", "input": {"a": 1}}', **qualifier
        )
        assert answer["StatusCode"] == 200
        assert answer["ExecutedVersion"] == "$LATEST"
        assert "FunctionError" not in answer
        assert json.loads(answer["Payload"].read()) == {"output": {"a": 1}}


def test_log_tail_holds_the_invocation_log(emulator: Emulator) -> None:
    answer = lambda_client(emulator).invoke(
        FunctionName="ThawFunction", Payload=b'{"handler": "echo"}', LogType="Tail"
    )
    request_id = answer["ResponseMetadata"]["RequestId"]
    log = base64.b64decode(answer["LogResult"]).decode()
    assert len(log.encode()) <= 4096
    assert f"START RequestId: {request_id}" in log
    assert f"invocation {request_id} 200" in log  # the runtime's own line
    assert f"REPORT RequestId: {request_id}" in log


def test_dry_run_checks_without_running(emulator: Emulator) -> None:
    answer = lambda_client(emulator).invoke(FunctionName="ThawFunction", InvocationType="DryRun")
    assert answer["StatusCode"] == 204


def test_event_invocation_runs_in_the_background(emulator: Emulator, tmp_path: Path) -> None:
    target = tmp_path / "effect.txt"
    event = {"handler": "write_file", "input": {"path": str(target), "text": "done"}}
    answer = lambda_client(emulator).invoke(
        FunctionName="ThawFunction", InvocationType="Event", Payload=orjson.dumps(event)
    )
    assert answer["StatusCode"] == 202
    wait_for(lambda: target.exists() and target.read_text() == "done")


def test_failed_event_invocation_is_retried_twice(emulator: Emulator, tmp_path: Path) -> None:
    attempts = tmp_path / "attempts.txt"
    event = {"handler": "flaky", "input": {"path": str(attempts), "fail_times": 5}}
    answer = lambda_client(emulator).invoke(
        FunctionName="ThawFunction", InvocationType="Event", Payload=orjson.dumps(event)
    )
    assert answer["StatusCode"] == 202
    wait_for(lambda: attempts.exists() and len(attempts.read_text().splitlines()) == 3)
    # As on Lambda, every attempt runs under the request id the 202 gave.
    request_id = answer["ResponseMetadata"]["RequestId"]
    assert attempts.read_text().splitlines() == [request_id] * 3
    wait_for(lambda: len([r for r in emulator.report_lines() if r.request_id == request_id]) == 3)
    reports = [r for r in emulator.report_lines() if r.request_id == request_id]
    # A function error is an answer: Lambda's REPORT gives it no Status.
    assert len(reports) == 3 and not any("Status" in r.fields for r in reports)


def test_function_error_is_flagged_unhandled(emulator: Emulator) -> None:
    answer = lambda_client(emulator).invoke(
        FunctionName="ThawFunction", Payload=b'{"handler": "raises", "input": {"message": "x"}}'
    )
    assert answer["FunctionError"] == "Unhandled"
    error = json.loads(answer["Payload"].read())
    # As AWS's Python runtime reports a handler's exception: its class, its message.
    assert error["errorType"] == "ValueError"
    assert error["errorMessage"] == "x"
    assert any("tests/handlers/raises.py" in frame for frame in error["stackTrace"])


def test_init_error_reaches_the_caller(emulator: Emulator) -> None:
    answer = lambda_client(emulator).invoke(FunctionName="Broken", Payload=b"{}")
    assert answer["FunctionError"] == "Unhandled"
    error = json.loads(answer["Payload"].read())
    assert error["errorType"] == "config"
    assert "thaw_test_module_that_does_not_exist" in error["errorMessage"]


def test_unknown_function_is_resource_not_found(emulator: Emulator) -> None:
    with pytest.raises(ClientError) as info:
        lambda_client(emulator).invoke(FunctionName="Nope", Payload=b"{}")
    assert info.value.response["Error"]["Code"] == "ResourceNotFoundException"
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


def test_bad_json_payload_is_refused(emulator: Emulator) -> None:
    response = emulator.invoke("ThawFunction", b"{not json")
    assert response.status_code == 400
    assert response.headers["x-amzn-ErrorType"] == "InvalidRequestContentException"
    assert response.json()["Type"] == "User"


@pytest.mark.skipif(shutil.which("aws") is None, reason="the AWS CLI is not installed")
def test_aws_cli_invoke(emulator: Emulator, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }
    command = ["aws", "lambda", "invoke", "--endpoint-url", emulator.url]
    command += ["--function-name", "ThawFunction", "--payload", '{"handler":"echo","input":[1]}']
    version = subprocess.run(
        ["aws", "--version"], env=env, capture_output=True, text=True, timeout=60
    )
    if (version.stdout + version.stderr).startswith("aws-cli/2"):
        # v2 reads blobs as base64 unless told otherwise; v1 has no such option.
        command += ["--cli-binary-format", "raw-in-base64-out"]
    done = subprocess.run([*command, str(out)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["StatusCode"] == 200
    assert json.loads(out.read_text()) == {"output": [1]}
