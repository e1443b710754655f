"""Eviction: the GDSF order on hand-made candidates, hysteresis (GDSF and
DensityPolicy) and pinning through the real cache (on an injected clock), and a
Hypothesis state machine driving the real ModelCache with fake bundles.
DensityPolicy's own order is tested in test_eviction_density.py.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from runtime.bundles.manifest import BundleFile, Manifest
from runtime.clock import Clock
from runtime.errors import InsufficientMemory, LoadFailed, UnknownBundle
from runtime.models.cache import Lease, ModelCache
from runtime.models.estimate import Estimator
from runtime.models.eviction import Candidate, DensityPolicy, EvictionPolicy, GDSFPolicy, LRUPolicy
from runtime.models.lifecycle import State
from runtime.registry import BuilderSpec, Registry
from runtime.telemetry.metrics import Metrics

GIB = 1 << 30


def cand(name: str, size_gib: float, reload_s: float, last_used_at: float = 0.0) -> Candidate:
    return Candidate(name, int(size_gib * GIB), reload_s, last_used_at, hits=0)


# ---- the order on hand-made candidates ------------------------------------------------


def test_lru_orders_by_last_use() -> None:
    old, new = cand("old", 1, 9, last_used_at=1), cand("new", 1, 9, last_used_at=2)
    assert [c.name for c in LRUPolicy().order([new, old], now=3)] == ["old", "new"]


def test_gdsf_evicts_the_cheapest_reload_per_byte_first() -> None:
    policy = GDSFPolicy(min_residency_s=0)
    slow, quick = cand("slow", 1, 10.0), cand("quick", 1, 1.0)
    big, small = cand("big", 4, 4.0), cand("small", 1, 4.0)
    for c in (slow, quick, big, small):
        policy.on_load(c, 0)
        policy.on_hit(c, 0)
    order = [c.name for c in policy.order([slow, quick, big, small], now=0)]
    # value = reload / size: quick 1, big 1, small 4, slow 10
    assert order.index("quick") < order.index("small") < order.index("slow")
    assert order.index("big") < order.index("small")


def test_gdsf_frequency_keeps_the_often_used() -> None:
    policy = GDSFPolicy(min_residency_s=0)
    once, often = cand("once", 1, 2.0), cand("often", 1, 2.0)
    for c in (once, often):
        policy.on_load(c, 0)
        policy.on_hit(c, 0)
    for _ in range(3):
        policy.on_hit(often, 1)
    assert [c.name for c in policy.order([often, once], now=2)] == ["once", "often"]


def test_gdsf_clock_ages_bundles_nobody_uses() -> None:
    """A valuable bundle left alone falls behind a cheap one that keeps being used."""
    policy = GDSFPolicy(min_residency_s=0)
    valuable = cand("valuable", 1, 10.0)
    policy.on_load(valuable, 0)
    policy.on_hit(valuable, 0)  # priority 0 + 10
    for index in range(3):  # three bundles come and go, each one's value 4 above the clock
        other = cand(f"other{index}", 1, 4.0)
        policy.on_load(other, 1)
        policy.on_hit(other, 1)
        policy.on_evict(other, 1)
    assert policy.clock == pytest.approx(12.0)
    cheap = cand("cheap", 1, 1.0)
    policy.on_load(cheap, 2)
    policy.on_hit(cheap, 2)  # priority 12 + 1 > 10
    assert [c.name for c in policy.order([cheap, valuable], now=3)] == ["valuable", "cheap"]


def test_gdsf_frequency_restarts_when_a_bundle_comes_back() -> None:
    policy = GDSFPolicy(min_residency_s=0)
    back = cand("back", 1, 2.0)
    policy.on_load(back, 0)
    for _ in range(5):
        policy.on_hit(back, 0)
    policy.on_evict(back, 1)  # clock 10
    policy.on_load(back, 2)
    policy.on_hit(back, 2)
    assert policy.priority(back) == pytest.approx(10.0 + 2.0)


def test_gdsf_reload_times_below_the_floor_count_alike() -> None:
    """Millisecond differences between tiny loads are noise: last use decides."""
    policy = GDSFPolicy(min_residency_s=0, min_cost_s=0.25)
    a, b = cand("a", 1, 0.01, last_used_at=5), cand("b", 1, 0.2, last_used_at=1)
    for c in (a, b):
        policy.on_load(c, 0)
        policy.on_hit(c, 0)
    assert [c.name for c in policy.order([a, b], now=6)] == ["b", "a"]


def test_gdsf_hysteresis_puts_recently_used_last() -> None:
    policy = GDSFPolicy(min_residency_s=30)
    cheap_recent = cand("cheap_recent", 1, 0.5, last_used_at=95)
    costly_old = cand("costly_old", 1, 20.0, last_used_at=10)
    for c in (cheap_recent, costly_old):
        policy.on_load(c, c.last_used_at)
        policy.on_hit(c, c.last_used_at)
    assert [c.name for c in policy.order([cheap_recent, costly_old], now=100)] == [
        "costly_old",
        "cheap_recent",
    ]
    # When everything is recent the order is still complete: eviction stays possible.
    both_recent = [cheap_recent, cand("x", 1, 20.0, last_used_at=99)]
    assert len(policy.order(both_recent, now=100)) == 2


def test_gdsf_orders_a_candidate_it_never_heard_of() -> None:
    policy = GDSFPolicy(min_residency_s=0)
    known = cand("known", 1, 5.0)
    policy.on_load(known, 0)
    policy.on_hit(known, 0)
    stranger = cand("stranger", 1, 1.0)
    assert [c.name for c in policy.order([known, stranger], now=1)] == ["stranger", "known"]


# ---- through the real cache ------------------------------------------------------------


class FakeSource:
    """Bundles with a size and a reload cost; fetch advances `clock` by the cost."""

    def __init__(
        self,
        sizes: dict[str, int],
        cost_s: dict[str, float],
        clock: Any = None,
        per_request: dict[str, int] | None = None,
    ):
        self.sizes = sizes
        self.per_request = per_request or {}
        self.cost_s = cost_s
        self.clock = clock
        self.root = Path(tempfile.gettempdir())

    def names(self) -> list[str]:
        return sorted(self.sizes)

    def manifest(self, name: str) -> Manifest:
        if name not in self.sizes:
            raise UnknownBundle(name)
        # No safetensors shard: nothing is read, the builder makes the model.
        files = (BundleFile("config.json", 1, "0" * 64),)
        return Manifest(
            name,
            "1",
            files,
            weights_bytes=self.sizes[name],
            per_request_bytes=self.per_request.get(name, 0),
        )

    def fetch(self, manifest: Manifest, on_progress: Any) -> Path:
        if self.clock is not None:
            self.clock.now += self.cost_s.get(manifest.name, 0.0)
        return self.root

    def release(self, manifest: Any) -> None:
        """Nothing is held: no files."""

    def describe(self) -> str:
        return "fake"


class FakeClock(Clock):
    """Simulated monotonic time: set by the test, moved by each fetch's cost."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(lambda: self.now)


