"""Reading template.yaml: short-form tags, parameters, Globals, and the local wiring."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.emulator import local_environment
from runtime.emulator.sandboxes import sandbox_env
from runtime.emulator.template import load_template, parse_template
from runtime.errors import ConfigError

TEMPLATE = """
Parameters:
  Memory: {Type: Number, Default: 3008}
  Stage: {Type: String, Default: dev}
  Unset: {Type: String}
Conditions:
  IsProd: !Equals [!Ref Stage, prod]
  NotProd: !Not [!Condition IsProd]
Mappings:
  Sizes: {dev: {wait: "2"}}
Globals:
  Function:
    Timeout: 30
    Environment:
      Variables:
        FROM_GLOBALS: "yes"
        OVERRIDDEN: global
Resources:
  Table: {Type: AWS::DynamoDB::Table}
  ThawFunction:
    Type: AWS::Serverless::Function
    Properties:
      FunctionName: !Sub "thaw-${Stage}"
      PackageType: Image
      MemorySize: !Ref Memory
      ReservedConcurrentExecutions: !If [IsProd, 50, 2]
      Environment:
        Variables:
          OVERRIDDEN: function
          JOBS: !Sub "dynamodb://${Table}"
          ARN: !GetAtt Table.Arn
          REGION: !Sub "${AWS::Region}/${Stage}"
          JOINED: !Join [",", [a, !Ref Stage, 3]]
          WAIT: !FindInMap [Sizes, !Ref Stage, wait]
          FLAG: !If [NotProd, true, false]
          UNSET: !Ref Unset
          NUMBER: 7
  Plain:
    Type: AWS::Lambda::Function
    Properties: {Runtime: python3.11, Handler: app.handler}
  OnlyInProd:
    Type: AWS::Serverless::Function
    Condition: IsProd
    Properties:
      PackageType: Image
      CapacityProviderConfig: {PerExecutionEnvironmentMaxConcurrency: 4}
  Url:
    Type: AWS::Lambda::Url
    Properties:
      TargetFunctionArn: !GetAtt Plain.Arn
"""


@pytest.mark.process
def test_short_form_tags_resolve_to_parameter_defaults() -> None:
    template = parse_template(TEMPLATE)
    function = template.functions["ThawFunction"]
    assert function.name == "thaw-dev"
    assert function.memory_mb == 3008
    assert function.timeout_s == 30.0
    assert function.reserved_concurrency == 2
    assert function.environment == {
        "FROM_GLOBALS": "yes",
        "OVERRIDDEN": "function",
        "REGION": "us-east-1/dev",
        "JOINED": "a,dev,3",
        "WAIT": "2",
        "FLAG": "true",
        "NUMBER": "7",
    }  # JOBS, ARN and UNSET need a deployed stack: left out


def test_lambda_defaults_and_url_targets() -> None:
    template = parse_template(TEMPLATE)
    plain = template.functions["Plain"]
    assert (plain.timeout_s, plain.memory_mb, plain.reserved_concurrency) == (30.0, 128, None)
    assert plain.has_url
    assert template.url_function() is plain


@pytest.mark.parametrize(
    "name",
    [
        "ThawFunction",
        "thaw-dev",
        "ThawFunction:$LATEST",
        "arn:aws:lambda:us-east-1:123456789012:function:thaw-dev",
        "arn:aws:lambda:us-east-1:123456789012:function:ThawFunction:live",
    ],
)
def test_functions_are_found_by_any_name(name: str) -> None:
    found = parse_template(TEMPLATE).find(name)
    assert found is not None and found.logical_id == "ThawFunction"


def test_unknown_names_are_not_found() -> None:
    assert parse_template(TEMPLATE).find("Table") is None


def test_conditional_functions_follow_the_parameter_defaults() -> None:
    assert "OnlyInProd" not in parse_template(TEMPLATE).functions
    prod = parse_template(TEMPLATE.replace("Default: dev", "Default: prod"))
    assert prod.functions["OnlyInProd"].max_concurrency == 4
    assert prod.functions["ThawFunction"].reserved_concurrency == 50


def test_the_shipped_template_reads() -> None:
    shipped = Path(__file__).resolve().parents[2] / "template.yaml"
    function = load_template(shipped).url_function()
    assert function.timeout_s >= 1 and function.memory_mb >= 128
    # AWS wiring that needs the deployed stack never reaches a local sandbox.
    assert not function.environment.get("THAW_JOB_STORE", "").startswith("dynamodb://")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Resources: [", "not valid YAML"),
        ("Outputs: {}", "no Resources"),
        ("Resources: {T: {Type: AWS::S3::Bucket}}", "no AWS::Serverless::Function"),
    ],
)
def test_defective_templates_are_config_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_template(text)


def test_missing_template_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="template"):
        load_template(tmp_path / "absent.yaml")


def test_local_wiring_wins_over_aws_wiring(tmp_path: Path) -> None:
    template = parse_template(
        TEMPLATE.replace("JOBS: !Sub", "THAW_JOB_STORE: !Sub").replace(
            "NUMBER: 7", "NUMBER: 7\n          THAW_BUNDLE_SOURCE: s3://bucket/bundles"
        )
    )
    function = template.functions["ThawFunction"]
    assert function.environment["THAW_BUNDLE_SOURCE"] == "s3://bucket/bundles"
    environ = {
        "PATH": "/bin",
        "AWS_LAMBDA_RUNTIME_API": "stale",
        "THAW_WAIT_S": "1",
        "THAW_STATE_DIR": str(tmp_path / "state"),
    }
    base, local = local_environment(environ)
    env = sandbox_env(function, base, local, "127.0.0.1:9001")
    assert env["THAW_JOB_STORE"].startswith("sqlite:////")  # the laptop default, absolute
    assert env["THAW_BUNDLE_SOURCE"] == str(Path("bundles").resolve())
    assert env["THAW_STATE_DIR"] == str(tmp_path / "state")
    assert env["THAW_WAIT_S"] == "1"  # the shell's THAW_* override the template
    assert env["OVERRIDDEN"] == "function"
    assert env["AWS_LAMBDA_RUNTIME_API"] == "127.0.0.1:9001"
    assert env["AWS_LAMBDA_FUNCTION_NAME"] == "thaw-dev"
    assert env["AWS_LAMBDA_FUNCTION_MEMORY_SIZE"] == "3008"
    assert env["PATH"] == "/bin"
