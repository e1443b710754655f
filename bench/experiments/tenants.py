"""One tenant at its limits against another's latency: a probe-style table.

    python bench/experiments/tenants.py [--requests 1000]

A real `thaw serve` on 127.0.0.1 with two tenant keys. The victim sends
sequential `POST /invoke/echo` calls on one keep-alive connection and its p50
and p99 are taken: first with the instance idle, then beside an attacker (a
process of its own, so that its threads take nothing from the victim's
timing) holding each limit in turn and knocking on it 50 times a second:

    held connections   THAW_MAX_HELD_PER_KEY long-polls of its own running job
    job quota          THAW_MAX_JOBS_PER_KEY stored jobs
    handler queue      THAW_MAX_QUEUE runs of a handler that sleeps

Target: the victim's p99 within 2x of idle beside each; idle is measured
before and after, and the lower p99 of the two is the baseline.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.synchronize
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

# `python bench/experiments/tenants.py` puts bench/ on sys.path, not the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import (
    HOST,
    Proc,
    Row,
    fmt_s,
    fmt_x,
    free_port,
    percentile,
    render,
    runtime_env,
    thaw_serve_argv,
    verdict,
)

ATTACKER = "bench-attacker-key"
VICTIM = "bench-victim-key"
HELD_PER_KEY = 32
JOBS_PER_KEY = 50
QUEUE = 16
KNOCKS_PER_S = 50


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _hold(url: str, method: str, path: str, kwargs: dict[str, object]) -> None:
    """Requests the server holds, one after another, until the attacker process ends."""
    headers = kwargs.pop("headers", _auth(ATTACKER))
    with httpx.Client(base_url=url, timeout=300, headers=headers) as client:  # type: ignore[arg-type]
        while True:
            client.request(method, path, **kwargs)  # type: ignore[arg-type]


def _attack(url: str, limit: str, ready: multiprocessing.synchronize.Event) -> None:
    """Take `limit` whole, then knock on it KNOCKS_PER_S times a second until killed."""
    client = httpx.Client(base_url=url, timeout=300, headers=_auth(ATTACKER))
    Request = tuple[str, str, dict[str, object]]
    knock: Request
    holders: list[Request]
    if limit == "held":
        job = client.post("/handlers/sleepy/jobs", json={"s": 600}).json()["id"]
        knock = ("GET", f"/jobs/{job}", {"params": {"wait": 1}})
        holders = [("GET", f"/jobs/{job}", {"params": {"wait": 240}})] * HELD_PER_KEY
    elif limit == "jobs":
        while client.post("/handlers/echo/jobs", json={"n": 1}).status_code == 202:
            pass
        knock = ("POST", "/handlers/echo/jobs", {"json": {"n": 1}})
        holders = []
    else:  # the handler queue: its runs count until they end, answered 202 or not
        body = {"json": {"s": 600}, "headers": {"Prefer": "respond-async"}}
        knock = ("POST", "/invoke/sleepy", body)
        holders = []
    for method, path, kwargs in holders:
        threading.Thread(target=_hold, args=(url, method, path, dict(kwargs)), daemon=True).start()
    method, path, kwargs = knock
    while True:  # until the limit is whole: a knock is refused
        time.sleep(0.05)
        if client.request(method, path, **kwargs).status_code in (429, 503):  # type: ignore[arg-type]
            break
    ready.set()
    while True:
        time.sleep(1 / KNOCKS_PER_S)
        client.request(method, path, **kwargs)  # type: ignore[arg-type]


def _victim(url: str, requests: int) -> list[float]:
    took = []
    with httpx.Client(base_url=url, timeout=30, headers=_auth(VICTIM)) as client:
        for _ in range(50):  # warm the connection and the path
            client.post("/invoke/echo", json={"n": 1})
        for _ in range(requests):
            started = time.perf_counter()
            answer = client.post("/invoke/echo", json={"n": 1})
            took.append(time.perf_counter() - started)
            if answer.status_code != 200:
                raise RuntimeError(f"the victim was refused: {answer.status_code} {answer.text}")
    return took


def _p99_p50(took: list[float]) -> str:
    return f"{fmt_s(percentile(took, 99))} ({fmt_s(percentile(took, 50))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        env = runtime_env(
            Path(tmp),
            handlers="handlers.echo,tests.handlers.sleepy",
            api_keys=f"{ATTACKER},{VICTIM}",
            max_held_per_key=str(HELD_PER_KEY),
            max_jobs_per_key=str(JOBS_PER_KEY),
            max_queue=str(QUEUE),
            drain_grace_s="1",
            log_level="WARNING",
        )
        url = f"http://{HOST}:{port}"
        with Proc(thaw_serve_argv(port), env, port, Path(tmp) / "server.log") as server:
            server.wait_healthy()
            alone = _victim(url, args.requests)
            measured: dict[str, list[float]] = {}
            names = {
                "held": f"{HELD_PER_KEY} held long-polls",
                "queue": f"a full handler queue ({QUEUE})",
                "jobs": f"{JOBS_PER_KEY} stored jobs (its quota)",
            }
            for limit in names:
                ready = multiprocessing.Event()
                attacker = multiprocessing.Process(target=_attack, args=(url, limit, ready))
                attacker.start()
                try:
                    if not ready.wait(60):
                        raise RuntimeError(f"the attacker never filled {limit}")
                    measured[limit] = _victim(url, args.requests)
                finally:
                    attacker.kill()
                    attacker.join()
            # Idle again once the attacker is gone (its sleeping jobs cost nothing): the
            # lower of the two idle p99s is the baseline, the stricter reading.
            after = _victim(url, args.requests)
        idle = min(percentile(alone, 99), percentile(after, 99))
        rows = [
            Row("victim p99 (p50), idle before", f"{_p99_p50(alone)}"),
            Row("victim p99 (p50), idle after", f"{_p99_p50(after)}"),
        ]
        for limit, name in names.items():
            p99 = percentile(measured[limit], 99)
            rows.append(
                Row(
                    f"victim p99 (p50), attacker at {name} + {KNOCKS_PER_S}/s refused",
                    _p99_p50(measured[limit]),
                    fmt_s(idle),
                    fmt_x(p99 / idle),
                    "≤ 2x idle",
                    verdict(p99 <= 2 * idle),
                )
            )
    print(render(rows))


if __name__ == "__main__":
    main()
