"""Zip-packaged Python functions: `Runtime: python3.X` and `Handler: module.function`
run under awslambdaric, and every other part of the emulator (the Invoke API,
REPORT lines, timeouts, function and init errors) treats them as it treats
Thaw's runtime. A real `thaw emulate` with a template of its own, boto3
against it; the handlers are plain modules in tests/emulator/zip_code/.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.emulator.ric import RicLauncher
from runtime.emulator.sandboxes import Sandbox
from runtime.emulator.template import load_template, parse_template
from runtime.errors import ConfigError
from tests.emulator.conftest import EMULATE, Emulator, lambda_client, state_env, wait_for
from tests.emulator.test_sandboxes import alive

CODE = Path(__file__).resolve().parent / "zip_code"
RUNTIME = f"python{sys.version_info.major}.{sys.version_info.minor}"
TEMPLATE = """
Globals:
  Function:
    Runtime: {runtime}
    CodeUri: {code}
    MemorySize: 256
    Timeout: 30
    Environment:
      Variables:
        FROM_TEMPLATE: "yes"
Resources:
  Answers:
    Type: AWS::Serverless::Function
    Properties:
      Handler: answers.handler
  Raises:
    Type: AWS::Lambda::Function
    Properties:
      Handler: raises.handler
  Sleeps:
    Type: AWS::Serverless::Function
    Properties:
      Handler: sleeps.handler
      Timeout: 1
  ImportFails:
    Type: AWS::Serverless::Function
    Properties:
      Handler: absent_module.handler
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    root = tmp_path_factory.mktemp("zip-functions")
    template = root / "template.yaml"
    # Relative to the template's directory, as SAM reads a CodeUri.
    template.write_text(TEMPLATE.format(runtime=RUNTIME, code=os.path.relpath(CODE, root)))
    env = state_env(root)
    emu = Emulator(root, env, "--max-sandboxes", "2", template=template)
    yield emu
    emu.stop()


def invoke(emulator: Emulator, function: str, event: Any, **kw: Any) -> tuple[Any, Any]:
    """(boto3's answer, the decoded payload)."""
    answer = lambda_client(emulator).invoke(
        FunctionName=function, Payload=json.dumps(event).encode(), **kw
    )
    return answer, json.loads(answer["Payload"].read() or b"null")


def request_id(answer: Any) -> str:
    rid: str = answer["ResponseMetadata"]["RequestId"]
    return rid


@pytest.mark.process
def test_a_zip_function_answers_under_awslambdaric(emulator: Emulator) -> None:
    answer, body = invoke(emulator, "Answers", {"x": 1}, LogType="Tail")
    assert answer["StatusCode"] == 200 and "FunctionError" not in answer
    assert answer["ExecutedVersion"] == "$LATEST"
    assert body["event"] == {"x": 1}
    assert body["request_id"] == request_id(answer)
    assert (body["function_name"], body["function_version"]) == ("Answers", "$LATEST")
    assert str(body["memory_limit_in_mb"]) == "256"
    assert 0 < body["remaining_ms"] <= 30_000
    assert body["cwd"] == str(CODE)  # the module imported from its CodeUri
    assert body["env"] == {
        "LAMBDA_TASK_ROOT": str(CODE),
        "_HANDLER": "answers.handler",
        "AWS_EXECUTION_ENV": f"AWS_Lambda_{RUNTIME}",
        "AWS_LAMBDA_FUNCTION_NAME": "Answers",
        "AWS_LAMBDA_FUNCTION_TIMEOUT": "30",
        "FROM_TEMPLATE": "yes",
    }
    log = base64.b64decode(answer["LogResult"]).decode()
    assert f"START RequestId: {request_id(answer)}" in log
    assert "answering {'x': 1}" in log
    first = emulator.report(request_id(answer))
    assert first.cold and f"REPORT RequestId: {request_id(answer)}" in log
    assert int(first.fields["Max Memory Used"].removesuffix(" MB")) > 0

    again, second_body = invoke(emulator, "Answers", {"x": 2})
    assert second_body["pid"] == body["pid"]  # the same sandbox, warm
    assert not emulator.report(request_id(again)).cold


@pytest.mark.process
def test_an_event_invocation_runs_in_the_background(emulator: Emulator) -> None:
    answer = lambda_client(emulator).invoke(
        FunctionName="Answers", InvocationType="Event", Payload=b'{"queued": true}'
    )
    assert answer["StatusCode"] == 202
    report = emulator.report(request_id(answer))
    assert "Status" not in report.fields
    wait_for(lambda: "answering {'queued': True}" in emulator.errors())


@pytest.mark.process
def test_a_raising_handler_is_a_function_error(emulator: Emulator) -> None:
    answer, body = invoke(emulator, "Raises", {"why": "testing"})
    assert answer["StatusCode"] == 200 and answer["FunctionError"] == "Unhandled"
    assert body["errorType"] == "ValueError"
    assert body["errorMessage"] == "raised on purpose: testing"
    assert any("raises.py" in frame for frame in body["stackTrace"])
    # A posted function error is an answer: no Status, and the sandbox stays.
    assert "Status" not in emulator.report(request_id(answer)).fields


