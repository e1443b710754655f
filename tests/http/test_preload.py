"""A server process loads the framework's native libraries as it starts (runtime/preload.py),
only when it will load a model, and never in the way of its own start-up imports.

Real `thaw serve` processes: what a process maps is the point.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.preload import START_UP_EXTENSIONS
from tests.support import ServerProcess, free_port, make_bundle, until

# Runs `thaw serve` in this process until it listens, then prints the extension
# modules loaded after `runtime.cli` was: what start-up loads beside the preload.
_START_UP = """
import json, sys
import runtime.cli.main
def extensions():
    return {n for n, m in list(sys.modules.items())
            if (getattr(m, "__file__", None) or "").endswith(".so")}
before = extensions()
import uvicorn
import runtime.http.server
import runtime.aws.lambda_loop  # python -m runtime's other start-up, on Lambda
listening = uvicorn.Server.startup
async def startup(self, sockets=None):
    await listening(self, sockets)
    import asyncio
    await asyncio.sleep(0.5)  # the job store opens in a worker thread once listening
    print(json.dumps(sorted(extensions() - before)))
    self.should_exit = True
uvicorn.Server.startup = startup
sys.exit(runtime.cli.main.main(["serve", "--port", sys.argv[1]]))
"""


def test_the_extensions_loaded_first_cover_what_start_up_loads(
    thaw_env: dict[str, str], tmp_path: Path
) -> None:
    """Each extension module start-up imports while libtorch's initialisers run waits
    for them (one dlopen at a time): the list loaded first must cover them all."""
    env = {**thaw_env, "THAW_HANDLERS": "handlers.echo", "THAW_PRELOAD_FRAMEWORK": "0"}
    done = subprocess.run(
        [sys.executable, "-c", _START_UP, str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded, "nothing measured: the start-up printed no extension modules"
    assert set(loaded) <= set(START_UP_EXTENSIONS), sorted(set(loaded) - set(START_UP_EXTENSIONS))


def test_a_server_that_will_load_models_maps_the_framework_before_any_request(
    servers: list[ServerProcess], server_env: dict[str, str], bundles: Path
) -> None:
    make_bundle(bundles, "alpha")
    server = ServerProcess(server_env)  # tests.handlers.loadlog's handlers use bundles
    servers.append(server)
    server.start()
    until(lambda: "libtorch_cpu" in server.maps(), "the framework's libraries were loaded")
    with server.client() as client:
        answer = client.post("/invoke/alpha", json={}, headers={"Prefer": "wait=60"})
        assert answer.status_code == 200, answer.text


def test_a_server_without_model_handlers_loads_no_framework(
    servers: list[ServerProcess], server_env: dict[str, str]
) -> None:
    server = ServerProcess({**server_env, "THAW_HANDLERS": "handlers.echo"})
    servers.append(server)
    server.start()
    with server.client() as client:
        assert client.post("/invoke/echo", json={"x": 1}).json() == {"x": 1}
    assert "libtorch" not in server.maps()


@pytest.mark.parametrize("refusal", ["settings", "port"])
def test_a_server_that_stops_while_the_framework_loads_exits_with_its_code(
    server_env: dict[str, str], refusal: str
) -> None:
    """A server that gives up at once (its settings refused, its port taken) ends
    while libtorch's initialisers still run on the preload thread. Its exit ran
    beside them and died of SIGSEGV or SIGABRT in 5 runs of 6; it must exit 1,
    saying why: a failed start is 1, as any command that failed (not uvicorn's
    own code for a failed start, 3, which is Thaw's invalid-input)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--host", "0.0.0.0"] if refusal == "settings" else []
        for _ in range(3):  # the crash was a race: each try is another chance at it
            done = subprocess.run(
                [sys.executable, "-m", "runtime.cli.main", "serve", "--port", str(port), *args],
                env=server_env,  # its handlers use bundles: the preload starts
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
            if refusal == "settings":
                assert "refusing to listen on 0.0.0.0 without API keys" in done.stderr
            else:
                assert "address already in use" in done.stderr.lower()
