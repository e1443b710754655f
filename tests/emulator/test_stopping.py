"""Stopping `thaw emulate` with an instance running prints no traceback: each sandbox's
runtime is answered 410 Gone on its long-poll for the next event (and signalled),
and ends quietly (runtime/aws/lambda_api.py's RuntimeAPIGone).

Here a sandbox is a process the SIGTERM ends first; in a container (`--image`),
PID 1 ignores it and the 410 is what ends the runtime: tests/deploy/test_image.py
checks that stop's stderr too, and tests/aws/test_stopping.py the 410 itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.emulator.conftest import Emulator, emulator_env, wait_for


@pytest.mark.process
def test_stopping_the_emulator_with_instances_running_prints_no_traceback(
    tmp_path: Path,
) -> None:
    emulator = Emulator(tmp_path, emulator_env(tmp_path), "--max-sandboxes", "2")
    try:
        answer = emulator.invoke("ThawFunction", b'{"handler": "echo", "input": 1}')
        assert answer.json() == {"output": 1}, answer.text
        # The instance is up and waiting for its next event.
        emulator.report(answer.headers["x-amzn-requestid"])
        wait_for(lambda: "ready:" in emulator.errors())
    finally:
        code = emulator.stop()
    errors = emulator.errors()
    assert code == 0, errors
    assert "Traceback" not in errors, errors