class Model:
    """What a fake builder returns: which bundle, and which build of it."""

    def __init__(self, name: str, build: int) -> None:
        self.name = name
        self.build = build


def make_cache(
    sizes: dict[str, int],
    state: Path,
    *,
    budget: int,
    cost_s: dict[str, float] | None = None,
    clock: Any = None,
    policy: EvictionPolicy | None = None,
    pinned: tuple[str, ...] = (),
    per_request: dict[str, int] | None = None,
) -> tuple[ModelCache, Counter[str]]:
    builds: Counter[str] = Counter()

    def builder_for(name: str) -> BuilderSpec:
        def build() -> Model:
            builds[name] += 1
            return Model(name, builds[name])

        return BuilderSpec(name, build, ())

    async def runner(*args: Any) -> Any:
        return None

    registry = Registry(builders={n: builder_for(n) for n in sizes}, handlers={})
    kwargs: dict[str, Any] = {} if clock is None else {"clock": clock}
    cache = ModelCache(
        source=FakeSource(sizes, cost_s or {}, clock, per_request),
        registry=registry,
        estimator=Estimator(state, default_bandwidth_bytes_s=1e9, default_init_s=0.1),
        metrics=Metrics(),
        warm_up=runner,
        device="cpu",
        memory_budget=budget,
        retry_backoff_s=0.0,
        policy=policy,
        pinned=pinned,
        **kwargs,
    )
    return cache, builds


async def use(cache: ModelCache, clock: FakeClock | None, name: str, at: float) -> None:
    if clock is not None:
        clock.now = max(clock.now, at)
    lease = await cache.acquire(name)
    lease.release()


async def waits_for_room(cache: ModelCache, name: str) -> None:
    """Returns once `name`'s load (its fetch runs in a thread) queues for memory."""
    for _ in range(2000):
        if cache.budget.waiting(name):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{name} never queued for memory")


