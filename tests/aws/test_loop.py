"""The Lambda loop end to end: a real `python -m runtime` against a fake Runtime API."""

from __future__ import annotations

import base64
import concurrent.futures
from collections.abc import Callable
from pathlib import Path

import orjson

from runtime.aws import limits
from tests.aws.conftest import LambdaProcess
from tests.aws.fake_runtime_api import FakeRuntimeAPI
from tests.support import until

Start = Callable[..., LambdaProcess]
HANDLERS = (
    "tests.handlers.echo,tests.handlers.raises,tests.handlers.refuses,tests.handlers.slow_builder"
)


def http_event(method: str, path: str, body: bytes = b"", **extra: object) -> dict[str, object]:
    event: dict[str, object] = {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": path,
        "rawQueryString": "",
        "headers": {"content-type": "application/json"},
        "requestContext": {"http": {"method": method, "path": path}},
        "body": base64.b64encode(body).decode(),
        "isBase64Encoded": True,
    }
    event.update(extra)
    return event


def test_direct_event_is_answered_with_output(
    start_runtime: Start, runtime_api: FakeRuntimeAPI
) -> None:
    start_runtime(THAW_HANDLERS=HANDLERS)
    request_id = runtime_api.push({"handler": "echo", "input": {"text": "hi", "n": [1, 2]}})
    posted = runtime_api.result(request_id)
    assert posted.kind == "response"
    assert posted.json() == {"output": {"text": "hi", "n": [1, 2]}}


def test_handler_error_becomes_a_lambda_error(
    start_runtime: Start, runtime_api: FakeRuntimeAPI
) -> None:
    """As AWS's Python runtime reports it: the exception's class, its message, user frames."""
    start_runtime(THAW_HANDLERS=HANDLERS)
    event = {"handler": "raises", "input": {"message": "no luck", "token": "s3cr3t-payload"}}
    failing = runtime_api.push(event)
    refused = runtime_api.push({"handler": "refuses", "input": {"value": "x"}})
    unknown = runtime_api.push({"handler": "nope"})
    not_ours = runtime_api.push({"Records": []})
    no_job = runtime_api.push({"job": "does-not-exist", "wait_s": 0})

    posted = runtime_api.result(failing)
    assert posted.kind == "error"
    assert posted.headers["lambda-runtime-function-error-type"] == "ValueError"
    error = posted.json()
    assert error["errorType"] == "ValueError"
    assert error["errorMessage"] == "no luck"
    trace = "".join(error["stackTrace"])
    assert "tests/handlers/raises.py" in trace and "raise ValueError(message)" in trace
    # User frames only, and never a part of the event the handler did not put in its message.
    assert "/runtime/" not in trace and "concurrent/futures" not in trace
    assert "s3cr3t" not in posted.body.decode()
    # Thaw's own errors keep their slugs, a handler's InvalidInput included.
    invalid = runtime_api.result(refused).json()
    assert invalid["errorType"] == "invalid-input"
    assert invalid["errorMessage"] == "value: must be a number"
    assert "tests/handlers/refuses.py" in "".join(invalid["stackTrace"])
    assert runtime_api.result(unknown).json()["errorType"] == "unknown-handler"
    assert runtime_api.result(unknown).json()["stackTrace"] == []
    assert runtime_api.result(not_ours).json()["errorType"] == "invalid-event"
    assert runtime_api.result(no_job).json()["errorType"] == "unknown-job"


def test_import_failure_is_posted_to_init_error(
    start_runtime: Start, runtime_api: FakeRuntimeAPI
) -> None:
    process = start_runtime(THAW_HANDLERS="tests.handlers.import_fails")
    posted = runtime_api.init_error()
    error = posted.json()
    assert error["errorType"] == "config"
    assert "thaw_test_module_that_does_not_exist" in error["errorMessage"]
    assert posted.headers["lambda-runtime-function-error-type"] == "config"
    # User frames only: the failing module, never the runtime's own code.
    trace = "".join(error["stackTrace"])
    assert "tests/handlers/import_fails.py" in trace
    assert "/runtime/" not in trace
    assert process.wait() != 0


