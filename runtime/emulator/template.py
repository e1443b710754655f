"""Function settings from a SAM / CloudFormation template.

Reads every `AWS::Serverless::Function` and `AWS::Lambda::Function` (those
whose `Condition` is false with the parameter defaults are left out): Timeout,
MemorySize, EphemeralStorage, Environment.Variables (merged over `Globals.Function`),
ReservedConcurrentExecutions, FunctionName and the per-sandbox concurrency
(`PerExecutionEnvironmentMaxConcurrency`, or AWS_LAMBDA_MAX_CONCURRENCY in the
environment). Short-form tags (`!Ref`,
`!Sub`, `!If`, ...) are read as their long forms, and intrinsics are resolved
as far as a template alone allows: `Ref` to a parameter's Default or a pseudo
parameter (us-east-1, account 123456789012), `Sub`, `Join`, `Select`,
`FindInMap`, `If` with `Equals`/`Not`/`And`/`Or` conditions. What needs a
deployed stack (`GetAtt`, `ImportValue`, a `Ref` to a resource) is
unresolvable: such an environment variable is left out, such a setting takes
Lambda's default.

Versions and aliases, for the Invoke API's `Qualifier` and `ExecutedVersion`:
`AutoPublishAlias: NAME` publishes version 1 and points alias NAME at it (as a
first `sam deploy` does); each `AWS::Lambda::Version` of a function publishes
the next number, in the template's order; an `AWS::Lambda::Alias` names the
version its `FunctionVersion` gives (a number, `$LATEST`, or a `!GetAtt` /
`!Ref` of one of those versions). Every version runs the template's code.
What GetFunction and ListFunctions describe besides (PackageType, Handler,
Runtime, Architectures, Description, the image) is read here too.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runtime.errors import ConfigError

FUNCTION_TYPES = frozenset({"AWS::Serverless::Function", "AWS::Lambda::Function"})
REGION = "us-east-1"
ACCOUNT = "123456789012"
PSEUDO = {
    "AWS::Region": REGION,
    "AWS::AccountId": ACCOUNT,
    "AWS::Partition": "aws",
    "AWS::URLSuffix": "amazonaws.com",
    "AWS::StackName": "local",
    "AWS::StackId": f"arn:aws:cloudformation:{REGION}:{ACCOUNT}:stack/local/local",
}
_SUB_VAR = re.compile(r"\$\{([^!}][^}]*)\}")


class _Unresolved:
    def __repr__(self) -> str:
        return "UNRESOLVED"


UNRESOLVED: Any = _Unresolved()


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `!Name value` as CloudFormation's `{"Fn::Name": value}`."""


def _construct_tag(loader: _Loader, suffix: str, node: yaml.Node) -> dict[str, Any]:
    value: Any
    if isinstance(node, yaml.ScalarNode):
        value = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        assert isinstance(node, yaml.MappingNode)
        value = loader.construct_mapping(node, deep=True)
    if suffix in ("Ref", "Condition"):
        return {suffix: value}
    if suffix == "GetAtt" and isinstance(value, str):
        value = value.split(".", 1)
    return {f"Fn::{suffix}": value}


_Loader.add_multi_constructor("!", _construct_tag)


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


