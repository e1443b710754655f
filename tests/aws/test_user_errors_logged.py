"""The Lambda loop logs user code's exception once, at ERROR, as one JSON record with
the user's frames (the function's log is where a Lambda user looks), while the
posted Lambda error carries the stackTrace; a builder's exception is load-failed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson

from runtime.bundles.manifest import build_bundle
from tests.aws.conftest import LambdaProcess
from tests.aws.fake_runtime_api import FakeRuntimeAPI

ROOT = Path(__file__).resolve().parents[2]
HANDLERS = "tests.handlers.raises,tests.handlers.builder_raises"


def error_records(log: str) -> list[dict[str, object]]:
    records = [orjson.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [r for r in records if r["level"] == "error"]


def test_each_user_exception_is_one_error_record(
    start_runtime: Callable[..., LambdaProcess], runtime_api: FakeRuntimeAPI, tmp_path: Path
) -> None:
    source = tmp_path / "config.json"
    source.write_text("{}")
    build_bundle(source, "builder-raises", out=tmp_path / "bundles" / "builder-raises")
    process = start_runtime(THAW_HANDLERS=HANDLERS, THAW_BUNDLE_SOURCE=str(tmp_path / "bundles"))
    raised = runtime_api.push({"handler": "raises", "input": {"message": "no luck"}})
    assert runtime_api.result(raised).json()["errorType"] == "ValueError"
    load = runtime_api.push({"handler": "builder_raises", "input": {}})
    error = runtime_api.result(load).json()
    assert error["errorType"] == "load-failed"
    assert "tests/handlers/builder_raises.py" in "".join(error["stackTrace"])
    log = process.log()
    handler, builder = error_records(log)
    assert handler["handler"] == "raises"
    assert f'File "{ROOT}/tests/handlers/raises.py", line 13' in str(handler["traceback"])
    assert builder["bundle"] == "builder-raises"
    assert f'File "{ROOT}/tests/handlers/builder_raises.py", line 13' in str(builder["traceback"])
    assert "no luck" not in log
