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
