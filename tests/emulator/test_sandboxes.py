"""Sandbox scaling, throttling, timeouts, crashes, idle reaping and shutdown."""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import httpx
import orjson
import pytest

from tests.emulator.conftest import Emulator, emulator_env, wait_for
from tests.support import SAFETY_S

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too; the emulator reaps its children.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "\nState:\tZ" not in status.read_text()


def test_past_the_limit_sync_invocations_are_throttled(emulator: Emulator) -> None:
    payload = orjson.dumps({"handler": "sleepy", "input": {"s": 1.0}, "wait_s": 5})
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda _: emulator.invoke("Capped", payload), range(4)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 429, 429]  # every call answered: nothing lost
    for throttled in (r for r in responses if r.status_code == 429):
        assert throttled.headers["x-amzn-ErrorType"] == "TooManyRequestsException"
        assert throttled.json()["Reason"] == "ReservedFunctionConcurrentInvocationLimitExceeded"
    served = [r.headers["x-amzn-RequestId"] for r in responses if r.status_code == 200]
    assert all(emulator.report(rid).cold for rid in served)  # exactly two cold starts
    assert len({r.json()["output"]["pid"] for r in responses if r.status_code == 200}) == 2
    warm = emulator.invoke("Capped", orjson.dumps({"handler": "echo"}))
    assert warm.status_code == 200
    assert not emulator.report(warm.headers["x-amzn-RequestId"]).cold


def test_one_instance_takes_max_concurrency_invocations(emulator: Emulator) -> None:
    payload = orjson.dumps({"handler": "sleepy", "input": {"s": 0.5}, "wait_s": 5})
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda _: emulator.invoke("Multi", payload), range(4)))
    assert [r.status_code for r in responses] == [200] * 4
    assert len({r.json()["output"]["pid"] for r in responses}) == 1
    assert sum(emulator.report(r.headers["x-amzn-RequestId"]).cold for r in responses) == 1


def test_timeout_kills_the_instance_and_the_next_call_is_cold(emulator: Emulator) -> None:
    first = emulator.invoke("Short", orjson.dumps({"handler": "sleepy", "input": {"s": 0}}))
    pid = first.json()["output"]["pid"]
    # `blocks` holds the sandbox's event loop: not even a 202 can be sent.
    timed_out = emulator.invoke("Short", orjson.dumps({"handler": "blocks", "input": {"s": 5}}))
    assert timed_out.status_code == 200
    assert timed_out.headers["x-amz-function-error"] == "Unhandled"
    request_id = timed_out.headers["x-amzn-RequestId"]
    assert timed_out.json() == {
        "errorType": "Sandbox.Timedout",
        "errorMessage": f"{request_id} Task timed out after 1.00 seconds",
    }
    report = emulator.report(request_id).fields
    assert report["Status"] == "timeout" and "Error Type" not in report  # as Lambda prints it
    wait_for(lambda: not alive(pid))
    after = emulator.invoke("Short", orjson.dumps({"handler": "sleepy", "input": {"s": 0}}))
    assert after.status_code == 200 and "x-amz-function-error" not in after.headers
    assert after.json()["output"]["pid"] != pid
    assert emulator.report(after.headers["x-amzn-RequestId"]).cold


def test_a_crashed_instance_is_replaced(emulator: Emulator) -> None:
    crashed = emulator.invoke("ThawFunction", orjson.dumps({"handler": "crashes"}))
    assert crashed.headers["x-amz-function-error"] == "Unhandled"
    error = crashed.json()
    assert error["errorType"] == "Runtime.ExitError"
    assert "exit status 3" in error["errorMessage"]
    report = emulator.report(crashed.headers["x-amzn-RequestId"]).fields
    assert report["Status"] == "error" and report["Error Type"] == "Runtime.ExitError"
    after = emulator.invoke("ThawFunction", orjson.dumps({"handler": "echo", "input": 1}))
    assert after.json() == {"output": 1}


def test_idle_instances_are_stopped(emulator: Emulator) -> None:
    """The module's emulator stops sandboxes idle for 2 s."""
    payload = orjson.dumps({"handler": "sleepy", "input": {"s": 0}})
    first = emulator.invoke("Capped", payload)
    pid = first.json()["output"]["pid"]
    warm = emulator.invoke("Capped", payload)
    assert warm.json()["output"]["pid"] == pid  # reused while warm
    wait_for(lambda: not alive(pid), timeout_s=SAFETY_S)
    cold = emulator.invoke("Capped", payload)
    assert cold.json()["output"]["pid"] != pid
    assert emulator.report(cold.headers["x-amzn-RequestId"]).cold


def test_report_lines_measure_the_process(emulator: Emulator) -> None:
    response = emulator.invoke("ThawFunction", orjson.dumps({"handler": "echo"}))
    fields = emulator.report(response.headers["x-amzn-RequestId"]).fields
    assert fields["Memory Size"] == "256 MB"
    used_mb = int(fields["Max Memory Used"].removesuffix(" MB"))
    assert 10 < used_mb < 2048  # measured, not the configured size
    duration_ms = float(fields["Duration"].removesuffix(" ms"))
    billed_ms = int(fields["Billed Duration"].removesuffix(" ms"))
    assert billed_ms >= duration_ms > 0


def test_shutdown_stops_every_instance(tmp_path: Path) -> None:
    emu = Emulator(tmp_path, emulator_env(tmp_path), "--max-sandboxes", "2")
    try:
        payload = orjson.dumps({"handler": "sleepy", "input": {"s": 0.5}, "wait_s": 5})
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pids = {
                r.json()["output"]["pid"]
                for r in pool.map(lambda _: emu.invoke("ThawFunction", payload), range(2))
            }
        assert all(alive(pid) for pid in pids)
        assert emu.stop() == 0
        assert not any(alive(pid) for pid in pids)
    finally:
        emu.stop()
    with httpx.Client() as client:
        try:
            client.get(f"{emu.url}/healthz", timeout=1)
        except httpx.TransportError:
            return
    raise AssertionError("the emulator still answers after SIGTERM")
