"""The batcher's timers are the instance's clock's: a member is started at its
start-by time on that clock and not before, and never while the handler's one
run slot is taken (capacity is a promise), whatever its start-by time.

Real `Work`s kept in real `Workload` (runtime/dispatch/work.py), a real async
batched handler (tests/handlers/stuck.py `ahang_batch`: one batch at a time),
and a `ManualClock` the test moves: when the held member goes is decided by
the clock alone, never by how busy the machine is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.clock import ManualClock
from runtime.context import Context
from runtime.dispatch.batcher import Batcher
from runtime.dispatch.executor import Executor
from runtime.dispatch.work import Work, Workload
from runtime.models.estimate import Estimator
from runtime.registry import discover
from runtime.telemetry.health import Health
from runtime.telemetry.metrics import Metrics

pytestmark = pytest.mark.anyio

MARGIN_S = 0.1


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def calls(clock: ManualClock) -> Iterator[Executor]:
    calls = Executor(1, run_limit_s=600.0, clock=clock)
    yield calls
    calls.shutdown()


async def turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_member_held_behind_a_running_batch_waits_past_its_start_by_time(
    tmp_path: Path, clock: ManualClock, calls: Executor
) -> None:
    from tests.handlers import stuck

    stuck.CANCELLED.clear()
    spec = discover(["tests.handlers.stuck"]).handler("ahang_batch")
    metrics = Metrics()
    workload = Workload(
        clock=clock,
        estimator=Estimator(tmp_path, default_bandwidth_bytes_s=1e9, default_init_s=0.1),
        metrics=metrics,
        health=Health(),
        executor=calls,
    )
    batcher = Batcher(executor=calls, run_estimate_s=lambda _: 0.0, margin_s=MARGIN_S, clock=clock)

    def work(request_id: str, deadline_in_s: float | None) -> Work:
        deadline = None if deadline_in_s is None else clock.monotonic() + deadline_in_s
        ctx = Context(request_id=request_id, handler=spec.name, deadline_at=deadline)
        workload.pending[spec.name] += 1
        made = Work(workload, spec, ctx, metrics.handler(spec.name))
        made.outcome.add_done_callback(made.settle)
        return made

    held = work("held", None)
    batcher.join(held, {"release": str(tmp_path / "never")}, [])
    assert batcher.running(spec.name) == 1, "it runs, and holds the one run slot"
    # Answered by 10 s from now, less the margin, after a run of at least one margin.
    start_by = clock.monotonic() + 10.0 - 2 * MARGIN_S
    near = work("near", 10.0)
    batcher.join(near, {"quick": True}, [])
    assert batcher.queued(spec.name) == 1

    clock.advance(start_by - clock.monotonic() + 5.0)
    await turns()
    assert batcher.queued(spec.name) == 1 and not near.outcome.done(), "held past start-by"
    assert batcher.running(spec.name) == 1

    held.cancel()  # nobody waits for the held batch: it is cancelled and frees its slot
    await turns()
    assert stuck.CANCELLED == [1]
    await turns()
    assert near.outcome.done() and near.outcome.result() == {"released": False}
    assert near.timings_ms["batch"] == pytest.approx((10.0 - 2 * MARGIN_S + 5.0) * 1000)
    assert batcher.queued(spec.name) == 0 and batcher.running(spec.name) == 0
    assert workload.pending[spec.name] == 0 and not workload.in_flight
