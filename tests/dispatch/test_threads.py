"""The handler threads: a call set off by another's completion runs on the thread
that just finished (the warm one), the thread idle last is used first, the pool
grows only while calls overlap, waits in arrival order past its bound, and a
shutdown cancels what waits and lets idle threads end.

Also end to end: after a bundle is READY, the first requests run on the thread
its warm-up ran on.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from runtime.dispatch.answers import Completed
from runtime.dispatch.threads import HandlerThreads
from tests.support import make_bundle, running_instance, settings_for
from tests.support import until as wait_for

WAIT_S = 10.0  # a safety limit only


def name() -> str:
    return threading.current_thread().name


def overlapping(
    pool: HandlerThreads, count: int, *, models: bool = False
) -> tuple[list[threading.Event], list[Future[str]]]:
    """`count` calls each on a thread of its own, all started: each waits for its
    gate, then answers its thread's name. (A call still queued when another's gate
    opens would go to the thread that finished first.)"""
    gates = [threading.Event() for _ in range(count)]
    started = threading.Semaphore(0)

    def call(gate: threading.Event) -> str:
        started.release()
        gate.wait(WAIT_S)
        return name()

    futures = [pool.submit(partial(call, g), models=models) for g in gates]
    for _ in range(count):
        assert started.acquire(timeout=WAIT_S), "the calls did not all start"
    return gates, futures


def test_a_call_set_off_by_a_completion_runs_on_the_thread_that_completed() -> None:
    """As the dispatcher does (the next warm-up example, the first request after
    READY): each call is submitted by the previous one's completion callback."""
    pool = HandlerThreads(8, "t")
    ran: list[str] = []
    done = threading.Event()

    def chain(left: int) -> None:
        future = pool.submit(name)

        def then(f: Future[Any]) -> None:
            ran.append(f.result())
            if left:
                chain(left - 1)
            else:
                done.set()

        future.add_done_callback(then)

    chain(200)
    assert done.wait(WAIT_S)
    assert set(ran) == {"t_0"} and len(ran) == 201
    assert pool.started == 1
    pool.shutdown()


def test_the_thread_idle_last_takes_the_next_call_and_overlap_grows_the_pool() -> None:
    pool = HandlerThreads(8, "t")
    gates, running = overlapping(pool, 3)
    assert pool.started == 3  # three overlapping calls, three threads
    gates[1].set()
    second = running[1].result(WAIT_S)
    gates[0].set()
    first = running[0].result(WAIT_S)
    # Idle now: the first thread last. Then the second. The third is still busy.
    assert pool.submit(name).result(WAIT_S) == first
    gates[2].set()
    running[2].result(WAIT_S)
    assert pool.started == 3
    assert second != first
    pool.shutdown()


def test_calls_past_the_bound_wait_in_arrival_order() -> None:
    pool = HandlerThreads(1, "t")
    gate = threading.Event()
    order: list[int] = []
    blocker = pool.submit(lambda: gate.wait(WAIT_S))
    waiting = [pool.submit(lambda i=i: order.append(i)) for i in range(5)]
    gate.set()
    blocker.result(WAIT_S)
    for future in waiting:
        future.result(WAIT_S)
    assert order == [0, 1, 2, 3, 4]
    assert pool.started == 1
    pool.shutdown()


def test_an_exception_even_system_exit_ends_the_call_not_the_thread() -> None:
    pool = HandlerThreads(1, "t")

    def exits() -> None:
        raise SystemExit(2)

    def raises() -> None:
        raise ValueError("bad")

    with pytest.raises(SystemExit):
        pool.submit(exits).result(WAIT_S)
    with pytest.raises(ValueError, match="bad"):
        pool.submit(raises).result(WAIT_S)
    assert pool.submit(name).result(WAIT_S) == "t_0"
    pool.shutdown()


def test_shutdown_cancels_waiting_calls_refuses_new_ones_and_ends_the_threads() -> None:
    pool = HandlerThreads(1, "t")
    [gate], [busy] = overlapping(pool, 1)
    waiting = pool.submit(name)
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.submit(name)
    assert waiting.cancelled()
    with pytest.raises(CancelledError):
        waiting.result(0)
    gate.set()
    assert busy.result(WAIT_S) == "t_0", "a running call finishes"
    threads = [t for t in threading.enumerate() if t.name == "t_0"]
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive()


