"""A step-level handler (tests/handlers/stepped.py: continuous batching,
runtime/dispatch/decode.py) through `thaw emulate`: boto3's Invoke gets the joined
output, InvokeWithResponseStream each step's item as it is made, and the
concurrent slots of one emulated instance share its decode steps.

An emulator of its own: one function, streaming, with four slots per instance.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.emulator.conftest import Emulator, emulator_env
from tests.emulator.test_invoke_api import lambda_client
from tests.emulator.test_streaming import lines, read_stream
from tests.support import SAFETY_S

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

TEMPLATE = """
AWSTemplateFormatVersion: "2010-09-09"
Transform: AWS::Serverless-2016-10-31
Resources:
  Stepper:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      Timeout: 60
      FunctionUrlConfig: {AuthType: NONE, InvokeMode: RESPONSE_STREAM}
      Environment:
        Variables:
          THAW_HANDLERS: tests.handlers.stepped
          THAW_INVOKE_MODE: RESPONSE_STREAM
          AWS_LAMBDA_MAX_CONCURRENCY: 4
"""


@pytest.fixture(scope="module")
def stepper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    root = tmp_path_factory.mktemp("emulator-decode")
    template = root / "template.yaml"
    template.write_text(TEMPLATE)
    emu = Emulator(root, emulator_env(root), "--max-sandboxes", "1", template=template)
    yield emu
    emu.stop()


def invoke(emulator: Emulator, event: Any) -> Any:
    answer = lambda_client(emulator).invoke(FunctionName="Stepper", Payload=orjson.dumps(event))
    assert answer["StatusCode"] == 200
    assert "FunctionError" not in answer, answer["Payload"].read()
    return orjson.loads(answer["Payload"].read())


def test_boto3_invoke_gets_the_sequence_joined(stepper: Emulator) -> None:
    output = invoke(stepper, {"handler": "stepped", "input": {"name": "a", "n": 3}})
    assert output == {"output": ["a:0", "a:1", "a:2"]}


def test_invoke_with_response_stream_reads_each_step_then_the_output(stepper: Emulator) -> None:
    event = {"handler": "stepped", "input": {"name": "s", "n": 3}, "stream": True}
    chunks, complete = read_stream(stepper, "Stepper", event)
    assert lines(chunks) == ["s:0", "s:1", "s:2", {"output": ["s:0", "s:1", "s:2"]}]
    assert "ErrorCode" not in complete


def test_a_failing_step_ends_only_its_own_stream(stepper: Emulator) -> None:
    event = {"handler": "stepped", "input": {"name": "f", "n": 4, "fail_at": 2}, "stream": True}
    chunks, complete = read_stream(stepper, "Stepper", event)
    assert lines(chunks) == ["f:0"]
    assert complete["ErrorCode"] == "RuntimeError"
    assert "f failed at step 2" in complete["ErrorDetails"]
    assert invoke(stepper, {"handler": "stepped", "input": {"name": "g", "n": 1}}) == {
        "output": ["g:0"]
    }


_RUNNING = 'thaw_decode_sequences{handler="stepped",state="running"}'


def _until_running(emulator: Emulator, value: float) -> None:
    """Until the instance holds `value` sequences (/metrics through the Function URL:
    another of its slots)."""
    deadline = time.monotonic() + SAFETY_S  # a hang guard, not a time bound
    while True:
        with emulator.client() as client:
            text = client.get("/metrics").text
        values = [
            float(line.split()[-1]) for line in text.splitlines() if line.startswith(_RUNNING)
        ]
        if values == [value]:
            return
        assert time.monotonic() < deadline, f"stepped never held {value} sequences"
        time.sleep(0.02)


def test_concurrent_slots_of_an_instance_share_its_steps(stepper: Emulator, tmp_path: Path) -> None:
    opened = tmp_path / "open"
    first = {"name": "a", "n": 4, "hold_at": 2, "hold_file": str(opened), "sizes": True}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        held = pool.submit(invoke, stepper, {"handler": "stepped", "input": first})
        _until_running(stepper, 1)  # prefilled: its second step holds
        rest = [
            pool.submit(
                invoke, stepper, {"handler": "stepped", "input": {"name": n, "n": 3, "sizes": True}}
            )
            for n in "bc"
        ]
        _until_running(stepper, 3)  # the two prefilled beside it
        opened.touch()
        outputs = [future.result()["output"] for future in (held, *rest)]
    assert [[step for step, _ in o] for o in outputs] == [[0, 1, 2, 3], [0, 1, 2], [0, 1, 2]]
    # One step held all three: the slots of one instance share its decode steps.
    assert all(3 in [size for _, size in o] for o in outputs), outputs
