"""Eviction policies replayed through the real ModelCache on a simulated clock.

Eight bundles of different sizes and reload times share a memory budget
that holds about three of them. A seeded trace of requests picks bundles by
Zipf(1.1) popularity (which bundle is most popular is shuffled per seed) at
Poisson arrival times. Each policy replays the same trace through the real
`runtime.cache.ModelCache`: its source's fetch advances a simulated clock by
the bundle's reload seconds instead of doing work, so a trace of hours runs in
seconds and every decision is the cache's own. Requests are served one after
another; one that arrives during a load waits for it.

Reported per policy, summed over seeds: hit rate, evictions (and per 1000
requests), and reload seconds (the time callers spent waiting for loads).
`cachetools.LRUCache` replays the same traces as the reference LRU; the real
cache with `LRUPolicy` must agree with it exactly.

The trace is i.i.d. (the independent reference model), for which the best
online policy is known: evict the bundle with the lowest p * R / S, p its true
request probability (Aho, Denning and Ullman's A0, with costs and sizes).
`KnownPopularity` is that policy, given the probabilities the trace was drawn
from: the bound any online policy, GDSF included, can approach on this trace.
"""

from __future__ import annotations

import asyncio
import math
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import Row, fmt_x, verdict

# name, GB, reload seconds: fetch and load from the node cache at ~1 GB/s plus
# init and warm-up, which vary far more than size does (a compiled ASR model
# takes seconds to get ready, a small reranker a fraction of one).
FLEET: tuple[tuple[str, float, float], ...] = (
    ("llm-1b", 2.0, 30.0),
    ("asr", 1.5, 12.0),
    ("embed", 0.5, 1.0),
    ("rerank", 0.6, 1.0),
    ("ocr", 0.8, 5.0),
    ("vision", 1.2, 2.0),
    ("tts", 1.0, 20.0),
    ("tagger", 0.4, 0.6),
)
BUDGET_GB = 3.0  # three average bundles (mean 1.0 GB)
ZIPF_S = 1.1
MEAN_INTERVAL_S = 5.0
RUN_S = 0.05  # each request's run, so no two uses share a timestamp
MIN_RESIDENCY_S = 30.0  # Settings.min_residency_s default
RELOAD_TARGET = 0.7
GB = 1_000_000_000


@dataclass
class Outcome:
    requests: int = 0
    hits: int = 0
    evictions: int = 0
    reload_s: float = 0.0

    def add(self, other: Outcome) -> None:
        self.requests += other.requests
        self.hits += other.hits
        self.evictions += other.evictions
        self.reload_s += other.reload_s

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.requests)


def popularity(seed: int) -> dict[str, float]:
    """Each bundle's request probability: Zipf over ranks, ranks shuffled per seed."""
    names = [name for name, _, _ in FLEET]
    random.Random(seed).shuffle(names)
    weights = [1 / (rank**ZIPF_S) for rank in range(1, len(names) + 1)]
    total = sum(weights)
    return {name: weight / total for name, weight in zip(names, weights, strict=True)}


def trace(seed: int, requests: int) -> list[tuple[float, str]]:
    """(arrival seconds, bundle) pairs drawn i.i.d. from `popularity(seed)`."""
    p = popularity(seed)
    rng = random.Random(1_000_003 * (seed + 1))
    at = 0.0
    out = []
    for name in rng.choices(list(p), weights=list(p.values()), k=requests):
        at += rng.expovariate(1 / MEAN_INTERVAL_S)
        out.append((at, name))
    return out


def cachetools_lru(requests: Sequence[tuple[float, str]]) -> Outcome:
    """The reference: the same trace through cachetools.LRUCache sized in bytes."""
    from cachetools import LRUCache

    sizes = {name: int(gb * GB) for name, gb, _ in FLEET}
    reload = {name: seconds for name, _, seconds in FLEET}
    cache: LRUCache[str, int] = LRUCache(maxsize=int(BUDGET_GB * GB), getsizeof=lambda v: v)
    out = Outcome()
    for _, name in requests:
        out.requests += 1
        if name in cache:
            cache[name]  # a use: moves it to most recent
            out.hits += 1
            continue
        before = set(cache)
        cache[name] = sizes[name]
        out.evictions += len(before - set(cache))
        out.reload_s += reload[name]
    return out


