"""The job's wire form: its times as RFC 3339, as datetime writes them."""

from __future__ import annotations

import random
from datetime import UTC, datetime

from runtime.jobs.job import Job, JobStatus, rfc3339


def by_datetime(epoch_s: float) -> str:
    return (
        datetime.fromtimestamp(epoch_s, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def test_rfc3339_writes_what_datetime_writes() -> None:
    edges = [
        0.0,
        1.0,
        1.9995,
        -0.5,
        -1.0000004,
        1796083200.0,
        1796083199.9995,
        1796083199.9999995,  # rounds up into the next second
        1800080908.5939994,  # a product epoch * 1e6 would round the other way
        2**31 + 0.25,
    ]
    seeded = random.Random(29)
    sample = [seeded.uniform(-1e9, 4e9) for _ in range(20_000)]
    sample += [1.8e9 + seeded.random() * 100 for _ in range(20_000)]  # many in one second
    for epoch_s in edges + sample:
        assert rfc3339(epoch_s) == by_datetime(epoch_s), epoch_s


def test_a_job_just_created_shows_one_time_for_both_stamps() -> None:
    job = Job(id="j", handler="echo", input={}, created_at=1796083200.25, updated_at=1796083200.25)
    body = job.public()
    assert body["created_at"] == body["updated_at"] == "2026-12-01T00:00:00.250Z"
    job.status, job.updated_at, job.output = JobStatus.SUCCEEDED, 1796083201.5, {"y": 1}
    body = job.public()
    assert body["updated_at"] == "2026-12-01T00:00:01.500Z" and body["output"] == {"y": 1}
