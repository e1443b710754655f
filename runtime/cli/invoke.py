"""`thaw invoke`: one invocation in-process, output on stdout, phases on stderr.

With `--stream`, a generator handler's items are printed as they come: an
item's `text` as it is (`generate` prints its tokens), any other item as a
JSON line; the joined output is not printed again.

On a terminal (stderr a TTY), a cold invocation shows each bundle's load as
it goes: the phase it is in, with bytes for fetch and load, read from the
instance's /models view (runtime/cli/progress.py); piped, nothing extra.

Stdout carries the answer only: for the call, anything else written there (a
handler's or builder's `print`, a library's output, at the file-descriptor
level too) goes to stderr, so `thaw invoke ... > out.json` holds valid JSON.
When user code raises, its traceback (user frames only, as a Lambda error's
stackTrace) is printed on stderr before `thaw`'s one error line.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TextIO

import orjson

from runtime.dispatch.answers import STREAM, WAIT, Answer, Completed
from runtime.dispatch.streams import Stream
from runtime.errors import HandlerError, LoadFailed
from runtime.instance import Instance
from runtime.settings import Settings
from runtime.wire.render import user_traceback

if TYPE_CHECKING:
    from runtime.cli.progress import Bars

# A loading bundle's view names the state it reached; the phase under way is the next.
_UNDER_WAY = {"stored": "fetch", "fetched": "load", "loaded": "init", "initialized": "warm-up"}
_WATCH_EVERY_S = 0.1
_PHASES = ("fetch", "load", "init", "warmup", "run")


def phase_table(timings_ms: dict[str, float]) -> str:
    width = max(len(p) for p in _PHASES)
    lines = [f"{'phase':<{width}}  {'ms':>10}"]
    lines += [f"{p:<{width}}  {timings_ms.get(p, 0.0):>10.1f}" for p in _PHASES]
    lines.append(f"{'total':<{width}}  {sum(timings_ms.get(p, 0.0) for p in _PHASES):>10.1f}")
    return "\n".join(lines)


async def _watch_loads(instance: Instance, live: Bars) -> None:
    """A bar per bundle while it loads: its phase, bytes for fetch and load."""
    tasks: dict[str, int] = {}
    while True:
        # Only bundles asked for: no manifest reads, every tick, of bundles not built.
        for model in (await instance.models_view(asked_only=True))["models"]:
            name, progress = model["name"], model.get("progress")
            if progress is None:
                if name in tasks:
                    live.update(tasks[name], description=f"{name}: ready")
                continue
            phase = _UNDER_WAY.get(progress["phase"], progress["phase"])
            if name not in tasks:
                tasks[name] = live.add(f"{name}: {phase}", progress["total_bytes"])
            # Bytes arriving while it fetches, read while it loads; after, all it read.
            live.update(
                tasks[name],
                description=f"{name}: {phase}",
                completed=progress["bytes"],
                total=progress["total_bytes"],
            )
        await asyncio.sleep(_WATCH_EVERY_S)


async def _invoke(
    settings: Settings,
    handler: str,
    event: Any,
    stream: bool,
    live: Bars | None = None,
    out: TextIO | None = None,
) -> Answer:
    instance = Instance.create(settings)
    if handler in instance.registry.handlers:
        # A call of a handler of a broken module fails with its own one line instead.
        for broken in instance.registry.broken:
            print(f"thaw: warning: handler module {broken.summary()}", file=sys.stderr)
    await instance.start()
    watcher = asyncio.ensure_future(_watch_loads(instance, live)) if live is not None else None
    try:
        try:
            policy = STREAM if stream else WAIT
            answer = await instance.invoke(
                handler, event, wait_s=float("inf"), policy=policy, request_id=uuid.uuid4().hex
            )
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
                assert live is not None
                live.close()  # off the screen before the output
        if answer.stream is not None:
            await _print_items(answer.stream, out or sys.stdout)
            return Completed(None, answer.timings_ms)
        return answer  # its output: with no deadline, never a job
    finally:
        await instance.stop()


async def _print_items(stream: Stream, out: TextIO) -> None:
    """Each item as it comes, on `out`; the stream's error raised once the items are out."""
    texts = True
    async for batch in stream.follow(0, 3600.0):
        for item in batch:
            if isinstance(item, dict) and isinstance(item.get("text"), str):
                out.write(item["text"])
            else:
                texts = False
                out.write(orjson.dumps(item, option=orjson.OPT_SERIALIZE_NUMPY).decode())
                out.write("\n")
        out.flush()
    if texts:
        out.write("\n")
        out.flush()
    if stream.error is not None:
        raise stream.error


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[TextIO]:
    """For the block, stdout (sys.stdout and file descriptor 1) writes to stderr;
    yields a stream to the real stdout, for the answer's streamed items."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):  # not a file (a test's capture)
        real = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            yield real
        return
    saved = os.dup(fd)
    answer = open(saved, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr.flush()
    os.dup2(sys.stderr.fileno(), fd)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield answer
    finally:
        sys.stdout.flush()  # what user code left in its buffer: to stderr still
        answer.flush()
        os.dup2(saved, fd)
        answer.close()
        os.close(saved)


def invoke_once(handler: str, event: Any, *, stream: bool = False) -> int:
    """Output on stdout and phases on stderr; what fails is raised (`thaw` renders it),
    after the traceback of the user code that raised it, on stderr."""
    from runtime.cli.progress import bars

    with _stdout_to_stderr() as out:
        try:
            with tempfile.TemporaryDirectory(prefix="thaw-invoke-") as tmp, bars() as live:
                # An in-process invocation never creates jobs; keep their store out of the cwd.
                settings = Settings.from_env(job_store=f"sqlite:///{tmp}/jobs.sqlite3", prewarm=())
                outcome = asyncio.run(_invoke(settings, handler, event, stream, live, out))
        except (HandlerError, LoadFailed) as exc:
            # User code that raised: a handler's exception, or a builder's (a load that
            # failed in its init phase). A refusal (InvalidInput) is its one line only.
            user_code = isinstance(exc, HandlerError) or exc.extra.get("phase") == "init"
            trace = user_traceback(exc) if user_code else ""
            if trace:
                sys.stderr.write(trace)
                sys.stderr.flush()
            raise
    if not stream:
        sys.stdout.write(
            orjson.dumps(outcome.output, option=orjson.OPT_SERIALIZE_NUMPY).decode() + "\n"
        )
    print(phase_table(outcome.timings_ms), file=sys.stderr)
    return 0
