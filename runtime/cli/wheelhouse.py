"""A wheelhouse served on loopback to an image build that reaches no network.

`thaw image build --wheelhouse DIR` and scripts/image.py (this repository's own
image) build the same way: the wheels get a PEP 503 index (`write_index`), an
HTTP server on 127.0.0.1 serves it (`serve`), and buildah runs in a network
namespace of its own that holds only a loopback interface (`unshare --net`),
so nothing in the build can reach a network even if something tried. The
index URL is the build's PIP_INDEX_URL and TORCH_INDEX_URL.

    python -m runtime.cli.wheelhouse REQUEST-JSON    (run by `build_offline`, in the namespace)

Only the standard library: scripts/image.py uses this module too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import html
import http.server
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
# The wheelhouse's port inside the build's network namespace, where nothing else
# listens: the index URL is a build argument, and buildah's cache keys on build
# arguments, so a fixed port keeps layers cached across builds.
PORT = 3141


def normalize(name: str) -> str:
    """A project name as PEP 503 spells it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_index(house: Path) -> None:
    """A PEP 503 simple index in house/simple: simple/<project>/index.html linking
    ../../<wheel>#sha256=<digest> for every wheel in `house`."""
    projects: dict[str, list[Path]] = {}
    for wheel in sorted(house.glob("*.whl")):
        projects.setdefault(normalize(wheel.name.split("-", 1)[0]), []).append(wheel)
    simple = house / "simple"
    if simple.exists():
        shutil.rmtree(simple)
    simple.mkdir()
    links = "".join(f'<a href="{p}/">{p}</a>\n' for p in sorted(projects))
    (simple / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    for project, wheels in projects.items():
        (simple / project).mkdir()
        anchors = "".join(
            f'<a href="../../{html.escape(w.name)}#sha256={sha256(w)}">{html.escape(w.name)}</a>\n'
            for w in wheels
        )
        page = f"<!DOCTYPE html>\n<html><body>\n{anchors}</body></html>\n"
        (simple / project / "index.html").write_text(page)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve(house: Path, port: int = 0) -> Iterator[str]:
    """`house` over HTTP on 127.0.0.1 (`port`, 0 for any); yields the index URL."""
    handler = functools.partial(_QuietHandler, directory=str(house))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, name="wheelhouse", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()


def loopback_up() -> None:
    """Bring `lo` up: a fresh network namespace starts with it down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def can_unshare_net() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, check=False)
    return probe.returncode == 0


def buildah_argv(request: dict[str, object], index: str) -> list[str]:
    """`buildah bud` of request's dockerfile, context, tag and target, both indexes `index`."""
    argv = [
        "buildah",
        "bud",
        "--isolation",
        "chroot",
        "--network",
        "host",
        f"--pull={request.get('pull', 'missing')}",
        "--layers",
        # As `docker build` writes it: the OCI format has no HEALTHCHECK.
        "--format",
        "docker",
        "--build-arg",
        f"TORCH_INDEX_URL={index}",
        "--build-arg",
        f"PIP_INDEX_URL={index}",
    ]
    for arg in request.get("build_args") or ():  # type: ignore[attr-defined]
        argv += ["--build-arg", str(arg)]
    if request.get("quiet"):
        argv.append("--quiet")
    if request.get("target"):
        argv += ["--target", str(request["target"])]
    argv += ["-f", str(request["dockerfile"]), "-t", str(request["tag"]), str(request["context"])]
    return argv


def run_in_namespace(request: dict[str, object]) -> int:
    """In the build's own network namespace (or, not isolated, on any free port):
    serve the wheelhouse and run buildah."""
    isolated = bool(request.get("isolated"))
    if isolated:
        loopback_up()
    with serve(Path(str(request["house"])), PORT if isolated else 0) as index:
        done = subprocess.run(buildah_argv(request, index), check=False)
    return done.returncode


def build_offline(
    request: dict[str, object], *, env: dict[str, str] | None = None, capture: bool = True
) -> subprocess.CompletedProcess[bytes]:
    """Run `run_in_namespace(request)` under `unshare --net` where that works; the
    request's "isolated" is set to say which."""
    request = {**request, "isolated": can_unshare_net()}
    inner = [sys.executable, "-m", "runtime.cli.wheelhouse", json.dumps(request)]
    argv: Sequence[str] = ["unshare", "--net", "--", *inner] if request["isolated"] else inner
    return subprocess.run(
        list(argv),
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None,
        env=env if env is not None else dict(os.environ),
        check=False,
    )


if __name__ == "__main__":
    sys.exit(run_in_namespace(json.loads(sys.argv[1])))
