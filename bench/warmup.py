"""Does warm-up work? First request after READY vs steady state, per warm-up path.

    .venv/bin/python bench/warmup.py [--bundles bundles] [--runs 4] [--repeats 3]
                                     [--only embed,classify] [--threads N] [--idle 0.2]

For each model handler and each of its declared warm-up examples (a "path"),
and with warm-up on and off, a fresh process starts a real runtime `Instance`,
loads the bundle to READY (prewarm), then times the first request of that path
and `--runs` more through the dispatcher: the call path of HTTP and Lambda
invocations (worker thread, inference mode), minus the socket. Warm-up off
means the handler's warm-up list is emptied before the instance starts, so the
first request pays every first-call cost itself.

Every timed request, the first and the steady ones alike, follows `--idle`
seconds of idleness: what a one-time cost is measured against is the same
request in the same conditions. Back to back, a request of a few
milliseconds runs faster still (torch's worker threads still spin, caches
are hot), and after any pause it pays that back: embed's 5-7 ms request costs
1.3-1.6x as much after 0.2 s idle, more than its first request after warm-up
does. Those back-to-back figures are printed too, for reference.

Each row is the median over `--repeats` fresh processes (first request) and
over all their steady requests. Prints one markdown table; the target is
first/steady <= 1.1 with warm-up on.
Bundles are built first (scripts/build_model_bundles.py, skipped when current).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET_RATIO = 1.1
HANDLERS = {"embed": "minilm", "generate": "smollm2", "classify": "efficientnet"}


def describe(handler: str, event: dict[str, Any]) -> str:
    """A short name for a warm-up path."""
    if handler == "embed":
        texts = event["texts"]
        return f"{len(texts)} text(s), longest {max(map(len, texts))} chars"
    if handler == "generate":
        mode = "sampled" if event.get("temperature", 0) > 0 else "greedy"
        source = "chat" if "messages" in event else "prompt"
        chars = len(json.dumps(event.get("messages", event.get("prompt"))))
        return f"{source} {chars} chars, {event.get('max_tokens')} tokens, {mode}"
    import base64
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(event["image"])))
    return f"{image.format} {image.width}x{image.height} {image.mode}"


def paths_of(handler: str, declared: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The declared warm-up examples, then the request bench/firstanswer.py sends
    (a typical first request, not itself declared)."""
    from bench.firstanswer import event_for

    return [*declared, event_for(handler)]


async def _measure(
    handler: str, index: int, warmup: bool, runs: int, bundles: Path, idle_s: float
) -> dict[str, Any]:
    from runtime.instance import Instance
    from runtime.models.lifecycle import State
    from runtime.registry import discover
    from runtime.settings import Settings

    module = f"handlers.{handler}"
    with tempfile.TemporaryDirectory(prefix="thaw-bench-") as tmp:
        settings = Settings.from_env(
            {},
            bundle_source=str(bundles),
            handlers=(module,),
            cache_dir=f"{tmp}/cache",
            state_dir=f"{tmp}/state",
            job_store=f"sqlite:///{tmp}/jobs.sqlite3",
        )
        registry = discover([module])
        spec = registry.handler(handler)
        event = paths_of(handler, list(spec.warmup))[index]
        # Which worker thread ran each call: torch's OpenMP team and glibc's malloc
        # arena are per thread, so a first request on a thread that never ran a
        # warm-up can still pay first-call costs.
        threads: list[tuple[bool, int]] = []

        def record(ctx: Any) -> None:
            # A batched handler (embed, classify) gets lists of events and contexts.
            first = ctx[0] if isinstance(ctx, list) else ctx
            threads.append((first.warmup, threading.get_ident()))

        def traced(event: Any, model: Any, ctx: Any) -> Any:
            record(ctx)
            return spec.fn(event, model, ctx)

        def traced_stream(event: Any, model: Any, ctx: Any) -> Iterator[Any]:
            # A streaming handler's calls go through its generator (`stream_fn`).
            record(ctx)
            assert spec.stream_fn is not None
            yield from spec.stream_fn(event, model, ctx)

        registry.handlers[handler] = dataclasses.replace(
            spec,
            fn=traced,
            stream_fn=traced_stream if spec.streams else None,
            warmup=spec.warmup if warmup else (),
        )
        instance = Instance.create(settings, registry)
        await instance.start(background=False)
        try:
            await instance.prewarm(HANDLERS[handler])
            entry = instance.cache.entries[HANDLERS[handler]]
            if entry.lifecycle.state is not State.READY:
                raise SystemExit(f"{handler}: bundle did not reach READY ({entry.lifecycle.state})")
            phases = dict(entry.lifecycle.phase_ms)

            async def timed(request_id: str) -> float:
                started = time.perf_counter()
                await instance.dispatcher.invoke(
                    handler, dict(event), wait_s=float("inf"), request_id=request_id
                )
                return (time.perf_counter() - started) * 1000.0

            times_ms: list[float] = []
            for run in range(1 + runs):
                await asyncio.sleep(idle_s)
                times_ms.append(await timed(f"bench-{run}"))
            back_to_back = [await timed(f"bench-b2b-{run}") for run in range(runs)]
        finally:
            await instance.stop()
    warmed = {ident for is_warmup, ident in threads if is_warmup}
    # None: the handler's calls ran on no thread of ours to tell (decode steps run
    # on the decode thread, not through `fn`).
    first_thread = next((ident for is_warmup, ident in threads if not is_warmup), None)
    return {
        "first_ms": times_ms[0],
        "steady_ms": times_ms[1:],
        "back_to_back_ms": back_to_back,
        "phases_ms": phases,
        "first_on_warmed_thread": None if first_thread is None else first_thread in warmed,
    }


