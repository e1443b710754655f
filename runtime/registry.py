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
handler modules and collects the specs into a `Registry`. Handler modules must
not import torch at module level (do it inside builders), so discovery stays
cheap and the control interface starts without torch.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from runtime.errors import ConfigError, UnknownHandler

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
class Batch:
    """A handler's batching policy (runtime/dispatch/batcher.py).

    Concurrent requests share one call of up to `max_size` events. A batch
    waits for the company it expects (as many requests as the handler's last
    batch held) at most `max_wait_ms`: a request that comes alone runs at
    once. At most `max_concurrent` batches of the handler run at a time;
    later ones queue and go when one ends (a request whose deadline comes is
    never held for either).
    """

    max_size: int = 32
    max_wait_ms: float = 5.0
    max_concurrent: int = 1

    def __post_init__(self) -> None:
        for name in ("max_size", "max_concurrent"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Batch.{name} must be an int >= 1, not {value!r}")
        if not self.max_wait_ms >= 0:  # also refuses NaN
            raise ValueError(f"Batch.max_wait_ms must be >= 0, not {self.max_wait_ms}")

    @property
    def max_wait_s(self) -> float:
        return self.max_wait_ms / 1000

    def describe(self) -> dict[str, Any]:
        return {
            "max_size": self.max_size,
            "max_wait_ms": self.max_wait_ms,
            "max_concurrent": self.max_concurrent,
        }


@dataclass(frozen=True)
class Decode:
    """A step-level handler's scheduling policy (runtime/dispatch/decode.py): at most
    `max_sequences` sequences share a step; later callers wait, in arrival order,
    and are admitted between steps as sequences end."""

    max_sequences: int = 16

    def __post_init__(self) -> None:
        value = self.max_sequences
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Decode.max_sequences must be an int >= 1, not {value!r}")

    def describe(self) -> dict[str, Any]:
        return {"max_sequences": self.max_sequences}


class Steps(Protocol):
    """Generation as steps, called on handler threads: `step` of the held sequences
    on one, one call at a time per model; a new sequence's `prefill` and its first
    `step([it])` on another, beside them (runtime/dispatch/decode.py). Never two
    calls for the same sequence at once; `release` may come from either thread.

    A sequence is whatever object the handler keeps per caller (its tokens, its
    cache, its sampler). Where a list is returned, it has one entry per input, in
    order, and an entry may be an exception: it fails only that caller (InvalidInput:
    400). An exception raised by the call itself fails every sequence in it.
    """

    def prefill(self, events: list[Any], ctxs: list[Any]) -> list[Any]:
        """Start one sequence per event (check it, run its prompt): the sequences."""
        ...

    def step(self, sequences: list[Any]) -> list[Any]:
        """Advance each by one token: per sequence, the list of items it yields now
        (maybe none: text held back), or an exception."""
        ...

    def finished(self, sequence: Any) -> bool:
        """It ended (a stop condition): it takes no more steps."""
        ...

    def release(self, sequence: Any) -> None:
        """Free what it holds (its KV cache); called once for every sequence started."""
        ...


def alone(make_steps: Callable[..., Steps]) -> Callable[..., Any]:
    """A step-level handler as a generator for one call: the same steps, one sequence."""

    def run(event: Any, *args: Any) -> Any:
        *models, ctx = args
        steps = make_steps(*models)
        [sequence] = steps.prefill([event], [ctx])
        if isinstance(sequence, BaseException):
            raise sequence
        try:
            while True:
                [items] = steps.step([sequence])
                if isinstance(items, BaseException):
                    raise items
                yield from items
                if steps.finished(sequence):
                    return
        finally:
            steps.release(sequence)

    return run


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
    """

    def decorate(fn: F) -> F:
        uses_t = tuple(uses)
        if decode is not None:
            return _decode_handler(fn, name, uses_t, decode, warmup, accelerator_warmup, join)
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
        )
        setattr(fn, _SPEC_ATTR, spec)
        return fn

    return decorate


def _decode_handler(
    fn: F,
    name: str,
    uses: tuple[str, ...],
    decode: Decode,
    warmup: Examples,
    accelerator_warmup: Examples,
    join: Callable[[list[Any]], Any] | None,
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
        warmup=_examples(warmup),
        accelerator_warmup=_examples(accelerator_warmup),
        description=(inspect.getdoc(fn) or "").split("\n")[0],
        stream_fn=one,
        join=rule,
        decode=decode,
        make_steps=fn,
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
        try:
            return self.handlers[name]
        except KeyError:
            raise UnknownHandler(f"no handler named {name!r}") from None

    def builder(self, bundle_name: str) -> BuilderSpec | None:
        return self.builders.get(bundle_name)

    def users_of(self, bundle_name: str) -> list[HandlerSpec]:
        return [h for h in self.handlers.values() if bundle_name in h.uses]

    def bundle_names(self) -> set[str]:
        return {b for h in self.handlers.values() for b in h.uses}

    def check(self) -> None:
        """Every bundle a handler uses has a builder."""
        for h in self.handlers.values():
            for b in h.uses:
                if b not in self.builders:
                    raise ConfigError(f"handler {h.name!r} uses bundle {b!r}, which has no builder")


def _collect(module: Any, registry: Registry) -> None:
    for value in vars(module).values():
        spec = getattr(value, _SPEC_ATTR, None)
        if isinstance(spec, BuilderSpec | HandlerSpec):
            registry.add(spec, module.__name__)


def discover(modules: Iterable[str] = ()) -> Registry:
    """Import handler modules (default: every module of the `handlers` package)."""
    names = list(modules)
    if not names:
        package = importlib.import_module("handlers")
        names = [
            f"handlers.{info.name}"
            for info in pkgutil.iter_modules(package.__path__)
            if not info.name.startswith("_") and not info.ispkg
        ]
    registry = Registry()
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"cannot import handler module {name!r}: {exc}") from exc
        _collect(module, registry)
    registry.check()
    return registry
