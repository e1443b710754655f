"""Server-sent events as the spec parses them, for tests that read event streams:
fields until a blank line; comment lines kept, as `{"comment": text}`.

One parser, fed a line at a time, behind a sync reader (`httpx.Response.iter_lines`)
and an async one (`aiter_lines`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import httpx

SSE = {"accept": "text/event-stream"}
Event = dict[str, Any]


class EventParser:
    """Feed it lines; it hands back each event (or comment) they complete."""

    def __init__(self) -> None:
        self.event: Event = {}

    def feed(self, line: str) -> Event | None:
        if line == "":
            done, self.event = self.event, {}
            return done or None
        if line.startswith(":"):
            return {"comment": line[1:].strip()}
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        self.event[name] = self.event[name] + "\n" + value if name in self.event else value
        return None

    def end(self) -> Event | None:
        """The event the stream's end cut short, if any."""
        done, self.event = self.event, {}
        return done or None


def read_events(lines: Iterable[str]) -> Iterator[Event]:
    parser = EventParser()
    for line in lines:
        if (event := parser.feed(line)) is not None:
            yield event
    if (event := parser.end()) is not None:
        yield event


async def aread_events(lines: AsyncIterator[str]) -> AsyncIterator[Event]:
    parser = EventParser()
    async for line in lines:
        if (event := parser.feed(line)) is not None:
            yield event
    if (event := parser.end()) is not None:
        yield event


def collect(response: httpx.Response) -> list[Event]:
    """Every event of a response read to its end, comments left out."""
    return [e for e in read_events(response.iter_lines()) if "comment" not in e]


async def acollect(response: httpx.Response) -> list[Event]:
    return [e async for e in aread_events(response.aiter_lines()) if "comment" not in e]
