"""Discovery: the handler modules imported, their specs collected into a `Registry`.

A module whose import raises is recorded (`Registry.broken`, runtime/registry/broken.py)
and the others are served; only when none imports is discovery an error.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from runtime.errors import BrokenHandler, ConfigError, UnknownHandler
from runtime.registry.broken import BrokenModule, broken_module
from runtime.registry.specs import SPEC_ATTR, BuilderSpec, HandlerSpec
from runtime.wire.openai_spec import clash


@dataclass
class Registry:
    builders: dict[str, BuilderSpec] = field(default_factory=dict)
    handlers: dict[str, HandlerSpec] = field(default_factory=dict)
    # Handler modules that failed to import: their handlers are not served.
    broken: list[BrokenModule] = field(default_factory=list)

    def add(self, spec: BuilderSpec | HandlerSpec, origin: str) -> None:
        if isinstance(spec, BuilderSpec):
            if spec.bundle in self.builders and self.builders[spec.bundle].fn is not spec.fn:
                raise ConfigError(f"two builders for bundle {spec.bundle!r} (second in {origin})")
            self.builders[spec.bundle] = spec
        else:
            if spec.name in self.handlers and self.handlers[spec.name].fn is not spec.fn:
                raise ConfigError(f"two handlers named {spec.name!r} (second in {origin})")
            self.handlers[spec.name] = spec

    def handler(self, name: str) -> HandlerSpec:
        """Handler `name`; BrokenHandler (500) when a module that failed to import
        declares it, else UnknownHandler (404), naming any broken module."""
        spec = self.handlers.get(name)
        if spec is not None:
            return spec
        for broken in self.broken:
            if name in broken.handlers:
                raise BrokenHandler(
                    f"handler {name!r} is not served: its module {broken.summary()}",
                    module=broken.module,
                )
        hint = "; ".join(b.summary() for b in self.broken)
        hint = f" (handler modules that failed to import: {hint})" if hint else ""
        raise UnknownHandler(f"no handler named {name!r}{hint}")

    def builder(self, bundle_name: str) -> BuilderSpec | None:
        return self.builders.get(bundle_name)

    def users_of(self, bundle_name: str) -> list[HandlerSpec]:
        return [h for h in self.handlers.values() if bundle_name in h.uses]

    def bundle_names(self) -> set[str]:
        return {b for h in self.handlers.values() for b in h.uses}

    def check(self) -> None:
        """Every bundle a handler uses has a builder; a handler whose builder is in a
        broken module is not served either (it joins that module's handlers); an
        OpenAI model name is one handler's."""
        if found := clash((h.name, h.openai) for h in self.handlers.values() if h.openai):
            raise ConfigError(found)
        for h in list(self.handlers.values()):
            for b in h.uses:
                if b in self.builders:
                    continue
                owner = next((i for i, m in enumerate(self.broken) if b in m.bundles), None)
                if owner is None:
                    raise ConfigError(f"handler {h.name!r} uses bundle {b!r}, which has no builder")
                module = self.broken[owner]
                self.broken[owner] = replace(module, handlers=(*module.handlers, h.name))
                del self.handlers[h.name]
                break


def _collect(module: Any, registry: Registry) -> None:
    for value in vars(module).values():
        spec = getattr(value, SPEC_ATTR, None)
        if isinstance(spec, BuilderSpec | HandlerSpec):
            registry.add(spec, module.__name__)


def discover(modules: Iterable[str] = ()) -> Registry:
    """Import handler modules (default: every module of the `handlers` package).

    A module whose import raises is recorded in `broken` and the rest served;
    ConfigError when no module imports (there would be nothing to serve)."""
    names = list(modules)
    if not names:
        try:
            package = importlib.import_module("handlers")
        except ModuleNotFoundError as exc:
            if exc.name != "handlers":
                summary = broken_module("handlers", exc).summary()
                raise ConfigError(f"cannot import {summary}") from exc
            raise ConfigError(
                "no `handlers` package to serve: run thaw in a function project (a directory "
                "whose pyproject.toml has [tool.thaw]; `thaw init PATH` makes one), or name "
                "handler modules in THAW_HANDLERS"
            ) from exc
        except Exception as exc:  # its __init__ is user code too
            raise ConfigError(f"cannot import {broken_module('handlers', exc).summary()}") from exc
        names = [
            f"handlers.{info.name}"
            for info in pkgutil.iter_modules(package.__path__)
            if not info.name.startswith("_") and not info.ispkg
        ]
    registry = Registry()
    imported = 0
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # a SyntaxError as much as an ImportError: user code
            registry.broken.append(broken_module(name, exc))
            continue
        imported += 1
        _collect(module, registry)
    if registry.broken and not imported:
        first = registry.broken[0]
        causes = "; ".join(b.summary() for b in registry.broken)
        raise ConfigError(f"cannot import handler module {causes}") from first.cause
    registry.check()
    return registry
