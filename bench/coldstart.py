"""Cold start, phase by phase, of a real `thaw serve` process.

For each handler (echo, fahrenheit, and every shipped model whose bundle is
built), a fresh process with an empty state directory (no load history):

1. process start -> first /healthz 200, against the same for a bare
   Starlette+uvicorn process started right after it (the floor: Python, the
   web stack, the socket);
2. the first invocation (its smallest warm-up example as the event), split by
   its Server-Timing header into fetch, load, init, warm-up and run; the
   runtime's own overhead is the client-measured wall time minus those five
   (so it holds the HTTP exchange, queueing, thread hand-offs and bookkeeping).

Both processes start from byte-compiled code, as a deployed image should:
pip compiles site-packages when it installs them, but nothing writes the .pyc
files of runtime/ and handlers/ under PYTHONDONTWRITEBYTECODE=1 (set in the
images and in many shells), so every start would compile them from source
again (about 80 ms here). `run()` compiles them first
(`runtime.cli.coldstart.compile_bytecode`), as the image build does.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

# `python bench/coldstart.py` puts bench/ on sys.path, not the repository root.
ROOT_DIR = Path(__file__).resolve().parent.parent
if str(ROOT_DIR) not in sys.path:
    sys.path.insert(0, str(ROOT_DIR))

from bench.common import (  # noqa: E402
    ROOT,
    Proc,
    Row,
    bare_argv,
    fmt_s,
    fmt_x,
    free_port,
    median,
    request,
    runtime_env,
    server_timing,
    stopping,
    thaw_serve_argv,
    verdict,
)
from runtime.cli.coldstart import compile_bytecode  # noqa: E402

HEALTHZ_TARGET_S = 0.3
OVERHEAD_TARGET_S = 0.050
PHASES = ("fetch", "load", "init", "warmup", "run")
# handler -> bundle (None: no model). Model bundles are built by
# scripts/build_model_bundles.py; those not built are skipped.
HANDLERS: dict[str, str | None] = {
    "echo": None,
    "fahrenheit": "tempconv",
    "embed": "minilm",
    "classify": "efficientnet",
    "generate": "smollm2",
}


@dataclass
class ColdRun:
    healthz_s: float
    bare_healthz_s: float
    wall_s: float
    phases_ms: dict[str, float]

    @property
    def overhead_s(self) -> float:
        return self.wall_s - sum(self.phases_ms.get(p, 0.0) for p in PHASES) / 1000


def event_for(handler: str) -> Any:
    """The handler's smallest declared warm-up example: a request it is built for,
    and one whose own run time does not swamp the phases measured here."""
    from runtime.registry import discover

    module = {"fahrenheit": "tempconv"}.get(handler, handler)
    spec = discover([f"handlers.{module}"]).handler(handler)
    if not spec.warmup:
        return {"hello": "thaw"}
    return min(spec.warmup, key=lambda example: len(orjson.dumps(example)))


def built(bundle: str | None) -> bool:
    return bundle is None or (ROOT / "bundles" / bundle / "bundle.json").is_file()


def _bundle_bytes(bundle: str | None) -> int:
    if bundle is None:
        return 0
    from runtime.bundles.manifest import read_manifest

    return read_manifest(ROOT / "bundles" / bundle).total_bytes


def cold_run(handler: str, event: Any, tmp: Path) -> ColdRun:
    """One fresh Thaw process (healthz, then the first invocation) and one bare process."""
    thaw_port, bare_port = free_port(), free_port()
    with stopping([]) as procs:
        thaw = Proc(thaw_serve_argv(thaw_port), runtime_env(tmp), thaw_port, tmp / "thaw.log")
        procs.append(thaw.start())
        healthz_s = thaw.wait_healthy()
        reply = asyncio.run(
            request(
                thaw_port,
                "POST",
                f"/invoke/{handler}",
                orjson.dumps(event),
                {"Prefer": "wait=300"},
            )
        )
        if reply.status != 200:
            raise RuntimeError(f"{handler}: {reply.status} {reply.body[:300]!r}\n{thaw.log()}")
        phases_ms = server_timing(reply.headers.get("server-timing", ""))
        # The client timed from before the connect: the same span a caller sees.
        thaw.stop()
        bare = Proc(bare_argv(bare_port), runtime_env(tmp), bare_port, tmp / "bare.log")
        procs.append(bare.start())
        bare_healthz_s = bare.wait_healthy()
    return ColdRun(healthz_s, bare_healthz_s, reply.wall_s, phases_ms)


def run(*, quick: bool = False) -> list[Row]:
    compile_bytecode(["handlers"])
    runs = 1 if quick else 3
    results: dict[str, list[ColdRun]] = {}
    skipped: list[str] = []
    events = {h: event_for(h) for h, b in HANDLERS.items() if built(b)}
    # Round-robin over handlers, so drifting background load spreads evenly.
    for _ in range(runs):
        for handler, bundle in HANDLERS.items():
            if not built(bundle):
                if handler not in skipped:
                    skipped.append(handler)
                continue
            with tempfile.TemporaryDirectory(prefix="thaw-bench-") as tmp:
                results.setdefault(handler, []).append(
                    cold_run(handler, events[handler], Path(tmp))
                )
    every = [r for rs in results.values() for r in rs]
    healthz = median([r.healthz_s for r in every])
    rows = [
        Row(
            f"process start -> /healthz 200 (median of {len(every)} starts)",
            fmt_s(healthz),
            f"{fmt_s(median([r.bare_healthz_s for r in every]))} bare Starlette+uvicorn",
            fmt_x(median([r.healthz_s / r.bare_healthz_s for r in every])),
            f"<= {fmt_s(HEALTHZ_TARGET_S)}",
            verdict(healthz <= HEALTHZ_TARGET_S),
        )
    ]
    for handler, rs in results.items():
        bundle = HANDLERS[handler]
        size = _bundle_bytes(bundle)
        what = f"`{handler}`" + (f" ({bundle}, {size / 1e6:.1f} MB)" if bundle else " (no model)")
        phases = {p: median([r.phases_ms.get(p, 0.0) for r in rs]) / 1000 for p in PHASES}
        split = " + ".join(f"{p} {fmt_s(phases[p])}" for p in PHASES if p in rs[0].phases_ms)
        overhead = median([r.overhead_s for r in rs])
        rows += [
            Row(
                f"cold {what}: first invocation",
                f"{fmt_s(median([r.wall_s for r in rs]))} = {split} + overhead",
            ),
            Row(
                f"cold {what}: runtime overhead (wall - fetch - load - init - warmup - run)",
                fmt_s(overhead),
                target=f"< {fmt_s(OVERHEAD_TARGET_S)}",
                verdict=verdict(overhead < OVERHEAD_TARGET_S),
            ),
        ]
    for handler in skipped:
        rows.append(
            Row(
                f"cold `{handler}` ({HANDLERS[handler]})",
                "bundle not built (scripts/build_model_bundles.py)",
                verdict="skipped",
            )
        )
    return rows


if __name__ == "__main__":
    from bench.common import table_main

    table_main(run, __doc__)
