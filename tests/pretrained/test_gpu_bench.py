"""bench/gpu.py, the GPU check (run on a lent H200, BENCHMARKS.md), run where
there is no GPU, as in CI: without CUDA it says so in one line and exits 0, and
`--smoke` drives every measurement's code path on the CPU (real servers, real
bundles) into one table.

The smoke run shares this session's built bundles (conftest's `bundles_dir`);
the bench builds any that are missing itself, and a shipped bundle whose
package is not installed must show as "skipped", never as missing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pretrained.conftest import PACKAGES
from tests.support import SAFETY_S

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu.py"

# Each row the table must hold, as a pattern of its first cell, and the shipped
# bundle it needs (None: the synthetic bundle only).
ROWS: list[tuple[str, str | None]] = [
    (r"^load to cpu, synthetic .*Thaw's load phase", None),
    (r"^load to cpu, smollm2 .*largest shipped bundle", "smollm2"),
    (r"^unload x\d+ \(gpu-synthetic\): allocated after each DELETE", None),
    (r"^unload x\d+: reserved by the caching allocator after each DELETE", None),
    (r"^unload x\d+: driver's used memory \(mem_get_info\)", None),
    (r"^`embed` first request after READY.*accelerator warm-up on", "minilm"),
    (r"^peak RSS, smoke memory of the largest `embed` request", "minilm"),
    (r"^`embed` batched, 32 keep-alive clients: requests/s", "minilm"),
    (r"^`classify` first request after READY.*accelerator warm-up on", "efficientnet"),
    (r"^peak RSS, smoke memory of the largest `classify` request", "efficientnet"),
    (r"^`generate` first request after READY.*accelerator warm-up on", "smollm2"),
    (r"^peak RSS, smoke memory of the largest `generate` request", "smollm2"),
    (r"^`generate`, 8 concurrent callers", "smollm2"),
]


def installed(bundle: str) -> bool:
    modules = (PACKAGES[bundle], "tokenizers", "PIL", "gguf")
    return all(importlib.util.find_spec(m) is not None for m in modules)


def run_bench(*args: str, cuda: bool, script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""  # torch then sees no device, even on a GPU machine
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=SAFETY_S * 5,
    )


def table_rows(stdout: str) -> list[list[str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    assert lines[0].startswith("| measurement |"), stdout
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[2:]]


def test_without_cuda_it_skips_in_one_line_and_exits_0() -> None:
    done = run_bench(cuda=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    assert lines[0].startswith("bench/gpu.py: skipped: no CUDA device"), lines[0]
    assert "|" not in done.stdout  # no table


@pytest.mark.slow
def test_smoke_runs_every_measurement_on_the_cpu(bundles_dir: Path) -> None:
    done = run_bench("--smoke", "--bundles", str(bundles_dir), cuda=False)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    rows = table_rows(done.stdout)
    assert len(rows) == len(ROWS), "\n".join(r[0] for r in rows)
    for pattern, needs in ROWS:
        found = [r for r in rows if re.search(pattern, r[0])]
        assert len(found) == 1, f"{pattern}: {len(found)} rows in\n{done.stdout}"
        _name, thaw, _baseline, _ratio, _target, verdict = found[0]
        if needs is not None and not installed(needs):
            assert verdict == "skipped", found[0]
            continue
        # Measured: a smoke run has no verdict, and every figure is a number.
        assert verdict == "smoke", found[0]
        assert re.search(r"\d", thaw) and "n/a" not in thaw, found[0]
    # The synthetic bundle was loaded and held its bytes on the CPU: the load
    # row is a bandwidth, and the memory probe saw the weights while loaded.
    load = next(r for r in rows if r[0].startswith("load to cpu, synthetic"))
    assert re.search(r"[\d.]+ [MG]B/s", load[1]) and "host copy" in load[2], load
    allocated = next(r for r in rows if "allocated after each DELETE" in r[0])
    assert allocated[2].startswith("+") and allocated[2].endswith("while loaded"), allocated
