"""An environment being stopped is no fault: `next` answered 410 Gone (what `thaw
emulate` answers a sandbox it stops; an image's PID 1 ignores the SIGTERM beside
it), then nobody listening, ends the Lambda loop with exit 0 and no traceback."""

from __future__ import annotations

from collections.abc import Callable

from tests.aws.conftest import LambdaProcess
from tests.aws.fake_runtime_api import FakeRuntimeAPI
from tests.support import until


def test_a_410_on_next_ends_the_loop_quietly(
    start_runtime: Callable[..., LambdaProcess], runtime_api: FakeRuntimeAPI
) -> None:
    process = start_runtime(THAW_HANDLERS="tests.handlers.echo")
    served = runtime_api.push({"handler": "echo", "input": {"a": 1}})
    assert runtime_api.result(served).json() == {"output": {"a": 1}}
    # The instance runs, long-polling for its next event, when the API stops it.
    until(lambda: runtime_api.asks >= 2, "the next event asked for")
    runtime_api.gone()
    assert process.wait() == 0, process.log()
    log = process.log()
    assert "Traceback" not in log and "410" in log, log
