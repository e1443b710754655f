"""`thaw coldstart`: a fresh server process, its phases, and nothing left running."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from runtime.cli.coldstart import parse_server_timing, percentile
from tests.support import make_bundle

PHASES = ("queue", "fetch", "load", "init", "warmup", "run")


def coldstart(env: dict[str, str], *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", "coldstart", *args, "--json"],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    result: dict[str, Any] = orjson.loads(done.stdout)
    # The server it started is gone.
    assert not Path(f"/proc/{result['pid']}").exists()
    return result


def test_echo_has_no_load_phases_and_a_faster_steady_state(thaw_env: dict[str, str]) -> None:
    env = {**thaw_env, "THAW_HANDLERS": "tests.handlers.echo"}
    result = coldstart(env, "echo", "--event", '{"a": 1}', "--runs", "30")
    assert result["process_start_to_healthy_ms"] > 0
    assert result["first_invocation_ms"] > 0
    assert result["phases_absent"] == ["fetch", "load", "init", "warmup"]
    assert all(result["phases_ms"][p] == 0 for p in result["phases_absent"])
    assert result["phases_ms"]["run"] > 0
    assert result["warm"]["runs"] == 30
    assert 0 < result["warm"]["p50_ms"] < result["first_invocation_ms"]


def test_a_model_handler_reports_every_phase(thaw_env: dict[str, str], tmp_path: Path) -> None:
    bundles = tmp_path / "bundles"
    make_bundle(bundles, "tiny", config={"sleep_s": 0.05, "warmup_sleep_s": 0.02})
    env = {
        **thaw_env,
        "THAW_HANDLERS": "tests.handlers.slow_builder",
        "THAW_BUNDLE_SOURCE": str(bundles),
    }
    result = coldstart(env, "predict", "--event", '{"x": 2}', "--runs", "10")
    assert result["phases_absent"] == []
    assert all(result["phases_ms"][p] > 0 for p in PHASES), result["phases_ms"]
    assert result["first_invocation_ms"] > sum(result["phases_ms"][p] for p in PHASES[1:5])
    assert 0 < result["warm"]["p50_ms"] < result["first_invocation_ms"]


def test_human_output_names_every_phase(thaw_env: dict[str, str]) -> None:
    env = {**thaw_env, "THAW_HANDLERS": "tests.handlers.echo"}
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", "coldstart", "echo", "--runs", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for label in ("process start -> healthy", "first invocation", *PHASES, "p50", "p99"):
        assert label in done.stdout
    assert "not paid" in done.stdout


def test_a_failing_handler_exits_non_zero_and_stops_the_server(thaw_env: dict[str, str]) -> None:
    env = {**thaw_env, "THAW_HANDLERS": "tests.handlers.raises"}
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", "coldstart", "raises", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "first invocation answered 500" in done.stderr


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("queue;dur=0.1, fetch;dur=12.0", {"queue": 0.1, "fetch": 12.0}),
        ('run;desc="x";dur=3', {"run": 3.0}),
        (
            'queue;dur=0.0, batch;dur=0.031;desc="n=1", run;dur=9.5',
            {"queue": 0.0, "batch": 0.031, "run": 9.5},
        ),
        ("junk, ;dur=1, load;dur=abc", {}),
        ("", {}),
    ],
)
def test_server_timing_parsing(header: str, expected: dict[str, float]) -> None:
    assert parse_server_timing(header) == expected


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([], 0.5) == 0.0


def test_bare_comparison_runs_the_same_work_in_a_fresh_process(
    thaw_env: dict[str, str], tmp_path: Path
) -> None:
    """`--bare`: the handler's own builder and function, no server; same answer's work."""
    bundles = tmp_path / "bundles"
    make_bundle(bundles, "tiny", config={"sleep_s": 0.05, "warmup_sleep_s": 0.02})
    env = {
        **thaw_env,
        "THAW_HANDLERS": "tests.handlers.slow_builder",
        "THAW_BUNDLE_SOURCE": str(bundles),
    }
    result = coldstart(env, "predict", "--runs", "2", "--bare", "--repeat", "2")
    bare = result["bare"]
    assert result["repeat"] == 2
    assert bare["build_ms"] >= 50  # the same builder ran (ms; it sleeps 0.05 s)
    assert bare["first_answer_ms"] > bare["import_ms"] + bare["load_ms"] + bare["build_ms"]
    first = result["process_start_to_first_answer_ms"]
    assert result["ratio"] == pytest.approx(first / bare["first_answer_ms"])
    # Without --event the handler's first warm-up example is the request.
    assert result["phases_ms"]["warmup"] > 0


def test_the_bare_script_answers_like_the_handler(thaw_env: dict[str, str]) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {
        **thaw_env,
        "THAW_HANDLERS": "handlers.tempconv",
        "THAW_BUNDLE_SOURCE": str(root / "bundles"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli.bare", "fahrenheit", '{"celsius": [100]}'],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    result = orjson.loads(done.stdout)
    assert result["output"] == {"fahrenheit": [pytest.approx(212.0)]}
    assert all(result[step] >= 0 for step in ("import_s", "load_s", "build_s", "run_s"))


def test_byte_code_is_written_for_the_handler_packages_before_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under PYTHONDONTWRITEBYTECODE nothing writes a source tree's .pyc files; the
    measurement compiles them first, as an image build does, so no start pays it."""
    from runtime.cli.coldstart import compile_bytecode

    package = tmp_path / "coldpkg"
    (package / "sub").mkdir(parents=True)
    for source in (package / "__init__.py", package / "sub" / "__init__.py", package / "m.py"):
        source.write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    compile_bytecode(["coldpkg.m", "no_such_package.m"])  # a missing one is skipped
    compiled = sorted(p.relative_to(package).parts[0] for p in package.rglob("*.pyc"))
    assert compiled == ["__pycache__", "__pycache__", "sub"]
