"""The handler API's declarations: `@bundle`, `@handler` and the specs they attach.

The decorators only attach a spec to the function (runtime/registry/discovery.py
collects them); the rules a declaration must follow are checked here, when the
handler module is imported, so a mistake names its handler at once.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from runtime.registry.policies import Batch, Decode, Steps, alone
from runtime.wire.openai_spec import OpenAI

F = TypeVar("F", bound=Callable[..., Any])

# Parameters a builder may declare, bound by name when it runs.
BUILDER_PARAMS = frozenset({"weights", "config", "device", "files", "manifest"})
SPEC_ATTR = "__thaw_spec__"


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
        setattr(fn, SPEC_ATTR, BuilderSpec(name, fn, params))
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
        setattr(fn, SPEC_ATTR, spec)
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
    setattr(fn, SPEC_ATTR, spec)
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
