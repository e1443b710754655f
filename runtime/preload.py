"""A server process loads the framework's native libraries while it starts.

`import torch` is two parts: the dynamic loader maps libtorch and runs its
relocations and static initialisers (0.2-0.3 s on the 2-core VM, more with
CUDA's libraries), then the Python modules run (0.7 s), holding the GIL. The
first part needs no GIL when done through a foreign call
(runtime/models/weights/framework.py `preload_framework`), so `thaw serve` and
`python -m runtime` start it on a thread of its own before they import their
server, and it runs on another core beside those imports (0.1 s of Python).
The first load then finds the libraries loaded and pays only the Python part:
issue 29's first answer on a fresh node, where the server's start-up came on
top of everything the bare script does (BENCHMARKS.md).

The Python part is left to the first load, as before: run ahead, it would
freeze the event loop for as long as an extension module's initialiser holds
the GIL (torch._C's: 0.1 s), just as a platform's health probes arrive.

The dynamic loader runs one dlopen at a time, and an extension module imported
while libtorch's initialisers run would wait for them (holding the GIL
meanwhile). So first the extension modules the rest of start-up imports are
loaded (START_UP_EXTENSIONS: tests/http/test_preload.py holds the list to what
`thaw serve` and the Lambda loop import), and glibc's handle is made
(host.configure: its ctypes handle is a dlopen too).

Only when a handler uses a bundle (a model will be loaded here) and
THAW_PRELOAD_FRAMEWORK is on (the default). Anything amiss (settings that do
not parse, no handler module that imports) starts nothing: the server reports
it as it would have.
"""

from __future__ import annotations

import contextlib
import importlib
import threading

from runtime.errors import ThawError
from runtime.models.weights import framework, host
from runtime.registry import discover
from runtime.settings import Settings

# The extension modules a server's start-up loads after `runtime.cli` (uvicorn,
# starlette, h11 and prometheus_client's imports; the job store's sqlite3; ctypes).
# One missing from here costs time, not correctness: its import waits for the
# framework's libraries.
START_UP_EXTENSIONS = (
    "_bisect",
    "_blake2",
    "_bz2",
    "_ctypes",
    "_decimal",
    "_hashlib",
    "_lzma",
    "_multiprocessing",
    "_pickle",
    "_queue",
    "_random",
    "_sha512",
    "_sqlite3",
    "mmap",
    "resource",
    "unicodedata",
    "zlib",
)


def start() -> threading.Thread | None:
    """Start loading the framework's native libraries, if this process will load a
    model: the thread doing it, or None."""
    try:
        settings = Settings.from_env()
        if not settings.preload_framework or not discover(settings.handlers).bundle_names():
            return None
    except ThawError:
        return None
    host.configure(settings)
    for name in START_UP_EXTENSIONS:
        with contextlib.suppress(ImportError):  # built in, or absent, in this Python
            importlib.import_module(name)
    return framework.preload_in_background()
