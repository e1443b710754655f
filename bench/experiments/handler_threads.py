"""The handler threads' hand-off: Thaw's pool against `ThreadPoolExecutor` (issue 29, part 1).

    .venv/bin/python bench/experiments/handler_threads.py [--rounds 5] [--calls 3000] [--callers 8]

In one process: an event loop runs `--callers` coroutines, each submitting a
no-op call to the pool and awaiting its answer (brought back to the loop with
`call_soon_threadsafe`, as runtime/dispatch/calls.py does), `--calls` times,
so that many calls are in flight at once: a busy server's sync handlers,
without the HTTP around them. Thaw's `HandlerThreads` and the standard
library's `ThreadPoolExecutor` (the bare app's pool, 64 threads) run in turn,
`--rounds` times each, medians. Reported: calls/s, and the process's voluntary
context switches per call (a thread that sleeps and is woken again; the event
loop's and the pool's threads together).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from time import perf_counter
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Row, fmt_x, median, render, verdict  # noqa: E402
from runtime.dispatch.threads import HandlerThreads  # noqa: E402

THREADS = 64


def _noop() -> int:
    return 1


async def _drive(
    submit: Callable[[], Future[Any]], callers: int, calls: int
) -> tuple[float, float]:
    """(calls/s, voluntary switches per call) of `callers` coroutines making `calls` each."""
    loop = asyncio.get_running_loop()

    async def caller(n: int) -> None:
        for _ in range(n):
            answer = loop.create_future()
            submit().add_done_callback(
                lambda done, answer=answer: loop.call_soon_threadsafe(
                    answer.set_result, done.result()
                )
            )
            await answer

    await asyncio.gather(*(caller(100) for _ in range(callers)))  # threads made, warm
    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    started = perf_counter()
    await asyncio.gather(*(caller(calls) for _ in range(callers)))
    took = perf_counter() - started
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
    total = callers * calls
    return total / took, switches / total


def measure(kind: str, callers: int, calls: int) -> tuple[float, float]:
    if kind == "thaw":
        pool = HandlerThreads(THREADS, "bench")
        try:
            return asyncio.run(_drive(lambda: pool.submit(_noop), callers, calls))
        finally:
            pool.shutdown()
    with ThreadPoolExecutor(THREADS) as executor:
        return asyncio.run(_drive(lambda: executor.submit(_noop), callers, calls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3000, help="calls per caller per round")
    parser.add_argument("--callers", type=int, default=8, help="calls in flight")
    args = parser.parse_args()
    figures: dict[str, list[tuple[float, float]]] = {"thaw": [], "executor": []}
    for _ in range(args.rounds):
        for kind in figures:
            figures[kind].append(measure(kind, args.callers, args.calls))
    rate = {k: median([r for r, _ in v]) for k, v in figures.items()}
    switches = {k: median([s for _, s in v]) for k, v in figures.items()}
    label = f"{args.callers} calls in flight, medians of {args.rounds}"
    ratio = rate["thaw"] / rate["executor"]
    print(
        render(
            [
                Row(
                    f"no-op calls/s, {label} (baseline: ThreadPoolExecutor({THREADS}))",
                    f"{rate['thaw']:.0f}",
                    f"{rate['executor']:.0f}",
                    fmt_x(ratio),
                    ">= 1x",
                    verdict(ratio >= 1.0),
                ),
                Row(
                    f"voluntary context switches per call, {label}",
                    f"{switches['thaw']:.2f}",
                    f"{switches['executor']:.2f}",
                    fmt_x(switches["thaw"] / switches["executor"]),
                ),
            ]
        )
    )


if __name__ == "__main__":
    main()