def _child(args: argparse.Namespace) -> int:
    handler, index, mode = args.child
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = asyncio.run(
        _measure(handler, int(index), mode == "on", args.runs, Path(args.bundles), args.idle)
    )
    print(json.dumps(result))
    return 0


def _run_child(handler: str, index: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", handler, str(index), mode]
    command += ["--runs", str(args.runs), "--bundles", args.bundles, "--threads", str(args.threads)]
    command += ["--idle", str(args.idle)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("THAW_")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{handler} path {index} ({mode}) failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundles", default=str(ROOT / "bundles"))
    parser.add_argument("--runs", type=int, default=4, help="steady requests per process")
    parser.add_argument(
        "--idle", type=float, default=0.2, help="seconds idle before each timed request"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="fresh processes per path and mode (medians)"
    )
    parser.add_argument("--only", default="", help=f"subset of {list(HANDLERS)}")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads (default: torch's own choice)"
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)

    from runtime.registry import discover

    handlers = [h for h in args.only.split(",") if h] or list(HANDLERS)
    bundle_names = ",".join(HANDLERS[h] for h in handlers)
    build = [sys.executable, str(ROOT / "scripts" / "build_model_bundles.py")]
    subprocess.run([*build, "--out", args.bundles, "--only", bundle_names], check=True)
    registry = discover([f"handlers.{h}" for h in handlers])
    started = time.monotonic()
    load = os.getloadavg()[0]
    rows = [
        "| handler | warm-up path | warm-up | first request (ms) | steady median (ms) "
        "| first / steady | steady back to back (ms) | first on a warmed thread |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    misses: list[str] = []
    warmup_ms: dict[str, float] = {}
    for handler in handlers:
        if not (Path(args.bundles) / HANDLERS[handler] / "bundle.json").exists():
            print(f"{handler}: no bundle (its package is not installed); skipped", file=sys.stderr)
            continue
        declared = list(registry.handler(handler).warmup)
        for index, event in enumerate(paths_of(handler, declared)):
            label = describe(handler, event)
            if index == len(declared):
                label += " (bench/firstanswer.py's request; not declared)"
            for mode in ("off", "on"):
                # Medians over fresh processes: a burst of load on a shared machine
                # then skews one sample, not the whole row.
                results = [_run_child(handler, index, mode, args) for _ in range(args.repeats)]
                first = statistics.median(r["first_ms"] for r in results)
                steady = statistics.median(ms for r in results for ms in r["steady_ms"])
                b2b = statistics.median(ms for r in results for ms in r["back_to_back_ms"])
                ratio = first / steady
                if mode == "on":
                    warmup_ms[handler] = statistics.median(
                        r["phases_ms"].get("warmup", 0.0) for r in results
                    )
                    if ratio > TARGET_RATIO and index < len(declared):
                        misses.append(f"{handler} #{index}")
                told = [r["first_on_warmed_thread"] for r in results]
                on_warmed = sum(bool(t) for t in told)
                warmed = f"{on_warmed}/{len(results)}" if mode == "on" and None not in told else "-"
                rows.append(
                    f"| {handler} | #{index}: {label} | {mode} "
                    f"| {first:.1f} | {steady:.1f} | {ratio:.2f}x | {b2b:.1f} | {warmed} |"
                )
                print(rows[-1], file=sys.stderr, flush=True)
    print("\n".join(rows))
    print()
    costs = ", ".join(f"{h} {ms / 1000:.1f} s" for h, ms in warmup_ms.items())
    print(f"Warm-up time paid at load: {costs}.")
    threads = args.threads or "default"
    print(
        f"Medians over {args.repeats} fresh processes per row ({args.runs} steady requests "
        f"each, every timed request after {args.idle:g} s idle, and as many back to back); "
        f"{os.cpu_count()} CPUs, torch threads {threads}, "
        f"load average {load:.1f} at start; bench took {time.monotonic() - started:.0f} s."
    )
    verdict = "met on every path" if not misses else f"missed on {', '.join(misses)}"
    print(f"Target (warm-up on: first <= {TARGET_RATIO}x steady): {verdict}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
