"""`thaw invoke`: one invocation in-process, output on stdout, phases on stderr.

With `--stream`, a generator handler's items are printed as they come: an
item's `text` as it is (`generate` prints its tokens), any other item as a
JSON line; the joined output is not printed again.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import uuid
from typing import Any

import orjson

from runtime.dispatch.dispatcher import Completed
from runtime.dispatch.streams import Stream, Streaming
from runtime.instance import Instance
from runtime.settings import Settings

_PHASES = ("fetch", "load", "init", "warmup", "run")


def phase_table(timings_ms: dict[str, float]) -> str:
    width = max(len(p) for p in _PHASES)
    lines = [f"{'phase':<{width}}  {'ms':>10}"]
    lines += [f"{p:<{width}}  {timings_ms.get(p, 0.0):>10.1f}" for p in _PHASES]
    lines.append(f"{'total':<{width}}  {sum(timings_ms.get(p, 0.0) for p in _PHASES):>10.1f}")
    return "\n".join(lines)


async def _invoke(settings: Settings, handler: str, event: Any, stream: bool) -> Completed:
    instance = Instance.create(settings)
    await instance.start()
    try:
        outcome = await instance.invoke(
            handler, event, wait_s=float("inf"), request_id=uuid.uuid4().hex, stream=stream
        )
        if isinstance(outcome, Streaming):
            await _print_items(outcome.stream)
            return Completed(None, outcome.timings_ms)
        assert isinstance(outcome, Completed)  # no deadline: never turned into a job
        return outcome
    finally:
        await instance.stop()


async def _print_items(stream: Stream) -> None:
    """Each item as it comes; the stream's error raised once the items are out."""
    texts = True
    async for batch in stream.follow(0, 3600.0):
        for item in batch:
            if isinstance(item, dict) and isinstance(item.get("text"), str):
                sys.stdout.write(item["text"])
            else:
                texts = False
                sys.stdout.write(orjson.dumps(item, option=orjson.OPT_SERIALIZE_NUMPY).decode())
                sys.stdout.write("\n")
        sys.stdout.flush()
    if texts:
        sys.stdout.write("\n")
    if stream.error is not None:
        raise stream.error


def invoke_once(handler: str, event: Any, *, stream: bool = False) -> int:
    """Output on stdout and phases on stderr; what fails is raised (`thaw` renders it)."""
    with tempfile.TemporaryDirectory(prefix="thaw-invoke-") as tmp:
        # An in-process invocation never creates jobs; keep their store out of the cwd.
        settings = Settings.from_env(job_store=f"sqlite:///{tmp}/jobs.sqlite3", prewarm=())
        outcome = asyncio.run(_invoke(settings, handler, event, stream))
    if not stream:
        sys.stdout.write(
            orjson.dumps(outcome.output, option=orjson.OPT_SERIALIZE_NUMPY).decode() + "\n"
        )
    print(phase_table(outcome.timings_ms), file=sys.stderr)
    return 0
