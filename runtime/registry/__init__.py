"""The handler API and its discovery.

    from runtime import Context, bundle, handler

    @bundle("tiny-mlp")
    def build(weights, config, device):           # once per instance per bundle version
        ...

    @handler("predict", uses=["tiny-mlp"], warmup=[{"x": [0.0, 0.0]}])
    def predict(event, mlp, ctx):                  # models positional, in `uses` order
        ...

A handler that is a generator (sync or async) streams: each item it yields
reaches a streaming caller as soon as it exists (runtime/dispatch/streams.py),
and a caller that asked for no stream gets `join(items)`, the rule the handler
declares (default: the list of items). One handler serves both:

    @handler("count", join=lambda items: {"text": "".join(items)})
    def count(event, ctx):
        for i in range(event["n"]):
            yield str(i)

A handler may instead declare its work as decode steps (`decode=Decode(...)`):
concurrent calls then share every step (continuous batching,
runtime/dispatch/decode.py). Its function takes the models only and returns
the `Steps` that run them:

    @handler("generate", uses=["smollm2"], decode=Decode(max_sequences=16), join=...)
    def generate(smollm2):
        return GenerateSteps(smollm2)

Such a handler streams (each step's items reach their own caller), and any
path that runs one call on its own (a warm-up example, a direct call of
`spec.fn`) runs the same steps for one sequence (`alone`).

`warmup` may also be a function returning the examples, called on first use:
for examples that take a while to build (discovery runs before the server
listens).

Warm-up is the smallest set of inputs that pays each one-time cost of a path
(kernel and allocator set-up, decoder plugins, tokenizer caches) before any
request does; on a CPU that is a few milliseconds per path, and large inputs
buy nothing. `accelerator_warmup` lists examples run only when the bundle
loads onto an accelerator (CUDA), after `warmup`: there the first call of
each large shape pays its own kernel selection and autotuning, so the large
shapes a handler serves belong there.

The decorators only attach a spec to the function; `discover()` imports the
handler modules and collects the specs into a `Registry`. A module whose
import raises is recorded (`Registry.broken`, runtime/registry/broken.py) and
the others are served; only when none imports is discovery an error. Handler modules must
not import torch at module level (do it inside builders), so discovery stays
cheap and the control interface starts without torch.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from runtime.errors import BrokenHandler, ConfigError, UnknownHandler
from runtime.registry.broken import BrokenModule, broken_module

# Re-exported: part of the handler API, as they always were.
from runtime.registry.policies import Batch as Batch
from runtime.registry.policies import Decode as Decode
from runtime.registry.policies import Steps as Steps
from runtime.registry.policies import alone as alone
from runtime.wire.openai_spec import OpenAI, clash

F = TypeVar("F", bound=Callable[..., Any])

# Parameters a builder may declare, bound by name when it runs.
BUILDER_PARAMS = frozenset({"weights", "config", "device", "files", "manifest"})
_SPEC_ATTR = "__thaw_spec__"


@dataclass(frozen=True)
class BuilderSpec:
    bundle: str
    fn: Callable[..., Any]
    params: tuple[str, ...]

    def call(self, available: Mapping[str, Any]) -> Any:
        return self.fn(**{name: available[name] for name in self.params})


class LazyExamples(Sequence[dict[str, Any]]):
    """Warm-up examples made by `make()` on first use."""

    def __init__(self, make: Callable[[], Iterable[dict[str, Any]]]) -> None:
        self._make = make

    @functools.cached_property
    def _examples(self) -> tuple[dict[str, Any], ...]:
        return tuple(dict(w) for w in self._make())

    def __getitem__(self, index: Any) -> Any:
        return self._examples[index]

    def __len__(self) -> int:
        return len(self._examples)


@dataclass(frozen=True)
class HandlerSpec:
    name: str
    fn: Callable[..., Any]
    uses: tuple[str, ...] = ()
    warmup: Sequence[dict[str, Any]] = ()
    # Run after `warmup`, on an accelerator only (large shapes: autotuning per shape).
    accelerator_warmup: Sequence[dict[str, Any]] = ()
    is_async: bool = False
    description: str = ""
    # Set: `fn(events, *models, ctxs)` takes lists and returns a list of outputs.
    batch: Batch | None = None
    # A generator handler: `fn` is it joined (what every non-streaming path calls),
    # `stream_fn` the generator itself, and `join` the rule between them.
    stream_fn: Callable[..., Any] | None = None
    join: Callable[[list[Any]], Any] | None = None
    # Set: a step-level handler; `make_steps(*models)` is its `Steps`.
    decode: Decode | None = None
    make_steps: Callable[..., Steps] | None = None
    # The OpenAI routes it serves (runtime/wire/openai_spec.py).
    openai: OpenAI | None = None

    @property
    def streams(self) -> bool:
        return self.stream_fn is not None

    def warmup_for(self, device: str) -> list[dict[str, Any]]:
        """The examples a load onto `device` runs, in order."""
        examples = list(self.warmup)
        if not device.startswith("cpu"):
            examples += self.accelerator_warmup
        return examples


def bundle(name: str) -> Callable[[F], F]:
    """Declare `fn` as the builder of bundle `name`: weights -> model object."""

    def decorate(fn: F) -> F:
        params = tuple(inspect.signature(fn).parameters)
        unknown = [p for p in params if p not in BUILDER_PARAMS]
        if unknown:
            raise TypeError(
                f"builder {fn.__qualname__} for {name!r}: unknown parameter {unknown[0]!r} "
                f"(builders may take {sorted(BUILDER_PARAMS)})"
            )
        setattr(fn, _SPEC_ATTR, BuilderSpec(name, fn, params))
        return fn

    return decorate


Examples = Iterable[dict[str, Any]] | Callable[[], Iterable[dict[str, Any]]]


def _examples(given: Examples) -> Sequence[dict[str, Any]]:
    return LazyExamples(given) if callable(given) else tuple(dict(w) for w in given)


def handler(
    name: str,
    *,
    uses: Iterable[str] = (),
    warmup: Examples = (),
    accelerator_warmup: Examples = (),
    batch: Batch | None = None,
    join: Callable[[list[Any]], Any] | None = None,
    decode: Decode | None = None,
    openai: OpenAI | str | Iterable[str] | None = None,
) -> Callable[[F], F]:
    """Declare `fn(event, *models, ctx)` as handler `name`.

    With `batch`, `fn(events, *models, ctxs)` is called with a list of events
    (and their contexts, in the same order) and returns a list of as many
    outputs; an item may be an exception (e.g. InvalidInput) that only its own
    caller gets. Warm-up examples are single events, each run as a batch of one.

    A generator `fn` streams its items; `join(items)` is the output of a call
    that asked for no stream (default: the list of items). A handler streams
    or batches, not both: a stream is one caller's.

    With `decode`, `fn(*models)` returns the handler's `Steps` (see the module doc).
    With `openai`, it also serves those OpenAI routes (runtime/wire/openai_spec.py).
    """
    declared = OpenAI.of(openai)

    def decorate(fn: F) -> F:
        uses_t = tuple(uses)
        if decode is not None:
            return _decode_handler(
                fn, name, uses_t, decode, (warmup, accelerator_warmup), join, declared
            )
        arity = len(inspect.signature(fn).parameters)
        if arity != len(uses_t) + 2:
            first, last = ("events", "ctxs") if batch is not None else ("event", "ctx")
            raise TypeError(
                f"handler {name!r} takes {arity} parameters; expected {first}, "
                f"{len(uses_t)} model(s) for {list(uses_t)}, {last}"
            )
        if batch is not None and not isinstance(batch, Batch):
            raise TypeError(f"handler {name!r}: batch must be a runtime.Batch, not {batch!r}")
        streams = inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)
        if join is not None and not streams:
            raise TypeError(f"handler {name!r} declares join= but is not a generator")
        if streams and batch is not None:
            raise TypeError(f"handler {name!r} is a generator: a streaming handler cannot batch")
        rule = (join or list) if streams else None
        spec = HandlerSpec(
            name=name,
            fn=joined(fn, rule) if rule is not None else fn,
            uses=uses_t,
            warmup=_examples(warmup),
            accelerator_warmup=_examples(accelerator_warmup),
            is_async=inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn),
            description=(inspect.getdoc(fn) or "").split("\n")[0],
            batch=batch,
            stream_fn=fn if streams else None,
            join=rule,
            openai=declared,
        )
        setattr(fn, _SPEC_ATTR, spec)
        return fn

    return decorate


def _decode_handler(
    fn: F,
    name: str,
    uses: tuple[str, ...],
    decode: Decode,
    warmups: tuple[Examples, Examples],
    join: Callable[[list[Any]], Any] | None,
    declared: OpenAI | None,
) -> F:
    if not isinstance(decode, Decode):
        raise TypeError(f"handler {name!r}: decode must be a runtime.Decode, not {decode!r}")
    arity = len(inspect.signature(fn).parameters)
    if arity != len(uses):
        raise TypeError(
            f"handler {name!r} declares decode= and takes {arity} parameters; expected "
            f"{len(uses)} model(s) for {list(uses)}"
        )
    if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn):
        raise TypeError(f"handler {name!r} declares decode=: it must return its Steps")
    rule = join or list
    one = alone(fn)
    spec = HandlerSpec(
        name=name,
        fn=joined(one, rule),
        uses=uses,
        warmup=_examples(warmups[0]),
        accelerator_warmup=_examples(warmups[1]),
        description=(inspect.getdoc(fn) or "").split("\n")[0],
        stream_fn=one,
        join=rule,
        decode=decode,
        make_steps=fn,
        openai=declared,
    )
    setattr(fn, _SPEC_ATTR, spec)
    return fn


def joined(fn: Callable[..., Any], join: Callable[[list[Any]], Any]) -> Callable[..., Any]:
    """Generator handler `fn` as a plain one: its items, joined (sync or async alike)."""
    if inspect.isasyncgenfunction(fn):

        async def run_async(*args: Any) -> Any:
            return join([item async for item in fn(*args)])

        return functools.wraps(fn)(run_async)

    def run(*args: Any) -> Any:
        return join(list(fn(*args)))

    return functools.wraps(fn)(run)


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
        spec = getattr(value, _SPEC_ATTR, None)
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
