"""How a handler's calls are scheduled: a batch policy, or decode steps.

Part of the handler API (`from runtime import Batch, Decode`): runtime/registry
re-exports these; the schedulers that follow them live in runtime/dispatch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


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
    and are admitted between steps as sequences end.

    While a new sequence's prompt is prefilled, the held sequences' next step
    waits for it, at most `prefill_pause_s` (None: as long as the last step took,
    so no held sequence waits more than one extra step; 0: never): the prompt, and
    with it the new caller's first token, then runs without the steps contending
    with it for the interpreter.
    """

    max_sequences: int = 16
    prefill_pause_s: float | None = None

    def __post_init__(self) -> None:
        value = self.max_sequences
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Decode.max_sequences must be an int >= 1, not {value!r}")
        pause = self.prefill_pause_s
        if pause is not None and (
            isinstance(pause, bool) or not isinstance(pause, int | float) or not pause >= 0
        ):
            raise ValueError(f"Decode.prefill_pause_s must be None or >= 0, not {pause!r}")

    def describe(self) -> dict[str, Any]:
        return {"max_sequences": self.max_sequences, "prefill_pause_s": self.prefill_pause_s}


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