class Resolver:
    """Evaluates the intrinsics a template can answer without a deployed stack."""

    def __init__(self, template: Mapping[str, Any]) -> None:
        self.parameters = template.get("Parameters") or {}
        self.conditions = template.get("Conditions") or {}
        self.mappings = template.get("Mappings") or {}

    def resolve(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            ((key, arg),) = value.items()
            if key == "Ref":
                return self._ref(arg)
            if key == "Condition":
                return self.condition(arg)
            if key.startswith("Fn::"):
                try:
                    return self._function(key[4:], arg)
                except (TypeError, ValueError, KeyError, IndexError, AttributeError):
                    return UNRESOLVED
        return {k: self.resolve(v) for k, v in value.items()}

    def _ref(self, name: Any) -> Any:
        if not isinstance(name, str):
            return UNRESOLVED
        if name in PSEUDO:
            return PSEUDO[name]
        parameter = self.parameters.get(name)
        if isinstance(parameter, dict) and "Default" in parameter:
            return self.resolve(parameter["Default"])
        return UNRESOLVED

    def condition(self, name: Any) -> Any:
        if not isinstance(name, str) or name not in self.conditions:
            return UNRESOLVED
        return self._truth(self.conditions[name])

    def _truth(self, value: Any) -> Any:
        result = self.resolve(value)
        return result if isinstance(result, bool) else UNRESOLVED

    def _function(self, name: str, arg: Any) -> Any:
        if name == "Sub":
            text, variables = (arg, {}) if isinstance(arg, str) else (arg[0], arg[1])
            return self._sub(text, {k: self.resolve(v) for k, v in variables.items()})
        if name == "Join":
            parts = self.resolve(arg[1])
            if parts is UNRESOLVED or any(p is UNRESOLVED for p in parts):
                return UNRESOLVED
            return str(arg[0]).join(_text(p) for p in parts)
        if name == "Select":
            items = self.resolve(arg[1])
            return UNRESOLVED if items is UNRESOLVED else items[int(self.resolve(arg[0]))]
        if name == "FindInMap":
            keys = [self.resolve(a) for a in arg]
            return self.mappings[keys[0]][keys[1]][keys[2]]
        if name == "If":
            chosen = self.condition(arg[0])
            return UNRESOLVED if chosen is UNRESOLVED else self.resolve(arg[1 if chosen else 2])
        if name == "Equals":
            a, b = self.resolve(arg[0]), self.resolve(arg[1])
            return UNRESOLVED if UNRESOLVED in (a, b) else _text(a) == _text(b)
        if name in ("Not", "And", "Or"):
            values = [self._truth(a) for a in arg]
            if any(v is UNRESOLVED for v in values):
                return UNRESOLVED
            return not values[0] if name == "Not" else (all if name == "And" else any)(values)
        return UNRESOLVED  # GetAtt, ImportValue, GetAZs, ...: need a deployed stack

    def _sub(self, text: str, variables: Mapping[str, Any]) -> Any:
        missing = False

        def lookup(match: re.Match[str]) -> str:
            nonlocal missing
            name = match.group(1).strip()
            value = variables[name] if name in variables else self._ref(name)
            if value is UNRESOLVED:
                missing = True
                return ""
            return _text(value)

        result = _SUB_VAR.sub(lookup, text).replace("${!", "${")
        return UNRESOLVED if missing else result


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


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


def _function(
    logical_id: str, props: dict[str, Any], url_targets: set[str], metadata: dict[str, Any]
) -> FunctionConfig:
    variables = props["Environment"]["Variables"]
    environment = {
        str(k): _text(v)
        for k, v in variables.items()
        if v is not UNRESOLVED and not isinstance(v, dict | list)
    }
    name = props.get("FunctionName")
    reserved = props.get("ReservedConcurrentExecutions")
    concurrency = environment.get("AWS_LAMBDA_MAX_CONCURRENCY") or _find_key(
        props, "PerExecutionEnvironmentMaxConcurrency"
    )
    package_type = _text_or(props.get("PackageType"), "Zip") or "Zip"
    # SAM's ImageUri, or CloudFormation's Code.ImageUri.
    image_uri = _text_or(props.get("ImageUri") or _dict(props.get("Code")).get("ImageUri"), None)
    if image_uri is None and package_type == "Image":
        image_uri = f"{logical_id.lower()}:{_text_or(metadata.get('DockerTag'), 'latest')}"
    architectures = props.get("Architectures")
    alias = props.get("AutoPublishAlias")
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


def parse_template(text: str) -> Template:
    try:
        # _Loader is a SafeLoader: tags become plain dicts, never objects.
        document = yaml.load(text, Loader=_Loader)
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
            logical_id, _merge(globals_, props), url_targets, metadata
        )
    if not functions:
        raise ConfigError("template: no AWS::Serverless::Function or AWS::Lambda::Function")
    return Template(_versions_and_aliases(resources, resolver, functions))


def load_template(path: Path) -> Template:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"template {path}: {exc.strerror}") from exc
    return parse_template(text)