def states(cache: ModelCache) -> dict[str, State]:
    return {n: e.lifecycle.state for n, e in cache.entries.items()}


def test_default_policy_is_density(tmp_path: Path) -> None:
    cache, _ = make_cache({"a": 1}, tmp_path, budget=10)
    assert isinstance(cache.policy, DensityPolicy)


@pytest.mark.parametrize("policy_class", [GDSFPolicy, DensityPolicy])
@pytest.mark.parametrize("min_residency_s", [30.0, 0.0])
def test_hysteresis_through_the_cache(
    tmp_path: Path, min_residency_s: float, policy_class: type[GDSFPolicy | DensityPolicy]
) -> None:
    """`costly` (old) goes before `cheap` (used 10 s ago) only while hysteresis is on."""
    clock = FakeClock()
    cache, _ = make_cache(
        {"costly": 50, "cheap": 50, "new": 50},
        tmp_path,
        budget=100,
        cost_s={"costly": 10.0, "cheap": 1.0, "new": 1.0},
        clock=clock,
        policy=policy_class(min_residency_s=min_residency_s),
    )

    async def scenario() -> None:
        await use(cache, clock, "costly", at=0)
        await use(cache, clock, "cheap", at=100)
        await use(cache, clock, "new", at=110)

    asyncio.run(scenario())
    evicted = [n for n, s in states(cache).items() if s is State.UNLOADED]
    assert evicted == (["costly"] if min_residency_s else ["cheap"])
    assert cache.entries["costly"].reload_s == pytest.approx(10.0)


@pytest.mark.parametrize("policy_class", [None, DensityPolicy, LRUPolicy])
def test_pinned_bundle_is_never_evicted(
    tmp_path: Path, policy_class: type[DensityPolicy | LRUPolicy] | None
) -> None:
    policy = None if policy_class is None else policy_class()
    cache, _ = make_cache(
        {"pin": 50, "a": 50, "b": 50}, tmp_path, budget=100, pinned=("pin",), policy=policy
    )

    async def scenario() -> None:
        await use(cache, None, "pin", 0)
        await use(cache, None, "a", 0)
        await use(cache, None, "b", 0)  # pin is least recently used: a goes
        assert states(cache) == {"pin": State.READY, "a": State.UNLOADED, "b": State.READY}
        held = await cache.acquire("a")  # b goes
        waiting = asyncio.ensure_future(cache.acquire("b"))  # pin pinned, a busy: waits
        await waits_for_room(cache, "b")
        assert not waiting.done()
        assert states(cache)["pin"] is State.READY and states(cache)["a"] is State.READY
        held.release()
        (await asyncio.wait_for(waiting, 5)).release()
        assert states(cache) == {"pin": State.READY, "a": State.UNLOADED, "b": State.READY}

    asyncio.run(scenario())


def test_a_load_waiting_for_room_never_evicts_a_bundle_under_its_waiters(
    tmp_path: Path,
) -> None:
    """c cannot fit beside busy pin and a; b can. b's load must reach its waiters:
    evicting it for c (which still would not fit) made b reload forever."""
    cache, builds = make_cache(
        {"pin": 20, "a": 40, "b": 30, "c": 50}, tmp_path, budget=100, pinned=("pin",)
    )

    async def scenario() -> None:
        held = [await cache.acquire("pin"), await cache.acquire("a")]
        c = [asyncio.ensure_future(cache.acquire("c")) for _ in range(3)]
        await waits_for_room(cache, "c")
        b = await asyncio.wait_for(asyncio.gather(*(cache.acquire("b") for _ in range(2))), 5)
        assert builds["b"] == 1 and not any(t.done() for t in c)
        for lease in [*held, *b]:
            lease.release()
        for lease in await asyncio.wait_for(asyncio.gather(*c), 5):
            lease.release()
        assert builds == {"pin": 1, "a": 1, "b": 1, "c": 1}

    asyncio.run(scenario())


def test_nothing_is_evicted_when_eviction_cannot_make_room(tmp_path: Path) -> None:
    cache, _ = make_cache({"busy": 60, "idle": 20, "big": 50}, tmp_path, budget=100)

    async def scenario() -> None:
        busy = await cache.acquire("busy")
        await use(cache, None, "idle", 0)
        big = asyncio.ensure_future(cache.acquire("big"))  # 60 + 50 > 100 even without idle
        await waits_for_room(cache, "big")
        assert states(cache)["idle"] is State.READY, "evicted for nothing"
        busy.release()
        (await asyncio.wait_for(big, 5)).release()

    asyncio.run(scenario())


