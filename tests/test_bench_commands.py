"""Every registered benchmark (bench/run.py's `BENCHMARKS`) starts as the docs run it:
`.venv/bin/python bench/NAME.py`, from the repository root, no PYTHONPATH (which puts
bench/, not the root, on sys.path), and every module a benchmark serves as handlers
imports and registers. BENCHMARKS.md holds one section per registered benchmark,
which `bench/run.py --write` rewrites.

A benchmark that no longer starts is found here, not by the next person who needs
its figures (bench/overhead.py and bench/generation.py once did not). Scripts under
bench/experiments/ are not run here: each measured one decision (docs/decisions/).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.common import fmt_s
from bench.run import BENCHMARKS, markers, registered, write_section
from tests.support import free_port, until

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# What bench/ holds beside the registered benchmarks: shared code, the servers and
# handlers the benchmarks measure against, and the package marker.
SUPPORT = {"__init__.py", "run.py", "common.py", "fixtures.py", "bare_app.py", "bare_lambda.py"}
MAX_SCRIPTS = 25


def run_as_user(*argv: str) -> subprocess.CompletedProcess[str]:
    """`python ARGV...` from the repository root, without PYTHONPATH, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_bench_holds_the_registered_benchmarks_and_their_support_only() -> None:
    scripts = {path.name for path in BENCH.glob("*.py")}
    commands = {b.script.name for b in BENCHMARKS}
    assert scripts - SUPPORT <= commands, "register it in bench/run.py or move it to experiments/"
    assert len(scripts) <= MAX_SCRIPTS, sorted(scripts)


@pytest.mark.parametrize("name", sorted({b.argv[0] for b in registered()}))
def test_the_benchmark_answers_help_as_the_docs_run_it(name: str) -> None:
    done = run_as_user(name, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]


def test_the_runner_lists_every_benchmark() -> None:
    done = run_as_user("bench/run.py", "--list")
    assert done.returncode == 0, done.stderr[-2000:]
    for bench in BENCHMARKS:
        assert f"{bench.name} (" in done.stdout
        assert bench.command in done.stdout


def test_benchmarks_md_has_a_section_for_every_benchmark() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    for bench in BENCHMARKS:
        begin, end = markers(bench.name)
        assert text.count(begin) == 1 and text.count(end) == 1, bench.name
        assert text.index(begin) < text.index(end), bench.name
    assert len(text.splitlines()) <= 600
    # Current figures, not a diary of work periods.
    assert not re.search(r"^#.*(session|round's)", text, re.MULTILINE)


def test_write_rewrites_one_section_and_leaves_the_rest(tmp_path: Path) -> None:
    doc = tmp_path / "B.md"
    doc.write_text(
        "# Title\n\n<!-- bench:a -->\nold a\n<!-- /bench:a -->\n\n"
        "text between\n\n<!-- bench:b -->\nold b\n<!-- /bench:b -->\n"
    )
    write_section(doc, "a", "new a\n| x |")
    assert doc.read_text() == (
        "# Title\n\n<!-- bench:a -->\nnew a\n| x |\n<!-- /bench:a -->\n\n"
        "text between\n\n<!-- bench:b -->\nold b\n<!-- /bench:b -->\n"
    )
    with pytest.raises(SystemExit, match="no section"):
        write_section(doc, "c", "anything")


def test_the_runner_refuses_what_is_not_registered() -> None:
    done = run_as_user("bench/run.py", "--only", "gemm_layout")
    assert done.returncode == 2
    assert "unknown benchmark" in done.stderr


def handler_modules() -> list[str]:
    """The bench modules that declare handlers or builders (a benchmark serves them,
    named in THAW_HANDLERS)."""
    return sorted(
        f"bench.{path.stem}"
        for path in BENCH.glob("*.py")
        if re.search(r"^@(handler|builder|bundle)\(", path.read_text(), re.MULTILINE)
    )


def test_every_benchmark_handler_module_registers() -> None:
    modules = handler_modules()
    assert {"bench.fixtures", "bench.batching", "bench.generation"} <= set(modules)
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
    for name in ("generate_private", "embed_unbatched", "device_memory", "echo_sync"):
        assert name in done.stdout, done.stdout


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
