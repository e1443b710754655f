"""OpenAI-compatible routes (issue 28): `/v1/embeddings` vs Thaw's own `/invoke/embed`.

    .venv/bin/python bench/openai_routes.py [--quick] [--rounds N] [--out FILE]

One `thaw serve` with `handlers.embed` (MiniLM prewarmed) answers both paths,
so the two differ only in what the /v1 route adds: OpenAI's request checked
and translated into the handler's event, the answer built in OpenAI's shape
(`{"object": "list", "data": [{"embedding": ...}], "usage"}`), the caller's
timeout header read. The work itself is the same batched `embed`
(runtime/dispatch), which the mean batch size per path shows.

Every request embeds one short sentence from bench/batching.py's list, sent as
each path takes it: `{"texts": [s]}` to /invoke/embed, `{"model": "embed",
"input": s}` to /v1/embeddings, with the `X-Stainless-Read-Timeout` header the
official Python client sends. The load generator is bench/common.py's lean
keep-alive client (closed loop, in this process), not the official client: its
own CPU cost would be measured instead of the server's on a 2-core machine.
Each round measures both paths at 32 clients (requests/s, p99) and at one
client (p50), in alternating order; the ratio is taken within a round, then
the median over rounds (the machine's load drifts between rounds more than
within one).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from bench.batching import SENTENCES, Slot, _batch_sizes, _wait_http_ok  # noqa: E402
from bench.common import (  # noqa: E402
    Conn,
    Proc,
    Row,
    fmt_s,
    fmt_x,
    free_port,
    median,
    percentile,
    render,
    round_ratio,
    runtime_env,
    stopping,
    thaw_serve_argv,
    verdict,
)

CONCURRENCY = 32
TARGET = 0.95  # /v1/embeddings requests/s over /invoke/embed's, at 32 clients
# The header of the official Python client's that the route reads (its default timeout).
CLIENT_HEADERS = {"X-Stainless-Read-Timeout": "600"}


@dataclass(frozen=True)
class Endpoint:
    """One way to ask for the same embedding."""

    name: str
    path: str
    body: Callable[[str], bytes]
    vector: Callable[[bytes], list[float]]
    headers: dict[str, str]


INVOKE = Endpoint(
    "/invoke/embed",
    "/invoke/embed",
    lambda s: orjson.dumps({"texts": [s]}),
    lambda body: orjson.loads(body)["embeddings"][0],
    {},
)
V1 = Endpoint(
    "/v1/embeddings",
    "/v1/embeddings",
    lambda s: orjson.dumps({"model": "embed", "input": s}),
    lambda body: orjson.loads(body)["data"][0]["embedding"],
    CLIENT_HEADERS,
)


async def _client(
    port: int, target: Endpoint, index: int, until: float, latencies: list[float]
) -> None:
    conn = await Conn(port).open()
    n = index
    try:
        while time.monotonic() < until:
            started = time.monotonic()
            body = target.body(SENTENCES[n % len(SENTENCES)])
            reply = await conn.request("POST", target.path, body, target.headers)
            if reply.status != 200:
                raise RuntimeError(f"{target.name} answered {reply.status}: {reply.body[:300]!r}")
            latencies.append(reply.done_at - started)
            n += 7  # clients walk the list at different offsets
    finally:
        await conn.close()


async def measure(port: int, target: Endpoint, clients: int, duration_s: float) -> Slot:
    latencies: list[float] = []
    started = time.monotonic()
    until = started + duration_s
    await asyncio.gather(*(_client(port, target, i, until, latencies) for i in range(clients)))
    elapsed = time.monotonic() - started
    return Slot(percentile(latencies, 50), percentile(latencies, 99), len(latencies) / elapsed)


async def _vector(port: int, target: Endpoint) -> list[float]:
    conn = await Conn(port).open()
    try:
        reply = await conn.request("POST", target.path, target.body(SENTENCES[0]), target.headers)
    finally:
        await conn.close()
    return target.vector(reply.body)


def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


@dataclass
class Result:
    busy: dict[str, list[Slot]]
    solo: dict[str, list[Slot]]
    batch: dict[str, list[float]]
    cosine: float


async def _run(port: int, rounds: int, solo_s: float, busy_s: float) -> Result:
    targets = [INVOKE, V1]
    cosine = _cos(await _vector(port, INVOKE), await _vector(port, V1))
    for target in targets:  # warm both paths: first calls, thread pools, allocator
        await measure(port, target, CONCURRENCY, 1.0)
    result = Result(
        busy={t.name: [] for t in targets},
        solo={t.name: [] for t in targets},
        batch={t.name: [] for t in targets},
        cosine=cosine,
    )
    for index in range(rounds):
        for target in targets if index % 2 == 0 else targets[::-1]:
            print(f"[openai] round {index + 1}: {target.name}", file=sys.stderr, flush=True)
            start = await _batch_sizes(port)
            result.busy[target.name].append(await measure(port, target, CONCURRENCY, busy_s))
            end = await _batch_sizes(port)
            if end[1] > start[1]:
                result.batch[target.name].append((end[0] - start[0]) / (end[1] - start[1]))
            result.solo[target.name].append(await measure(port, target, 1, solo_s))
    return result


def table(result: Result) -> str:
    v1, inv = result.busy[V1.name], result.busy[INVOKE.name]
    rps = round_ratio(v1, inv, "rps")

    def med(slots: list[Slot], field: str) -> float:
        return median([getattr(s, field) for s in slots])

    solo_v1, solo_inv = result.solo[V1.name], result.solo[INVOKE.name]
    rows = [
        Row(
            f"embed, {CONCURRENCY} clients: requests/s (/v1/embeddings vs /invoke/embed)",
            f"{med(v1, 'rps'):.0f}",
            f"{med(inv, 'rps'):.0f}",
            fmt_x(rps),
            f">= {TARGET}x",
            verdict(rps >= TARGET),
        ),
        Row(
            f"embed, {CONCURRENCY} clients: p99 latency",
            fmt_s(med(v1, "p99_s")),
            fmt_s(med(inv, "p99_s")),
            fmt_x(round_ratio(v1, inv, "p99_s")),
        ),
        Row(
            f"embed, {CONCURRENCY} clients: mean batch size",
            f"{median(result.batch[V1.name]):.1f}",
            f"{median(result.batch[INVOKE.name]):.1f}",
        ),
        Row(
            "embed, 1 client: p50 latency",
            fmt_s(med(solo_v1, "p50_s")),
            fmt_s(med(solo_inv, "p50_s")),
            fmt_x(round_ratio(solo_v1, solo_inv, "p50_s")),
        ),
    ]
    note = (
        f"- {len(v1)} rounds, Thaw = /v1/embeddings, baseline = /invoke/embed (same server, "
        f"same model); cosine of the first sentence's vectors: {result.cosine:.6f}"
    )
    return render(rows) + "\n\n" + note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 short rounds")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default 4; quick 2)")
    parser.add_argument("--out", default="", help="also write the table to this file")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 4)
    solo_s, busy_s = (1.0, 3.0) if args.quick else (2.0, 5.0)
    with tempfile.TemporaryDirectory(prefix="thaw-bench-openai-") as tmp_dir:
        tmp = Path(tmp_dir)
        with stopping([]) as procs:
            port = free_port()
            env = runtime_env(tmp, handlers="handlers.embed", prewarm="minilm")
            thaw = Proc(thaw_serve_argv(port), env, port, tmp / "thaw.log").start()
            procs.append(thaw)
            asyncio.run(_wait_http_ok(port, "/readyz", thaw, 300.0))
            result = asyncio.run(_run(port, rounds, solo_s, busy_s))
    out = table(result)
    print(out)
    if args.out:
        Path(args.out).write_text(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