# ---- the state machine ------------------------------------------------------------------

SIZES = {"a": 40, "b": 30, "c": 50, "pin": 20, "huge": 150}
# Request slots: a second request of `a` needs 10 more bytes, and so on.
PER_REQUEST = {"a": 10, "b": 15, "c": 0, "pin": 5, "huge": 0}
BUDGET = 100


class CountingExecutor(ThreadPoolExecutor):
    """The loop's default executor, knowing whether any thread work is in flight: the
    cache's manifest reads, builds and releases all run there, so "no thread busy"
    is what makes the loop quiet, however slowly a loaded machine runs them."""

    def __init__(self) -> None:
        super().__init__(max_workers=4)
        self._running: set[Future[Any]] = set()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future = super().submit(fn, *args, **kwargs)
        self._running.add(future)
        future.add_done_callback(self._running.discard)
        return future

    def busy(self) -> bool:
        return bool(self._running)


class CacheMachine(RuleBasedStateMachine):
    """Any sequence of acquire/release/unload either raises the documented error
    or does what was asked; work that must wait (for memory, for a drain) waits
    only while waiting is justified, and finishes once the leases are returned.

    Liveness: whenever nothing is loading and nothing is in flight (no lease is
    held), nobody is waiting, whether for a load's room or a request's slot."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.executor = CountingExecutor()
        self.loop.set_default_executor(self.executor)
        self.state_dir = Path(tempfile.mkdtemp(prefix="thaw-eviction-"))
        self.cache, self.builds = make_cache(
            SIZES, self.state_dir, budget=BUDGET, pinned=("pin",), per_request=PER_REQUEST
        )
        self.leases: list[Lease] = []
        self.pending: list[tuple[str, str, asyncio.Task[Any]]] = []  # (kind, name, task)
        self.pinned_ready = False
        # Bundles whose load an unload abandoned: their waiting acquires fail.
        self.abandoned: set[str] = set()

    # -- helpers --

    def entry_state(self, name: str) -> State | None:
        entry = self.cache.entries.get(name)
        return entry.lifecycle.state if entry else None

    def loading(self) -> bool:
        """A load under way and not queued for memory (which is waiting, not loading)."""
        return any(
            e.task is not None and self.cache.budget.waiting(e.name) == 0
            for e in self.cache.entries.values()
        )

    def justified_wait(self, kind: str, name: str) -> bool:
        """Waiting is justified only while something holds memory that will be given
        back: a lease (in flight), or a load under way."""
        entry = self.cache.entries[name]
        if entry.lifecycle.state is State.UNLOADING:
            return self.cache.in_flight(name) > 0  # the drain waits for leases we hold
        if SIZES[name] + PER_REQUEST[name] > BUDGET:
            return False  # bound to fail at once
        return bool(self.leases) or self.loading()

    def settle(self) -> None:
        """Run the loop until nothing can progress: no thread work in flight, no load
        mid-way, no wait unjustified. Polls count loop turns, not time: a step on a
        thread may take any time, and the loop is quiet only once none is running."""

        async def quiet() -> None:
            stable = 0
            for _ in range(2000):
                await asyncio.sleep(0.002)
                self.collect()
                waiting_wrongly = any(
                    not task.done() and not self.justified_wait(kind, name)
                    for kind, name, task in self.pending
                )
                busy = self.executor.busy() or self.loading()
                stable = 0 if busy or waiting_wrongly else stable + 1
                if stable >= 3:
                    return
            raise AssertionError(f"cache never settled: {states(self.cache)} {self.pending}")

        self.loop.run_until_complete(quiet())

    def give_back(self, leases: list[Lease]) -> None:
        """Release on the loop, as a request does (a release may wake waiters)."""

        async def release() -> None:
            for lease in leases:
                lease.release()

        self.loop.run_until_complete(release())

    def collect(self) -> None:
        """Take finished pending work: leases join the held ones, errors are checked."""
        still = []
        for kind, name, task in self.pending:
            if not task.done():
                still.append((kind, name, task))
                continue
            if kind == "acquire" and name in self.abandoned and task.exception() is not None:
                # An unload during the load abandons it: its waiters get load-failed.
                assert isinstance(task.exception(), LoadFailed), task.exception()
                continue
            result = task.result()  # no other pending work may fail
            if kind == "acquire":
                assert isinstance(result, Lease) and result.model.name == name
                self.leases.append(result)
        self.pending = still

    # -- rules --

    @rule(name=st.sampled_from(sorted(SIZES)), k=st.integers(1, 3))
    def acquire(self, name: str, k: int) -> None:
        builds_before = self.builds[name]
        tasks = [self.loop.create_task(self.cache.acquire(name)) for _ in range(k)]
        self.settle()
        if SIZES[name] + PER_REQUEST[name] > BUDGET:
            for task in tasks:
                with pytest.raises(InsufficientMemory):
                    task.result()
            return
        leases = [t.result() for t in tasks if t.done()]
        assert len({id(lease.model) for lease in leases}) <= 1, "one model for all"
        if leases:
            assert leases[0].model.name == name
            assert self.entry_state(name) is State.READY
        self.leases += leases
        waiting = [t for t in tasks if not t.done()]
        if waiting:
            # Some may be admitted and others wait for a request slot; never both
            # admitted and waiting for the load itself.
            assert self.justified_wait("acquire", name), states(self.cache)
            self.pending += [("acquire", name, t) for t in waiting]
        assert self.builds[name] - builds_before <= 1, "single flight: at most one build"

    @rule(pick=st.integers(0, 1000))
    def release(self, pick: int) -> None:
        # The draw must not depend on state: which loads finish first varies run to run.
        if not self.leases:
            return
        self.give_back([self.leases.pop(pick % len(self.leases))])
        self.settle()

    @rule(name=st.sampled_from(sorted(SIZES)))
    def unload(self, name: str) -> None:
        entry = self.cache.entries.get(name)
        if entry is not None and entry.task is not None:
            self.abandoned.add(name)
        task = self.loop.create_task(self.cache.unload(name))
        self.settle()
        if task.done():
            task.result()
            state = self.entry_state(name)
            if state is State.UNLOADING:  # an earlier unload is under way: not twice
                assert any(k == "unload" and n == name for k, n, _ in self.pending)
            else:
                assert state in (None, State.UNLOADED, State.FAILED, State.STORED), state
            if name == "pin":
                self.pinned_ready = False
        else:
            assert self.justified_wait("unload", name), states(self.cache)
            self.pending.append(("unload", name, task))

    # -- invariants --

    @invariant()
    def budget_never_exceeded(self) -> None:
        assert self.cache.reserved_bytes() <= BUDGET

    @invariant()
    def nobody_waits_while_nothing_moves(self) -> None:
        if not self.leases and not self.loading():
            assert not [p for p in self.pending if not p[2].done()], (
                "waiting with nothing in flight or loading",
                states(self.cache),
                self.pending,
            )
            assert self.cache.budget.waiting() == 0

    @invariant()
    def in_use_is_never_evicted(self) -> None:
        for lease in self.leases:
            entry = lease.entry
            assert self.cache.in_flight(entry.name) > 0
            assert entry.lifecycle.state in (State.READY, State.UNLOADING)
            assert entry.model is lease.model

    @invariant()
    def pinned_stays(self) -> None:
        if self.pinned_ready and not any(n == "pin" for k, n, _ in self.pending):
            assert self.entry_state("pin") is State.READY
        self.pinned_ready = self.entry_state("pin") is State.READY

    @invariant()
    def one_build_per_load(self) -> None:
        for name, entry in self.cache.entries.items():
            assert self.builds[name] == entry.loads, (name, self.builds[name], entry.loads)

    def teardown(self) -> None:
        try:
            # Liveness: with every lease returned, all waiting work finishes. Each
            # round gives back what the last one admitted; every round must admit
            # someone until nobody waits.
            while self.pending or self.leases:
                before = len(self.pending)
                self.give_back(self.leases)
                self.leases = []
                self.settle()
                assert len(self.pending) < before or not self.pending, self.pending
            self.loop.run_until_complete(self.cache.unload_all())
        finally:
            # After a failure loads may still be running (or livelocked): stop them all
            # before the thread pool, so a broken cache fails the test instead of hanging it.
            left = asyncio.all_tasks(self.loop)
            for task in left:
                task.cancel()
            if left:
                self.loop.run_until_complete(asyncio.wait(left, timeout=5))
            self.loop.run_until_complete(
                asyncio.wait_for(self.loop.shutdown_default_executor(), 10)
            )
            self.loop.close()
            shutil.rmtree(self.state_dir, ignore_errors=True)


CacheMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Fifty runs of 25 steps, each on a real cache: `slow`, left out of make test-fast.
test_cache_state_machine = pytest.mark.slow(CacheMachine.TestCase)
