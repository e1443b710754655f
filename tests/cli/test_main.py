"""`thaw`'s contract with scripts: one error prefix, documented exit codes, `--json`.

0  done                    2  the command line is wrong (argparse's code)
1  the command failed      3  a handler refused its event (invalid-input)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from runtime.wire.render import EXIT_FAILED, EXIT_INVALID_INPUT, EXIT_USAGE
from tests.support import make_bundle

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def thaw(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


def test_version() -> None:
    done = thaw("--version")
    assert done.returncode == 0 and done.stdout.startswith("thaw ")


@pytest.mark.parametrize(
    "args",
    [
        ("bundle", "verify"),  # a missing argument
        ("serve", "--port", "eighty"),  # a bad flag value
        ("invoke", "echo", "--event", "{x"),  # an --event that is not JSON
        ("invoke", "echo", "--event", "@/nonexistent/event.json"),  # one that cannot be read
        ("bundle", "build", ".", "--name", "x", "--config", "[1]"),  # a --config not an object
    ],
)
def test_usage_errors_exit_2_with_the_one_prefix(
    args: tuple[str, ...], thaw_env: dict[str, str]
) -> None:
    done = thaw(*args, env=thaw_env)
    assert done.returncode == EXIT_USAGE == 2, done.stderr
    assert done.stderr.splitlines()[-1].startswith("thaw: error: ")


def test_handler_errors_exit_codes(thaw_env: dict[str, str]) -> None:
    env = {**thaw_env, "THAW_HANDLERS": "tests.handlers.refuses,tests.handlers.raises"}
    unknown = thaw("invoke", "nope", env=env)
    assert unknown.returncode == EXIT_USAGE
    assert unknown.stderr.strip() == "thaw: error: unknown-handler: no handler named 'nope'"
    refused = thaw("invoke", "refuses", "--event", "{}", env=env)
    assert refused.returncode == EXIT_INVALID_INPUT == 3
    assert refused.stderr.strip() == "thaw: error: invalid-input: value: must be a number"
    failed = thaw("invoke", "raises", "--event", '{"message": "no luck"}', env=env)
    assert failed.returncode == EXIT_FAILED == 1
    assert failed.stderr.strip().endswith("thaw: error: handler-error: ValueError: no luck")


def test_bundle_commands_print_json(tmp_path: Path) -> None:
    manifest = make_bundle(tmp_path / "bundles", "alpha")
    path = tmp_path / "bundles" / "alpha"
    verified = thaw("bundle", "verify", str(path), "--json")
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout) == {
        "id": manifest.id,
        "name": "alpha",
        "version": manifest.version,
        "path": str(path),
        "files": len(manifest.files),
        "bytes": manifest.total_bytes,
    }
    out = tmp_path / "rebuilt"
    built = thaw("bundle", "build", str(path), "--name", "beta", "--out", str(out), "--json")
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout)["id"].startswith("beta@sha256:")

    shard = path / manifest.files[0].path
    shard.write_bytes(shard.read_bytes()[:-1])
    broken = thaw("bundle", "verify", str(path), "--json")
    assert broken.returncode == EXIT_FAILED
    error = json.loads(broken.stdout)["error"]
    assert error["type"] == "integrity" and manifest.files[0].path in error["message"]
    assert broken.stderr.startswith("thaw: error: integrity: ")


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("THAW_BUNDLE_SOURCE", "s3://", "THAW_BUNDLE_SOURCE='s3://': no bucket name"),
        ("THAW_BUNDLE_SOURCE", "s3://b/../x", "prefix has an empty or dot segment"),
        ("THAW_JOB_STORE", "bogus://x", "THAW_JOB_STORE='bogus://x': expected sqlite:///path"),
        ("THAW_MAX_JSON_DEPTH", "zero", "THAW_MAX_JSON_DEPTH='zero' is not a valid int"),
    ],
)
def test_serve_refuses_settings_in_one_line_before_it_listens(
    thaw_env: dict[str, str], variable: str, value: str, says: str
) -> None:
    """A setting that does not parse, wherever it is read (the settings, the bundle
    source, the job store), is one `thaw: error: config:` line and exit 1: not
    uvicorn's failed lifespan, a traceback inside a log line."""
    env = {**thaw_env, "THAW_HANDLERS": "handlers.echo", variable: value}
    done = thaw("serve", "--port", "0", env=env)
    assert done.returncode == EXIT_FAILED, done.stderr
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("thaw: error: config: ") and says in line, line


def test_serve_on_port_0_logs_the_port_the_os_gave_it(thaw_env: dict[str, str]) -> None:
    """`--port 0` lets the OS choose; the serving line names the port it chose (one a
    script can call), not `:0`."""
    env = {**thaw_env, "THAW_HANDLERS": "handlers.echo"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli.main", "serve", "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        assert proc.stderr is not None
        for raw in proc.stderr:
            msg = json.loads(raw)["msg"]
            if " serving http://" in msg:
                break
        else:
            pytest.fail(f"no serving line; exit {proc.wait()}")
        found = re.search(r" serving http://127\.0\.0\.1:(\d+):", msg)
        assert found, msg
        port = int(found.group(1))
        assert port != 0
        health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30)
        assert health.status_code == 200
    finally:
        proc.terminate()
        proc.wait(60)
