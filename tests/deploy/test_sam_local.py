"""The AWS SAM CLI's own developer loop on the shipped template and the Lambda image.

`sam local invoke` and `sam local start-lambda` (PyPI's aws-sam-cli) talk to
podman through `podman system service`, its Docker-compatible API, on a socket
in the test's own directory (DOCKER_HOST), exactly as docs/lambda.md, "sam local",
tells a user to. They run template.yaml as it ships, the image the session
built (the Dockerfile's default target, the LocalImage parameter) and
deploy/sam/env.local.json, the documented --env-vars file: jobs in SQLite,
bundles from the image. SAM wraps the image with its runtime emulator in a
build step of its own; the answers come from the shipped handlers and their
baked-in bundles.

Every process the tests start (the podman service, SAM) is stopped, and every
container SAM started is removed, however a test ends. Kept, like the suite's
images: SAM's wrapping of the Lambda image (`localhost/thaw-test:rapid-x86_64`,
the image plus SAM's emulator), which SAM rebuilds on every run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.config import Config

from tests.deploy.conftest import ROOT, Engine, record
from tests.support import SAFETY_S, free_port, until

pytestmark = pytest.mark.image

ENV_VARS = ROOT / "deploy" / "sam" / "env.local.json"
# Ctrl+C in a terminal reaches a process whose SIGINT is at its default. A suite run
# as a background job of a script (`make test &`, `nohup`) has SIGINT ignored, an
# ignored signal stays ignored across exec, and Python then never raises the
# KeyboardInterrupt SAM stops on: it served on, deaf to Ctrl+C. Its argv is run
# through this, which puts SIGINT back to its default and execs it (same pid).
AS_FROM_A_TERMINAL = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL);"
    " os.execv(sys.argv[1], sys.argv[1:])",
]
CONTAINER_ID = re.compile(r"SAM_CONTAINER_ID: ([0-9a-f]{12,64})")


def _sam() -> str | None:
    own = ROOT / ".venv-sam" / "bin" / "sam"  # scripts/setup.sh installs it there, isolated
    return str(own) if own.exists() else shutil.which("sam")


@dataclass(frozen=True)
class Sam:
    """The SAM CLI with DOCKER_HOST on the test's podman socket, offline and anonymous."""

    argv0: str
    env: dict[str, str]
    workdir: Path
    image: str
    containers: set[str]

    def common(self) -> list[str]:
        return [
            "--template",
            str(ROOT / "template.yaml"),
            "--parameter-overrides",
            f"LocalImage={self.image}",
            "--env-vars",
            str(ENV_VARS),
            # The image exists only in the local store; no registry can be reached.
            "--skip-pull-image",
        ]

    def remember_containers(self, output: str) -> None:
        self.containers.update(CONTAINER_ID.findall(output))

    def left_behind(self, engine: Engine) -> list[str]:
        """The containers SAM said it started that still exist."""
        exists = ("container", "exists")
        return sorted(c for c in self.containers if engine(*exists, c, check=False).returncode == 0)


