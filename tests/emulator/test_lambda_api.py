"""The emulator toward the Lambda API: qualifiers (versions and aliases the template
publishes), ExecutedVersion, ClientContext reaching the handler, GetFunction,
GetFunctionConfiguration and ListFunctions answered from the template, Lambda's
error shape for operations it does not serve; and the HTTP contract's job route
and Prefer through a Function URL. boto3 and the AWS CLI against a real
`thaw emulate` with a template of its own."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from botocore.exceptions import ClientError

from runtime.emulator.template import parse_template
from tests.emulator.conftest import Emulator, lambda_client, state_env

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

HANDLERS = "handlers.echo,tests.emulator.context_handler"
TEMPLATE = f"""
AWSTemplateFormatVersion: "2010-09-09"
Transform: AWS::Serverless-2016-10-31
Globals:
  Function:
    Timeout: 30
    MemorySize: 256
    Environment:
      Variables:
        THAW_HANDLERS: {HANDLERS}
Resources:
  Api:
    Type: AWS::Serverless::Function
    Metadata: {{DockerTag: v7}}
    Properties:
      PackageType: Image
      Description: served behind a URL, with an alias
      AutoPublishAlias: live
      ReservedConcurrentExecutions: 3
      FunctionUrlConfig: {{AuthType: NONE}}
  Plain:
    Type: AWS::Lambda::Function
    Properties:
      FunctionName: thaw-plain
      PackageType: Image
      Code: {{ImageUri: 123456789012.dkr.ecr.us-east-1.amazonaws.com/thaw:1}}
      Environment:
        Variables:
          THAW_HANDLERS: {HANDLERS}
  PlainOne:
    Type: AWS::Lambda::Version
    Properties: {{FunctionName: !Ref Plain}}
  PlainTwo:
    Type: AWS::Lambda::Version
    Properties: {{FunctionName: !Ref Plain}}
  PlainProd:
    Type: AWS::Lambda::Alias
    Properties:
      FunctionName: !Ref Plain
      FunctionVersion: !GetAtt PlainTwo.Version
      Name: prod
