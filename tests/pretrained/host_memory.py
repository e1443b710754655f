"""Driving a real `thaw serve` through loads, unloads and evictions while reading its
RSS from /proc: what the tests of host memory (test_host_memory.py) and
bench/memory.py share.

Figures are the kernel's (VmRSS, VmHWM of the server's pid), never Thaw's own
accounting: the budget is a promise to the container, which counts pages.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from tests.support import SAFETY_S, ServerProcess

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
# Every shipped model handler, and `fahrenheit`, whose one-neuron bundle imports
# the framework and pays the first load's one-time costs without holding weights.
HANDLERS = "handlers.tempconv,handlers.embed,handlers.generate,handlers.classify"


def status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def rss(server: ServerProcess) -> int:
    assert server.proc is not None
    return status_bytes(server.proc.pid, "VmRSS")


def peak_rss(server: ServerProcess) -> int:
    """The server's highest RSS since it started (VmHWM)."""
    assert server.proc is not None
    return status_bytes(server.proc.pid, "VmHWM")


def bundle_root(where: Path, bundles: Mapping[str, Path]) -> Path:
    """One source directory naming `bundles` (links to where they were built) and the
    repository's tempconv."""
    where.mkdir(parents=True, exist_ok=True)
    for name, path in {**bundles, "tempconv": ROOT / "bundles" / "tempconv"}.items():
        (where / name).symlink_to(path.resolve(), target_is_directory=True)
    return where


def server_env(base: Mapping[str, str], source: Path, **settings: str) -> dict[str, str]:
    env = {**base, "THAW_BUNDLE_SOURCE": str(source), "THAW_HANDLERS": HANDLERS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(settings)
    return env


def model(client: httpx.Client, name: str) -> dict[str, Any]:
    for view in client.get("/models").json()["models"]:
        if view["name"] == name:
            return dict(view)
    raise AssertionError(f"/models has no {name}")


def load(client: httpx.Client, name: str) -> None:
    """Load `name` (an operator's prewarm) and wait until it is READY."""
    response = client.post(f"/models/{name}/load")
    assert response.status_code == 202, response.text
    deadline = time.monotonic() + SAFETY_S
    while (state := model(client, name)["state"]) != "ready":
        assert state != "failed", model(client, name)
        assert time.monotonic() < deadline, f"{name} not READY after {SAFETY_S} s: {state}"
        time.sleep(0.02)


def unload(client: httpx.Client, name: str) -> None:
    """Unload `name`; answered once its memory was handed back."""
    response = client.delete(f"/models/{name}")
    assert response.status_code == 200, response.text
    assert response.json()["state"] == "unloaded", response.text


def invoke(client: httpx.Client, handler: str, event: Any) -> Any:
    response = client.post(f"/invoke/{handler}", json=event, headers={"Prefer": "wait=300"})
    assert response.status_code == 200, response.text
    return response.json()


def idle_baseline(server: ServerProcess, client: httpx.Client) -> int:
    """RSS with nothing loaded once the framework is imported: tempconv loaded
    (torch, its libraries and thread pools, the first load's one-time state) and
    unloaded again."""
    load(client, "tempconv")
    unload(client, "tempconv")
    return rss(server)


# What a request of each handler sends in the eviction runs: small, so the
# figures are the models' and their loads', with one request slot each.
REQUESTS = {
    "embed": {"texts": ["A man is eating food."]},
    "generate": {"prompt": "The capital of France is", "max_tokens": 4},
}
