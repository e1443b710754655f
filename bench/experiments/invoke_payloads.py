"""Warm invocations with large bodies: Thaw against the bare app, body sizes and shapes.

    .venv/bin/python bench/experiments/invoke_payloads.py [--rounds 5]
    .venv/bin/python bench/experiments/invoke_payloads.py --against /path/to/an/older/checkout

`bench/overhead.py` measures a 34-byte event; this measures the same warm
`POST /invoke/echo` (the event back as the output) with the bodies inference
takes: lists of floats of 0.06, 0.40 and 1.5 MB, a batch of vectors, records with
text. Each variant is a real server process on 127.0.0.1, all up at once, one
client, measured in alternating 1 s windows (Thaw, bare, [the other
checkout's Thaw], then the reverse order), each ratio taken within a round and
the median over rounds taken. Per request: p50 latency, the server's CPU (user
+ system, /proc/PID/stat) and its minor page faults (a fault is about 4 us of
CPU in a VM: a page the allocator handed back and took again). Target: p50 at
most 1.25x the bare app's, the warm p50 target of issue 29.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402  # noqa: E402
    Conn,
    Proc,
    Row,
    bare_argv,
    cpu_s,
    fmt_s,
    fmt_x,
    free_port,
    median,
    minor_faults,
    render,
    round_ratio,
    runtime_env,
    stopping,
    thaw_serve_argv,
    verdict,
)

P50_TARGET = 1.25
WINDOW_S = 1.0


def _floats(count: int) -> bytes:
    return orjson.dumps({"values": [i / 7 for i in range(count)]})


SHAPES: dict[str, bytes] = {
    "3,500 floats": _floats(3_500),
    "23,500 floats": _floats(23_500),
    "88,000 floats": _floats(88_000),
    "100 vectors of 384": orjson.dumps({"vectors": [[i / 7] * 384 for i in range(100)]}),
    "10,000 records with text": orjson.dumps(
        [
            {"id": i, "text": f'line {i}\nof "quoted" text', "tags": ["a", "b"]}
            for i in range(10_000)
        ]
    ),
}


@dataclass
class Window:
    p50_s: float
    cpu_s: float
    faults: float


async def window(proc: Proc, body: bytes) -> Window:
    """One client's requests for WINDOW_S: per request p50, server CPU, faults."""
    assert proc.proc is not None
    pid = proc.proc.pid
    conn = await Conn(proc.port).open()
    took: list[float] = []
    try:
        cpu, faults = cpu_s(pid), minor_faults(pid)
        until = time.monotonic() + WINDOW_S
        while (started := time.monotonic()) < until:
            reply = await conn.request("POST", "/invoke/echo", body)
            if reply.status != 200:
                raise RuntimeError(f"echo answered {reply.status}: {reply.body[:200]!r}")
            took.append(time.monotonic() - started)
        count = len(took)
        return Window(
            median(took), (cpu_s(pid) - cpu) / count, (minor_faults(pid) - faults) / count
        )
    finally:
        await conn.close()


async def measure(procs: dict[str, Proc], rounds: int) -> dict[str, dict[str, list[Window]]]:
    got: dict[str, dict[str, list[Window]]] = {}
    for shape, body in SHAPES.items():
        got[shape] = {name: [] for name in procs}
        for proc in procs.values():  # warm: first calls, the allocator's first growth
            await window(proc, body)
        for index in range(rounds):
            names = list(procs) if index % 2 == 0 else list(procs)[::-1]
            for name in names:
                got[shape][name].append(await window(procs[name], body))
    return got


def rows_for(got: dict[str, dict[str, list[Window]]]) -> list[Row]:
    rows: list[Row] = []
    for shape, by in got.items():
        label = f"{shape} ({len(SHAPES[shape]) / 1e6:.2f} MB)"
        thaw, bare = by["thaw"], by["bare"]
        p50 = round_ratio(thaw, bare, "p50_s")
        rows.append(
            Row(
                f"{label}: p50 vs the bare app",
                fmt_s(median([w.p50_s for w in thaw])),
                fmt_s(median([w.p50_s for w in bare])),
                fmt_x(p50),
                f"<= {P50_TARGET}x bare",
                verdict(p50 <= P50_TARGET),
            )
        )
        rows.append(
            Row(
                f"{label}: server CPU per request vs the bare app",
                fmt_s(median([w.cpu_s for w in thaw])),
                fmt_s(median([w.cpu_s for w in bare])),
                fmt_x(round_ratio(thaw, bare, "cpu_s")),
            )
        )
        faults = f"{median([w.faults for w in thaw]):.0f} / {median([w.faults for w in bare]):.0f}"
        if "against" in by:
            other = by["against"]
            faults += f" / {median([w.faults for w in other]):.0f}"
            for field, what in (("p50_s", "p50"), ("cpu_s", "server CPU per request")):
                rows.append(
                    Row(
                        f"{label}: {what} vs the other checkout",
                        fmt_s(median([getattr(w, field) for w in thaw])),
                        fmt_s(median([getattr(w, field) for w in other])),
                        fmt_x(round_ratio(thaw, other, field)),
                    )
                )
        rows.append(Row(f"{label}: page faults per request (Thaw / bare[ / other])", faults, "—"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating windows per variant")
    parser.add_argument("--against", type=Path, help="another checkout's Thaw, measured beside")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="thaw-invoke-payloads-") as tmp_dir:
        tmp = Path(tmp_dir)
        variants = {"thaw": (thaw_serve_argv, ROOT), "bare": (bare_argv, ROOT)}
        if args.against is not None:
            variants["against"] = (thaw_serve_argv, args.against.resolve())
        with stopping([]) as started:
            procs: dict[str, Proc] = {}
            for name, (argv, root) in variants.items():
                env = runtime_env(tmp / name, handlers="handlers.echo")
                env["PYTHONPATH"] = str(root)
                port = free_port()
                procs[name] = Proc(argv(port), env, port, tmp / f"{name}.log", cwd=root).start()
                started.append(procs[name])
            for proc in procs.values():
                proc.wait_healthy()
            got = asyncio.run(measure(procs, args.rounds))
    print(render(rows_for(got)))


if __name__ == "__main__":
    main()