def test_one_module_that_fails_to_import_leaves_the_others_served(
    start_runtime: Start, runtime_api: FakeRuntimeAPI
) -> None:
    process = start_runtime(THAW_HANDLERS="tests.handlers.import_fails,handlers.echo")
    served = runtime_api.push({"handler": "echo", "input": {"a": 1}})
    assert runtime_api.result(served).json() == {"output": {"a": 1}}
    # No init error: the function's log names the module that is not served, and where.
    [said] = [line for line in process.log().splitlines() if "tests.handlers.import_fails" in line]
    assert orjson.loads(said)["level"] == "warning"
    assert "tests/handlers/import_fails.py:5): ModuleNotFoundError" in said


def test_http_event_round_trip_keeps_status_headers_and_body(
    start_runtime: Start, runtime_api: FakeRuntimeAPI
) -> None:
    start_runtime(THAW_HANDLERS=HANDLERS)
    payload = {"text": "héllo", "raw": [0, 255]}
    ok = runtime_api.push(
        http_event(
            "POST",
            "/invoke/echo",
            orjson.dumps(payload),
            rawQueryString="trace=1&trace=2",
            cookies=["session=abc", "theme=dark"],
            headers={"content-type": "application/json", "x-request-id": "req-42"},
        )
    )
    missing = runtime_api.push(http_event("GET", "/jobs/does-not-exist"))

    result = runtime_api.result(ok).json()
    assert result["statusCode"] == 200
    assert result["headers"]["content-type"] == "application/json"
    assert result["headers"]["x-request-id"] == "req-42"
    assert "run;dur=" in result["headers"]["server-timing"]
    body = result["body"]
    decoded = base64.b64decode(body) if result["isBase64Encoded"] else body.encode()
    assert orjson.loads(decoded) == payload

    problem = runtime_api.result(missing).json()
    assert problem["statusCode"] == 404
    assert problem["headers"]["content-type"] == "application/problem+json"
    assert orjson.loads(problem["body"])["type"].endswith("/unknown-job")


def test_an_answers_access_line_is_written_before_the_next_event_is_asked_for(
    start_runtime: Start, runtime_api: FakeRuntimeAPI
) -> None:
    # Asking for the next event may freeze the sandbox, and a frozen one may be
    # reaped unannounced: the line must not wait for the access log's window.
    runtime = start_runtime(THAW_HANDLERS=HANDLERS, THAW_LOG_LEVEL="INFO")
    asked = until(lambda: runtime_api.asks >= 1, "the first next")
    assert asked
    answered = runtime_api.push(
        http_event("POST", "/invoke/echo", b"{}", headers={"x-request-id": "before-next"})
    )
    assert runtime_api.result(answered).json()["statusCode"] == 200
    until(lambda: runtime_api.asks >= 2, "the next event asked for")
    runtime.kill()  # SIGKILL: no exit hook runs
    lines = [orjson.loads(line) for line in runtime.log().splitlines() if line.startswith("{")]
    access = [e for e in lines if e["logger"] == "thaw.access"]
    assert [e["request_id"] for e in access] == ["before-next"], access


def test_short_deadline_gives_a_job_that_ends_before_the_next_event(
    start_runtime: Start, runtime_api: FakeRuntimeAPI, tiny_bundles: Path
) -> None:
    start_runtime(THAW_HANDLERS=HANDLERS, THAW_BUNDLE_SOURCE=str(tiny_bundles))
    # Lambda allows 0.6 s; the model takes seconds to load: the answer must be a 202.
    cold = runtime_api.push(
        http_event("POST", "/invoke/predict", b'{"x": 2}', headers={"prefer": "wait=30"}),
        deadline_s=0.6,
    )
    result = runtime_api.result(cold).json()
    assert result["statusCode"] == 202
    location = result["headers"]["location"]
    assert location.startswith("/jobs/")
    assert int(result["headers"]["retry-after"]) >= 1
    job_id = location.removeprefix("/jobs/")

    # The job keeps running in the instance, and `next` waits for it: the
    # following event sees a finished job without waiting at all.
    poll = runtime_api.push({"job": job_id, "wait_s": 0})
    job = runtime_api.result(poll).json()
    assert job["status"] == "succeeded", job
    assert job["output"]["y"] != 0
    delivered_at = dict(runtime_api.deliveries)[poll]
    assert delivered_at >= runtime_api.result(cold).at


