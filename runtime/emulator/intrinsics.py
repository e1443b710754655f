"""CloudFormation's intrinsic functions, as far as a template alone resolves them.

Short-form tags (`!Ref`, `!Sub`, `!If`, ...) are read as their long forms
(`TagLoader`), and `Resolver` evaluates `Ref` to a parameter's Default or a
pseudo parameter (us-east-1, account 123456789012), `Sub`, `Join`, `Select`,
`FindInMap`, `If` with `Equals`/`Not`/`And`/`Or` conditions. What needs a
deployed stack (`GetAtt`, `ImportValue`, a `Ref` to a resource) is
`UNRESOLVED`; template.py decides what that means for each setting.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import yaml

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


class TagLoader(yaml.SafeLoader):
    """SafeLoader that reads `!Name value` as CloudFormation's `{"Fn::Name": value}`."""


def _construct_tag(loader: TagLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
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


TagLoader.add_multi_constructor("!", _construct_tag)


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
            return str(arg[0]).join(as_text(p) for p in parts)
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
            return UNRESOLVED if UNRESOLVED in (a, b) else as_text(a) == as_text(b)
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
            return as_text(value)

        result = _SUB_VAR.sub(lookup, text).replace("${!", "${")
        return UNRESOLVED if missing else result


def as_text(value: Any) -> str:
    """A scalar as CloudFormation writes it into a string (booleans lowercase)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