@pytest.mark.process
def test_a_handler_past_its_timeout_is_killed(emulator: Emulator) -> None:
    _, first = invoke(emulator, "Sleeps", {"sleep_s": 0})
    pid = first["pid"]
    answer, body = invoke(emulator, "Sleeps", {"sleep_s": 30})
    rid = request_id(answer)
    assert answer["FunctionError"] == "Unhandled"
    assert body == {
        "errorType": "Sandbox.Timedout",
        "errorMessage": f"{rid} Task timed out after 1.00 seconds",
    }
    report = emulator.report(rid).fields
    assert report["Status"] == "timeout" and "Error Type" not in report
    wait_for(lambda: not alive(pid))
    after, body = invoke(emulator, "Sleeps", {"sleep_s": 0})
    assert "FunctionError" not in after and body["pid"] != pid
    assert emulator.report(request_id(after)).cold


@pytest.mark.process
def test_a_handler_module_that_cannot_import_is_an_init_error(emulator: Emulator) -> None:
    answer, body = invoke(emulator, "ImportFails", {})
    assert answer["FunctionError"] == "Unhandled"
    assert body["errorType"] == "Runtime.ImportModuleError"
    assert "Unable to import module 'absent_module'" in body["errorMessage"]
    report = emulator.report(request_id(answer)).fields
    assert report["Status"] == "error" and report["Error Type"] == "Runtime.ImportModuleError"


@pytest.mark.process
def test_the_sandbox_runs_awslambdaric_in_the_code_directory(tmp_path: Path) -> None:
    template = tmp_path / "template.yaml"
    template.write_text(TEMPLATE.format(runtime=RUNTIME, code=CODE))
    function = load_template(template).functions["Answers"]
    launcher = RicLauncher({"PATH": "/bin", "PYTHONPATH": "/elsewhere"}, {"THAW_WAIT_S": "1"})
    sandbox = Sandbox(function, launcher)
    argv, env = launcher.command(sandbox, "127.0.0.1:9001")
    assert argv == [sys.executable, "-m", "awslambdaric", "answers.handler"]
    assert launcher.workdir(sandbox) == str(CODE)
    assert env["PYTHONPATH"] == f"{CODE}{os.pathsep}/elsewhere"
    assert env["AWS_LAMBDA_RUNTIME_API"] == "127.0.0.1:9001"
    assert env["THAW_WAIT_S"] == "1" and env["PATH"] == "/bin"


def test_code_is_found_relative_to_the_template(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    template = tmp_path / "template.yaml"
    template.write_text(
        f"""
Resources:
  InPlace: {{Type: AWS::Serverless::Function, Properties: {{Runtime: {RUNTIME}, Handler: a.b}}}}
  Below:
    Type: AWS::Serverless::Function
    Properties: {{Runtime: {RUNTIME}, Handler: a.b, CodeUri: src}}
  Image: {{Type: AWS::Serverless::Function, Properties: {{PackageType: Image}}}}
"""
    )
    functions = load_template(template).functions
    assert functions["InPlace"].code_dir == tmp_path.resolve()
    assert functions["Below"].code_dir == (tmp_path / "src").resolve()
    assert functions["Image"].code_dir is None


@pytest.mark.parametrize(
    ("properties", "message"),
    [
        ("{Runtime: nodejs20.x, Handler: index.handler}", r"Runtime nodejs20\.x; .*python3\.X"),
        ("{Runtime: java21, PackageType: Zip, Handler: a.b}", r"Runtime java21; .*python3\.X"),
        ("{Handler: app.handler}", "a Zip function with no Runtime"),
        ("{Runtime: python3.11}", r"\(python3\.11\) has no Handler"),
        ("{Runtime: python3.11, Handler: a.b, CodeUri: s3://bucket/key.zip}", "local directory"),
        ("{Runtime: python3.11, Handler: a.b, CodeUri: {Bucket: b, Key: k}}", "local directory"),
        ("{Runtime: python3.11, Handler: a.b, InlineCode: 'def b(e, c): 1'}", "local directory"),
        ("{Runtime: python3.11, Handler: a.b, CodeUri: absent}", "CodeUri absent: no directory"),
        ("{PackageType: Container}", "neither Zip nor Image"),
    ],
)
def test_what_cannot_run_is_a_config_error_naming_the_function(
    tmp_path: Path, properties: str, message: str
) -> None:
    text = f"Resources:\n  Fn:\n    Type: AWS::Serverless::Function\n    Properties: {properties}\n"
    with pytest.raises(ConfigError, match=f"function Fn.*{message}"):
        parse_template(text, tmp_path)


@pytest.mark.process
def test_thaw_emulate_refuses_an_unsupported_runtime_at_start(tmp_path: Path) -> None:
    template = tmp_path / "template.yaml"
    template.write_text(
        "Resources:\n  Node:\n    Type: AWS::Serverless::Function\n"
        "    Properties: {Runtime: nodejs20.x, Handler: index.handler}\n"
    )
    done = subprocess.run(
        [*EMULATE, "--template", str(template)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.startswith("thaw: error:")
    assert "function Node" in done.stderr and "Runtime nodejs20.x" in done.stderr
    assert "listening" not in done.stderr