@pytest.fixture(scope="module")
def podman_socket(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`podman system service` on a private socket; stopped when the module ends."""
    directory = tmp_path_factory.mktemp("podman-service")
    socket = directory / "podman.sock"
    log = (directory / "service.log").open("wb")
    service = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{socket}"],
        env=engine.env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        transport = httpx.HTTPTransport(uds=str(socket))
        with httpx.Client(transport=transport, base_url="http://podman", timeout=5.0) as api:

            def pong() -> bool:
                assert service.poll() is None, (directory / "service.log").read_text()
                with contextlib.suppress(httpx.TransportError):
                    return api.get("/_ping").text == "OK"
                return False

            until(pong, "podman's API answers /_ping")
        yield f"unix://{socket}"
    finally:
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(SAFETY_S)
        except subprocess.TimeoutExpired:
            os.killpg(service.pid, signal.SIGKILL)
            service.wait(10)
        log.close()


@pytest.fixture(scope="module")
def sam(
    engine: Engine,
    session_images: dict[str, str],
    podman_socket: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Sam]:
    argv0 = _sam()
    if argv0 is None:
        pytest.skip("sam local tests: no AWS SAM CLI (scripts/setup.sh puts it in .venv-sam)")
    workdir = tmp_path_factory.mktemp("sam")
    env = {k: v for k, v in engine.env.items() if not k.startswith(("AWS_", "THAW_"))}
    env.update(
        DOCKER_HOST=podman_socket,
        SAM_CLI_TELEMETRY="0",
        # SAM asks for a session only to resolve AWS::AccountId; none is needed.
        AWS_CONFIG_FILE=str(workdir / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(workdir / "none"),
        AWS_DEFAULT_REGION="us-east-1",
        HOME=str(workdir),  # SAM keeps its metadata under ~/.aws-sam
        # Its log reaches the file as it is written, and a SIGABRT makes it print
        # every thread's stack: what a stop that hangs was waiting on.
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",
    )
    found = Sam(argv0, env, workdir, session_images["cpu"], set())
    try:
        yield found
    finally:
        left = found.left_behind(engine)
        if left:  # a test that failed half-way: SAM may not have cleaned up
            engine("rm", "-f", "-t", "0", *left, check=False)


def test_sam_local_invoke_answers_from_a_shipped_handler(sam: Sam, engine: Engine) -> None:
    event = sam.workdir / "event.json"
    event.write_text(json.dumps({"handler": "fahrenheit", "input": {"celsius": [100, -40]}}))
    started = time.monotonic()
    done = subprocess.run(
        [sam.argv0, "local", "invoke", "ThawFunction", *sam.common(), "--event", str(event)],
        cwd=sam.workdir,
        env=sam.env,
        capture_output=True,
        text=True,
        timeout=SAFETY_S,
        check=False,
    )
    record("sam_local_invoke_s", round(time.monotonic() - started, 1))
    sam.remember_containers(done.stdout + done.stderr)
    assert done.returncode == 0, done.stderr
    # stdout is the function's answer; the function's own log lines go to stderr.
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "output": {"fahrenheit": [212.0, -40.0]}
    }
    # No check of RIE's REPORT line: SAM waits at most 1 s after the answer for it to
    # come through the container's log stream, and under load prints the log without it.
    # SAM skips the GPU function (no build Metadata, an ECR image) instead of failing on it.
    assert "ThawGpuFunction" in done.stderr
    assert sam.containers, done.stderr
    assert sam.left_behind(engine) == []  # SAM removes the container after the call


def _lambda(url: str) -> Any:
    return boto3.client(
        "lambda",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
        config=Config(retries={"max_attempts": 1}, read_timeout=SAFETY_S),
    )


def _function_url_event(body: object) -> dict[str, Any]:
    """POST /invoke/echo as a Function URL delivers it (payload format 2.0)."""
    headers = {"content-type": "application/json", "prefer": "respond-async"}
    return {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": "/invoke/echo",
        "rawQueryString": "",
        "headers": headers,
        "requestContext": {"http": {"method": "POST", "path": "/invoke/echo"}},
        "body": json.dumps(body),
        "isBase64Encoded": False,
    }


class StartLambda:
    """`sam local start-lambda` on 127.0.0.1 with eager warm containers."""

    def __init__(self, sam: Sam) -> None:
        self.sam = sam
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = sam.workdir / f"start-lambda-{self.port}.log"
        self.interrupts = 0  # the Ctrl+Cs `stop` took
        argv = [*AS_FROM_A_TERMINAL, sam.argv0, "local", "start-lambda", *sam.common()]
        # EAGER: one container per function, started now and kept, so jobs a call
        # leaves running are still there for the next call.
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--warm-containers", "EAGER"]
        self.proc = subprocess.Popen(
            argv,
            cwd=sam.workdir,
            env=sam.env,
            stdout=self.log_path.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_listening(self) -> None:
        def listening() -> bool:
            assert self.proc.poll() is None, self.log()
            with contextlib.suppress(httpx.TransportError):
                httpx.get(self.url, timeout=2.0)
                return True
            return False

        until(listening, "sam local start-lambda listens")

    def stop(self) -> int:
        """Ctrl+C, as a developer stops it: SAM then removes its warm containers
        (podman gives each 3 s to stop). A SAM that outlasts a second Ctrl+C gets a
        SIGABRT, which makes it print its threads' stacks to its log (what it waited
        on), then a kill: the test fails with that log."""
        for _ in range(2):
            if self.proc.poll() is not None:
                break
            self.interrupts += 1
            self.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(SAFETY_S / 4)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            with contextlib.suppress(ProcessLookupError):  # the group may be gone
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.sam.remember_containers(self.log())
        return self.proc.returncode


def test_sam_local_start_lambda_serves_boto3_invokes_and_jobs(sam: Sam, engine: Engine) -> None:
    started = time.monotonic()
    server = StartLambda(sam)
    try:
        server.wait_listening()
        client = _lambda(server.url)
        answer = client.invoke(
            FunctionName="ThawFunction",
            Payload=json.dumps({"handler": "fahrenheit", "input": {"celsius": [100]}}),
        )
        assert answer["StatusCode"] == 200
        assert "FunctionError" not in answer, answer["Payload"].read()
        assert json.loads(answer["Payload"].read()) == {"output": {"fahrenheit": [212.0]}}
        # A job: created by one call (a Function URL event, `Prefer: respond-async`: a
        # 202 at once), read back by the next. It lives in the SQLite store the env
        # file names, in the warm container: the template's DynamoDB table does not
        # exist locally.
        created = client.invoke(
            FunctionName="ThawFunction", Payload=json.dumps(_function_url_event({"n": 7}))
        )
        assert "FunctionError" not in created, created["Payload"].read()
        result = json.loads(created["Payload"].read())
        assert result["statusCode"] == 202, result
        job = json.loads(result["body"])
        polled = client.invoke(
            FunctionName="ThawFunction", Payload=json.dumps({"job": job["id"], "wait_s": 30})
        )
        assert "FunctionError" not in polled, polled["Payload"].read()
        finished = json.loads(polled["Payload"].read())
        assert (finished["id"], finished["status"]) == (job["id"], "succeeded"), finished
        assert finished["output"] == {"n": 7}
        unknown = client.invoke(FunctionName="ThawFunction", Payload=b'{"nothing": 1}')
        assert unknown["FunctionError"] == "Unhandled"
        assert json.loads(unknown["Payload"].read())["errorType"] == "invalid-event"
        record("sam_start_lambda_s", round(time.monotonic() - started, 1))
    finally:
        code = server.stop()
    log = server.log()
    assert sam.containers, f"no SAM_CONTAINER_ID in the log:\n{log}"
    # Ended by Ctrl+C: 0 for one, whatever SAM exits with for a second.
    assert code == 0 or (server.interrupts == 2 and code > 0), (code, server.interrupts, log)
    # SAM removed its warm container on Ctrl+C (the fixture removes any it did not).
    assert sam.left_behind(engine) == [], log