def test_a_cancelled_call_never_runs_and_its_thread_goes_on() -> None:
    pool = HandlerThreads(1, "t")
    gate = threading.Event()
    ran: list[str] = []
    busy = pool.submit(lambda: gate.wait(WAIT_S))
    skipped = pool.submit(lambda: ran.append("skipped"))
    assert skipped.cancel()
    gate.set()
    busy.result(WAIT_S)
    assert pool.submit(name).result(WAIT_S) == "t_0"
    assert ran == []
    pool.shutdown()


@pytest.mark.anyio
async def test_the_first_requests_after_ready_run_on_the_warm_up_thread(tmp_path: Path) -> None:
    make_bundle(tmp_path / "bundles", "paths")
    settings = settings_for(
        tmp_path,
        handlers=("tests.handlers.warmed",),
        prewarm=("paths",),
    )
    async with running_instance(settings) as instance:
        dispatcher = instance.dispatcher
        await until(lambda: instance.cache.is_ready("paths"))
        outcomes = [
            await dispatcher.invoke("paths", {"path": "small"}, request_id=f"r{i}")
            for i in range(20)
        ]
        assert all(isinstance(o, Completed) for o in outcomes)
        model = instance.cache.entries["paths"].model
        threads = {thread for _, _, thread in model.calls}
        assert len(threads) == 1, f"warm-up and requests on {threads}"
        assert [request for request, _, _ in model.calls[:2]] == [
            "warmup-paths-0",
            "warmup-paths-1",
        ]


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never happened")


# ---- OpenMP teams (runtime/models/weights/teams.py) -----------------------------


class Releases:
    """Where the pool's `release_team` calls land: the thread each ran on."""

    def __init__(self) -> None:
        self.on: list[str] = []
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.on.append(name())


def test_model_calls_in_a_row_keep_their_threads_team() -> None:
    releases = Releases()
    pool = HandlerThreads(8, "t", release_team=releases)
    ran = [pool.submit(name, models=True).result(WAIT_S) for _ in range(20)]
    assert set(ran) == {"t_0"}
    assert releases.on == []
    pool.shutdown()


def test_a_thread_going_idle_while_other_model_work_runs_ends_its_team() -> None:
    """As a prefill's thread does while the decode thread steps: the thread still
    working keeps its team, the one going idle gives its up (after its answer)."""
    releases = Releases()
    pool = HandlerThreads(8, "t", release_team=releases)
    (steps, prefill), (stepping, prefilling) = overlapping(pool, 2, models=True)
    prefill.set()
    prefilled_on = prefilling.result(WAIT_S)
    wait_for(lambda: releases.on == [prefilled_on], "the idle thread's release")
    steps.set()
    stepped_on = stepping.result(WAIT_S)
    assert stepped_on != prefilled_on
    # Nothing else runs: the last thread keeps its team, and serves the next call.
    assert pool.submit(name, models=True).result(WAIT_S) == stepped_on
    assert releases.on == [prefilled_on]
    pool.shutdown()


def test_an_idle_thread_holding_a_team_ends_it_when_model_work_starts_elsewhere() -> None:
    releases = Releases()
    pool = HandlerThreads(8, "t", release_team=releases)
    [model_gate], [model] = overlapping(pool, 1, models=True)
    [plain_gate], [plain] = overlapping(pool, 1)
    model_gate.set()
    team_on = model.result(WAIT_S)  # idle now, its team kept: nothing else runs models
    plain_gate.set()
    plain_on = plain.result(WAIT_S)  # idle last: it takes the next call
    assert releases.on == []
    assert pool.submit(name, models=True).result(WAIT_S) == plain_on
    wait_for(lambda: releases.on == [team_on], "the idle thread's release")
    pool.shutdown()


def test_calls_without_models_end_no_team() -> None:
    releases = Releases()
    pool = HandlerThreads(8, "t", release_team=releases)
    gates = [threading.Event() for _ in range(3)]
    running = [pool.submit(lambda g=g: g.wait(WAIT_S)) for g in gates]
    for gate, future in zip(gates, running, strict=True):
        gate.set()
        future.result(WAIT_S)
    assert pool.submit(name).result(WAIT_S)
    assert releases.on == []
    pool.shutdown()


