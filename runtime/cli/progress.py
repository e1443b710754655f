"""Live progress for long CLI work, in a terminal only.

`thaw bundle build` (hashing, conversion), a cold `thaw invoke` (the load
phase it is in, with bytes for fetch and load) and `scripts/image.py`'s
builds draw progress bars with rich, on stderr, and only when stderr is a
terminal and `--json` was not asked for: piped, a command prints exactly what
it printed before. The bars are transient (gone once the work is done), so
what stays on the screen is the command's own output.

rich is imported here and only when a bar is drawn: the control interface
never imports it (tests/test_import_light.py), and without the `cli` extra a
command works the same, without bars.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO


def wanted(as_json: bool = False, stream: TextIO | None = None) -> bool:
    """Bars only for a person at a terminal: stderr a TTY, no --json, TERM not dumb,
    rich installed."""
    stream = sys.stderr if stream is None else stream
    if as_json or os.environ.get("TERM") == "dumb":
        return False
    try:
        if not stream.isatty():
            return False
    except (AttributeError, ValueError):  # closed, or not a real file
        return False
    return importlib.util.find_spec("rich") is not None


class Bars:
    """A set of progress bars on one live display; thread-safe (rich's lock), so
    hashing and read threads may advance them."""

    def __init__(self, progress: Any) -> None:
        self._progress = progress

    def close(self) -> None:
        """Take the bars off the screen now (before output that follows them)."""
        self._progress.stop()

    def add(self, description: str, total: float | None, *, unit: str = "bytes") -> int:
        """A new bar; `unit` is "bytes" (sizes and speed) or "items" (n/total)."""
        task: int = self._progress.add_task(description, total=total, unit=unit)
        self._progress.refresh()
        return task

    def advance(self, task: int, amount: float) -> None:
        self._progress.update(task, advance=amount)

    def update(
        self,
        task: int,
        *,
        description: str | None = None,
        completed: float | None = None,
        total: float | None = None,
    ) -> None:
        fields: dict[str, Any] = {}
        if description is not None:
            fields["description"] = description
        if completed is not None:
            fields["completed"] = completed
        if total is not None:
            fields["total"] = total
        # A new phase is drawn at once, not at the next tick: a short one shows too.
        self._progress.update(task, refresh=description is not None, **fields)

    def reporter(self, description: str, *, unit: str = "bytes") -> Callable[[int, int], None]:
        """`on_progress(done, total)` for code that reports how far it is; the bar
        appears at the first report."""
        task: int | None = None

        def report(done: int, total: int) -> None:
            nonlocal task
            if task is None:
                task = self.add(description, total, unit=unit)
            self.update(task, completed=done, total=total)

        return report


def _columns() -> list[Any]:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        ProgressColumn,
        SpinnerColumn,
        Task,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )
    from rich.text import Text

    class _Amount(ProgressColumn):
        """Bytes (done/total, speed) or items (n/total), as the bar's unit says."""

        def __init__(self) -> None:
            super().__init__()
            self._bytes = DownloadColumn()
            self._speed = TransferSpeedColumn()
            self._items = MofNCompleteColumn()

        def render(self, task: Task) -> Text:
            if task.fields.get("unit") == "items":
                return self._items.render(task)
            if task.total is None:
                return Text(f"{task.completed / 1e6:.1f} MB", style="progress.download")
            amount, speed = self._bytes.render(task), self._speed.render(task)
            return Text.assemble(amount, " ", speed)

    return [
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        _Amount(),
        TimeElapsedColumn(),
    ]


@contextlib.contextmanager
def bars(as_json: bool = False, stream: TextIO | None = None) -> Iterator[Bars | None]:
    """A live display of bars on a terminal, else None (draw nothing)."""
    stream = sys.stderr if stream is None else stream
    if not wanted(as_json, stream):
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress

    console = Console(file=stream)
    # stdout left alone: rich would otherwise route it through the display (onto
    # stderr, when stdout is a pipe), and a command's output must stay where it was.
    progress = Progress(
        *_columns(),
        console=console,
        transient=True,
        redirect_stdout=False,
        redirect_stderr=False,
    )
    with progress:
        yield Bars(progress)
