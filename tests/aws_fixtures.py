"""AWS for tests: one moto server process per session, on 127.0.0.1.

The stores and sources under test talk real HTTP to it through boto3, exactly
as they talk to AWS; nothing in the runtime or in boto3 is patched. Clients
get the endpoint and fake credentials as explicit arguments, so no AWS_*
variable leaks into other tests (`aws_env` sets them, per test, for code that
reads them itself, like `from_url`).

moto's server runs each request in its own thread and does not make a
conditional write atomic (it checks, then writes), while DynamoDB does: six
threads racing to claim one job had two winners in 15 of 60 trials against
`python -m moto.server`. The server is therefore started as
`python -m tests.aws_fixtures PORT`: moto's own WSGI app and request handler
behind one lock, so each request is applied whole, as on AWS (0 of 60).
Responses are written to the socket outside the lock, so a slow reader stalls
no one else.

Use the fixtures in a test module by binding them to module names
(importing the name trips ruff's F811 on every test that takes it):

    from tests import aws_fixtures
    moto_endpoint = aws_fixtures.moto_endpoint
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

REGION = "us-east-1"
CREDENTIALS = {
    "aws_access_key_id": "testing",
    "aws_secret_access_key": "testing",
    "region_name": REGION,
}
_START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_until_up(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}: {log.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/moto-api/data.json", timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto server did not answer within {_START_TIMEOUT_S} s")


class _Shared:
    """The session's one server. Each test module that imports the fixture gets its
    own session-scoped copy of it, so the copies share this and count their users;
    the last one torn down (at session end) stops the process."""

    lock = threading.Lock()
    proc: subprocess.Popen[bytes] | None = None
    url = ""
    users = 0


def _acquire(log_dir: Path) -> str:
    with _Shared.lock:
        if _Shared.proc is None:
            port = free_port()
            log = log_dir / "moto.log"
            env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "x"}
            env["AWS_DEFAULT_REGION"] = REGION  # the server's own; tests pass theirs
            with open(log, "wb") as sink:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.aws_fixtures", str(port)],
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=Path(__file__).resolve().parent.parent,
                )
            url = f"http://127.0.0.1:{port}"
            try:
                _wait_until_up(url, proc, log)
            except BaseException:
                _stop(proc)
                raise
            _Shared.proc, _Shared.url = proc, url
        _Shared.users += 1
        return _Shared.url


def _release() -> None:
    with _Shared.lock:
        _Shared.users -= 1
        if _Shared.users == 0 and _Shared.proc is not None:
            _stop(_Shared.proc)
            _Shared.proc = None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of the moto server (S3, DynamoDB, ...) shared by the whole session."""
    url = _acquire(tmp_path_factory.getbasetemp())
    try:
        yield url
    finally:
        _release()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, moto_endpoint: str) -> str:
    """AWS_* variables pointing at moto, for this test only; yields the endpoint."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return moto_endpoint


@functools.cache
def _session() -> Any:
    """One boto3 session, so service models are parsed once (clients come from the main thread)."""
    import boto3

    return boto3.session.Session()


def client(endpoint: str, service: str, **kwargs: Any) -> Any:
    """A boto3 client for moto with explicit endpoint and credentials."""
    return _session().client(service, endpoint_url=endpoint, **CREDENTIALS, **kwargs)


def unique_name(stem: str) -> str:
    return f"{stem}-{uuid.uuid4().hex[:12]}"


def make_bucket(endpoint: str) -> str:
    """A fresh bucket (a new name per call, so tests never share state)."""
    name = unique_name("thaw-test")
    client(endpoint, "s3").create_bucket(Bucket=name)
    return name


def make_jobs_table(endpoint: str) -> str:
    """A fresh jobs table with the schema DynamoDBJobStore expects."""
    from runtime.jobs.stores.dynamodb import DynamoDBJobStore

    name = unique_name("thaw-jobs")
    DynamoDBJobStore.create_table(client(endpoint, "dynamodb"), name)
    return name


def _serve(port: int) -> None:
    """`moto.server.main`, but one request applied at a time (see the module docstring)."""
    import signal

    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    os.environ.setdefault("MOTO_PORT", str(port))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()

    def serialized(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        with lock:
            body: Any = app(environ, start_response)
            # moto builds whole responses; materialise inside the lock to be sure.
            chunks = list(body)
            with contextlib.suppress(AttributeError):
                body.close()
        return chunks

    run_simple("127.0.0.1", port, serialized, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
