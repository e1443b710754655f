"""Each sandbox's Runtime API, as real Lambda clients see it, and how an invocation ends.

On Lambda AWS_LAMBDA_RUNTIME_API is a plain `host:port`; a client that hands it
to `http.client` (awslambdaric does, to post an init error) refuses anything
else. And an invocation ends, and is billed, when the runtime asks for its next
event, not when it posts the response.
"""

from __future__ import annotations

import base64
import concurrent.futures
import re

import orjson
import pytest

from tests.emulator.conftest import Emulator
from tests.emulator.test_invoke_api import lambda_client

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

PLAIN_ADDRESS = re.compile(r"^127\.0\.0\.1:\d+$")


def test_each_instance_gets_a_plain_host_port_of_its_own(emulator: Emulator) -> None:
    """A stdlib client runs the whole loop: next, then response, on `host:port` as given."""
    payload = orjson.dumps({"sleep_s": 0.5})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: emulator.invoke("Foreign", payload), range(2)))
    assert [a.status_code for a in answers] == [200, 200]
    bodies = [a.json() for a in answers]
    assert all(b["foreign"] == {"sleep_s": 0.5} for b in bodies)
    addresses = {b["address"] for b in bodies}
    assert len({b["pid"] for b in bodies}) == 2  # two sandboxes...
    assert len(addresses) == 2  # ...with a listener each
    assert all(PLAIN_ADDRESS.match(address) for address in addresses), addresses


def test_a_stdlib_client_posts_its_init_error_as_awslambdaric_does(emulator: Emulator) -> None:
    answer = emulator.invoke("ForeignInit", b"{}")
    assert answer.status_code == 200
    assert answer.headers["x-amz-function-error"] == "Unhandled"
    assert answer.json() == {
        "errorType": "Runtime.ForeignInitError",
        "errorMessage": "init failed on purpose",
    }


def test_duration_runs_until_the_instance_asks_for_its_next_event(emulator: Emulator) -> None:
    """A job answered 202 keeps the sandbox working; the REPORT bills that work."""
    event = {"handler": "sleepy", "input": {"s": 1.5}, "wait_s": 0.3}
    answer = emulator.invoke("ThawFunction", orjson.dumps(event))
    assert answer.status_code == 200
    job = answer.json()
    assert job["status"] in ("queued", "running")  # answered before the work was done
    report = emulator.report(answer.headers["x-amzn-RequestId"])
    assert float(report.fields["Duration"].removesuffix(" ms")) >= 1500
    assert "Status" not in report.fields


def test_the_log_tail_waits_for_the_report(emulator: Emulator) -> None:
    answer = lambda_client(emulator).invoke(
        FunctionName="ThawFunction",
        Payload=orjson.dumps({"handler": "sleepy", "input": {"s": 1.0}, "wait_s": 0.2}),
        LogType="Tail",
    )
    request_id = answer["ResponseMetadata"]["RequestId"]
    log = base64.b64decode(answer["LogResult"]).decode()
    report = next(line for line in log.splitlines() if line.startswith("REPORT"))
    assert request_id in report
    duration = re.search(r"\tDuration: ([\d.]+) ms", report)
    assert duration is not None and float(duration.group(1)) >= 1000


def test_work_after_the_answer_past_the_timeout_ends_in_a_timeout(emulator: Emulator) -> None:
    """`Short` has a 1 s timeout: the answer goes out, the job's work is cut off."""
    event = {"handler": "sleepy", "input": {"s": 5}, "wait_s": 0.2}
    answer = emulator.invoke("Short", orjson.dumps(event))
    assert answer.status_code == 200 and "x-amz-function-error" not in answer.headers
    report = emulator.report(answer.headers["x-amzn-RequestId"])
    assert report.fields["Status"] == "timeout"
    assert 900 <= float(report.fields["Duration"].removesuffix(" ms")) < 5000
