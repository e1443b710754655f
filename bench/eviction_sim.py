"""Eviction policies replayed through the real ModelCache on a simulated clock.

Eight bundles of different sizes and reload times share a memory budget
that holds about three of them. A seeded trace of requests picks bundles by
Zipf(1.1) popularity (which bundle is most popular is shuffled per seed) at
Poisson arrival times. Each policy replays the same trace through the real
`runtime.models.cache.ModelCache`: its source's fetch advances a simulated clock by
the bundle's reload seconds instead of doing work, so a trace of hours runs in
seconds and every decision is the cache's own. Requests are served one after
another; one that arrives during a load waits for it.

Reported per policy, summed over seeds: hit rate, evictions (per 1000
requests and per simulated hour), and reload seconds (the time callers spent
waiting for loads). `cachetools.LRUCache` replays the same traces as the
reference LRU; the real cache with `LRUPolicy` must agree with it exactly.

What is attainable, computed on the same traces:

* A0 (Aho, Denning and Ullman): evict the lowest p * R / S, p the true
  request probability the trace was drawn from. Near-optimal online for
  i.i.d. requests, but not optimal once sizes differ.
* The online optimum for i.i.d. requests with known p: an average-cost
  Markov decision process over every resident set that fits (at most 2^8),
  solved by relative value iteration; on a miss it moves to the resident set
  of least relative cost. No online policy does better in expectation.
* The offline optimum: the least reload seconds any policy, knowing the whole
  trace, could pay (dynamic programming over resident sets, request by
  request). No policy at all does better on that trace.

The sweeps (arrival rate, hysteresis, bursty sessions) and the bounds go
through `model`, a plain-Python copy of the cache's serial path that runs
~100x faster; it must agree exactly with the real cache on every policy that
both replay, which the table checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# `python bench/eviction_sim.py` puts bench/ on sys.path, not the repository root.
ROOT_DIR = Path(__file__).resolve().parent.parent
if str(ROOT_DIR) not in sys.path:
    sys.path.insert(0, str(ROOT_DIR))

from bench.common import Row, fmt_x, verdict  # noqa: E402
from runtime.clock import Clock  # noqa: E402
from runtime.models.eviction import Candidate, DensityPolicy, EvictionPolicy, GDSFPolicy, LRUPolicy  # noqa: E402

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
SIZE = {name: int(gb * GB) for name, gb, _ in FLEET}
COST = {name: seconds for name, _, seconds in FLEET}
NAMES = tuple(name for name, _, _ in FLEET)
BUDGET = int(BUDGET_GB * GB)

Trace = Sequence[tuple[float, str]]


@dataclass
class Outcome:
    requests: int = 0
    hits: int = 0
    evictions: int = 0
    reload_s: float = 0.0
    span_s: float = 0.0  # simulated seconds from the first arrival to the last reply

    def add(self, other: Outcome) -> None:
        self.requests += other.requests
        self.hits += other.hits
        self.evictions += other.evictions
        self.reload_s += other.reload_s
        self.span_s += other.span_s

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.requests)

    def same_decisions(self, other: Outcome) -> bool:
        return (self.hits, self.evictions, round(self.reload_s, 6)) == (
            other.hits,
            other.evictions,
            round(other.reload_s, 6),
        )


def popularity(seed: int) -> dict[str, float]:
    """Each bundle's request probability: Zipf over ranks, ranks shuffled per seed."""
    names = list(NAMES)
    random.Random(seed).shuffle(names)
    weights = [1 / (rank**ZIPF_S) for rank in range(1, len(names) + 1)]
    total = sum(weights)
    return {name: weight / total for name, weight in zip(names, weights, strict=True)}


def trace(seed: int, requests: int, mean_interval_s: float = MEAN_INTERVAL_S) -> list[Any]:
    """(arrival seconds, bundle) pairs drawn i.i.d. from `popularity(seed)`.

    The bundles are drawn before the intervals, so every `mean_interval_s`
    replays the same sequence of bundles, only spread differently in time.
    """
    p = popularity(seed)
    rng = random.Random(1_000_003 * (seed + 1))
    at = 0.0
    out = []
    for name in rng.choices(list(p), weights=list(p.values()), k=requests):
        at += rng.expovariate(1 / mean_interval_s)
        out.append((at, name))
    return out


