"""Function settings from a SAM / CloudFormation template.

Reads every `AWS::Serverless::Function` and `AWS::Lambda::Function` (those
whose `Condition` is false with the parameter defaults are left out): Timeout,
MemorySize, EphemeralStorage, Environment.Variables (merged over `Globals.Function`),
ReservedConcurrentExecutions, FunctionName and the per-instance concurrency
(`PerExecutionEnvironmentMaxConcurrency`, or AWS_LAMBDA_MAX_CONCURRENCY in the
environment). Short-form tags (`!Ref`,
`!Sub`, `!If`, ...) are read as their long forms, and intrinsics are resolved
as far as a template alone allows: `Ref` to a parameter's Default or a pseudo
parameter (us-east-1, account 123456789012), `Sub`, `Join`, `Select`,
`FindInMap`, `If` with `Equals`/`Not`/`And`/`Or` conditions. What needs a
deployed stack (`GetAtt`, `ImportValue`, a `Ref` to a resource) is
unresolvable: such an environment variable is left out, such a setting takes
Lambda's default.
"""

from __future__ import annotations

import re
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
    # /tmp's size (EphemeralStorage.Size); only a container instance is held to it.
    ephemeral_mb: int = 512
    environment: dict[str, str] = field(default_factory=dict)
    reserved_concurrency: int | None = None
    # Invocations one instance takes at once (AWS_LAMBDA_MAX_CONCURRENCY).
    max_concurrency: int = 1
    has_url: bool = False

    @property
    def arn(self) -> str:
        return f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{self.name}"


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


def _function(logical_id: str, props: dict[str, Any], url_targets: set[str]) -> FunctionConfig:
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
    )


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

    def find(self, name: str) -> FunctionConfig | None:
        """By logical id or FunctionName, also as an ARN or with a `:qualifier`."""
        if name.startswith("arn:"):
            parts = name.split(":")
            name = parts[6] if len(parts) > 6 else ""
        else:
            name = name.split(":", 1)[0]
        for function in self.functions.values():
            if name in (function.logical_id, function.name):
                return function
        return None

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
        functions[logical_id] = _function(logical_id, _merge(globals_, props), url_targets)
    if not functions:
        raise ConfigError("template: no AWS::Serverless::Function or AWS::Lambda::Function")
    return Template(functions)


def load_template(path: Path) -> Template:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"template {path}: {exc.strerror}") from exc
    return parse_template(text)
