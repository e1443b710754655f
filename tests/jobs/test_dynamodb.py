"""What the DynamoDB store does beyond the shared contract: wiring, TTL, S3 payloads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from runtime.errors import ConfigError, PayloadTooLarge, StorageUnavailable
from runtime.jobs.job import Job, JobStatus, new_job_id
from runtime.jobs.store import open_store
from runtime.jobs.stores.dynamodb import TTL_ATTRIBUTE, DynamoDBJobStore
from tests import aws_fixtures
from tests.aws_fixtures import client, free_port, make_bucket, make_jobs_table

moto_endpoint = aws_fixtures.moto_endpoint  # fixtures: the session's moto server
aws_env = aws_fixtures.aws_env

BIG = {"blob": "x" * 450_000}


@pytest.fixture
def aws(moto_endpoint: str) -> dict[str, Any]:
    return {
        "table": make_jobs_table(moto_endpoint),
        "bucket": make_bucket(moto_endpoint),
        "ddb": client(moto_endpoint, "dynamodb"),
        "s3": client(moto_endpoint, "s3"),
    }


@pytest.fixture
def store(aws: dict[str, Any]) -> Iterator[DynamoDBJobStore]:
    store = DynamoDBJobStore(
        aws["table"], ttl_s=3600, bucket=aws["bucket"], client=aws["ddb"], s3_client=aws["s3"]
    )
    yield store
    store.close()


def keys(aws: dict[str, Any]) -> list[str]:
    listed = aws["s3"].list_objects_v2(Bucket=aws["bucket"])
    return sorted(obj["Key"] for obj in listed.get("Contents", []))


def item(aws: dict[str, Any], job_id: str) -> dict[str, Any]:
    found: dict[str, Any] = aws["ddb"].get_item(TableName=aws["table"], Key={"id": {"S": job_id}})
    stored: dict[str, Any] = found["Item"]
    return stored


def test_open_store_from_url_uses_the_standard_aws_environment(
    aws_env: str, aws: dict[str, Any]
) -> None:
    store = open_store(f"dynamodb://{aws['table']}?bucket={aws['bucket']}&prefix=jobs/", ttl_s=60)
    try:
        job = Job(id=new_job_id(), handler="echo", input=BIG)
        store.create(job)
        assert store.get(job.id) == job
    finally:
        store.close()


@pytest.mark.parametrize(
    "url",
    ["dynamodb://", "dynamodb://t", "dynamodb://table?bucket=b&region=x", "dynamodb://table/x"],
)
def test_bad_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        DynamoDBJobStore.from_url(url, ttl_s=60)


def test_prefix_is_normalised(aws_env: str) -> None:
    store = DynamoDBJobStore.from_url("dynamodb://table?bucket=b&prefix=/a/b", ttl_s=60)
    assert store.payloads.prefix == "a/b/" and store.payloads.bucket == "b"
    store.close()


def test_expires_at_is_whole_epoch_seconds_and_the_ttl_attribute(
    store: DynamoDBJobStore, aws: dict[str, Any]
) -> None:
    job = Job(id=new_job_id(), handler="echo", input={})
    store.create(job)
    raw = item(aws, job.id)[TTL_ATTRIBUTE]["N"]
    assert float(raw) == int(float(raw)) == job.expires_at
    ttl = aws["ddb"].describe_time_to_live(TableName=aws["table"])["TimeToLiveDescription"]
    assert ttl["AttributeName"] == TTL_ATTRIBUTE and ttl["TimeToLiveStatus"] == "ENABLED"


def test_large_payloads_live_in_s3_under_the_prefix(
    store: DynamoDBJobStore, aws: dict[str, Any]
) -> None:
    job = Job(id=new_job_id(), handler="echo", input=BIG)
    store.create(job)
    assert store.claim(job.id, "a", 30, 3) is not None
    assert store.finish(job.id, "a", JobStatus.SUCCEEDED, BIG)
    stored = item(aws, job.id)
    assert "input" not in stored and "output" not in stored
    assert stored["output_ref"]["S"].startswith(f"jobs/{job.id}/output-")
    assert [k.rpartition("-")[0] for k in keys(aws)] == [
        f"jobs/{job.id}/input",
        f"jobs/{job.id}/output",
    ]


@pytest.mark.parametrize("big_input", [False, True], ids=["inline input", "input in S3"])
def test_finish_reads_back_nothing_it_stored(
    store: DynamoDBJobStore, aws: dict[str, Any], big_input: bool
) -> None:
    """`finish` answers with the record it wrote (ReturnValues=ALL_NEW), its output and
    error taken from the bytes it just stored: a large output costs no S3 GET and no
    download after its upload. Only an input kept in S3 is read, as `get` would."""
    gets: list[str] = []
    aws["s3"].meta.events.register(
        "before-parameter-build.s3.GetObject", lambda params, **_: gets.append(params["Key"])
    )
    job = Job(id=new_job_id(), handler="echo", input=BIG if big_input else {"x": 1})
    store.create(job)
    assert store.claim(job.id, "a", 30, 3) is not None
    gets.clear()  # the claim reads the input, for the run it hands out
    finished = store.finish(job.id, "a", JobStatus.SUCCEEDED, {"out": "y" * 300_000})
    assert [key.rpartition("-")[0] for key in gets] == (
        [f"jobs/{job.id}/input"] if big_input else []
    )
    assert item(aws, job.id)["output_ref"]["S"].startswith(f"jobs/{job.id}/output-")
    assert finished is not None and finished == store.get(job.id)
    assert finished.output == {"out": "y" * 300_000}


def test_small_payloads_stay_inline(store: DynamoDBJobStore, aws: dict[str, Any]) -> None:
    job = Job(id=new_job_id(), handler="echo", input={"x": 0.1})
    store.create(job)
    assert item(aws, job.id)["input"]["B"] == b'{"x":0.1}'
    assert keys(aws) == []


def test_a_writer_that_loses_drops_its_s3_object(
    store: DynamoDBJobStore, aws: dict[str, Any]
) -> None:
    job = Job(id=new_job_id(), handler="echo", input={})
    store.create(job)
    store.claim(job.id, "a", 30, 3)
    assert not store.finish(job.id, "intruder", JobStatus.SUCCEEDED, BIG)
    assert not store.set_phase(job.id, "intruder", "run", {"p": "y" * 20_000})
    assert keys(aws) == []


def test_a_duplicate_create_leaves_no_s3_object(
    store: DynamoDBJobStore, aws: dict[str, Any]
) -> None:
    job = Job(id=new_job_id(), handler="echo", input={})
    store.create(job)
    with pytest.raises(Exception, match="already exists"):
        store.create(Job(id=job.id, handler="echo", input=BIG))
    assert keys(aws) == []


def test_without_a_bucket_large_payloads_are_refused(aws: dict[str, Any]) -> None:
    store = DynamoDBJobStore(aws["table"], ttl_s=60, client=aws["ddb"])
    job = Job(id=new_job_id(), handler="echo", input=BIG)
    with pytest.raises(PayloadTooLarge):
        store.create(job)
    assert store.get(job.id) is None


def test_purge_removes_the_s3_payloads_of_expired_jobs(aws: dict[str, Any]) -> None:
    store = DynamoDBJobStore(
        aws["table"], ttl_s=-1, bucket=aws["bucket"], client=aws["ddb"], s3_client=aws["s3"]
    )
    store.create(Job(id=new_job_id(), handler="echo", input=BIG))
    assert len(keys(aws)) == 1
    assert store.purge_expired() == 1
    assert keys(aws) == []


def test_an_unreachable_table_is_storage_unavailable() -> None:
    """Nothing listens on the endpoint: every call is a 503 storage-unavailable with
    Retry-After, translated once from botocore's error."""
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError

    config = Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=2)
    dead = client(f"http://127.0.0.1:{free_port()}", "dynamodb", config=config)
    store = DynamoDBJobStore("thaw-jobs", ttl_s=60, client=dead)
    job = Job(id=new_job_id(), handler="echo", input={})
    for call in (
        lambda: store.create(job),
        lambda: store.get(job.id),
        lambda: store.finish(job.id, "a", JobStatus.SUCCEEDED, {}),
        lambda: store.ping("a"),
        lambda: store.owned("a"),
        lambda: store.lapsed(),
    ):
        with pytest.raises(StorageUnavailable) as caught:
            call()
        assert caught.value.status == 503 and caught.value.slug == "storage-unavailable"
        assert caught.value.retry_after_s is not None
        assert isinstance(caught.value.__cause__, BotoCoreError)
    dead.close()