class SimClock:
    """The cache's clock; the fake source advances it by each fetch's cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimSource:
    """A BundleSource whose fetch costs simulated seconds and touches no disk."""

    def __init__(self, clock: SimClock) -> None:
        from runtime.bundles import BundleFile, Manifest

        self.clock = clock
        self.cost = {name: seconds for name, _, seconds in FLEET}
        self.manifests = {
            name: Manifest(
                name,
                "1",
                (BundleFile("config.json", 1, "0" * 64),),  # no shards: nothing to read
                weights_bytes=int(gb * GB),
            )
            for name, gb, _ in FLEET
        }

    def names(self) -> list[str]:
        return sorted(self.manifests)

    def manifest(self, name: str) -> Any:
        return self.manifests[name]

    def fetch(self, manifest: Any, on_progress: Any) -> Path:
        self.clock.now += self.cost[manifest.name]
        return Path("/nonexistent")

    def describe(self) -> str:
        return "simulated"


class KnownPopularity:
    """Evict the lowest p * R / S, knowing each bundle's true probability p."""

    def __init__(self, p: dict[str, float]) -> None:
        self.p = p

    def on_load(self, candidate: Any, now: float) -> None:
        pass

    def on_hit(self, candidate: Any, now: float) -> None:
        pass

    def on_evict(self, candidate: Any, now: float) -> None:
        pass

    def order(self, candidates: Any, now: float) -> Any:
        return sorted(candidates, key=lambda c: self.p[c.name] * c.reload_s / max(1, c.size_bytes))


