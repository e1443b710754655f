"""`thaw invoke`: one invocation in-process, output on stdout, phases on stderr."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import uuid
from typing import Any

import orjson

from runtime.dispatch.dispatcher import Completed
from runtime.instance import Instance
from runtime.settings import Settings

_PHASES = ("fetch", "load", "init", "warmup", "run")


def phase_table(timings_ms: dict[str, float]) -> str:
    width = max(len(p) for p in _PHASES)
    lines = [f"{'phase':<{width}}  {'ms':>10}"]
    lines += [f"{p:<{width}}  {timings_ms.get(p, 0.0):>10.1f}" for p in _PHASES]
    lines.append(f"{'total':<{width}}  {sum(timings_ms.get(p, 0.0) for p in _PHASES):>10.1f}")
    return "\n".join(lines)


async def _invoke(settings: Settings, handler: str, event: Any) -> Completed:
    instance = Instance.create(settings)
    await instance.start()
    try:
        outcome = await instance.dispatcher.invoke(
            handler, event, wait_s=float("inf"), request_id=uuid.uuid4().hex
        )
        assert isinstance(outcome, Completed)  # no deadline: never turned into a job
        return outcome
    finally:
        await instance.stop()


def invoke_once(handler: str, event: Any) -> int:
    """Output on stdout and phases on stderr; what fails is raised (`thaw` renders it)."""
    with tempfile.TemporaryDirectory(prefix="thaw-invoke-") as tmp:
        # An in-process invocation never creates jobs; keep their store out of the cwd.
        settings = Settings.from_env(job_store=f"sqlite:///{tmp}/jobs.sqlite3", prewarm=())
        outcome = asyncio.run(_invoke(settings, handler, event))
    sys.stdout.write(
        orjson.dumps(outcome.output, option=orjson.OPT_SERIALIZE_NUMPY).decode() + "\n"
    )
    print(phase_table(outcome.timings_ms), file=sys.stderr)
    return 0
