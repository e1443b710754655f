"""Function settings from a SAM / CloudFormation template.

Reads every `AWS::Serverless::Function` and `AWS::Lambda::Function` (those
whose `Condition` is false with the parameter defaults are left out): Timeout,
MemorySize, EphemeralStorage, Environment.Variables (merged over `Globals.Function`),
ReservedConcurrentExecutions, FunctionName and the per-sandbox concurrency
(`PerExecutionEnvironmentMaxConcurrency`, or AWS_LAMBDA_MAX_CONCURRENCY in the
environment). Intrinsics are resolved as far as a template alone allows
(intrinsics.py); what needs a deployed stack is unresolvable: such an
environment variable is left out, such a setting takes Lambda's default.

Versions and aliases, for the Invoke API's `Qualifier` and `ExecutedVersion`:
`AutoPublishAlias: NAME` publishes version 1 and points alias NAME at it (as a
first `sam deploy` does); each `AWS::Lambda::Version` of a function publishes
the next number, in the template's order; an `AWS::Lambda::Alias` names the
version its `FunctionVersion` gives (a number, `$LATEST`, or a `!GetAtt` /
`!Ref` of one of those versions). Every version runs the template's code.
What GetFunction and ListFunctions describe besides (PackageType, Handler,
Runtime, Architectures, Description, the image) is read here too.

A Zip function (PackageType Zip, the default) runs under AWS's Runtime
Interface Client (runtime/emulator/ric.py), so only a Python one can run:
`Runtime: python3.X`, a `Handler`, and its code in a local directory
(`CodeUri`, or a string `Code`, relative to the template; the template's own
directory without one). Anything else (another runtime, no Handler, code in
S3 or inline) is a ConfigError naming the function, at load.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runtime.emulator.intrinsics import ACCOUNT as ACCOUNT
from runtime.emulator.intrinsics import REGION as REGION
from runtime.emulator.intrinsics import UNRESOLVED, Resolver, TagLoader, as_text
from runtime.errors import ConfigError

FUNCTION_TYPES = frozenset({"AWS::Serverless::Function", "AWS::Lambda::Function"})
# The Zip runtimes the emulator runs: Python 3's, under awslambdaric.
PYTHON_RUNTIME = re.compile(r"python3\.\d+")


@dataclass(frozen=True)
class FunctionConfig:
    logical_id: str
    name: str
    timeout_s: float = 3.0
    memory_mb: int = 128
    # /tmp's size (EphemeralStorage.Size); only a container sandbox is held to it.
    ephemeral_mb: int = 512
    environment: dict[str, str] = field(default_factory=dict)
    reserved_concurrency: int | None = None
    # Invocations one sandbox takes at once (AWS_LAMBDA_MAX_CONCURRENCY).
    max_concurrency: int = 1
    has_url: bool = False
    # Published versions ("1", "2", ...) and aliases (name -> version).
    versions: tuple[str, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)
    # AutoPublishAlias: SAM puts the Function URL on that alias, not on $LATEST.
    url_qualifier: str | None = None
    package_type: str = "Zip"
    handler: str | None = None
    runtime: str | None = None
    architectures: tuple[str, ...] = ("x86_64",)
    description: str = ""
    # The image a container function runs (ImageUri, else `<logical id>:<DockerTag>`).
    image_uri: str | None = None
    # A Zip function's code: the absolute directory its CodeUri names.
    code_dir: Path | None = None

    @property
    def arn(self) -> str:
        return f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{self.name}"

    def version_of(self, qualifier: str | None) -> str | None:
        """The version a qualifier names: `$LATEST` when there is none; None if unknown."""
        if qualifier is None or qualifier == "$LATEST":
            return "$LATEST"
        if qualifier in self.versions:
            return qualifier
        return self.aliases.get(qualifier)


class QualifierMismatch(ValueError):
    """The function name's qualifier and the `Qualifier` parameter differ."""


def split_name(name: str) -> tuple[str, str | None]:
    """(function, qualifier) of a name, partial ARN or ARN, each with or without `:qualifier`."""
    parts = name.split(":")
    if parts[0] == "arn":  # arn:aws:lambda:REGION:ACCOUNT:function:NAME[:QUALIFIER]
        rest = parts[6:]
    elif len(parts) >= 3 and parts[0].isdigit() and parts[1] == "function":
        rest = parts[2:]  # ACCOUNT:function:NAME[:QUALIFIER], a partial ARN
    else:
        rest = parts  # NAME[:QUALIFIER]
    return (rest[0] if rest else ""), (rest[1] if len(rest) > 1 else None)


def _number(value: Any, default: float) -> float:
    if isinstance(value, bool) or value is UNRESOLVED or value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _find_key(value: Any, key: str) -> Any:
    if isinstance(value, dict):
        if key in value:
            return value[key]
        for child in value.values():
            found = _find_key(child, key)
            if found is not None:
                return found
    return None


def _text_or(value: Any, default: str | None) -> str | None:
    return value if isinstance(value, str) else default