def sessions(seed: int, requests: int, mean_start_s: float = 20.0) -> list[Any]:
    """A bursty trace: sessions start every `mean_start_s` on average (Poisson),
    each picks a bundle by the same Zipf popularity and sends a geometric number
    of requests (mean 5) about 2 s apart; sessions interleave."""
    p = popularity(seed)
    rng = random.Random(7 * seed + 1)
    out: list[tuple[float, str]] = []
    start = 0.0
    while len(out) < requests:
        start += rng.expovariate(1 / mean_start_s)
        name = rng.choices(list(p), weights=list(p.values()))[0]
        at = start
        while True:
            out.append((at, name))
            at += rng.expovariate(1 / 2.0)
            if rng.random() < 1 / 5:
                break
    out.sort()
    return out[:requests]


def cachetools_lru(requests: Trace) -> Outcome:
    """The reference: the same trace through cachetools.LRUCache sized in bytes."""
    from cachetools import LRUCache

    cache: LRUCache[str, int] = LRUCache(maxsize=BUDGET, getsizeof=lambda v: v)
    out = Outcome()
    for _, name in requests:
        out.requests += 1
        if name in cache:
            cache[name]  # a use: moves it to most recent
            out.hits += 1
            continue
        before = set(cache)
        cache[name] = SIZE[name]
        out.evictions += len(before - set(cache))
        out.reload_s += COST[name]
    return out