def test_direct_event_wait_s_gives_the_job_object(
    start_runtime: Start, runtime_api: FakeRuntimeAPI, tiny_bundles: Path
) -> None:
    process = start_runtime(THAW_HANDLERS=HANDLERS, THAW_BUNDLE_SOURCE=str(tiny_bundles))
    request_id = runtime_api.push({"handler": "predict", "input": {"x": 1}, "wait_s": 0.1})
    job = runtime_api.result(request_id).json()
    assert job["handler"] == "predict"
    assert job["status"] in {"queued", "running"}
    # Recognisable as a job (a sync Invoke's answer has no status code to say so),
    # with the event that polls it.
    assert job["thaw"] == "job" and job["poll"] == {"job": job["id"]}
    # And the function's log says so, in one line (logged before the answer was posted).
    [said] = [line for line in process.log().splitlines() if "poll it with" in line]
    assert f"answered with job {job['id']}" in said and "THAW_WAIT_S=" in said
    # The next event waits for the job, so the model is warm by then.
    warm = runtime_api.push({"handler": "predict", "input": {"x": 1}, "wait_s": 5})
    assert "y" in runtime_api.result(warm).json()["output"]


def test_concurrent_workers_share_one_model_load(
    start_runtime: Start, runtime_api: FakeRuntimeAPI, tiny_bundles: Path
) -> None:
    start_runtime(
        THAW_HANDLERS=HANDLERS,
        THAW_BUNDLE_SOURCE=str(tiny_bundles),
        AWS_LAMBDA_MAX_CONCURRENCY="4",
    )
    ids = [
        runtime_api.push({"handler": "predict", "input": {"x": i, "run_s": 0.2}, "wait_s": 20})
        for i in range(4)
    ]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        posted = list(pool.map(runtime_api.result, ids))
    outputs = [p.json()["output"] for p in posted]
    assert len({o["pid"] for o in outputs}) == 1
    assert sorted(o["y"] / outputs[1]["y"] for o in outputs[1:]) == [1.0, 2.0, 3.0]
    # All four were taken before the first answer: they ran side by side.
    first_answer = min(p.at for p in posted)
    assert all(at <= first_answer for _, at in runtime_api.deliveries[:4])
    loads = (tiny_bundles.parent / "loads.log").read_text().splitlines()
    assert len(loads) == 1