class Counting:
    """Wraps a policy and counts the evictions the cache makes on its advice."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.evictions = 0

    def on_load(self, candidate: Any, now: float) -> None:
        self.inner.on_load(candidate, now)

    def on_hit(self, candidate: Any, now: float) -> None:
        self.inner.on_hit(candidate, now)

    def on_evict(self, candidate: Any, now: float) -> None:
        self.evictions += 1
        self.inner.on_evict(candidate, now)

    def order(self, candidates: Any, now: float) -> Any:
        return self.inner.order(candidates, now)


async def replay(requests: Sequence[tuple[float, str]], policy: Any, state: Path) -> Outcome:
    """The trace through a real ModelCache with `policy`, on a simulated clock."""
    from runtime.cache import ModelCache
    from runtime.estimate import Estimator
    from runtime.metrics import Metrics
    from runtime.registry import BuilderSpec, Registry

    clock = SimClock()
    registry = Registry(
        builders={name: BuilderSpec(name, object, ()) for name, _, _ in FLEET}, handlers={}
    )

    async def no_runner(*args: Any) -> Any:  # no handlers, so no warm-ups
        return None

    counting = Counting(policy)
    cache = ModelCache(
        source=SimSource(clock),
        registry=registry,
        estimator=Estimator(state, default_bandwidth_bytes_s=1e9, default_init_s=1.0),
        metrics=Metrics(),
        runner=no_runner,
        device="cpu",
        memory_budget=int(BUDGET_GB * GB),
        policy=counting,
        clock=clock,
    )
    cost = {name: seconds for name, _, seconds in FLEET}
    out = Outcome()
    for arrival, name in requests:
        clock.now = max(clock.now, arrival)
        out.requests += 1
        if cache.is_ready(name):
            out.hits += 1
        else:
            out.reload_s += cost[name]
        lease = await cache.acquire(name)
        clock.now += RUN_S
        lease.release()
    out.evictions = counting.evictions
    await cache.unload_all()
    return out


def threshold_rule(p: dict[str, float]) -> str:
    """The keep-versus-evict rule with its threshold, for one seed's popularity.

    Evicting b costs R_b per request of b, R_b / T_b reload-seconds per second
    with T_b its mean request interval; keeping b costs S_b of the budget. So
    keep the bundles of highest density (R/T)/S, filling the budget, and let
    the rest take turns in what is left: the threshold θ is the density of
    the last bundle kept. (GDSF estimates the density online: frequency ~ 1/T.)
    """
    size = {name: gb for name, gb, _ in FLEET}
    density = {name: reload_s / (MEAN_INTERVAL_S / p[name]) / gb for name, gb, reload_s in FLEET}
    ranked = sorted(density, key=density.__getitem__, reverse=True)
    # Keep in density order while room stays for the largest bundle not kept,
    # which must still be loadable into what is left.
    kept: list[str] = []
    for name in ranked:
        rest = [size[n] for n in ranked if n not in kept and n != name]
        if sum(size[n] for n in kept) + size[name] + max(rest, default=0.0) <= BUDGET_GB:
            kept.append(name)
        else:
            break
    theta = density[kept[-1]] if kept else math.inf
    left = [n for n in ranked if n not in kept]
    return (
        f"keep b while (R_b/T_b)/S_b >= θ; seed 0: θ = {theta:.3f} reload-s/s per GB "
        f"(keep {', '.join(kept) or 'none'}; next: {left[0]} at {density[left[0]]:.3f})"
    )


def run(*, quick: bool = False) -> list[Row]:
    import torch  # noqa: F401  (imported before the freeze below, so frozen with the rest)

    from runtime import weights as weights_mod
    from runtime.eviction import GDSFPolicy, LRUPolicy

    # The framework import (and the runtime's gc.freeze after it) happens once here,
    # not inside the first replay.
    weights_mod.resolve_device("cpu")
    seeds, requests = (2, 1500) if quick else (5, 3000)
    names = ("cachetools", "lru", "gdsf", "gdsf-nohyst", "known")
    totals = {name: Outcome() for name in names}
    per_seed: list[float] = []
    agree = True
    with tempfile.TemporaryDirectory(prefix="thaw-bench-sim-") as tmp:
        for seed in range(seeds):
            requests_ = trace(seed, requests)
            reference = cachetools_lru(requests_)
            runs: dict[str, Any] = {
                "lru": LRUPolicy(),
                "gdsf": GDSFPolicy(min_residency_s=MIN_RESIDENCY_S),
                "gdsf-nohyst": GDSFPolicy(min_residency_s=0.0),
                "known": KnownPopularity(popularity(seed)),
            }
            outcomes = {
                name: asyncio.run(replay(requests_, policy, Path(tmp) / f"{seed}-{name}"))
                for name, policy in runs.items()
            }
            agree &= (reference.hits, reference.evictions) == (
                outcomes["lru"].hits,
                outcomes["lru"].evictions,
            )
            totals["cachetools"].add(reference)
            for name, outcome in outcomes.items():
                totals[name].add(outcome)
            per_seed.append(outcomes["gdsf"].reload_s / outcomes["lru"].reload_s)

    def describe(o: Outcome) -> str:
        return (
            f"hit rate {o.hit_rate:.1%}, {o.evictions} evictions "
            f"({1000 * o.evictions / o.requests:.0f}/1000 req), reload {o.reload_s:,.0f} s"
        )

    lru, gdsf = totals["lru"], totals["gdsf"]
    ratio = gdsf.reload_s / lru.reload_s
    label = f"eviction sim ({seeds} x {requests} req)"
    return [
        Row(
            f"{label}: LRU — real cache with LRUPolicy vs cachetools.LRUCache replay",
            describe(lru),
            describe(totals["cachetools"]),
            "identical" if agree else "DIFFER",
            "identical",
            verdict(agree),
        ),
        Row(
            f"{label}: GDSF + hysteresis ({MIN_RESIDENCY_S:.0f} s), the default, vs LRU",
            describe(gdsf),
            describe(lru),
            fmt_x(ratio),
            f"reload <= {RELOAD_TARGET}x LRU, hit rate >= LRU",
            verdict(ratio <= RELOAD_TARGET and gdsf.hit_rate >= lru.hit_rate),
        ),
        Row(
            f"{label}: GDSF reload seconds / LRU's, per seed",
            ", ".join(f"{r:.2f}" for r in per_seed),
        ),
        Row(
            f"{label}: GDSF without hysteresis vs LRU",
            describe(totals["gdsf-nohyst"]),
            describe(lru),
            fmt_x(totals["gdsf-nohyst"].reload_s / lru.reload_s),
        ),
        Row(
            f"{label}: bound — evict lowest p·R/S knowing true p (A0, optimal for i.i.d.)",
            describe(totals["known"]),
            describe(lru),
            fmt_x(totals["known"].reload_s / lru.reload_s),
        ),
        Row("eviction: keep-versus-evict threshold", threshold_rule(popularity(0))),
    ]


if __name__ == "__main__":
    from bench.common import render

    print(render(run(quick=True)))
