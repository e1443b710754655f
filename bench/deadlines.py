"""Deadlines under wrong estimates: no answer after its deadline, whatever the estimates say.

    .venv/bin/python bench/deadlines.py [--requests 200] [--seed 20261129]

200 requests with random deadlines (0.2-3 s) against eight bundles with
random load times (0-4 s), with the persisted load-time estimates made wrong
in both directions (even bundles claim to be 100x faster than they are, odd
ones 100x slower, and the framework import claims to be instant), sent from
one client over 6 s. Each answer must be 200 or 202, every 202's job must
succeed, and every request must run exactly once; the figure is the lateness
of each answer past its deadline, as the client saw it (target: none later
than 50 ms).

`tests/http/test_deadline_fault.py` runs the same scenario and checks its
outcomes; the lateness is a timing on a shared machine, so it is measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import Row, render, runtime_env, verdict  # noqa: E402
from tests.support import ServerProcess, make_bundle  # noqa: E402

TOLERANCE_S = 0.05
BUNDLES = 8


@dataclass
class Answer:
    token: str
    deadline_s: float
    status: int
    elapsed_s: float
    body: dict[str, Any]

    @property
    def late_s(self) -> float:
        return self.elapsed_s - self.deadline_s


def prepare(bundles: Path, state: Path, ledger: Path, seed: int) -> random.Random:
    """Eight `fleet` bundles with random load times, and estimates wrong both ways."""
    rng = random.Random(seed)
    load_s = [rng.uniform(0.0, 4.0) for _ in range(BUNDLES)]
    state.mkdir(parents=True, exist_ok=True)
    history = {}
    for index, seconds in enumerate(load_s):
        name = f"fleet{index}"
        make_bundle(bundles, name, config={"sleep_s": seconds, "ledger": str(ledger)})
        claimed = seconds / 100 if index % 2 == 0 else seconds * 100 + 5
        history[name] = {
            "fetch_bytes_s": 1e12,
            "load_bytes_s": 1e12,
            "init_s": claimed,
            "warmup_s": 0.0,
            "loads": 3,
        }
    runs = {f"fleet{i}": (0.001 if i % 3 else 2.0) for i in range(BUNDLES)}
    (state / "estimates.json").write_text(
        json.dumps({"bundles": history, "runs": runs, "framework_s": 0.001})
    )
    return rng


def env_for(base: dict[str, str], state: Path) -> dict[str, str]:
    return {**base, "THAW_HANDLERS": "tests.handlers.fleet", "THAW_STATE_DIR": str(state)}


def send_all(url: str, rng: random.Random, count: int) -> list[Answer]:
    """`count` requests, each after a random delay, from one client on one loop."""
    specs = [
        {
            "token": f"t{token}",
            "bundle": f"fleet{rng.randrange(BUNDLES)}",
            "deadline_s": rng.uniform(0.2, 3.0),
            "run_s": rng.choice([0.0, 0.0, 0.05, 0.5]),
            "delay_s": rng.uniform(0.0, 6.0),
        }
        for token in range(count)
    ]

    async def send(client: httpx.AsyncClient, spec: dict[str, Any]) -> Answer:
        await asyncio.sleep(spec["delay_s"])
        started = time.monotonic()
        response = await client.post(
            f"/invoke/{spec['bundle']}",
            json={"token": spec["token"], "run_s": spec["run_s"]},
            headers={"Prefer": f"wait={spec['deadline_s']:.3f}"},
        )
        elapsed = time.monotonic() - started
        return Answer(
            spec["token"], spec["deadline_s"], response.status_code, elapsed, response.json()
        )

    async def main() -> list[Answer]:
        limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
            return list(await asyncio.gather(*(send(client, spec) for spec in specs)))

    return asyncio.run(main())


def final_statuses(server: ServerProcess, answers: list[Answer]) -> Counter[str]:
    """The final status of every job a 202 named (long-polled)."""
    finals: Counter[str] = Counter()
    with server.client() as client:
        for answer in answers:
            if answer.status == 202:
                job = client.get(f"/jobs/{answer.body['id']}", params={"wait": 30}).json()
                finals[job["status"]] += 1
    return finals


def runs_per_token(ledger: Path) -> Counter[str]:
    return Counter(ledger.read_text().split())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=20261129)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="thaw-bench-deadlines-") as tmp:
        root = Path(tmp)
        bundles, state, ledger = root / "bundles", root / "state", root / "ledger.txt"
        bundles.mkdir()
        rng = prepare(bundles, state, ledger, args.seed)
        env = env_for(runtime_env(root, bundle_source=str(bundles)), state)
        server = ServerProcess(env)
        server.start()
        try:
            answers = send_all(server.url, rng, args.requests)
            finals = final_statuses(server, answers)
        finally:
            server.kill()
        runs = runs_per_token(ledger)
    lateness = sorted(a.late_s for a in answers)
    late = [a for a in answers if a.late_s > TOLERANCE_S]
    statuses = Counter(a.status for a in answers)
    p99 = lateness[min(len(lateness) - 1, int(0.99 * len(lateness)))]
    others = sum(n for s, n in statuses.items() if s not in (200, 202))
    failed_jobs = sum(finals.values()) - finals["succeeded"]
    once = sum(1 for n in runs.values() if n == 1)
    rows = [
        Row(
            "answers 200 / 202 / other",
            f"{statuses[200]} / {statuses[202]} / {others}",
            target="other 0",
            verdict=verdict(others == 0),
        ),
        Row(
            "jobs succeeded / not",
            f"{finals['succeeded']} / {failed_jobs}",
            target="not 0",
            verdict=verdict(failed_jobs == 0),
        ),
        Row(
            "requests run exactly once",
            f"{once} of {args.requests}",
            target="all",
            verdict=verdict(once == args.requests == len(runs)),
        ),
        Row(
            "lateness past the deadline: worst / p99",
            f"{lateness[-1] * 1000:.1f} ms / {p99 * 1000:.1f} ms",
            target=f"<= {TOLERANCE_S * 1000:.0f} ms",
            verdict=verdict(not late),
        ),
    ]
    print(render(rows))
    return 0 if not late else 1


if __name__ == "__main__":
    raise SystemExit(main())
