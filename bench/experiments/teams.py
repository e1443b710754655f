"""OpenMP teams: torch's loops with one team alive against two (runtime/models/weights/teams.py).

    .venv/bin/python bench/experiments/teams.py [--rounds 5]

In one process, on threads of its own (the main thread runs no torch), the
same work measured three ways in turn, medians of `--rounds`:

- a 64x576 add (one parallel loop), 2,000 times on thread B: with B's team the
  only one; with thread A's team alive beside it, A idle (as a handler thread
  or a load's executor thread kept it before); and with A's team ended by
  `teams.release()` on A (what Thaw does now);
- SmolLM2's 8-token answer (`generate`'s call as the bare script makes it),
  when its bundle is built (scripts/build_model_bundles.py): built on thread A,
  answered on thread B, with A's team kept against A's team ended.

The ratio is the one-team time (Thaw now) over the two-team time (before). Where torch does not run
on libgomp, or with one OpenMP thread, there are no teams to end: one line
says so. Run with the cores to itself: a second process spinning its own team
on the same cores is what README's `OMP_NUM_THREADS` note is about.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Row, fmt_s, fmt_x, median, render  # noqa: E402

ADDS = 2000


def on_thread(fn: Callable[[], Any]) -> Any:
    """`fn()` on a new thread, which ends with it (and its team with it)."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


class Holder:
    """Thread A: runs what it is given, and lives on between calls (keeping its team)."""

    def __init__(self) -> None:
        self._calls: list[tuple[Callable[[], Any], list[Any], threading.Event]] = []
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._calls:
                    self._wake.wait()
                fn, out, done = self._calls.pop(0)
            out.append(fn())
            done.set()

    def call(self, fn: Callable[[], Any]) -> Any:
        out: list[Any] = []
        done = threading.Event()
        with self._wake:
            self._calls.append((fn, out, done))
            self._wake.notify()
        done.wait()
        return out[0]


def compared(measurement: str, ended: list[float], kept: list[float]) -> Row:
    """A row: Thaw now (the other team ended) against before (it kept)."""
    now, before = median(ended), median(kept)
    return Row(measurement, fmt_s(now), fmt_s(before), fmt_x(now / before))


def adds_s(x: Any) -> float:
    """Seconds per add on the calling thread (after a few to make its team)."""
    for _ in range(50):
        x + x
    started = time.perf_counter()
    for _ in range(ADDS):
        x + x
    return (time.perf_counter() - started) / ADDS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import torch

    from runtime.models.weights import teams

    if torch.get_num_threads() < 2 or not teams.supported():
        print("skipped: torch runs no OpenMP teams here (one thread, or not on libgomp)")
        return 0
    a = Holder()
    # Made on a thread that ends: filling it is a parallel loop, and the main thread
    # must keep no team.
    x = on_thread(lambda: torch.ones(64, 576))
    alone: list[float] = []
    beside: list[float] = []
    ended: list[float] = []
    for _ in range(args.rounds):
        alone.append(on_thread(lambda: adds_s(x)))
        a.call(lambda: x + x)  # A makes a team, and keeps it
        beside.append(on_thread(lambda: adds_s(x)))
        a.call(teams.release)
        ended.append(on_thread(lambda: adds_s(x)))
    rows = [
        compared(
            "64x576 add on thread B, thread A's idle team ended (baseline: A's team "
            f"kept; B's team alone {fmt_s(median(alone))}; median of {args.rounds})",
            ended,
            beside,
        )
    ]
    rows += generate_rows(a, teams.release, args.rounds)
    print(render(rows))
    return 0


def generate_rows(a: Holder, release: Callable[[], object], rounds: int) -> list[Row]:
    if not (ROOT / "bundles" / "smollm2" / "bundle.json").is_file():
        return [
            Row(
                "SmolLM2 8-token answer",
                "bundle not built (scripts/build_model_bundles.py)",
                verdict="skipped",
            )
        ]
    os.environ.setdefault("THAW_HANDLERS", "handlers.generate")
    os.environ.setdefault("THAW_BUNDLE_SOURCE", str(ROOT / "bundles"))
    from runtime.cli import bare

    prepared = a.call(lambda: bare.prepare("generate"))  # built on A
    event = {"prompt": "The capital of France is", "max_tokens": 8}

    def answer_s() -> float:
        started = time.perf_counter()
        bare.call(prepared, event)
        return time.perf_counter() - started

    kept: list[float] = []
    ended: list[float] = []
    for _ in range(rounds):
        a.call(lambda: bare.call(prepared, event))  # A's team, made again
        kept.append(on_thread(answer_s))
        a.call(release)
        ended.append(on_thread(answer_s))
    return [
        compared(
            "SmolLM2 8-token answer on thread B, the builder's thread A's team ended "
            f"(baseline: A's team kept; median of {rounds})",
            ended,
            kept,
        )
    ]


if __name__ == "__main__":
    sys.exit(main())
