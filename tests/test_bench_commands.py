"""Every benchmark starts as the docs run it: `.venv/bin/python bench/NAME.py`, from the
repository root, no PYTHONPATH (which puts bench/, not the root, on sys.path), and
every module a benchmark serves as handlers imports and registers.

A benchmark that no longer starts is found here, not by the next person who needs
its figures (bench/overhead.py and bench/generation.py once did not).
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.common import fmt_s
from tests.support import free_port, until

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# Servers a benchmark starts with a port, not commands: bare_app.py is started
# below; runpod_worker.py runs under a Python with `runpod` (BENCHMARKS.md).
SERVERS = {"bare_app.py", "runpod_worker.py"}


def commands() -> list[str]:
    """The bench scripts that run as commands: every one with a main block."""
    return sorted(
        path.name
        for path in BENCH.glob("*.py")
        if 'if __name__ == "__main__":' in path.read_text() and path.name not in SERVERS
    )


def documented() -> set[str]:
    """The bench scripts the docs and the scripts' own docstrings tell users to run."""
    texts = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *ROOT.glob("docs/*.md")]
    texts += BENCH.glob("*.py")
    found: set[str] = set()
    for text in texts:
        found |= set(re.findall(r"python[\w-]* bench/([a-z_]+\.py)", text.read_text()))
    return found


def run_as_user(*argv: str) -> subprocess.CompletedProcess[str]:
    """`python ARGV...` from the repository root, without PYTHONPATH, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_every_documented_benchmark_is_a_command() -> None:
    assert documented() - SERVERS <= set(commands())


@pytest.mark.parametrize("script", commands())
def test_the_benchmark_answers_help_as_the_docs_run_it(script: str) -> None:
    done = run_as_user(f"bench/{script}", "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]


def handler_modules() -> list[str]:
    """The bench modules that declare handlers or builders (a benchmark serves them,
    named in THAW_HANDLERS)."""
    return sorted(
        f"bench.{path.stem}"
        for path in BENCH.glob("*.py")
        if re.search(r"^@(handler|builder)\(", path.read_text(), re.MULTILINE)
    )


def test_every_benchmark_handler_module_registers() -> None:
    modules = handler_modules()
    assert {"bench.fixtures", "bench.private_generate", "bench.unbatched_embed"} <= set(modules)
    # In a process of its own: some import the models' code.
    probe = (
        "import sys\n"
        "from runtime.registry import discover\n"
        "registry = discover(sys.argv[1:])\n"
        "for broken in registry.broken:\n"
        "    print(broken.summary(), file=sys.stderr)\n"
        "print(sorted(registry.handlers))\n"
        "sys.exit(1 if registry.broken else 0)\n"
    )
    done = run_as_user("-c", probe, *modules)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "generate_private" in done.stdout, done.stdout


def test_the_bare_app_serves_the_baseline(tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "bare.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "bench/bare_app.py", str(port)],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:

            def answered() -> httpx.Response | None:
                assert proc.poll() is None, (tmp_path / "bare.log").read_text()
                try:
                    return client.post("/invoke/echo", json={"n": [1, 2]})
                except httpx.TransportError:
                    return None

            response = until(answered, "the bare app to answer")
        assert response.status_code == 200
        assert response.json() == {"n": [1, 2]}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.mark.parametrize("what", ["job-cycle", "two-invokes"])
def test_the_instruction_counts_job_driver_runs_its_cycles(tmp_path: Path, what: str) -> None:
    """`bench/instructions.py --jobs` counts what its driver runs under callgrind: the
    driver itself, run plainly, submits and long-polls real jobs (it checks each
    ends succeeded) or invokes, in the real app on a SQLite file."""
    from bench.common import runtime_env

    env = runtime_env(tmp_path, handlers="handlers.echo,bench.fixtures", max_jobs="1000")
    env.pop("PYTHONPATH")  # as a user runs it: the script puts the root on sys.path
    done = subprocess.run(
        [sys.executable, "bench/instructions.py", "--drive", "thaw", what, "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # The driver warms up with 200 of them, then runs the 3 asked for.
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        stored = db.execute("SELECT status, count(*) FROM jobs GROUP BY status").fetchall()
    assert stored == ([] if what == "two-invokes" else [("succeeded", 203)])


def test_the_job_cycle_cpu_comparison_needs_another_checkout() -> None:
    done = run_as_user("bench/server_cpu.py", "--jobs")
    assert done.returncode == 2
    assert "--jobs needs --against" in done.stderr


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0.00094, "940 µs"),
        (0.00099996, "1.00 ms"),  # rounds up into the next unit, not "1000 µs"
        (0.00104, "1.04 ms"),  # beside a target of 1.0 ms: which side, not "1.0 ms"
        (0.0189, "18.9 ms"),
        (0.25, "250 ms"),
        (0.9999, "1.00 s"),
        (2.5, "2.50 s"),
        (float("nan"), "n/a"),
    ],
)
def test_durations_show_three_significant_digits(seconds: float, shown: str) -> None:
    assert fmt_s(seconds) == shown
