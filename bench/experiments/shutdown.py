"""Shutdown: seconds from the signal to the process's exit, against the drain grace.

    .venv/bin/python bench/experiments/shutdown.py [--grace S] [--callers N]

For each scenario a fresh `thaw serve` process gets its callers in flight
(every handler entered, or the load under way), then a signal; the row gives
the seconds from the signal to the exit, how far past the grace that is, the
exit code, and what the callers were answered. The target: whatever user
code does, the process is gone within the grace plus one second (after a
second SIGTERM or a SIGINT, within one second of it). Handlers that never
return block for a day (tests/handlers/hangs.py); the builder that never
returns sleeps for an hour (tests/handlers/loadlog.py).

`run()` gives the rows to bench/run.py's table, as the other benchmarks do.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.common import Proc, Row, fmt_s, free_port, render, runtime_env, thaw_serve_argv  # noqa: E402

HANDLERS = "tests.handlers.hangs,tests.handlers.loadlog,handlers.echo"
PATIENCE_S = 120.0


# (handler, event) per caller; the stuck builder's bundle is `alpha`.
Calls = tuple[tuple[str, dict[str, float]], ...]


@dataclass(frozen=True)
class Scenario:
    name: str
    calls: Calls
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)
    # How many callers reach their handler before the signal (a cold load enters none).
    entering: int | None = None


def scenarios(grace_s: float, callers: int) -> list[Scenario]:
    stuck_sync: Calls = (("hangs", {}),)
    half = callers // 2
    return [
        Scenario("idle: nothing in flight", ()),
        Scenario("async handler ending in half the grace", (("hangs_async", {"s": grace_s / 2}),)),
        Scenario("sync handler that never returns", stuck_sync),
        Scenario("async handler that never returns", (("hangs_async", {}),)),
        Scenario(
            f"{callers} callers that never return ({half} sync, {callers - half} async)",
            (("hangs", {}),) * half + (("hangs_async", {}),) * (callers - half),
        ),
        Scenario("builder that never returns (cold load)", (("alpha", {}),), entering=0),
        Scenario(
            "second SIGTERM in the grace, sync handler stuck",
            stuck_sync,
            (signal.SIGTERM, signal.SIGTERM),
        ),
        Scenario("SIGINT, sync handler stuck", stuck_sync, (signal.SIGINT,)),
    ]


def _call(port: int, handler: str, event: dict[str, float]) -> str:
    url = f"http://127.0.0.1:{port}/invoke/{handler}"
    try:
        response = httpx.post(url, json=event, headers={"Prefer": "wait=100"}, timeout=PATIENCE_S)
    except httpx.TransportError as exc:
        return type(exc).__name__
    if response.status_code >= 400:
        return f"{response.status_code} {response.json().get('type', '').rsplit('/', 1)[-1]}"
    return str(response.status_code)


def _entered(port: int) -> int:
    reply = httpx.post(f"http://127.0.0.1:{port}/invoke/entered_count", json={}, timeout=30)
    count: int = reply.json()["entered"]
    return count


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"never: {what}")
        time.sleep(0.01)


def measure(scenario: Scenario, grace_s: float, tmp: Path) -> Row:
    bundles = tmp / "bundles"
    if not (bundles / "alpha").exists():
        from tests.support import make_bundle

        make_bundle(bundles, "alpha", config={"sleep_s": 3600})
    port = free_port()
    env = runtime_env(
        tmp / scenario.name.replace(" ", "-"),
        handlers=HANDLERS,
        drain_grace_s=str(grace_s),
        bundle_source=str(bundles),
    )
    with Proc(thaw_serve_argv(port), env, port, tmp / f"server-{port}.log") as proc:
        proc.wait_healthy()
        assert proc.proc is not None
        with concurrent.futures.ThreadPoolExecutor(max(1, len(scenario.calls))) as pool:
            answers = [pool.submit(_call, port, h, e) for h, e in scenario.calls]
            entering = len(scenario.calls) if scenario.entering is None else scenario.entering
            _wait_for(lambda: _entered(port) >= entering, "every caller in its handler")
            if scenario.entering == 0:
                time.sleep(0.5)  # the load is under way (its builder sleeps an hour)
            signalled = time.monotonic()
            for index, sig in enumerate(scenario.signals):
                if index:
                    # The drain began (readiness off); then the next signal, timed from here.
                    _wait_for(
                        lambda: httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 503,
                        "readiness off",
                    )
                    signalled = time.monotonic()
                proc.proc.send_signal(sig)
            code = proc.proc.wait(PATIENCE_S)
            exited_s = time.monotonic() - signalled
            answered = collections.Counter(f.result() for f in answers)
    stop_now = len(scenario.signals) > 1 or scenario.signals[0] == signal.SIGINT
    allowed_s = 1.0 if stop_now else grace_s + 1.0
    signals = " then ".join(s.name for s in scenario.signals)
    callers = ", ".join(f"{n}x {answer}" for answer, n in sorted(answered.items())) or "none"
    past = exited_s - (0.0 if stop_now else grace_s)
    return Row(
        f"shutdown, {scenario.name}: {signals} -> exit (callers: {callers})",
        f"{fmt_s(exited_s)}, exit {code}",
        baseline="the signal" if stop_now else f"grace {grace_s:g} s",
        ratio=f"{past:+.2f} s",
        target=f"<= {allowed_s:g} s",
        verdict="pass" if exited_s <= allowed_s else "FAIL",
    )


def run(quick: bool = False, grace_s: float = 2.0, callers: int = 20) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="thaw-shutdown-") as tmp:
        return [measure(s, grace_s, Path(tmp)) for s in scenarios(grace_s, callers)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grace", type=float, default=2.0, help="THAW_DRAIN_GRACE_S")
    parser.add_argument("--callers", type=int, default=20, help="callers in the crowd scenario")
    args = parser.parse_args(argv)
    rows = run(grace_s=args.grace, callers=args.callers)
    print(render(rows))
    return 0 if all(r.verdict == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
