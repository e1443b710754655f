"""`thaw emulate --image`: the container a sandbox runs in, as the engine is told to run it.

The image itself runs under the emulator in tests/deploy/test_image.py (it
needs root, podman and a built image); this checks the command line anywhere.
"""

from __future__ import annotations

from pathlib import Path

from runtime.emulator.containers import JOBS_MOUNT, ContainerLauncher
from runtime.emulator.sandboxes import Sandbox
from runtime.emulator.template import parse_template

TEMPLATE = """
Resources:
  Fn:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      MemorySize: 256
      Timeout: 30
      EphemeralStorage: {Size: 1024}
      Environment:
        Variables:
          FROM_TEMPLATE: yes-really
"""


def test_the_container_is_held_to_the_functions_limits(tmp_path: Path) -> None:
    function = parse_template(TEMPLATE).functions["Fn"]
    local = {
        "THAW_WAIT_S": "1",
        "THAW_BUNDLE_SOURCE": "/home/me/bundles",  # a laptop path: not in the container
        "THAW_CACHE_DIR": "/home/me/.thaw/cache",
    }
    launcher = ContainerLauncher("/usr/bin/podman", "localhost/thaw:x", local, tmp_path / "jobs")
    sandbox = Sandbox(function, launcher)
    argv, env = launcher.command(sandbox, "127.0.0.1:4321")
    text = " ".join(argv)
    assert argv[:3] == ["/usr/bin/podman", "run", "--rm"] and argv[-1] == "localhost/thaw:x"
    assert f"--name thaw-{sandbox.sid}" in text and "--network host" in text
    assert "--read-only" in argv and "--tmpfs /tmp:rw,mode=1777,size=1024m" in text
    assert "--memory 256m --memory-swap 256m" in text
    assert "--ulimit nofile=1024:1024" in text and "--ulimit nproc=1024:1024" in text
    assert f"--volume {(tmp_path / 'jobs').resolve()}:{JOBS_MOUNT}:U" in text
    # Values travel in the engine's environment; only names are on its command line.
    passed = {argv[i + 1] for i, arg in enumerate(argv) if arg == "--env"}
    assert all("=" not in name for name in passed)
    assert {"AWS_LAMBDA_RUNTIME_API", "FROM_TEMPLATE", "THAW_WAIT_S"} <= passed
    assert env["AWS_LAMBDA_RUNTIME_API"] == "127.0.0.1:4321"
    assert env["AWS_LAMBDA_FUNCTION_MEMORY_SIZE"] == "256"
    assert env["FROM_TEMPLATE"] == "yes-really"
    assert env["THAW_JOB_STORE"] == f"sqlite:///{JOBS_MOUNT}/jobs.sqlite3"
    assert not passed & {"THAW_BUNDLE_SOURCE", "THAW_CACHE_DIR", "PATH", "HOME"}


def test_an_engine_exit_of_128_plus_n_is_signal_n(tmp_path: Path) -> None:
    launcher = ContainerLauncher("/usr/bin/docker", "img", {}, tmp_path / "jobs")
    assert launcher.exit_reason(137) == "signal: SIGKILL"
    assert launcher.exit_reason(143) == "signal: SIGTERM"
    assert launcher.exit_reason(3) == "exit status 3"
