"""DensityPolicy on hand-made candidates, and the eviction simulator's own
machinery: its plain-Python model must make the real cache's decisions, and its
offline optimum must be the true minimum (checked by exhaustive search).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from pathlib import Path

import pytest

from bench import eviction_sim as sim
from runtime.models.eviction import Candidate, DensityPolicy, GDSFPolicy, LRUPolicy

GIB = 1 << 30


def cand(name: str, size_gib: float, reload_s: float, last_used_at: float = 0.0) -> Candidate:
    return Candidate(name, int(size_gib * GIB), reload_s, last_used_at, hits=0)


def used(policy: DensityPolicy, c: Candidate, *times: float) -> None:
    for t in times:
        policy.on_hit(c, t)


def names(policy: DensityPolicy, candidates: list[Candidate], now: float) -> list[str]:
    return [c.name for c in policy.order(candidates, now)]


def test_density_is_rate_times_reload_over_size() -> None:
    policy = DensityPolicy(min_residency_s=0, rate_window_s=100.0)
    c = cand("c", 2, 10.0)
    used(policy, c, 0.0, 0.0)
    assert policy.rate("c", 0.0) == pytest.approx(2 / 100)
    assert policy.density(c, 0.0) == pytest.approx(2 / 100 * 10.0 / 2)
    assert policy.rate("c", 100.0) == pytest.approx(2 / 100 * math.exp(-1))
    assert policy.rate("never", 5.0) == 0.0


def test_density_evicts_lowest_rate_times_reload_per_byte() -> None:
    policy = DensityPolicy(min_residency_s=0)
    # Same request rate: reload per byte decides. quick 1, big 1, small 4, slow 10.
    slow, quick = cand("slow", 1, 10.0), cand("quick", 1, 1.0)
    big, small = cand("big", 4, 4.0), cand("small", 1, 4.0)
    for c in (slow, quick, big, small):
        used(policy, c, 0.0)
    order = names(policy, [slow, quick, big, small], 1.0)
    assert order.index("quick") < order.index("small") < order.index("slow")
    assert order.index("big") < order.index("small")
    # Three times the requests outweigh a reload 2.5x as costly.
    often = cand("often", 1, 4.0)
    used(policy, often, 0.0, 0.0, 0.0)
    assert names(policy, [slow, often], 1.0) == ["slow", "often"]


def test_density_remembers_a_bundle_across_evictions() -> None:
    """Unlike GDSF, whose frequency restarts at every reload, a popular bundle
    that was pushed out comes back judged by its history."""
    density, gdsf = DensityPolicy(min_residency_s=0), GDSFPolicy(min_residency_s=0)
    popular, other = cand("popular", 1, 2.0), cand("other", 1, 3.0)
    for policy in (density, gdsf):
        policy.on_load(popular, 0)
        for t in range(10):
            policy.on_hit(popular, float(t))
        policy.on_evict(popular, 10)
        for c in (popular, other):  # both come back, one request each
            policy.on_load(c, 11)
            policy.on_hit(c, 11)
    assert names(density, [popular, other], 12) == ["other", "popular"]
    assert [c.name for c in gdsf.order([popular, other], 12)] == ["popular", "other"]


def test_density_forgets_popularity_that_stopped() -> None:
    """A bundle used a lot once and never since falls behind a steadily used one."""
    policy = DensityPolicy(min_residency_s=0, rate_window_s=600.0)
    former, steady = cand("former", 1, 10.0), cand("steady", 1, 10.0)
    used(policy, former, *[0.0] * 20)
    used(policy, steady, *[60.0 * k for k in range(61)])  # every minute for an hour
    assert names(policy, [former, steady], 3600.0) == ["former", "steady"]
    # ...and while it was recent, the burst kept it ahead.
    assert names(policy, [former, steady], 60.0) == ["steady", "former"]


def test_density_hysteresis_puts_recently_used_last() -> None:
    policy = DensityPolicy(min_residency_s=30)
    cheap_recent = cand("cheap_recent", 1, 0.5, last_used_at=95)
    costly_old = cand("costly_old", 1, 20.0, last_used_at=10)
    used(policy, cheap_recent, 95)
    used(policy, costly_old, 10)
    assert names(policy, [cheap_recent, costly_old], 100) == ["costly_old", "cheap_recent"]
    assert names(policy, [cheap_recent, costly_old], 126) == ["cheap_recent", "costly_old"]
    # When everything is recent the order is still complete: eviction stays possible.
    assert len(policy.order([cheap_recent, cand("x", 1, 20.0, 99)], now=100)) == 2


def test_density_reload_times_below_the_floor_count_alike() -> None:
    policy = DensityPolicy(min_residency_s=0, min_cost_s=0.25)
    a, b = cand("a", 1, 0.01, last_used_at=5), cand("b", 1, 0.2, last_used_at=1)
    used(policy, a, 0.0)
    used(policy, b, 0.0)
    assert names(policy, [a, b], 6) == ["b", "a"]  # equal density: older use first


def test_density_evicts_a_bundle_it_never_saw_used_first() -> None:
    policy = DensityPolicy(min_residency_s=0)
    known = cand("known", 1, 0.5)
    used(policy, known, 0.0)
    assert names(policy, [known, cand("stranger", 1, 30.0)], 1) == ["stranger", "known"]


# ---- the simulator ---------------------------------------------------------------------


@pytest.mark.slow  # 300 requests replayed through a real cache, per policy
@pytest.mark.parametrize(
    "make",
    [LRUPolicy, DensityPolicy, GDSFPolicy, lambda: DensityPolicy(min_residency_s=0)],
    ids=["lru", "density", "gdsf", "density-nohyst"],
)
def test_simulator_model_makes_the_real_cache_decisions(tmp_path: Path, make: object) -> None:
    assert callable(make)
    requests = sim.trace(3, 300, mean_interval_s=4.0)
    real = asyncio.run(sim.replay(requests, make(), tmp_path / "state"))
    modelled = sim.model(requests, make())
    assert modelled.evictions > 50  # the budget is actually contended
    assert real.same_decisions(modelled), (real, modelled)
    assert real.span_s == pytest.approx(modelled.span_s)


def brute_force_optimum(requests: list[str]) -> float:
    """Every choice of what to keep at every miss, explored exhaustively."""
    best = math.inf

    def visit(index: int, resident: frozenset[str], cost: float) -> None:
        nonlocal best
        if cost >= best:
            return
        if index == len(requests):
            best = cost
            return
        name = requests[index]
        if name in resident:
            visit(index + 1, resident, cost)
            return
        pool = sorted(resident | {name})
        for k in range(len(pool) + 1):
            for keep in itertools.combinations(pool, k):
                kept = frozenset(keep)
                if name in kept and sum(sim.SIZE[n] for n in kept) <= sim.BUDGET:
                    visit(index + 1, kept, cost + sim.COST[name])

    visit(0, frozenset(), 0.0)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_offline_optimum_is_the_exhaustive_minimum(seed: int) -> None:
    rng = random.Random(seed)
    requests = [rng.choice(sim.NAMES[:5]) for _ in range(12)]
    timed = [(float(i), name) for i, name in enumerate(requests)]
    optimum = sim.offline_optimum(timed)
    assert optimum == pytest.approx(brute_force_optimum(requests))
    assert optimum <= sim.model(timed, LRUPolicy()).reload_s


def test_online_optimum_is_no_worse_in_expectation_than_a0() -> None:
    p = sim.popularity(0)
    gain, _ = sim.online_optimum(p, sim.trace(0, 10))
    # A0's long-run cost, measured on a long trace, is an upper bound on the optimum's.
    long = sim.trace(0, 20_000)
    a0 = sim.model(long, sim.KnownPopularity(p)).reload_s / len(long)
    assert 0 < gain <= a0 * 1.02
