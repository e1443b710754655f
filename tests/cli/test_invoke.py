"""`thaw invoke`: output JSON on stdout, a phase table on stderr, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import make_bundle

ROOT = Path(__file__).resolve().parents[2]


def invoke(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", "invoke", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


def test_invoke_echo(thaw_env: dict[str, str]) -> None:
    result = invoke("echo", "--event", '{"x": 1}', env=thaw_env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"x": 1}
    for phase in ("fetch", "load", "init", "warmup", "run"):
        assert phase in result.stderr


def test_invoke_model_backed_example(thaw_env: dict[str, str]) -> None:
    result = invoke("fahrenheit", "--event", '{"celsius": [100, -40, 0]}', env=thaw_env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"fahrenheit": [212.0, -40.0, 32.0]}
    table = {
        line.split()[0]: float(line.split()[1]) for line in result.stderr.strip().splitlines()[1:]
    }
    assert table["load"] > 0 and table["init"] > 0 and table["warmup"] > 0 and table["run"] > 0


@pytest.mark.gpu
def test_invoke_model_backed_example_on_cuda(thaw_env: dict[str, str]) -> None:
    """docs/handlers.md's handler, as shipped, on a CUDA device: its input goes to the model's."""
    env = {**thaw_env, "THAW_DEVICE": "cuda"}
    result = invoke("fahrenheit", "--event", '{"celsius": [100, -40, 0]}', env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"fahrenheit": [212.0, -40.0, 32.0]}


def test_invoke_event_from_file(thaw_env: dict[str, str], tmp_path: Path) -> None:
    event = tmp_path / "event.json"
    event.write_text('{"celsius": [37]}')
    result = invoke("fahrenheit", "--event", f"@{event}", env=thaw_env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["fahrenheit"][0] == 98.5999984741211


def test_invoke_errors_are_one_clear_line(thaw_env: dict[str, str], tmp_path: Path) -> None:
    unknown = invoke("nope", env=thaw_env)
    assert unknown.returncode != 0
    assert "no handler named 'nope'" in unknown.stderr
    bad_json = invoke("echo", "--event", "{x", env=thaw_env)
    assert bad_json.returncode != 0 and "--event: not valid JSON" in bad_json.stderr
    bad_input = invoke("fahrenheit", "--event", '{"celsius": "hot"}', env=thaw_env)
    assert bad_input.returncode != 0 and "celsius" in bad_input.stderr


def test_invoke_integrity_failure_is_reported(thaw_env: dict[str, str], tmp_path: Path) -> None:
    manifest = make_bundle(tmp_path / "bundles", "alpha")
    shard = tmp_path / "bundles" / "alpha" / manifest.files[0].path
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    env = {**thaw_env, "THAW_BUNDLE_SOURCE": str(tmp_path / "bundles")}
    env["THAW_HANDLERS"] = "tests.handlers.loadlog"
    result = invoke("alpha", env=env)
    assert result.returncode == 1
    assert "integrity" in result.stderr and manifest.files[0].path in result.stderr


def test_invoke_stream_prints_items_as_they_come(thaw_env: dict[str, str], tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    event = json.dumps({"n": 3, "hold": str(hold), "hold_at": 2})
    env = {**thaw_env, "THAW_HANDLERS": "tests.handlers.ticks"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli.main", "invoke", "ticks", "--stream", "--event", event],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )
    try:
        assert proc.stdout is not None
        # Ticks 0 and 1 are printed while the handler still waits before tick 2.
        assert proc.stdout.read(6) == b"t0 t1 "
        assert proc.poll() is None
        hold.unlink()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out == b"t2 \n"
    assert b"run" in err


def test_invoke_stream_of_a_failure_midway_exits_non_zero(thaw_env: dict[str, str]) -> None:
    env = {**thaw_env, "THAW_HANDLERS": "tests.handlers.ticks"}
    result = invoke("ticks", "--stream", "--event", '{"n": 4, "fail_at": 2}', env=env)
    assert result.returncode != 0
    assert result.stdout.startswith("t0 t1 ")
    assert "tick 2 failed" in result.stderr
