"""The container image, built from the checkout and run: HTTP mode, Lambda mode, its content.

HTTP mode runs the image's `http` target as a container platform does: on podman's bridge
network, port 8080 published on 127.0.0.1 only, the root filesystem read-only
with a tmpfs /tmp. The entrypoint binds 0.0.0.0 inside the container, a
non-loopback bind, so it needs an API key: this is the suite's one
non-loopback bind, and it is reachable from the host only through 127.0.0.1.
Lambda mode runs the Lambda image (the default target) under `thaw emulate
--image`, invoked with boto3 and the AWS CLI; test_sam_local.py runs it under
`sam local` itself.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime.emulator.containers import SANDBOX_USER
from runtime.version import __version__
from scripts import image as image_script
from tests.deploy.conftest import ROOT, Engine, owned_label, record
from tests.emulator.conftest import Emulator
from tests.emulator.test_invoke_api import lambda_client

pytestmark = pytest.mark.image

# The one source of the version (runtime/version.py; pyproject.toml reads it too).
VERSION = __version__
# Lambda's limits; runc also refuses podman's default of more open files than the host allows.
ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
APP_USER = 10001


class Container:
    """A detached container of the test's, published on 127.0.0.1 only."""

    def __init__(self, engine: Engine, image: str, env: dict[str, str], *args: str) -> None:
        self.engine = engine
        self.name = f"thaw-test-{secrets.token_hex(4)}"
        env_args = [a for key in sorted(env) for a in ("--env", key)]
        # Values reach podman through its environment, not its command line.
        self.engine_env = {**engine.env, **env}
        self.started = time.monotonic()
        argv = ["podman", "run", "-d", "--name", self.name, "--label", owned_label()]
        argv += [*ULIMITS, "--publish", "127.0.0.1::8080", *env_args, *args, image]
        done = subprocess.run(
            argv,
            env=self.engine_env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        port = engine("port", self.name, "8080/tcp").stdout.strip().rsplit(":", 1)[1]
        self.url = f"http://127.0.0.1:{port}"

    def wait_healthy(self, timeout_s: float = 60.0) -> float:
        """Seconds from `podman run` to the first 200 from /healthz."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                try:
                    if client.get(f"{self.url}/healthz").status_code == 200:
                        return time.monotonic() - self.started
                except httpx.TransportError:
                    pass
                time.sleep(0.01)
        raise AssertionError(f"no /healthz within {timeout_s} s:\n{self.logs()}")

    def exec(self, *argv: str) -> str:
        return self.engine("exec", self.name, *argv).stdout

    def logs(self) -> str:
        done = self.engine("logs", self.name, check=False)
        return done.stdout + done.stderr

    def remove(self) -> None:
        self.engine("rm", "-f", "-t", "0", self.name, check=False)


@pytest.fixture
def key() -> str:
    return secrets.token_urlsafe(24)


@pytest.fixture
def container(engine: Engine, http_image: str, key: str) -> Iterator[Container]:
    """The image as a platform runs it: read-only root, tmpfs /tmp, an API key."""
    running = Container(
        engine, http_image, {"THAW_API_KEYS": key}, "--read-only", "--tmpfs", "/tmp:rw,mode=1777"
    )
    try:
        yield running
    finally:
        running.remove()


def test_http_mode_serves_the_contract_as_an_unprivileged_read_only_container(
    container: Container, key: str
) -> None:
    record("start_to_healthz_s", round(container.wait_healthy(), 3))
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=container.url, timeout=60.0) as client:
        refused = client.post("/invoke/echo", json={"a": 1})
        assert refused.status_code == 401  # the non-loopback bind requires the key
        echoed = client.post("/invoke/echo", json={"a": 1}, headers=auth)
        assert echoed.status_code == 200, echoed.text
        assert echoed.json() == {"a": 1}
        started = time.monotonic()
        converted = client.post("/invoke/fahrenheit", json={"celsius": [100, -40]}, headers=auth)
        record("first_fahrenheit_invocation_s", round(time.monotonic() - started, 3))
        assert converted.status_code == 200, converted.text
        assert converted.json() == {"fahrenheit": [212.0, -40.0]}  # from the baked-in bundle
        # The image's root is a read-only overlay: its weights were mapped for the build,
        # not copied (runtime/models/weights/mapped.py).
        models = client.get("/models", headers=auth).json()["models"]
        assert [m["weights_read"] for m in models if m["name"] == "tempconv"] == ["mapped"]
        assert client.get("/openapi.json", headers=auth).json()["info"]["version"] == VERSION
    status = container.exec("cat", "/proc/1/status")
    uids = re.search(r"^Uid:\s+(\d+)\s+(\d+)", status, re.MULTILINE)
    assert uids is not None and {int(uids.group(1)), int(uids.group(2))} == {APP_USER}
    mounts = [line.split() for line in container.exec("cat", "/proc/mounts").splitlines()]
    root = [m for m in mounts if m[1] == "/"]
    assert root and "ro" in root[-1][3].split(","), root
    tmp = [m for m in mounts if m[1] == "/tmp"]
    assert tmp and tmp[-1][2] == "tmpfs" and "rw" in tmp[-1][3].split(",")


def test_sigterm_drains_and_exits_zero(container: Container, engine: Engine) -> None:
    container.wait_healthy()
    engine("kill", "--signal", "TERM", container.name)
    code = engine("wait", container.name, timeout_s=60).stdout.strip()
    logs = container.logs()
    assert code == "0", logs
    assert "draining (SIGTERM)" in logs


def test_a_non_loopback_bind_without_an_api_key_is_refused(engine: Engine, http_image: str) -> None:
    done = engine("run", "--rm", "--network", "none", *ULIMITS, http_image, check=False)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "refusing to listen on 0.0.0.0 without API keys" in done.stderr


def test_the_package_is_installed_and_reports_its_version(
    engine: Engine, built_image: str, http_image: str
) -> None:
    thaw = ("run", "--rm", "--network", "none", *ULIMITS, "--entrypoint", "thaw", built_image)
    assert engine(*thaw, "--version").stdout.strip() == f"thaw {VERSION}"
    # The installed distribution's metadata says the same (pyproject's dynamic version).
    python = ("run", "--rm", "--network", "none", *ULIMITS, "--entrypoint", "python", built_image)
    metadata = "import importlib.metadata as m; print(m.version('thaw-runtime'))"
    assert engine(*python, "-c", metadata).stdout.strip() == VERSION
    configs = {
        image: json.loads(engine("image", "inspect", image).stdout)[0]["Config"]
        for image in (built_image, http_image)
    }
    # The Lambda image: no USER (Lambda picks one; `sam local`'s wrapping build step
    # runs as it), a CMD (`sam local` needs one). The http target: uid 10001.
    assert configs[built_image].get("User", "") in ("", "root", "0")
    assert configs[built_image]["Cmd"] == ["runtime.aws.lambda_loop.main"]
    assert configs[http_image]["User"] == str(APP_USER)
    for config in configs.values():
        assert config["Entrypoint"] == ["python", "-m", "runtime"]
        names = {entry.split("=", 1)[0] for entry in config["Env"]}
        assert not names & {"PYTHONPATH", "PIP_INDEX_URL", "TORCH_INDEX_URL", "PIP_FIND_LINKS"}


def test_nothing_from_the_build_or_the_host_is_left_in_the_image(
    engine: Engine, built_image: str
) -> None:
    rootfs = Path(engine("image", "mount", built_image).stdout.strip())
    house, _ = image_script.ensure_wheels()
    from_wheelhouse = {path.name for path in house.iterdir() if path.is_file()}
    # Certificates this host trusts beyond Debian's (a proxy's CA, say).
    host_cas = {p: _pem_body(p) for p in Path("/usr/local/share/ca-certificates").rglob("*.crt")}
    unwanted = from_wheelhouse | {"pip.conf", "constraints.txt"} | {p.name for p in host_cas}
    try:
        leftovers = []
        for directory, dirs, files in os.walk(rootfs):
            relative = Path(directory).relative_to(rootfs)
            # Debian's own wheels for ensurepip (usr/share/python-wheels) are the base's.
            leftovers += [str(relative / n) for n in files if n in unwanted]
            for name in dirs:
                if name in ("pip-ephem-wheel-cache", "wheelhouse", ".cache", "staging"):
                    leftovers.append(str(relative / name))
        assert leftovers == []
        for path in ("src", "staging", "etc/pip.conf", "etc/xdg/pip"):
            assert not (rootfs / path).exists(), path
        for path in ("etc/resolv.conf", "etc/hostname", "etc/hosts"):
            # Empty mount points a RUN step leaves behind, never the host's files.
            assert not (rootfs / path).exists() or (rootfs / path).stat().st_size == 0, path
        assert list((rootfs / "tmp").iterdir()) == []
        # The package is installed; the working directory is the project: its
        # pyproject.toml ([tool.thaw]), handlers and bundles.
        assert sorted(p.name for p in (rootfs / "opt/thaw").iterdir()) == [
            "bundles",
            "handlers",
            "pyproject.toml",
        ]
        trusted = "".join((rootfs / "etc/ssl/certs/ca-certificates.crt").read_text().split())
        for host_ca, body in host_cas.items():
            assert body not in trusted, f"the host's {host_ca} is in the image"
        _assert_bytecode_is_current(rootfs / "usr/local/lib/python3.11/site-packages" / "runtime")
        _assert_bytecode_is_current(rootfs / "opt/thaw/handlers")
        assert not (rootfs / "usr/local/lib/python3.11/site-packages/handlers").exists()
    finally:
        engine("image", "unmount", built_image, check=False)


def _pem_body(path: Path) -> str:
    """The base64 of a PEM file's first certificate, whitespace removed."""
    parts = path.read_text(errors="replace").split("-----")
    return "".join(parts[2].split()) if len(parts) > 2 else path.name


def _assert_bytecode_is_current(package: Path) -> None:
    """pip compiled the package (compileall the handlers); the copy out of its build
    stage kept the sources' mtimes."""
    checked = 0
    for source in package.rglob("*.py"):
        cached = source.parent / "__pycache__" / f"{source.stem}.cpython-311.pyc"
        header = cached.read_bytes()[:16]
        flags, mtime, size = struct.unpack("<III", header[4:16])
        stat = source.stat()
        assert flags == 0 and (mtime, size) == (int(stat.st_mtime), stat.st_size), source
        checked += 1
    assert checked > 3, package


def test_lambda_mode_under_thaw_emulate_image(
    engine: Engine, built_image: str, tmp_path: Path
) -> None:
    """The repo's template.yaml, the image's entrypoint, boto3 and the AWS CLI."""
    env = {k: v for k, v in engine.env.items() if not k.startswith(("THAW_", "AWS_LAMBDA"))}
    env["THAW_STATE_DIR"] = str(tmp_path / "state")  # the shared job store's directory
    emulator = Emulator(
        tmp_path / "emulator",
        env,
        "--image",
        built_image,
        "--max-sandboxes",
        "2",
        template=ROOT / "template.yaml",
    )
    try:
        client = lambda_client(emulator)
        cold = client.invoke(
            FunctionName="ThawFunction", Payload=b'{"handler": "echo", "input": 7}'
        )
        assert "FunctionError" not in cold, cold["Payload"].read()
        assert json.loads(cold["Payload"].read()) == {"output": 7}
        report = emulator.report(cold["ResponseMetadata"]["RequestId"])
        assert report.cold
        record("lambda_cold_report", report.fields)
        names = engine("ps", "--filter", "label=io.thaw.emulate", "--format", "{{.Names}}")
        assert names.stdout.split(), "no container runs the instance"
        # As on Lambda: its own unprivileged user, not the image's (root, no USER).
        status = engine("exec", names.stdout.split()[0], "cat", "/proc/1/status").stdout
        uids = re.search(r"^Uid:\s+(\d+)", status, re.MULTILINE)
        assert uids is not None and uids.group(1) == SANDBOX_USER.split(":")[0], status
        warm = client.invoke(
            FunctionName="ThawFunction",
            Payload=b'{"handler": "fahrenheit", "input": {"celsius": [100]}}',
            LogType="Tail",
        )
        assert json.loads(warm["Payload"].read()) == {"output": {"fahrenheit": [212.0]}}
        log = base64.b64decode(warm["LogResult"]).decode()
        assert "REPORT RequestId" in log and "Init Duration" not in log  # same container
        record(
            "lambda_first_fahrenheit_report",
            emulator.report(warm["ResponseMetadata"]["RequestId"]).fields,
        )
        with emulator.client() as http:  # the HTTP contract through the Function URL
            assert http.get("/healthz").json() == {"status": "ok"}
        event = client.invoke(
            FunctionName="ThawFunction", InvocationType="Event", Payload=b'{"handler": "echo"}'
        )
        assert event["StatusCode"] == 202
        emulator.report(event["ResponseMetadata"]["RequestId"])
        if shutil.which("aws"):
            _aws_cli_invoke(emulator, tmp_path)
    finally:
        code = emulator.stop()
    assert code == 0, emulator.errors()
    # Stopped with containers running: each runtime, answered 410 on its next, exits quietly.
    assert "Traceback" not in emulator.errors(), emulator.errors()
    left = engine("ps", "-a", "--filter", "label=io.thaw.emulate", "--format", "{{.Names}}")
    assert left.stdout.split() == []


def _aws_cli_invoke(emulator: Emulator, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }
    command = ["aws", "lambda", "invoke", "--endpoint-url", emulator.url]
    command += ["--function-name", "ThawFunction", "--payload", '{"handler":"echo","input":[1]}']
    version = subprocess.run(["aws", "--version"], env=env, capture_output=True, text=True)
    if (version.stdout + version.stderr).startswith("aws-cli/2"):
        command += ["--cli-binary-format", "raw-in-base64-out"]
    done = subprocess.run(
        [*command, str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == {"output": [1]}


def test_the_gpu_dockerfile_builds_and_serves_on_the_stand_in_base(
    engine: Engine, built_images: dict[str, str], key: str
) -> None:
    """Dockerfile.gpu's own steps on the stand-in with the CPU wheel: all but the CUDA base."""
    running = Container(engine, built_images["gpu"], {"THAW_API_KEYS": key})
    try:
        running.wait_healthy()
        with httpx.Client(base_url=running.url, timeout=60.0) as client:
            auth = {"Authorization": f"Bearer {key}"}
            answer = client.post("/invoke/fahrenheit", json={"celsius": [0]}, headers=auth)
            assert answer.json() == {"fahrenheit": [32.0]}
            assert client.get("/openapi.json", headers=auth).json()["info"]["version"] == VERSION
        assert engine("healthcheck", "run", running.name, check=False).returncode == 0
        uids = re.search(r"^Uid:\s+(\d+)", running.exec("cat", "/proc/1/status"), re.MULTILINE)
        assert uids is not None and int(uids.group(1)) == APP_USER
    finally:
        running.remove()
