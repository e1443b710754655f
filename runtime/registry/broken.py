"""Handler modules that failed to import, and where.

One broken module does not take the instance down: discovery records it here
and serves the handlers of the others. What is recorded is what a person
fixing it needs (the file and line, the exception in one line) and what a
caller of one of its handlers needs to be told instead of "no such handler":
the names the module declares, read from its source text, since a module that
did not import registered nothing. The scan is a regular expression over the
text, not an import or a parse: the file may not even be valid Python.
"""

from __future__ import annotations

import importlib.util
import os
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# `@handler("name"` and `@bundle("name"`, however the decorator was imported
# (`@runtime.handler(`, `@thaw_handler(` aliases are not followed).
_DECLARED = re.compile(r"""@\s*(?:\w+\.)*(handler|bundle)\(\s*(?P<q>['"])(?P<name>[^'"]+)(?P=q)""")


@dataclass(frozen=True)
class BrokenModule:
    """A handler module whose import raised; its handlers are not served."""

    module: str
    file: str | None  # as a person finds it: relative to the working directory when under it
    line: int | None
    error: str  # "SyntaxError: invalid syntax"
    handlers: tuple[str, ...] = ()  # declared in its source, so not served
    bundles: tuple[str, ...] = ()  # builders declared in its source
    cause: BaseException | None = field(default=None, compare=False, repr=False)

    @property
    def where(self) -> str:
        """`handlers/broken.py:3`, or the module's name where its file is unknown."""
        if self.file is None:
            return self.module
        return f"{self.file}:{self.line}" if self.line is not None else self.file

    def summary(self) -> str:
        """One line: `handlers.broken (handlers/broken.py:3): SyntaxError: invalid syntax`."""
        where = f" ({self.where})" if self.file is not None else ""
        return f"{self.module}{where}: {self.error}"

    def describe(self) -> dict[str, Any]:
        """Its entry in /models and an operator's /readyz."""
        return {
            "module": self.module,
            "file": self.file,
            "line": self.line,
            "error": self.error,
            "handlers": list(self.handlers),
        }


def _shown(path: str) -> str:
    """A path relative to the working directory when it lies under it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if relative.startswith("..") else relative


def _origin(module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except Exception:  # its package is missing, or itself fails to import
        return None
    return spec.origin if spec is not None and spec.has_location else None


def broken_module(module: str, exc: BaseException) -> BrokenModule:
    """What `import module` raising `exc` means, located.

    A SyntaxError names its own file and line (maybe a helper the module
    imports); any other exception is placed at the module's own line that
    raised it, the last frame of the traceback in its file, or, where the
    module has no such frame (it does not exist), at the module itself."""
    origin = _origin(module)
    file: str | None = origin
    line: int | None = None
    if isinstance(exc, SyntaxError) and exc.filename:
        file, line = exc.filename, exc.lineno
    elif origin is not None:
        real = os.path.realpath(origin)
        for frame in traceback.extract_tb(exc.__traceback__):
            if os.path.realpath(frame.filename) == real:
                line = frame.lineno
    message = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    error = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    handlers: list[str] = []
    bundles: list[str] = []
    if origin is not None:
        try:
            text = Path(origin).read_text(errors="replace")
        except OSError:
            text = ""
        for found in _DECLARED.finditer(text):
            (handlers if found[1] == "handler" else bundles).append(found["name"])
    return BrokenModule(
        module=module,
        file=_shown(file) if file is not None else None,
        line=line,
        error=error,
        handlers=tuple(dict.fromkeys(handlers)),
        bundles=tuple(dict.fromkeys(bundles)),
        cause=exc,
    )