def test_a_team_that_will_not_end_costs_the_thread_nothing() -> None:
    def refuses() -> None:
        raise OSError("no libgomp here after all")

    pool = HandlerThreads(8, "t", release_team=refuses)
    (other, mine), (running, first) = overlapping(pool, 2, models=True)
    mine.set()
    released_on = first.result(WAIT_S)  # idle while the other runs: it tries to end its team
    other.set()
    running.result(WAIT_S)
    # Both threads still serve: the failed release ended neither.
    gates, both = overlapping(pool, 2, models=True)
    for gate in gates:
        gate.set()
    assert released_on in {f.result(WAIT_S) for f in both}
    assert pool.started == 2
    pool.shutdown()


class BlockingRelease(Releases):
    """Releases that, once armed, hold the releasing thread until `go` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.entered = threading.Event()
        self.go = threading.Event()

    def __call__(self) -> None:
        super().__call__()
        if self.armed:
            self.entered.set()
            assert self.go.wait(WAIT_S)


def test_a_thread_woken_for_a_call_another_thread_took_goes_idle_again() -> None:
    """The thread woken for a queued call (idle last, but held up: here, ending its
    team) finds the call taken by a thread that finished first. It goes idle again,
    and the pool's count of threads on their way to the queue goes back to zero:
    later calls still wake threads, and none is started beyond those needed."""
    releases = BlockingRelease()
    pool = HandlerThreads(8, "t", release_team=releases)
    [team_gate], [team_call] = overlapping(pool, 1, models=True)
    [idle_gate], [idle_call] = overlapping(pool, 1)
    [busy_gate], [busy_call] = overlapping(pool, 1)
    team_gate.set()
    woken = team_call.result(WAIT_S)  # idle, keeping its team: no other model work runs
    idle_gate.set()
    idle_last = idle_call.result(WAIT_S)
    assert releases.on == []

    releases.armed = True
    model_started, model_gate = threading.Event(), threading.Event()

    def model_work() -> str:
        model_started.set()
        model_gate.wait(WAIT_S)
        return name()

    # The model call wakes the thread idle last, and tells `woken` to end its team,
    # which holds it; the plain call queued behind wakes `woken` next.
    model = pool.submit(model_work, models=True)
    queued = pool.submit(name)
    assert releases.entered.wait(WAIT_S) and model_started.wait(WAIT_S)
    busy_gate.set()
    finisher = busy_call.result(WAIT_S)
    assert queued.result(WAIT_S) == finisher  # taken by the thread that finished first
    releases.go.set()
    model_gate.set()
    assert model.result(WAIT_S) == idle_last
    assert releases.on == [woken]

    # No wake-up was lost: calls overlapping on every thread all start, on the same three.
    gates, futures = overlapping(pool, 3)
    for gate in gates:
        gate.set()
    assert {f.result(WAIT_S) for f in futures} == {woken, idle_last, finisher}
    assert pool.started == 3
    pool.shutdown()


def test_a_call_still_waiting_is_wrapped_and_one_a_thread_took_is_not() -> None:
    """wrap_waiting (a 202'd caller's call gated for its job's claim): a call still in
    the queue runs wrapped, in its place and in its turn; a call a thread has taken
    runs as it was, and the wrap is refused, so the call never runs both ways."""
    pool = HandlerThreads(1, "t")
    [gate], [held] = overlapping(pool, 1)
    ran: list[str] = []

    def log(what: str) -> str:
        ran.append(what)
        return what

    waiting = pool.submit(partial(log, "call"))
    behind = pool.submit(partial(log, "behind"))

    def wrap(fn: Callable[[], Any]) -> Callable[[], Any]:
        return lambda: ("wrapped", fn())

    assert pool.wrap_waiting(waiting, wrap)
    assert not pool.wrap_waiting(held, wrap), "a thread has it: it runs as it was"
    gate.set()
    assert held.result(WAIT_S) == "t_0"
    assert waiting.result(WAIT_S) == ("wrapped", "call")
    assert behind.result(WAIT_S) == "behind"
    assert ran == ["call", "behind"]
    assert not pool.wrap_waiting(waiting, wrap), "done: nothing left to wrap"
    pool.shutdown()