"""
ARN = "arn:aws:lambda:us-east-1:123456789012:function:"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    root = tmp_path_factory.mktemp("lambda-api")
    (root / "bundles").mkdir()
    template = root / "template.yaml"
    template.write_text(TEMPLATE)
    env = state_env(root)
    emu = Emulator(root, env, template=template)
    yield emu
    emu.stop()


def error_of(info: pytest.ExceptionInfo[ClientError]) -> tuple[str, int, str]:
    response = info.value.response
    return (
        response["Error"]["Code"],
        response["ResponseMetadata"]["HTTPStatusCode"],
        response["Error"]["Message"],
    )


def test_the_template_publishes_versions_and_aliases() -> None:
    functions = parse_template(TEMPLATE).functions
    api, plain = functions["Api"], functions["Plain"]
    assert (api.versions, api.aliases) == (("1",), {"live": "1"})
    assert (plain.versions, plain.aliases) == (("1", "2"), {"prod": "2"})
    assert api.image_uri == "api:v7"
    assert plain.image_uri == "123456789012.dkr.ecr.us-east-1.amazonaws.com/thaw:1"
    assert [api.version_of(q) for q in (None, "$LATEST", "1", "live", "2", "prod")] == [
        "$LATEST",
        "$LATEST",
        "1",
        "1",
        None,
        None,
    ]


def test_executed_version_is_the_version_the_qualifier_names(emulator: Emulator) -> None:
    client = lambda_client(emulator)
    cases: list[tuple[str, dict[str, str], str]] = [
        ("Api", {}, "$LATEST"),
        ("Api", {"Qualifier": "$LATEST"}, "$LATEST"),
        ("Api", {"Qualifier": "live"}, "1"),
        ("Api:1", {}, "1"),
        (f"{ARN}Api:live", {}, "1"),
        ("123456789012:function:Api:live", {}, "1"),
        ("thaw-plain", {"Qualifier": "prod"}, "2"),
        ("thaw-plain:1", {"Qualifier": "1"}, "1"),
    ]
    for name, qualifier, version in cases:
        answer = client.invoke(
            FunctionName=name, Payload=b'{"handler": "echo", "input": 1}', **qualifier
        )
        assert answer["StatusCode"] == 200, (name, qualifier)
        assert answer["ExecutedVersion"] == version, (name, qualifier)
        assert json.loads(answer["Payload"].read()) == {"output": 1}


def test_an_unknown_alias_or_version_is_resource_not_found(emulator: Emulator) -> None:
    client = lambda_client(emulator)
    for name, qualifier, arn in [
        ("Api", {"Qualifier": "nope"}, f"{ARN}Api:nope"),
        ("Api:7", {}, f"{ARN}Api:7"),
        ("thaw-plain", {"Qualifier": "live"}, f"{ARN}thaw-plain:live"),
    ]:
        with pytest.raises(ClientError) as info:
            client.invoke(FunctionName=name, Payload=b"{}", **qualifier)
        code, status, message = error_of(info)
        assert (code, status) == ("ResourceNotFoundException", 404)
        assert message == f"Function not found: {arn}"
        with pytest.raises(ClientError) as info:
            client.get_function(FunctionName=name, **qualifier)
        assert error_of(info)[:2] == ("ResourceNotFoundException", 404)
    with pytest.raises(ClientError) as info:
        client.invoke(FunctionName="Api:live", Qualifier="1", Payload=b"{}")
    assert error_of(info)[:2] == ("InvalidParameterValueException", 400)


def test_client_context_reaches_the_handler(emulator: Emulator) -> None:
    client = lambda_client(emulator)
    sent = {"custom": {"tenant": "t-9"}, "env": {"platform": "test"}, "client": {}}
    answer = client.invoke(
        FunctionName="Api",
        ClientContext=base64.b64encode(json.dumps(sent).encode()).decode(),
        Payload=b'{"handler": "client_context"}',
    )
    output = json.loads(answer["Payload"].read())["output"]
    assert output["client_context"] == sent
    assert output["request_id"] == answer["ResponseMetadata"]["RequestId"]
    # None when the caller sends none, and on the next invocation of the same sandbox.
    answer = client.invoke(FunctionName="Api", Payload=b'{"handler": "client_context"}')
    assert json.loads(answer["Payload"].read())["output"]["client_context"] is None
    response = emulator.invoke(
        "Api", b'{"handler": "client_context"}', headers={"X-Amz-Client-Context": "not base64!"}
    )
    assert response.status_code == 400
    assert response.headers["x-amzn-ErrorType"] == "InvalidRequestContentException"


def test_get_function_answers_from_the_template(emulator: Emulator) -> None:
    client = lambda_client(emulator)
    found = client.get_function(FunctionName="Api")
    configuration = found["Configuration"]
    assert configuration["FunctionName"] == "Api"
    assert configuration["FunctionArn"] == f"{ARN}Api"
    assert configuration["Version"] == "$LATEST"
    assert (configuration["MemorySize"], configuration["Timeout"]) == (256, 30)
    assert configuration["PackageType"] == "Image"
    assert configuration["Description"] == "served behind a URL, with an alias"
    assert configuration["State"] == "Active"
    assert configuration["Environment"]["Variables"]["THAW_HANDLERS"] == HANDLERS
    assert found["Code"] == {"RepositoryType": "ECR", "ImageUri": "api:v7"}
    assert found["Concurrency"] == {"ReservedConcurrentExecutions": 3}
    live = client.get_function(FunctionName="Api", Qualifier="live")["Configuration"]
    assert (live["Version"], live["FunctionArn"]) == ("1", f"{ARN}Api:live")
    prod = client.get_function_configuration(FunctionName="thaw-plain", Qualifier="prod")
    assert (prod["FunctionName"], prod["Version"]) == ("thaw-plain", "2")
    assert client.get_function_configuration(FunctionName=f"{ARN}Api")["FunctionName"] == "Api"


def test_list_functions_answers_from_the_template(emulator: Emulator) -> None:
    client = lambda_client(emulator)
    listed = client.list_functions()["Functions"]
    assert sorted((f["FunctionName"], f["Version"]) for f in listed) == [
        ("Api", "$LATEST"),
        ("thaw-plain", "$LATEST"),
    ]
    pages = client.get_paginator("list_functions").paginate(
        FunctionVersion="ALL", PaginationConfig={"PageSize": 2}
    )
    every = [(f["FunctionName"], f["Version"]) for page in pages for f in page["Functions"]]
    assert sorted(every) == [
        ("Api", "$LATEST"),
        ("Api", "1"),
        ("thaw-plain", "$LATEST"),
        ("thaw-plain", "1"),
        ("thaw-plain", "2"),
    ]


def test_an_operation_it_does_not_serve_answers_in_lambdas_error_shape(
    emulator: Emulator,
) -> None:
    with pytest.raises(ClientError) as info:
        lambda_client(emulator).get_policy(FunctionName="Api")
    code, status, message = error_of(info)
    assert (code, status) == ("UnknownOperationException", 404)
    assert "GetFunction" in message  # it names what it does serve
    with httpx.Client(base_url=emulator.url, timeout=30) as client:
        for method, path in [
            ("GET", "/2015-03-31/functions/Api/invocations"),
            ("DELETE", "/2015-03-31/functions/Api"),
            ("GET", "/2021-10-31/functions/Api/url"),
        ]:
            response = client.request(method, path)
            assert response.status_code == 404, path
            assert response.headers["x-amzn-ErrorType"] == "UnknownOperationException"
            assert response.json()["Type"] == "User"


@pytest.mark.skipif(shutil.which("aws") is None, reason="the AWS CLI is not installed")
def test_aws_cli_get_function_and_list_functions(emulator: Emulator, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }

    def aws(*args: str) -> Any:
        command = ["aws", "lambda", *args, "--endpoint-url", emulator.url, "--output", "json"]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    found = aws("get-function", "--function-name", "Api", "--qualifier", "live")
    assert found["Configuration"]["Version"] == "1"
    assert found["Code"]["ImageUri"] == "api:v7"
    names = {f["FunctionName"] for f in aws("list-functions")["Functions"]}
    assert names == {"Api", "thaw-plain"}


def test_the_http_contract_through_the_function_url(emulator: Emulator) -> None:
    with httpx.Client(base_url=emulator.url, timeout=60) as client:
        accepted = client.post("/handlers/echo/jobs", json={"via": "url"})
        assert accepted.status_code == 202
        assert accepted.headers["x-request-id"]
        done = client.get(accepted.headers["location"], params={"wait": 20}).json()
        assert done["output"] == {"via": "url"}
        # `respond-async` alone is a 202 at once, though the loop adds Lambda's deadline
        # as a wait where the caller gave none; with the caller's wait, 200 if it can.
        alone = client.post("/invoke/echo", json={}, headers={"Prefer": "respond-async"})
        assert alone.status_code == 202
        assert "Prefer" in alone.headers.get_list("vary")
        quick = client.post("/invoke/echo", json={}, headers={"Prefer": "respond-async, wait=20"})
        assert quick.status_code == 200
