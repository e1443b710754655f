"""The loop's deadline arithmetic and Prefer rewriting, without a process."""

from __future__ import annotations

import pytest

from runtime.aws.lambda_loop import budget_s, prefer_with_wait
from runtime.http.prefer import parse_prefer
from runtime.wire.render import user_frames


def test_no_deadline_header_means_no_lambda_limit() -> None:
    assert budget_s(0, 1_700_000_000.0) == float("inf")
    assert "wait=10.000" in prefer_with_wait(None, limit_s=float("inf"), default_s=10.0)


@pytest.mark.parametrize(
    ("remaining_s", "expected_s"),
    [
        (1.0, 0.8),  # the 0.2 s floor
        (10.0, 9.5),  # 5 %
        (900.0, 899.0),  # the 1 s cap
        (0.1, 0.0),  # already too late: answer at once
        (-5.0, 0.0),
    ],
)
def test_budget_is_time_left_less_the_margin(remaining_s: float, expected_s: float) -> None:
    now_s = 1_700_000_000.0
    deadline_ms = int((now_s + remaining_s) * 1000)
    assert budget_s(deadline_ms, now_s) == pytest.approx(expected_s, abs=0.002)


@pytest.mark.parametrize(
    ("prefer", "expected_wait_s", "respond_async"),
    [
        (None, 4.0, False),  # no caller wait: THAW_WAIT_S (10) capped by Lambda (4)
        ("wait=2", 2.0, False),  # the caller's is smaller
        ("wait=60", 4.0, False),  # Lambda's is smaller
        ("respond-async, wait=1", 1.0, True),
        ("handling=lenient", 4.0, False),
    ],
)
def test_prefer_wait_is_the_smaller_deadline(
    prefer: str | None, expected_wait_s: float, respond_async: bool
) -> None:
    rewritten = prefer_with_wait(prefer, limit_s=4.0, default_s=10.0)
    parsed = parse_prefer([rewritten])
    assert parsed.wait_s == pytest.approx(expected_wait_s)
    assert parsed.respond_async is respond_async


def test_an_unparsable_wait_is_left_for_the_app_to_refuse() -> None:
    assert "wait=soon" in prefer_with_wait("wait=soon", limit_s=4.0, default_s=10.0)


def test_user_frames_leave_out_the_runtime() -> None:
    from runtime.registry import discover

    with pytest.raises(Exception) as info:
        discover(["tests.handlers.import_fails"])
    frames = user_frames(info.value)
    assert any("tests/handlers/import_fails.py" in f for f in frames)
    assert not any("/runtime/" in f or "importlib" in f for f in frames)
