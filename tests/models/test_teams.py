"""OpenMP teams, for real: torch on libgomp, in a process of its own.

Each thread that runs one of torch's parallel loops keeps a team of worker
threads, and two teams alive make every loop of both wait on futexes
(runtime/models/weights/teams.py). Counted here as the process's threads that
Python did not start: the handler threads keep one team however their model
calls overlapped, and a load phase's executor thread keeps none; without the
releases (the control) each thread keeps its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, os, sys, threading
from concurrent.futures import ThreadPoolExecutor

import torch

from runtime.dispatch.threads import HandlerThreads
from runtime.models.weights import teams
from tests.support import until

release = sys.argv[1] == "release"
both_ran = threading.Barrier(2)


def native() -> int:
    # OS threads Python did not start: the teams' workers.
    return len(os.listdir("/proc/self/task")) - threading.active_count()


def op() -> None:
    # Over one grain (32768 elements): a parallel loop, so the thread gets a team.
    x = torch.ones(512, 1024)
    (x + x).sum()


def overlapping() -> None:
    op()
    both_ran.wait(60)  # both threads hold a team at once


cores = torch.get_num_threads()
out = {"threads": cores, "supported": teams.supported(), "baseline": native()}
pool = HandlerThreads(4, "h", release_team=teams.release if release else (lambda: None))
futures = [pool.submit(overlapping, models=True) for _ in range(2)]
for f in futures:
    f.result(60)
want = out["baseline"] + cores - 1
if release:
    until(lambda: native() == want, "one team", 60)
out["after_overlap"] = native()
for _ in range(5):
    pool.submit(op, models=True).result(60)
out["after_in_a_row"] = native()
loader = ThreadPoolExecutor(1)
loader.submit(teams.released_after if release else (lambda fn: fn()), op).result(60)
out["after_a_load_phase"] = native()
print(json.dumps(out))
sys.stdout.flush()
os._exit(0)  # the pool's idle threads are daemons; nothing to wait for
"""


def probe(mode: str) -> dict[str, Any]:
    # Two threads per team whatever the suite's share of the cores (tests/conftest.py).
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.process
def test_model_threads_keep_one_openmp_team_between_them() -> None:
    kept = probe("release")
    if not kept["supported"]:
        pytest.skip("torch here does not run on GNU libgomp")
    team = kept["threads"] - 1
    base = kept["baseline"]
    assert kept["after_overlap"] == base + team
    assert kept["after_in_a_row"] == base + team
    assert kept["after_a_load_phase"] == base + team
    # The control: the same work with no release keeps a team per thread.
    control = probe("keep")
    assert control["after_overlap"] == control["baseline"] + 2 * team
    assert control["after_a_load_phase"] == control["baseline"] + 3 * team


# ---- a team no larger than the CPU quota ---------------------------------------------


def cgroup(root: Path, *, v2: str | None = None, v1: tuple[str, str] | None = None) -> Path:
    """A cgroup tree as the kernel shows it to a container: v2's cpu.max, or v1's files."""
    root.mkdir(parents=True, exist_ok=True)
    if v2 is not None:
        (root / "cpu.max").write_text(v2 + "\n")
    if v1 is not None:
        (root / "cpu").mkdir()
        (root / "cpu" / "cpu.cfs_quota_us").write_text(v1[0] + "\n")
        (root / "cpu" / "cpu.cfs_period_us").write_text(v1[1] + "\n")
    return root


@pytest.mark.parametrize(
    ("v2", "v1", "cpus"),
    [
        ("max 100000", None, None),
        ("200000 100000", None, 2),
        ("150000 100000", None, 1),  # whole CPUs: a spinning thread must not be throttled
        ("50000 100000", None, 1),  # at least one
        (None, ("-1", "100000"), None),
        (None, ("300000", "100000"), 3),
        (None, None, None),
        ("garbage", None, None),
    ],
)
def test_the_cpu_quota_is_read_from_either_cgroup_version(
    tmp_path: Path, v2: str | None, v1: tuple[str, str] | None, cpus: int | None
) -> None:
    from runtime.models.weights.teams import quota_cpus

    assert quota_cpus(cgroup(tmp_path / "cg", v2=v2, v1=v1)) == cpus


@pytest.mark.parametrize(
    ("memory_mb", "cpus"),
    [("128", 1), ("1769", 1), ("3008", 1), ("3538", 2), ("10240", 5), ("", None), ("x", None)],
)
def test_a_lambda_functions_memory_buys_its_cpus(memory_mb: str, cpus: int | None) -> None:
    from runtime.models.weights.teams import lambda_cpus

    environ = {"AWS_LAMBDA_FUNCTION_MEMORY_SIZE": memory_mb} if memory_mb else {}
    assert lambda_cpus(environ) == cpus


QUOTA_PROBE = r"""
import json, os, sys
from pathlib import Path

from runtime.models.weights import teams

root = Path(sys.argv[1])
set_to = teams.configure_threads(root)
import torch

print(json.dumps({"set": set_to, "env": os.environ.get("OMP_NUM_THREADS"),
                  "torch": torch.get_num_threads()}))
"""


def run_quota_probe(root: Path, **env: str) -> dict[str, Any]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "AWS_LAMBDA_FUNCTION_MEMORY_SIZE")
    }
    done = subprocess.run(
        [sys.executable, "-c", QUOTA_PROBE, str(root)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**clean, **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.process
def test_a_quota_below_the_cores_sizes_torchs_team_before_it_loads(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no quota can be below it")
    limited = run_quota_probe(cgroup(tmp_path / "limited", v2="100000 100000"))
    assert limited == {"set": 1, "env": "1", "torch": 1}
    # No quota: libgomp's own choice, one thread per CPU the process may use.
    free = run_quota_probe(cgroup(tmp_path / "free", v2="max 100000"))
    assert free["set"] is None and free["env"] is None
    assert free["torch"] == len(os.sched_getaffinity(0))
    # On Lambda, the function's memory is its quota (1,769 MB: one vCPU).
    on_lambda = run_quota_probe(tmp_path / "free", AWS_LAMBDA_FUNCTION_MEMORY_SIZE="1769")
    assert on_lambda == {"set": 1, "env": "1", "torch": 1}
    # A variable the operator set wins over the quota.
    chosen = run_quota_probe(tmp_path / "limited", OMP_NUM_THREADS="2")
    assert chosen == {"set": None, "env": "2", "torch": 2}
