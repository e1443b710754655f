"""Progress on long CLI work, on a terminal only (runtime/cli/progress.py).

Each command runs twice as a real process: once with stderr on a pseudo-terminal
(python's pty module, as a person's shell gives it), once with everything
piped, as a script runs it. On the terminal the bars appear (their labels and
byte counts are in what the terminal received); piped, and with --json, the
output is exactly the command's own: stdout byte for byte the same in both
runs, and nothing on stderr that the command did not print before.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import orjson
import pytest

from tests.support import SAFETY_S, make_bundle

pytest.importorskip("rich", reason="the bars are rich's (the cli extra)")

# rich reads these; a CI's values would turn the live display off.
_RICH_ENV = ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "LINES")
# The one line of `thaw invoke`'s phase table, per row (the figures vary).
PHASE_ROW = re.compile(r"^(phase +ms|(fetch|load|init|warmup|run|total) +\d+\.\d)$")


def _env(base: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in _RICH_ENV}
    env["TERM"] = "xterm-256color"
    return env


def run_on_terminal(argv: list[str], env: dict[str, str]) -> tuple[bytes, str, int]:
    """(stdout, what the terminal got, exit code): stdout piped, stderr a pty."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    received = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                return
            if not chunk:
                return
            received.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave
        )
        os.close(slave)
        try:
            stdout, _ = proc.communicate(timeout=SAFETY_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reader.join(SAFETY_S)
    finally:
        os.close(master)
    return stdout, received.decode(errors="replace"), proc.returncode


def run_piped(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, env=env, capture_output=True, timeout=SAFETY_S, check=False)


def thaw(*args: str) -> list[str]:
    return [sys.executable, "-m", "runtime.cli.main", *args]


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A model directory of a few MB: several hash chunks."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    generator = torch.Generator().manual_seed(0)
    save_file({"w": torch.randn(1_000_000, generator=generator)}, src / "model.safetensors")
    (src / "config.json").write_text('{"dim": 4}')
    return src


def test_bundle_build_shows_hashing_on_a_terminal_only(
    thaw_env: dict[str, str], source: Path, tmp_path: Path
) -> None:
    env = _env(thaw_env)
    # --per-request-bytes given: no warning about what admission assumes on stderr.
    argv = thaw("bundle", "build", str(source), "--name", "m", "--out", str(tmp_path / "out"))
    argv += ["--per-request-bytes", "4096"]
    stdout, terminal, code = run_on_terminal(argv, env)
    assert code == 0, terminal
    assert "hashing src" in terminal
    assert "4.0 MB" in terminal  # the bytes, as rich writes them
    piped = run_piped(argv, env)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == stdout  # stdout the same byte for byte
    assert piped.stdout.decode().startswith("built m@sha256:")
    assert piped.stderr == b""  # nothing extra when piped


def test_bundle_build_with_json_on_a_terminal_draws_nothing(
    thaw_env: dict[str, str], source: Path, tmp_path: Path
) -> None:
    argv = thaw("bundle", "build", str(source), "--name", "m", "--json", "--per-request-bytes", "0")
    stdout, terminal, code = run_on_terminal(argv, _env(thaw_env))
    assert code == 0, terminal
    assert terminal == ""
    assert orjson.loads(stdout)["files"] == 2


def test_a_conversion_shows_its_tensors_on_a_terminal_and_its_lines_when_piped(
    thaw_env: dict[str, str], tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    checkpoint = tmp_path / "net.pth"
    torch.save({f"layer{i}.weight": torch.ones(4) * i for i in range(40)}, checkpoint)
    env = _env(thaw_env)
    argv = thaw("bundle", "build", str(checkpoint), "--name", "net", "--out", str(tmp_path / "b"))
    argv += ["--per-request-bytes", "4096"]
    stdout, terminal, code = run_on_terminal(argv, env)
    assert code == 0, terminal
    assert "converting net.pth" in terminal and "40/40" in terminal
    assert "tensors (" not in terminal  # the bar, not the piped run's lines
    piped = run_piped(argv, env)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == stdout
    # Piped: the lines it always printed, and nothing else.
    assert piped.stderr.decode().splitlines() == [
        "converting net.pth: 30/40 tensors (75%)",
        "converting net.pth: 40/40 tensors (100%)",
    ]


def test_a_cold_invoke_shows_the_load_phase_on_a_terminal_only(
    thaw_env: dict[str, str], tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    bundles = tmp_path / "bundles"
    # The builder sleeps: the watcher (every 0.1 s) sees the load under way.
    make_bundle(bundles, "tiny", floats_per_shard=4096, config={"sleep_s": 0.5})
    env = _env(
        {
            **thaw_env,
            "THAW_HANDLERS": "tests.handlers.slow_builder",
            "THAW_BUNDLE_SOURCE": str(bundles),
        }
    )
    argv = thaw("invoke", "predict", "--event", '{"x": 2}')
    stdout, terminal, code = run_on_terminal(argv, env)
    assert code == 0, terminal
    plain = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", terminal)
    # The phases it went through, the weights' bytes read (4096 float32 and a header).
    assert "tiny: load" in plain and "tiny: init" in plain
    assert re.search(r"tiny: (load|init) [^\r\n]* 16\.\d/16\.\d kB", plain), plain
    # The bars are gone before the phase table, which follows them as before.
    assert terminal.rstrip().splitlines()[-1].strip().startswith("total")
    piped = run_piped(argv, env)
    assert piped.returncode == 0, piped.stderr
    # The same one line (the fixture's answer names its process, which differs).
    assert re.sub(rb'"pid":\d+', b"", piped.stdout) == re.sub(rb'"pid":\d+', b"", stdout)
    assert piped.stdout.count(b"\n") == 1
    lines = piped.stderr.decode().splitlines()
    assert len(lines) == 7 and all(PHASE_ROW.match(line) for line in lines), lines


# A stand-in for `buildah bud`: a real process printing a build's STEP lines.
_STEPS = """
import sys
for n, step in enumerate(["FROM python:3.11", "RUN pip install thaw", "COPY . /app"], 1):
    print(f"STEP {n}/3: {step}", flush=True)
    print("some build output", flush=True)
sys.exit(int(sys.argv[1]))
"""
_FOLLOW = """
import sys
from runtime.cli.progress import bars
from scripts.image import ImageError, follow_steps
with bars() as live:
    if live is None:
        print("no bars", file=sys.stderr)
        sys.exit(0)
    try:
        follow_steps([sys.executable, "-c", sys.argv[1], sys.argv[2]], what="build of Dockerfile",
                     live=live, timeout_s=float(sys.argv[3]), env=dict(__import__("os").environ))
    except ImageError as exc:
        live.close()
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
print("built")
"""


def test_an_image_build_follows_buildahs_steps_on_a_terminal(thaw_env: dict[str, str]) -> None:
    argv = [sys.executable, "-c", _FOLLOW, _STEPS, "0", str(SAFETY_S)]
    stdout, terminal, code = run_on_terminal(argv, _env(thaw_env))
    assert code == 0, terminal
    assert stdout == b"built\n"
    plain = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", terminal)
    steps = [plain.find(f"build of Dockerfile: {s}") for s in ("FROM", "RUN pip", "COPY")]
    assert -1 not in steps and steps == sorted(steps), plain
    assert "0/3" in plain and "2/3" in plain
    assert "some build output" not in plain  # the build's own lines are kept, not shown
    # Piped, the same command draws nothing (build() runs buildah --quiet then).
    piped = run_piped(argv, _env(thaw_env))
    assert piped.stderr == b"no bars\n"


def test_a_failed_image_build_names_its_output_tail(thaw_env: dict[str, str]) -> None:
    argv = [sys.executable, "-c", _FOLLOW, _STEPS, "3", str(SAFETY_S)]
    _, terminal, code = run_on_terminal(argv, _env(thaw_env))
    assert code == 1
    assert "error: build of Dockerfile failed (exit 3):" in terminal
    assert "STEP 3/3: COPY . /app" in terminal.split("error:")[1]


def test_an_image_build_past_its_limit_is_stopped(thaw_env: dict[str, str]) -> None:
    hangs = "import sys, time\nprint('STEP 1/2: RUN sleep', flush=True)\ntime.sleep(3600)"
    argv = [sys.executable, "-c", _FOLLOW, hangs, "0", "0.5"]
    _, terminal, code = run_on_terminal(argv, _env(thaw_env))
    assert code == 1
    assert "error: build of Dockerfile: still running after 0.5 s" in terminal