class SimClock(Clock):
    """The cache's clock; the fake source advances it by each fetch's cost."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(lambda: self.now)


class SimSource:
    """A BundleSource whose fetch costs simulated seconds and touches no disk."""

    def __init__(self, clock: SimClock) -> None:
        from runtime.bundles.manifest import BundleFile, Manifest

        self.clock = clock
        self.manifests = {
            name: Manifest(
                name,
                "1",
                (BundleFile("config.json", 1, "0" * 64),),  # no shards: nothing to read
                weights_bytes=SIZE[name],
            )
            for name in NAMES
        }

    def names(self) -> list[str]:
        return sorted(self.manifests)

    def manifest(self, name: str) -> Any:
        return self.manifests[name]

    def fetch(self, manifest: Any, on_progress: Any) -> Path:
        self.clock.now += COST[manifest.name]
        return Path("/nonexistent")

    def release(self, manifest: Any) -> None:
        """Nothing is held: no files."""

    def describe(self) -> str:
        return "simulated"


class KnownPopularity:
    """A0: evict the lowest p * R / S, knowing each bundle's true probability p."""

    def __init__(self, p: dict[str, float]) -> None:
        self.p = p

    def on_load(self, candidate: Candidate, now: float) -> None:
        pass

    def on_hit(self, candidate: Candidate, now: float) -> None:
        pass

    def on_evict(self, candidate: Candidate, now: float) -> None:
        pass

    def order(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        return sorted(candidates, key=lambda c: self.p[c.name] * c.reload_s / max(1, c.size_bytes))


class Counting:
    """Wraps a policy and counts the evictions the cache makes on its advice."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.evictions = 0

    def on_load(self, candidate: Candidate, now: float) -> None:
        self.inner.on_load(candidate, now)

    def on_hit(self, candidate: Candidate, now: float) -> None:
        self.inner.on_hit(candidate, now)

    def on_evict(self, candidate: Candidate, now: float) -> None:
        self.evictions += 1
        self.inner.on_evict(candidate, now)

    def order(self, candidates: Sequence[Candidate], now: float) -> list[Candidate]:
        return self.inner.order(candidates, now)


@contextlib.contextmanager
def no_device_release() -> Iterator[None]:
    """The fake loaders allocate nothing, so an eviction has nothing to give back:
    skip weights.release (a full gc.collect, most of a replay's time otherwise)."""
    from runtime.models import weights as weights_mod

    real = weights_mod.release
    weights_mod.release = lambda device: None
    try:
        yield
    finally:
        weights_mod.release = real


async def replay(requests: Trace, policy: EvictionPolicy, state: Path) -> Outcome:
    """The trace through a real ModelCache with `policy`, on a simulated clock."""
    from runtime.models.cache import ModelCache
    from runtime.models.estimate import Estimator
    from runtime.registry import BuilderSpec, Registry
    from runtime.telemetry.metrics import Metrics

    clock = SimClock()
    registry = Registry(
        builders={name: BuilderSpec(name, object, ()) for name in NAMES}, handlers={}
    )

    async def no_runner(*args: Any) -> Any:  # no handlers, so no warm-ups
        return None

    counting = Counting(policy)
    cache = ModelCache(
        source=SimSource(clock),
        registry=registry,
        estimator=Estimator(state, default_bandwidth_bytes_s=1e9, default_init_s=1.0),
        metrics=Metrics(),
        warm_up=no_runner,
        device="cpu",
        memory_budget=BUDGET,
        policy=counting,
        clock=clock,
    )
    out = Outcome()
    for arrival, name in requests:
        clock.now = max(clock.now, arrival)
        out.requests += 1
        if cache.is_ready(name):
            out.hits += 1
        else:
            out.reload_s += COST[name]
        lease = await cache.acquire(name)
        clock.now += RUN_S
        lease.release()
    out.evictions = counting.evictions
    out.span_s = clock.now - requests[0][0]
    await cache.unload_all()
    return out


def model(requests: Trace, policy: EvictionPolicy) -> Outcome:
    """What `replay` does, without the cache: the same hooks with the same
    arguments in the same order (checked against `replay` in the table)."""
    now = 0.0
    last_used: dict[str, float] = {}  # resident bundles
    hits = dict.fromkeys(NAMES, 0)
    reload_s = dict.fromkeys(NAMES, 0.0)
    out = Outcome()

    def candidate(name: str) -> Candidate:
        return Candidate(name, SIZE[name], reload_s[name], last_used[name], hits[name])

    for arrival, name in requests:
        now = max(now, arrival)
        out.requests += 1
        if name in last_used:
            out.hits += 1
        else:
            out.reload_s += COST[name]
            started = now
            now += COST[name]
            if sum(SIZE[n] for n in last_used) + SIZE[name] > BUDGET:
                for c in policy.order([candidate(n) for n in last_used], now):
                    if sum(SIZE[n] for n in last_used) + SIZE[name] <= BUDGET:
                        break
                    del last_used[c.name]
                    policy.on_evict(c, now)
                    out.evictions += 1
            reload_s[name] = max(0.0, now - started)  # as the cache measures it
            last_used[name] = now
            policy.on_load(candidate(name), now)
        hits[name] += 1
        last_used[name] = now
        policy.on_hit(candidate(name), now)
        now += RUN_S
        last_used[name] = now
    out.span_s = now - requests[0][0]
    return out


# ---- bounds ---------------------------------------------------------------------------

_BIT = {name: 1 << i for i, name in enumerate(NAMES)}
_ALL = (1 << len(NAMES)) - 1


def _fits(mask: int) -> bool:
    return sum(SIZE[n] for n in NAMES if mask & _BIT[n]) <= BUDGET


_FEASIBLE = [mask for mask in range(_ALL + 1) if _fits(mask)]


def offline_optimum(requests: Trace) -> float:
    """The least reload seconds of any policy that knows the whole trace.

    cost[S] = least cost so far ending with resident set S. Dropping a bundle is
    free, so before request r every superset's cost is available to S
    (`reach`, a minimum over supersets); S holds r either because a superset
    already held it or because r was loaded, paying R_r.
    """
    inf = math.inf
    cost = [inf] * (_ALL + 1)
    cost[0] = 0.0
    for _, name in requests:
        reach = cost[:]
        for bit in _BIT.values():
            for mask in range(_ALL + 1):
                if not mask & bit and reach[mask | bit] < reach[mask]:
                    reach[mask] = reach[mask | bit]
        bit = _BIT[name]
        cost = [inf] * (_ALL + 1)
        for mask in _FEASIBLE:
            if mask & bit:
                cost[mask] = min(reach[mask], reach[mask & ~bit] + COST[name])
    return min(cost)


def online_optimum(p: dict[str, float], requests: Trace) -> tuple[float, Outcome]:
    """The best online policy for i.i.d. requests of known p, and its replay of `requests`.

    States are resident sets that fit; a request to b not in S pays R_b and
    moves to any fitting subset of S + b that holds b. Relative value iteration
    gives the average reload seconds per request g and the relative values h;
    the policy moves to the successor of least h.
    """
    feasible = set(_FEASIBLE)
    successors: dict[tuple[int, str], list[int]] = {}
    for mask in _FEASIBLE:
        for name in NAMES:
            if not mask & _BIT[name]:
                full, sub, options = mask | _BIT[name], mask | _BIT[name], []
                while True:  # every subset of `full`
                    if sub & _BIT[name] and sub in feasible:
                        options.append(sub)
                    if sub == 0:
                        break
                    sub = (sub - 1) & full
                successors[(mask, name)] = options
    h = dict.fromkeys(_FEASIBLE, 0.0)
    gain = 0.0
    for _ in range(10_000):
        new = {}
        for mask in _FEASIBLE:
            value = 0.0
            for name in NAMES:
                if mask & _BIT[name]:
                    value += p[name] * h[mask]
                else:
                    best = min(h[s] for s in successors[(mask, name)])
                    value += p[name] * (COST[name] + best)
            new[mask] = value
        diffs = [new[m] - h[m] for m in _FEASIBLE]
        gain = (max(diffs) + min(diffs)) / 2
        h = {m: new[m] - new[0] for m in _FEASIBLE}
        if max(diffs) - min(diffs) < 1e-9:
            break
    out = Outcome()
    mask = 0
    for _, name in requests:
        out.requests += 1
        if mask & _BIT[name]:
            out.hits += 1
            continue
        out.reload_s += COST[name]
        nxt = min(successors[(mask, name)], key=h.__getitem__)
        out.evictions += bin(mask & ~nxt).count("1")
        mask = nxt
    return gain, out


def threshold_rule(p: dict[str, float]) -> str:
    """The keep-versus-evict rule with its threshold, for one seed's popularity.

    Evicting b costs R_b per request of b, R_b / T_b reload-seconds per second
    with T_b its mean request interval; keeping b costs S_b of the budget. So
    keep the bundles of highest density (R/T)/S, filling the budget, and let
    the rest take turns in what is left: the threshold θ is the density of
    the last bundle kept. (DensityPolicy estimates 1/T online.)
    """
    gb = {name: gb for name, gb, _ in FLEET}
    density = {n: COST[n] / (MEAN_INTERVAL_S / p[n]) / gb[n] for n in NAMES}
    ranked = sorted(density, key=density.__getitem__, reverse=True)
    # Keep in density order while room stays for the largest bundle not kept,
    # which must still be loadable into what is left.
    kept: list[str] = []
    for name in ranked:
        rest = [gb[n] for n in ranked if n not in kept and n != name]
        if sum(gb[n] for n in kept) + gb[name] + max(rest, default=0.0) <= BUDGET_GB:
            kept.append(name)
        else:
            break
    theta = density[kept[-1]] if kept else math.inf
    left = [n for n in ranked if n not in kept]
    return (
        f"keep b while (R_b/T_b)/S_b >= θ; seed 0: θ = {theta:.3f} reload-s/s per GB "
        f"(keep {', '.join(kept) or 'none'}; next: {left[0]} at {density[left[0]]:.3f}; "
        f"i.e. keep a 1 GB bundle of 10 s reload while requested at least every "
        f"{10 / theta:.0f} s)"
    )


def describe(o: Outcome) -> str:
    # Replays without a clock (cachetools, the bounds) have no span to rate by.
    per_hour = f", {3600 * o.evictions / o.span_s:.0f}/h" if o.span_s else ""
    return (
        f"hit rate {o.hit_rate:.1%}, {o.evictions} evictions "
        f"({1000 * o.evictions / o.requests:.0f}/1000 req{per_hour}), reload {o.reload_s:,.0f} s"
    )


def run(*, quick: bool = False) -> list[Row]:
    import torch  # noqa: F401  (imported before the freeze below, so frozen with the rest)

    from runtime.models import weights as weights_mod

    # The framework import (and the runtime's gc.freeze after it) happens once here,
    # not inside the first replay.
    weights_mod.resolve_device("cpu")
    seeds, requests = (2, 1500) if quick else (5, 3000)
    policies: dict[str, Callable[[int], EvictionPolicy]] = {
        "lru": lambda seed: LRUPolicy(),
        "density": lambda seed: DensityPolicy(min_residency_s=MIN_RESIDENCY_S),
        "gdsf": lambda seed: GDSFPolicy(min_residency_s=MIN_RESIDENCY_S),
        "density-nohyst": lambda seed: DensityPolicy(min_residency_s=0.0),
        "gdsf-nohyst": lambda seed: GDSFPolicy(min_residency_s=0.0),
        "a0": lambda seed: KnownPopularity(popularity(seed)),
    }
    real_names = ("lru", "density", "gdsf")  # through the real cache as well
    totals = {name: Outcome() for name in (*policies, "cachetools", "online", "offline")}
    real = {name: Outcome() for name in real_names}
    expected_online = 0.0
    per_seed: dict[str, list[float]] = {"density": [], "gdsf": [], "online": [], "offline": []}
    lru_agrees = model_agrees = True
    with tempfile.TemporaryDirectory(prefix="thaw-bench-sim-") as tmp, no_device_release():
        for seed in range(seeds):
            requests_ = trace(seed, requests)
            reference = cachetools_lru(requests_)
            totals["cachetools"].add(reference)
            modelled = {name: model(requests_, make(seed)) for name, make in policies.items()}
            for name in real_names:
                outcome = asyncio.run(
                    replay(requests_, policies[name](seed), Path(tmp) / f"{seed}-{name}")
                )
                real[name].add(outcome)
                model_agrees &= outcome.same_decisions(modelled[name])
            lru_agrees &= (reference.hits, reference.evictions) == (
                modelled["lru"].hits,
                modelled["lru"].evictions,
            )
            gain, online = online_optimum(popularity(seed), requests_)
            expected_online += gain * requests
            offline = Outcome(requests, reload_s=offline_optimum(requests_))
            for name, outcome in [*modelled.items(), ("online", online), ("offline", offline)]:
                totals[name].add(outcome)
            lru_s = modelled["lru"].reload_s
            for name in per_seed:
                source = {"online": online, "offline": offline}.get(name) or modelled[name]
                per_seed[name].append(source.reload_s / lru_s)

        # Hysteresis across arrival rates and on a bursty trace (same bundles, same seeds).
        sweep = []
        for interval in (2.0, 5.0, 20.0, 80.0, 300.0):
            sums = dict.fromkeys(("lru", "density", "density-nohyst"), 0.0)
            busy = 0.0
            for seed in range(seeds):
                requests_ = trace(seed, requests, interval)
                for name in sums:
                    outcome = model(requests_, policies[name](seed))
                    sums[name] += outcome.reload_s
                    if name == "lru":  # reload demand per second of arrivals
                        busy += outcome.reload_s / requests_[-1][0] / seeds
            with_, without = sums["density"], sums["density-nohyst"]
            sweep.append(
                f"{interval:.0f} s (LRU loading {busy:.0%} of the time): "
                f"{with_ / sums['lru']:.2f}x / {without / sums['lru']:.2f}x"
            )
        bursty = {name: Outcome() for name in ("lru", "density", "density-nohyst", "offline")}
        for seed in range(seeds):
            requests_ = sessions(seed, requests)
            for name in ("lru", "density", "density-nohyst"):
                bursty[name].add(model(requests_, policies[name](seed)))
            bursty["offline"].add(Outcome(requests, reload_s=offline_optimum(requests_)))

    lru = totals["lru"]

    def x(name: str, of: dict[str, Outcome] = totals) -> str:
        return fmt_x(of[name].reload_s / of["lru"].reload_s)

    density = totals["density"]
    ratio = density.reload_s / lru.reload_s
    label = f"eviction sim ({seeds} x {requests} req)"
    return [
        Row(
            f"{label}: LRU — real cache with LRUPolicy vs cachetools.LRUCache replay",
            describe(real["lru"]),
            describe(totals["cachetools"]),
            "identical" if lru_agrees and model_agrees else "DIFFER",
            "identical",
            verdict(lru_agrees and model_agrees),
        ),
        Row(
            f"{label}: DensityPolicy + hysteresis ({MIN_RESIDENCY_S:.0f} s) vs LRU, real cache",
            describe(real["density"]),
            describe(real["lru"]),
            fmt_x(real["density"].reload_s / real["lru"].reload_s),
            f"reload <= {RELOAD_TARGET}x LRU, hit rate >= LRU",
            verdict(ratio <= RELOAD_TARGET and density.hit_rate >= lru.hit_rate),
        ),
        Row(
            f"{label}: GDSF + hysteresis ({MIN_RESIDENCY_S:.0f} s, the previous default) "
            "vs LRU, real cache",
            describe(real["gdsf"]),
            describe(real["lru"]),
            fmt_x(real["gdsf"].reload_s / real["lru"].reload_s),
        ),
        Row(
            f"{label}: plain-Python model of the cache vs real cache (LRU, Density, GDSF)",
            "identical" if model_agrees else "DIFFER",
            "—",
            "—",
            "identical",
            verdict(model_agrees),
        ),
        Row(
            f"{label}: reload seconds / LRU's per seed (Density+hyst; GDSF+hyst; "
            "online optimum; offline optimum)",
            "; ".join(" ".join(f"{r:.2f}" for r in per_seed[n]) for n in per_seed),
        ),
        Row(
            f"{label}: without hysteresis — DensityPolicy vs LRU (GDSF: {x('gdsf-nohyst')})",
            describe(totals["density-nohyst"]),
            describe(lru),
            x("density-nohyst"),
        ),
        Row(
            f"{label}: bound — A0, evict lowest p·R/S knowing true p",
            describe(totals["a0"]),
            describe(lru),
            x("a0"),
        ),
        Row(
            f"{label}: bound — online optimum for i.i.d. with true p (MDP over resident sets)",
            describe(totals["online"]) + f"; expected {expected_online:,.0f} s",
            describe(lru),
            x("online"),
        ),
        Row(
            f"{label}: bound — offline optimum (knows the whole trace; DP over resident sets)",
            f"reload {totals['offline'].reload_s:,.0f} s",
            describe(lru),
            x("offline"),
            f"<= {RELOAD_TARGET}x needed for the target to be reachable",
            "info",
        ),
        Row(
            f"{label}: Density with / without hysteresis vs LRU, by mean arrival interval",
            "; ".join(sweep),
        ),
        Row(
            f"{label}: bursty sessions (start every 20 s, ~5 requests 2 s apart) — "
            f"Density + hysteresis vs LRU (without hysteresis {x('density-nohyst', bursty)}, "
            f"offline optimum {x('offline', bursty)})",
            describe(bursty["density"]),
            describe(bursty["lru"]),
            x("density", bursty),
        ),
        Row("eviction: keep-versus-evict threshold", threshold_rule(popularity(0))),
    ]


if __name__ == "__main__":
    from bench.common import table_main

    table_main(run, __doc__)
