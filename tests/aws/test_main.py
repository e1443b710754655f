"""`python -m runtime` picks its mode from the environment."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ServerProcess, free_port

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)


def test_without_a_runtime_api_it_serves_http(thaw_env: dict[str, str]) -> None:
    port = free_port()
    env = {**thaw_env, "PORT": str(port), "THAW_HANDLERS": "tests.handlers.echo"}
    server = ServerProcess(env, port=port)
    server.proc = subprocess.Popen(
        [sys.executable, "-m", "runtime", "--insecure"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        server.wait_healthy()
        with server.client() as client:
            assert client.post("/invoke/echo", json={"a": 1}).json() == {"a": 1}
    finally:
        server.kill()


def test_a_public_bind_without_keys_is_refused_in_one_line(thaw_env: dict[str, str]) -> None:
    env = {**thaw_env, "PORT": str(free_port()), "THAW_HANDLERS": "tests.handlers.echo"}
    done = subprocess.run(
        [sys.executable, "-m", "runtime"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert done.stderr.startswith("thaw: error:")


def test_the_lambda_loop_does_not_import_httpx_s_command_line_client() -> None:
    """httpx imports its CLI (click, rich, pygments: 30 ms here) when they are
    installed, as they are in the dev environment; a Lambda init has no use for it."""
    import importlib.util

    if importlib.util.find_spec("rich") is None or importlib.util.find_spec("pygments") is None:
        pytest.skip("rich and pygments are not installed: httpx would not import its CLI")
    script = (
        "import sys, runtime.aws.lambda_loop, httpx\n"
        "print(sorted(m for m in ('click', 'rich', 'pygments') if m in sys.modules))\n"
        "print(httpx.Client)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.splitlines()[0] == "[]", done.stdout