def _zip_code(logical_id: str, props: dict[str, Any], base_dir: Path) -> Path:
    """The directory a Zip function's code is in; ConfigError unless it can run here."""
    runtime = props.get("Runtime")
    supported = (
        "thaw emulate runs Zip functions of a Python runtime (Runtime: python3.X, "
        "Handler: module.function) under awslambdaric; any other function needs PackageType: Image"
    )
    if not isinstance(runtime, str) or not PYTHON_RUNTIME.fullmatch(runtime):
        said = f"Runtime {runtime}" if isinstance(runtime, str) else "no Runtime it can resolve"
        raise ConfigError(
            f"template: function {logical_id} is a Zip function with {said}; {supported}"
        )
    handler = props.get("Handler")
    if not isinstance(handler, str) or not handler.strip():
        raise ConfigError(
            f"template: function {logical_id} ({runtime}) has no Handler; {supported}"
        )
    code = props.get("CodeUri", props.get("Code"))
    if code is None and "InlineCode" in props:
        code = {"InlineCode": "..."}
    if code is None:
        return base_dir.resolve()
    if not isinstance(code, str) or "://" in code:
        raise ConfigError(
            f"template: function {logical_id}: its code must be a local directory "
            f"(CodeUri: DIR, relative to the template), not {code!r}"
        )
    directory = (base_dir / code).resolve()
    if not directory.is_dir():
        raise ConfigError(
            f"template: function {logical_id}: CodeUri {code}: no directory {directory}"
        )
    return directory


def _function(
    logical_id: str,
    props: dict[str, Any],
    url_targets: set[str],
    metadata: dict[str, Any],
    base_dir: Path,
) -> FunctionConfig:
    variables = props["Environment"]["Variables"]
    environment = {
        str(k): as_text(v)
        for k, v in variables.items()
        if v is not UNRESOLVED and not isinstance(v, dict | list)
    }
    name = props.get("FunctionName")
    reserved = props.get("ReservedConcurrentExecutions")
    concurrency = environment.get("AWS_LAMBDA_MAX_CONCURRENCY") or _find_key(
        props, "PerExecutionEnvironmentMaxConcurrency"
    )
    package_type = _text_or(props.get("PackageType"), "Zip") or "Zip"
    if package_type not in ("Zip", "Image"):
        raise ConfigError(
            f"template: function {logical_id}: PackageType {package_type!r} "
            "is neither Zip nor Image"
        )
    # SAM's ImageUri, or CloudFormation's Code.ImageUri.
    image_uri = _text_or(props.get("ImageUri") or _dict(props.get("Code")).get("ImageUri"), None)
    if image_uri is None and package_type == "Image":
        image_uri = f"{logical_id.lower()}:{_text_or(metadata.get('DockerTag'), 'latest')}"
    architectures = props.get("Architectures")
    alias = props.get("AutoPublishAlias")
    code_dir = _zip_code(logical_id, props, base_dir) if package_type == "Zip" else None
    return FunctionConfig(
        logical_id=logical_id,
        name=name if isinstance(name, str) else logical_id,
        timeout_s=_number(props.get("Timeout"), 3.0),
        memory_mb=int(_number(props.get("MemorySize"), 128)),
        ephemeral_mb=int(_number(_dict(props.get("EphemeralStorage")).get("Size"), 512)),
        environment=environment,
        reserved_concurrency=None if reserved in (None, UNRESOLVED) else int(_number(reserved, 0)),
        max_concurrency=max(1, int(_number(concurrency, 1))),
        has_url="FunctionUrlConfig" in props or logical_id in url_targets,
        # A first `sam deploy` publishes version 1 and points the alias at it.
        versions=("1",) if isinstance(alias, str) else (),
        aliases={alias: "1"} if isinstance(alias, str) else {},
        url_qualifier=alias if isinstance(alias, str) else None,
        package_type=package_type,
        handler=_text_or(props.get("Handler"), None),
        runtime=_text_or(props.get("Runtime"), None),
        architectures=(
            tuple(a for a in architectures if isinstance(a, str))
            if isinstance(architectures, list) and architectures
            else ("x86_64",)
        ),
        description=_text_or(props.get("Description"), "") or "",
        image_uri=image_uri,
        code_dir=code_dir,
    )


def _referenced(value: Any) -> str | None:
    """The logical id a `Ref` or `Fn::GetAtt` in `value` names."""
    ref = _find_key(value, "Ref") or (_find_key(value, "Fn::GetAtt") or [None])[0]
    return ref if isinstance(ref, str) else None


