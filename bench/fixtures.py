"""Handlers the benchmarks load into a real `thaw serve` (THAW_HANDLERS=bench.fixtures).

`echo_sync` is `handlers.echo` as a plain `def`: the warm-overhead benchmark
prices the worker-thread hand-off of sync handlers with it.

Bundles `flight` and `slow` share one builder: it sleeps `config["sleep_s"]`
(standing in for fetch-to-init work) and stamps when it finished. Handlers of
the same names answer when they started running and when their model was
built, both wall-clock, so a benchmark can split a waiter's latency into the
runtime's wake-up (READY -> handler running) and the HTTP answer after it.
"""

from __future__ import annotations

import time
from typing import Any

from runtime import Context, bundle, handler


class Stamp:
    def __init__(self, built_at: float) -> None:
        self.built_at = built_at


def _build(config: dict[str, Any]) -> Stamp:
    time.sleep(float(config.get("sleep_s", 0.0)))
    return Stamp(time.time())


def _run(model: Stamp) -> dict[str, float]:
    return {"ran_at": time.time(), "built_at": model.built_at}


@bundle("flight")
def build_flight(config: dict[str, Any]) -> Stamp:
    return _build(config)


@bundle("slow")
def build_slow(config: dict[str, Any]) -> Stamp:
    return _build(config)


@handler("flight", uses=["flight"])
def flight(event: Any, model: Stamp, ctx: Context) -> dict[str, float]:
    return _run(model)


@handler("flight_async", uses=["flight"])
async def flight_async(event: Any, model: Stamp, ctx: Context) -> dict[str, float]:
    return _run(model)


@handler("slow", uses=["slow"])
def slow(event: Any, model: Stamp, ctx: Context) -> dict[str, float]:
    return _run(model)


@handler("echo_sync")
def echo_sync(event: Any, ctx: Context) -> Any:
    return event
