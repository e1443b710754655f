"""User code that raises, where the user looks: `thaw invoke` prints the traceback of
the user's frames on stderr and exits 1, its stdout holding only the answer (a
handler's or builder's print goes to stderr); a server logs it once, at ERROR, as
one JSON record with the traceback, and the HTTP body stays one problem line. A
builder's exception is the documented 503 `load-failed`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.bundles.manifest import build_bundle
from tests.inproc import captured_logs, serving, settings_for

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "handlers" / "builder_raises.py"
RAISES = ROOT / "tests" / "handlers" / "raises.py"


def bundles(root: Path) -> Path:
    source = root / "src" / "config.json"
    source.parent.mkdir(parents=True)
    source.write_text('{"a": 1}')
    build_bundle(source, "builder-raises", out=root / "bundles" / "builder-raises")
    return root / "bundles"


def invoke(handler: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", "invoke", handler, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


def user_lines(stderr: str) -> list[str]:
    """The traceback's `File "...", line N, in f` lines."""
    return [line.strip() for line in stderr.splitlines() if line.strip().startswith("File ")]


def test_invoke_prints_a_builders_traceback_and_exits_1(
    thaw_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**thaw_env, "THAW_BUNDLE_SOURCE": str(bundles(tmp_path))}
    env["THAW_HANDLERS"] = "tests.handlers.builder_raises"
    result = invoke("builder_raises", env)
    assert result.returncode == 1
    assert result.stdout == ""  # the builder's print went to stderr
    assert "building builder-raises (a print" in result.stderr
    assert user_lines(result.stderr) == [
        f'File "{FIXTURE}", line 20, in build',
        f'File "{FIXTURE}", line 13, in _shape_of',
        f'File "{FIXTURE}", line 22, in build',
    ]
    lines = result.stderr.strip().splitlines()
    assert "ValueError: the builder cannot build this bundle" in lines
    assert lines[-1] == (
        "thaw: error: load-failed: builder for 'builder-raises' raised ValueError: "
        "the builder cannot build this bundle"
    )


def test_invoke_prints_a_handlers_traceback_and_exits_1(thaw_env: dict[str, str]) -> None:
    env = {**thaw_env, "THAW_HANDLERS": "tests.handlers.raises"}
    result = invoke("raises", env, "--event", '{"message": "no luck"}')
    assert result.returncode == 1 and result.stdout == ""
    assert user_lines(result.stderr) == [f'File "{RAISES}", line 13, in raises']
    assert "Traceback (most recent call last):" in result.stderr
    assert result.stderr.strip().endswith("thaw: error: handler-error: ValueError: no luck")


def test_invoke_stdout_is_the_answer_only(thaw_env: dict[str, str]) -> None:
    env = {**thaw_env, "THAW_HANDLERS": "tests.handlers.builder_raises"}
    result = invoke("prints_then_answers", env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"ok": True}
    assert "a handler's print (must go to stderr)" in result.stderr


@pytest.mark.anyio
async def test_a_builders_exception_is_503_load_failed_logged_once(tmp_path: Path) -> None:
    settings = settings_for(
        tmp_path, bundle_source=str(bundles(tmp_path)), handlers=("tests.handlers.builder_raises",)
    )
    with captured_logs() as logs:
        async with serving(settings) as served:
            response = await served.client.post("/invoke/builder_raises", json={})
    assert response.status_code == 503, response.text
    problem = response.json()
    assert problem["type"].endswith("/load-failed")
    assert "Traceback" not in response.text and "builder_raises.py" not in response.text
    errors = [e for e in logs.entries() if e["level"] == "error"]
    assert len(errors) == 1, errors
    [record] = errors
    assert record["bundle"] == "builder-raises"
    assert record["traceback"].startswith("Traceback (most recent call last):\n")
    assert f'File "{FIXTURE}", line 13, in _shape_of' in record["traceback"]
    assert "/runtime/" not in record["traceback"]
    assert record["traceback"].endswith("\nValueError\n")


@pytest.mark.anyio
async def test_a_handlers_exception_is_logged_once_with_its_traceback(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, handlers=("tests.handlers.raises",))
    with captured_logs() as logs:
        async with serving(settings) as served:
            response = await served.client.post("/invoke/raises", json={"message": "nope"})
    assert response.status_code == 500
    assert "Traceback" not in response.text and "raises.py" not in response.text
    errors = [e for e in logs.entries() if e["level"] == "error"]
    assert len(errors) == 1, errors
    [record] = errors
    assert record["handler"] == "raises"
    assert record["traceback"].splitlines()[1:] == [
        f'  File "{RAISES}", line 13, in raises',
        "    raise ValueError(message)",
        "ValueError",  # the class: its message may be the caller's input, never logged
    ]
    assert "nope" not in logs.text