def _versions_and_aliases(
    resources: dict[str, Any], resolver: Resolver, functions: dict[str, FunctionConfig]
) -> dict[str, FunctionConfig]:
    """`functions` with the versions and aliases of the template's AWS::Lambda::Version
    and AWS::Lambda::Alias resources added."""
    versions = {logical_id: list(f.versions) for logical_id, f in functions.items()}
    aliases = {logical_id: dict(f.aliases) for logical_id, f in functions.items()}
    numbers: dict[str, str] = {}  # a Version resource's logical id -> its number
    for logical_id, resource in resources.items():
        if isinstance(resource, dict) and resource.get("Type") == "AWS::Lambda::Version":
            owner = _referenced(_dict(resource.get("Properties")).get("FunctionName"))
            if owner in versions:
                versions[owner].append(str(len(versions[owner]) + 1))
                numbers[logical_id] = versions[owner][-1]
    for resource in resources.values():
        if not isinstance(resource, dict) or resource.get("Type") != "AWS::Lambda::Alias":
            continue
        props = _dict(resource.get("Properties"))
        owner = _referenced(props.get("FunctionName"))
        name = resolver.resolve(props.get("Name"))
        pointed = props.get("FunctionVersion")
        version = numbers.get(_referenced(pointed) or "") or resolver.resolve(pointed)
        if owner in aliases and isinstance(name, str) and isinstance(version, str | int):
            aliases[owner][name] = str(version)
    return {
        logical_id: dataclasses.replace(
            f, versions=tuple(versions[logical_id]), aliases=aliases[logical_id]
        )
        for logical_id, f in functions.items()
    }


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _merge(globals_: dict[str, Any], props: dict[str, Any]) -> dict[str, Any]:
    merged = {**globals_, **props}
    variables = {
        **_dict(_dict(globals_.get("Environment")).get("Variables")),
        **_dict(_dict(props.get("Environment")).get("Variables")),
    }
    merged["Environment"] = {"Variables": variables}
    return merged


@dataclass(frozen=True)
class Template:
    functions: dict[str, FunctionConfig]
    # When it was read: every function's LastModified.
    loaded_at: float = field(default_factory=time.time)

    def find(self, name: str) -> FunctionConfig | None:
        """By logical id or FunctionName, also as an ARN or with a `:qualifier`."""
        name = split_name(name)[0]
        for function in self.functions.values():
            if name in (function.logical_id, function.name):
                return function
        return None

    def target(
        self, name: str, qualifier: str | None = None
    ) -> tuple[FunctionConfig | None, str | None, str | None]:
        """(function, qualifier, version) for a name and an optional `Qualifier`.

        function None: no such function; version None: no such version or alias.
        Raises QualifierMismatch when the name carries a qualifier other than `qualifier`.
        """
        base, named = split_name(name)
        if named is not None and qualifier is not None and named != qualifier:
            raise QualifierMismatch(
                "The derived qualifier from the function name does not match the "
                "specified qualifier."
            )
        asked = qualifier if qualifier is not None else named
        function = self.find(base)
        if function is None:
            return None, asked, None
        return function, asked, function.version_of(asked)

    def url_function(self) -> FunctionConfig:
        """The function behind the Function URL: one with a URL config, else the first."""
        with_url = [f for f in self.functions.values() if f.has_url]
        return (with_url or list(self.functions.values()))[0]


def parse_template(text: str, base_dir: Path | None = None) -> Template:
    """`base_dir`: what a CodeUri is relative to (the template's directory; else the cwd)."""
    base_dir = Path.cwd() if base_dir is None else base_dir
    try:
        # TagLoader is a SafeLoader: tags become plain dicts, never objects.
        document = yaml.load(text, Loader=TagLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"template: not valid YAML: {exc}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("Resources"), dict):
        raise ConfigError("template: no Resources section")
    resolver = Resolver(document)
    globals_ = _dict(resolver.resolve(_dict(_dict(document.get("Globals")).get("Function"))))
    resources = document["Resources"]
    url_targets: set[str] = set()
    for resource in resources.values():
        if isinstance(resource, dict) and resource.get("Type") == "AWS::Lambda::Url":
            target = _dict(resource.get("Properties")).get("TargetFunctionArn")
            ref = _find_key(target, "Ref") or (_find_key(target, "Fn::GetAtt") or [None])[0]
            if isinstance(ref, str):
                url_targets.add(ref)
    functions: dict[str, FunctionConfig] = {}
    for logical_id, resource in resources.items():
        if not isinstance(resource, dict) or resource.get("Type") not in FUNCTION_TYPES:
            continue
        if "Condition" in resource and resolver.condition(resource["Condition"]) is False:
            continue  # not deployed with the parameter defaults
        props = resolver.resolve(resource.get("Properties") or {})
        if not isinstance(props, dict):
            continue
        metadata = _dict(resolver.resolve(_dict(resource.get("Metadata"))))
        functions[logical_id] = _function(
            logical_id, _merge(globals_, props), url_targets, metadata, base_dir
        )
    if not functions:
        raise ConfigError("template: no AWS::Serverless::Function or AWS::Lambda::Function")
    return Template(_versions_and_aliases(resources, resolver, functions))


def load_template(path: Path) -> Template:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"template {path}: {exc.strerror}") from exc
    return parse_template(text, path.parent)