def _queue_depth(runtime_api: FakeRuntimeAPI, handler: str) -> float:
    """thaw_queue_depth{handler} read through a Function URL event (another slot)."""
    result = runtime_api.result(runtime_api.push(http_event("GET", "/metrics"))).json()
    body = result["body"]
    text = (base64.b64decode(body) if result["isBase64Encoded"] else body.encode()).decode()
    for line in text.splitlines():
        if line.startswith(f'thaw_queue_depth{{handler="{handler}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _until_queue_depth(runtime_api: FakeRuntimeAPI, handler: str, depth: float) -> None:
    for _ in range(2000):  # a hang guard, not a time bound
        if _queue_depth(runtime_api, handler) == depth:
            return
    raise AssertionError(f"{handler} never had {depth} requests in flight")


def test_concurrent_slots_are_batched_together(
    start_runtime: Start, runtime_api: FakeRuntimeAPI, tmp_path: Path
) -> None:
    """Invocations of one process's slots that arrive while a batch runs share the next."""
    start_runtime(THAW_HANDLERS="tests.handlers.batched", AWS_LAMBDA_MAX_CONCURRENCY="5")
    opened = tmp_path / "open"
    held = runtime_api.push(
        {"handler": "batch_gated", "input": {"id": 0, "hold_file": str(opened)}}
    )
    _until_queue_depth(runtime_api, "batch_gated", 1)  # the held batch runs
    rest = [runtime_api.push({"handler": "batch_gated", "input": {"id": i}}) for i in (1, 2, 3)]
    _until_queue_depth(runtime_api, "batch_gated", 4)  # the three wait behind it
    opened.touch()
    assert runtime_api.result(held).json()["output"]["batch"] == [0]
    outputs = [runtime_api.result(r).json()["output"] for r in rest]
    assert {o["size"] for o in outputs} == {3}
    assert sorted(outputs[0]["batch"]) == [1, 2, 3]
    assert [o["id"] for o in outputs] == [1, 2, 3], "each slot gets its own output"


def test_concurrent_slots_share_decode_steps(
    start_runtime: Start, runtime_api: FakeRuntimeAPI, tmp_path: Path
) -> None:
    """Sequences of a step-level handler from one process's slots share its decode
    steps (runtime/dispatch/decode.py), each slot answered with its own output."""
    start_runtime(THAW_HANDLERS="tests.handlers.stepped", AWS_LAMBDA_MAX_CONCURRENCY="4")
    opened = tmp_path / "open"
    first = {"name": "a", "n": 4, "hold_at": 2, "hold_file": str(opened), "sizes": True}
    held = runtime_api.push({"handler": "stepped", "input": first})
    _until_metric(runtime_api, _RUNNING, 1)  # prefilled: its second step holds
    rest = [
        runtime_api.push({"handler": "stepped", "input": {"name": n, "n": 3, "sizes": True}})
        for n in "bc"
    ]
    _until_metric(runtime_api, _RUNNING, 3)  # the two prefilled beside it
    opened.touch()
    outputs = [runtime_api.result(r).json()["output"] for r in (held, *rest)]
    assert [[step for step, _ in o] for o in outputs] == [[0, 1, 2, 3], [0, 1, 2], [0, 1, 2]]
    # Each one's first step is its own (after its prefill); then one step held all three.
    assert all(o[0][1] == 1 and 3 in [size for _, size in o] for o in outputs), outputs


def test_an_answer_over_lambdas_buffered_limit_is_never_posted(
    start_runtime: Start, runtime_api: FakeRuntimeAPI
) -> None:
    """Lambda would refuse it (and a Function URL's caller see a bare 502): the loop posts
    an answer that says why and names what carries it, on every buffered path."""
    start_runtime(THAW_HANDLERS="tests.handlers.sized")
    over = limits.MAX_RESPONSE_BYTES + 1
    body = orjson.dumps({"bytes": over})
    url = runtime_api.push(
        http_event("POST", "/invoke/sized", body, headers={"x-request-id": "big-1"})
    )
    direct = runtime_api.push({"handler": "sized", "input": {"bytes": over}})
    fits = runtime_api.push({"handler": "sized", "input": {"bytes": 1000}})

    posted = runtime_api.result(url)
    assert posted.kind == "response"
    assert len(posted.body) < limits.MAX_RESPONSE_BYTES
    result = posted.json()
    assert result["statusCode"] == 500
    assert result["headers"]["content-type"] == "application/problem+json"
    assert result["headers"]["x-request-id"] == "big-1"
    problem = orjson.loads(result["body"])
    assert problem["type"].endswith("/response-too-large")
    assert (
        "text/event-stream" in problem["detail"]
        and str(limits.MAX_RESPONSE_BYTES) in problem["detail"]
    )

    failed = runtime_api.result(direct)
    assert failed.kind == "error"
    assert failed.json()["errorType"] == "response-too-large"
    assert '"stream": true' in failed.json()["errorMessage"]
    assert runtime_api.result(fits).json() == {"output": {"blob": "x" * 1000}}


_RUNNING = 'thaw_decode_sequences{handler="stepped",state="running"}'


def _until_metric(runtime_api: FakeRuntimeAPI, series: str, value: float) -> None:
    """Until `series` (read through Function URL events, another slot) is `value`."""
    for _ in range(2000):  # a hang guard, not a time bound
        result = runtime_api.result(runtime_api.push(http_event("GET", "/metrics"))).json()
        body = result["body"]
        text = (base64.b64decode(body) if result["isBase64Encoded"] else body.encode()).decode()
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(series)]
        if values == [value]:
            return
    raise AssertionError(f"{series} never read {value}")
