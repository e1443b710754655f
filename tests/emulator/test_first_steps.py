"""What `thaw emulate` tells a first-time user at startup, and that it works.

boto3 and the AWS CLI sign every request and fail before sending one when no
credentials are found, local endpoint or not; the banner prints the exact
lines to set. A client made from exactly those values, and an unsigned one
(botocore.UNSIGNED, as the banner also says), both invoke.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import boto3
import botocore
import pytest
from botocore.config import Config

from tests.emulator.conftest import Emulator, wait_for

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)


def banner(emulator: Emulator) -> str:
    """From the whole stderr: the package's emulator is shared, and `errors()` keeps
    only its tail, past which the banner has scrolled once other tests ran."""
    text = emulator.err_path.read_text(errors="replace")
    return text[text.index("thaw emulate: listening") :]


def invoke(client: Any) -> Any:
    answer = client.invoke(
        FunctionName="ThawFunction", Payload=b'{"handler": "echo", "input": {"first": true}}'
    )
    assert answer["StatusCode"] == 200
    return json.loads(answer["Payload"].read())


def test_the_banner_gives_credentials_that_work(emulator: Emulator) -> None:
    said = banner(emulator)
    [line] = [x.strip() for x in said.splitlines() if x.strip().startswith("export AWS_")]
    values = dict(pair.split("=", 1) for pair in line.removeprefix("export ").split())
    assert set(values) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}
    assert f"--endpoint-url {emulator.url}" in said
    client = boto3.client(
        "lambda",
        endpoint_url=emulator.url,
        region_name=values["AWS_DEFAULT_REGION"],
        aws_access_key_id=values["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=values["AWS_SECRET_ACCESS_KEY"],
        config=Config(retries={"max_attempts": 1}),
    )
    assert invoke(client) == {"output": {"first": True}}


def test_an_unsigned_client_invokes_too(emulator: Emulator) -> None:
    assert "signature_version=botocore.UNSIGNED" in banner(emulator)
    client = boto3.client(
        "lambda",
        endpoint_url=emulator.url,
        region_name="us-east-1",
        config=Config(signature_version=botocore.UNSIGNED, retries={"max_attempts": 1}),
    )
    assert invoke(client) == {"output": {"first": True}}


def test_the_banner_says_when_a_sync_invoke_answers_a_job(emulator: Emulator) -> None:
    said = " ".join(banner(emulator).split())
    assert re.search(r"wait_s, else THAW_WAIT_S \(default 10 s\), never past the function's", said)
    assert '{"thaw": "job", ..., "poll": {"job": ID}}' in said


def test_a_sync_invoke_past_its_wait_is_a_marked_job_and_a_log_line(
    emulator: Emulator, tmp_path: Path
) -> None:
    hold = tmp_path / "hold"  # the handler runs until the test removes it
    hold.touch()
    client = boto3.client(
        "lambda",
        endpoint_url=emulator.url,
        region_name="us-east-1",
        config=Config(signature_version=botocore.UNSIGNED, retries={"max_attempts": 1}),
    )
    event = {"handler": "while_file", "input": {"path": str(hold)}, "wait_s": 0.2}
    try:
        answer = client.invoke(FunctionName="ThawFunction", Payload=json.dumps(event).encode())
        job = json.loads(answer["Payload"].read())
    finally:
        hold.unlink()
    assert answer["StatusCode"] == 200 and "FunctionError" not in answer
    assert job["thaw"] == "job" and job["status"] in {"queued", "running"}
    assert job["poll"] == {"job": job["id"]}
    polled = client.invoke(
        FunctionName="ThawFunction",
        Payload=json.dumps({**job["poll"], "wait_s": 30}).encode(),
    )
    assert json.loads(polled["Payload"].read())["output"] == {"released": True}
    wait_for(lambda: f"answered with job {job['id']}" in emulator.errors())
