"""Host memory handed back to the OS, measured as the container sees it (issue 27, part 1).

    .venv/bin/python bench/memory.py [--bundles bundles] [--cycles 10] [--rounds 5]

Every figure is the RSS of a real `thaw serve` (VmRSS / VmHWM from /proc),
never Thaw's own accounting. Each scenario runs twice, one configuration
after the other in the same run: Thaw's host-memory controls
(runtime/models/weights/host.py: fixed mmap threshold, arena cap,
malloc_trim after an unload; the defaults) against the baseline of glibc's
own behaviour (THAW_MMAP_THRESHOLD_BYTES=0, THAW_MALLOC_ARENA_MAX=0,
THAW_MALLOC_TRIM=false).

- Idle baseline: tempconv loaded and unloaded (the framework imported,
  nothing loaded).
- Cycles: each shipped bundle loaded (prewarm: fetch, load, build, warm-up)
  and unloaded `--cycles` times; the RSS with nothing loaded after the first
  and the last cycle. Target: at most baseline + 128 MiB after all of them
  (the first use of the bundles' code: tokenizers, oneDNN), and no growth
  past 16 MiB from the first cycle to the last.
- Eviction: a budget that holds SmolLM2 or MiniLM but not both; `embed` and
  `generate` called in turn `--rounds` times, each call evicting the other's
  model. Target: peak RSS <= baseline + budget + 128 MiB (the per-process
  overhead the README tells containers to leave).
- What the controls cost: warm `embed` (32 texts) and `generate` (16 tokens)
  request medians, one server per configuration up at once and sent requests
  in turn; and the unload round trip (which now trims).

Bundles are built first (scripts/build_model_bundles.py, skipped when current).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    Row,
    fmt_s,
    fmt_x,
    median,
    minor_faults,
    render,
    runtime_env,
    verdict,
)
from runtime.bundles.manifest import read_manifest  # noqa: E402
from tests.pretrained.host_memory import (  # noqa: E402
    MIB,
    REQUESTS,
    bundle_root,
    idle_baseline,
    invoke,
    load,
    peak_rss,
    rss,
    server_env,
    unload,
)
from tests.support import ServerProcess  # noqa: E402

BUNDLES = ("smollm2", "minilm", "efficientnet")
FIRST_USE_MARGIN = 128 * MIB
CYCLE_MARGIN = 16 * MIB
OVERHEAD = 128 * MIB
GLIBC = {
    "THAW_MMAP_THRESHOLD_BYTES": "0",
    "THAW_MALLOC_ARENA_MAX": "0",
    "THAW_MALLOC_TRIM": "false",
}
CONFIGS = {"thaw": {}, "glibc": GLIBC}


@dataclass
class Figures:
    baseline: int = 0
    idle: dict[str, list[int]] = field(default_factory=dict)  # after each cycle
    unload_s: list[float] = field(default_factory=list)
    embed_s: list[float] = field(default_factory=list)
    generate_s: list[float] = field(default_factory=list)
    # Minor page faults of each warm request (memory the allocator took again).
    faults: dict[str, list[int]] = field(default_factory=dict)
    evict_baseline: int = 0
    evict_peak: int = 0
    evict_loads: int = 0


def _env(tmp: Path, source: Path, settings: dict[str, str]) -> dict[str, str]:
    base = runtime_env(tmp)
    base["THAW_LOG_LEVEL"] = "WARNING"
    return server_env(base, source, **settings)


def cycles(figures: Figures, source: Path, settings: dict[str, str], n: int, tmp: Path) -> None:
    with ServerProcess(_env(tmp, source, settings)) as server, server.client(timeout=300) as c:
        figures.baseline = idle_baseline(server, c)
        for name in BUNDLES:
            figures.idle[name] = []
            for _ in range(n):
                load(c, name)
                started = time.perf_counter()
                unload(c, name)
                figures.unload_s.append(time.perf_counter() - started)
                figures.idle[name].append(rss(server))


def warm(figures: dict[str, Figures], source: Path, requests: int, tmp: Path) -> None:
    """Warm requests to one server per configuration, up at once, sent in turn (one
    to each, who goes first alternating), so both see the same machine load."""
    with contextlib.ExitStack() as stack:
        clients, pids = {}, {}
        for name, settings in CONFIGS.items():
            server = stack.enter_context(ServerProcess(_env(tmp / name, source, settings)))
            assert server.proc is not None
            pids[name] = server.proc.pid
            clients[name] = stack.enter_context(server.client(timeout=300))
            load(clients[name], "minilm")
            load(clients[name], "smollm2")
        texts = {"texts": [f"sentence number {i} of a batch" for i in range(32)]}
        prompt = {"prompt": "Once upon a time", "max_tokens": 16}
        for turn in range(requests):
            order = list(CONFIGS) if turn % 2 == 0 else list(reversed(CONFIGS))
            for name in order:
                for handler, event, took in (
                    ("embed", texts, figures[name].embed_s),
                    ("generate", prompt, figures[name].generate_s),
                ):
                    faults = minor_faults(pids[name])
                    started = time.perf_counter()
                    invoke(clients[name], handler, event)
                    took.append(time.perf_counter() - started)
                    faulted = minor_faults(pids[name]) - faults
                    figures[name].faults.setdefault(handler, []).append(faulted)


def evictions(
    figures: Figures, source: Path, settings: dict[str, str], rounds: int, budget: int, tmp: Path
) -> None:
    env = _env(tmp, source, {**settings, "THAW_MEMORY_BUDGET": str(budget)})
    with ServerProcess(env) as server, server.client(timeout=300) as c:
        figures.evict_baseline = idle_baseline(server, c)
        for _ in range(rounds):
            invoke(c, "embed", REQUESTS["embed"])
            invoke(c, "generate", REQUESTS["generate"])
        figures.evict_peak = peak_rss(server)
        figures.evict_loads = sum(
            m["loads"] for m in c.get("/models").json()["models"] if m["name"] != "tempconv"
        )


def _mib(n: int) -> str:
    return f"{n / MIB:.0f} MiB"


def rows(on: Figures, off: Figures, budget: int, n: int, rounds: int) -> list[Row]:
    out = [Row("RSS idle, framework imported (baseline)", _mib(on.baseline), _mib(off.baseline))]
    for name in BUNDLES:
        first, last = on.idle[name][0], on.idle[name][-1]
        ok = last - first <= CYCLE_MARGIN and last <= on.baseline + FIRST_USE_MARGIN
        out.append(
            Row(
                f"RSS idle after {n} load/unload cycles of {name} (after cycle 1)",
                f"{_mib(last)} ({_mib(first)})",
                f"{_mib(off.idle[name][-1])} ({_mib(off.idle[name][0])})",
                fmt_x(last / off.idle[name][-1]),
                "<= baseline + 128 MiB, cycle 1 -> last <= +16 MiB",
                verdict(ok),
            )
        )
    limit = on.evict_baseline + budget + OVERHEAD
    out.append(
        Row(
            f"peak RSS, embed/generate evicting each other x{rounds} "
            f"(budget {_mib(budget)}; {on.evict_loads} / {off.evict_loads} loads)",
            f"{_mib(on.evict_peak)} (baseline + budget {_mib(on.evict_baseline + budget)})",
            f"{_mib(off.evict_peak)} (baseline + budget {_mib(off.evict_baseline + budget)})",
            fmt_x(on.evict_peak / off.evict_peak),
            f"<= baseline + budget + 128 MiB ({_mib(limit)})",
            verdict(on.evict_peak <= limit),
        )
    )
    for what, a, b in (
        (f"warm embed, 32 texts (median of {len(on.embed_s)})", on.embed_s, off.embed_s),
        (
            f"warm generate, 16 tokens (median of {len(on.generate_s)})",
            on.generate_s,
            off.generate_s,
        ),
        (f"unload round trip (median of {3 * n})", on.unload_s, off.unload_s),
    ):
        out.append(Row(what, fmt_s(median(a)), fmt_s(median(b)), fmt_x(median(a) / median(b))))
    for handler, faults in on.faults.items():
        out.append(
            Row(
                f"page faults per warm {handler} request (median)",
                f"{median(faults):.0f}",
                f"{median(off.faults[handler]):.0f}",
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundles", default=str(ROOT / "bundles"))
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=16, help="warm requests per handler")
    args = parser.parse_args(argv)
    build = [sys.executable, str(ROOT / "scripts" / "build_model_bundles.py")]
    subprocess.run([*build, "--out", args.bundles, "--only", ",".join(BUNDLES)], check=True)
    built = {name: Path(args.bundles) / name for name in BUNDLES}
    sizes = [
        read_manifest(built[n]).weights_bytes + read_manifest(built[n]).per_request_bytes
        for n in ("smollm2", "minilm")
    ]
    budget = max(sizes) + min(sizes) // 2  # either model, never both
    figures = {name: Figures() for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="thaw-bench-memory-") as tmp:
        source = bundle_root(Path(tmp) / "bundles", built)
        # Interleaved: each scenario under both configurations before the next.
        for name, settings in CONFIGS.items():
            print(f"cycles, {name}", file=sys.stderr)
            cycles(figures[name], source, settings, args.cycles, Path(tmp) / f"c-{name}")
        for name, settings in CONFIGS.items():
            print(f"evictions, {name}", file=sys.stderr)
            state = Path(tmp) / f"e-{name}"
            evictions(figures[name], source, settings, args.rounds, budget, state)
        print("warm requests, both", file=sys.stderr)
        warm(figures, source, args.requests, Path(tmp) / "warm")
    print("Thaw: the host-memory controls (defaults); baseline: glibc's own behaviour\n")
    print(render(rows(figures["thaw"], figures["glibc"], budget, args.cycles, args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
