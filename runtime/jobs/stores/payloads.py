"""Job payloads (input, output, error, progress) for a store with an item size limit.

A DynamoDB item holds at most 400 KB. Each payload is serialized with orjson
(floats round-trip exactly; no Decimal) and kept inline when it is small, or
written to `s3://bucket/<prefix><job id>/<field>-<random>.json` with the item
holding the key. The per-field limits add up to less than an item, whatever
mix of payloads a job carries. A key is never reused, so a writer that loses a
conditional update deletes its own object and cannot clobber the winner's.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import orjson
from botocore.exceptions import BotoCoreError, ClientError

from runtime.errors import PayloadTooLarge, StorageUnavailable, Unavailable
from runtime.jobs.job import STORE_RETRY_AFTER_S

# Largest inline serialized payload per field; their sum stays well under 400 KB.
INLINE_LIMITS = {"input": 180_000, "output": 180_000, "error": 16_000, "progress": 16_000}
FIELDS = tuple(INLINE_LIMITS)


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """AWS errors -> StorageUnavailable, once, at the boundary."""
    try:
        yield
    except (ClientError, BotoCoreError) as exc:
        raise StorageUnavailable(
            f"job store: {what} failed: {exc}", retry_after_s=STORE_RETRY_AFTER_S
        ) from exc


class Stored(NamedTuple):
    """A payload as an item holds it: the attribute (`field` or `field_ref`), its value,
    and the serialized bytes (inline, or the S3 object's body)."""

    attribute: str
    value: dict[str, Any]
    blob: bytes


NONE_WRITTEN: Mapping[str, bytes | None] = MappingProxyType({})


class Payloads:
    """Inline-or-S3 storage of job payloads; `s3` is None when no bucket is configured."""

    def __init__(self, s3: Any, bucket: str | None, prefix: str) -> None:
        self.s3 = s3 if bucket is not None else None
        self.bucket = bucket
        self.prefix = prefix

    def store(self, job_id: str, field: str, value: Any) -> Stored | None:
        """The attribute for `value` (inline bytes or an S3 key), and its bytes."""
        if value is None:
            return None
        blob = orjson.dumps(value)
        if len(blob) <= INLINE_LIMITS[field]:
            return Stored(field, {"B": blob}, blob)
        if self.s3 is None:
            raise PayloadTooLarge(
                f"job {field} is {len(blob)} bytes; large payloads need THAW_JOB_STORE ?bucket="
            )
        key = f"{self.prefix}{job_id}/{field}-{secrets.token_hex(8)}.json"
        assert key.startswith(self.prefix) and "/../" not in key
        with translated(f"storing the {field} of job {job_id}"):
            self.s3.put_object(
                Bucket=self.bucket, Key=key, Body=blob, ContentType="application/json"
            )
        return Stored(f"{field}_ref", {"S": key}, blob)

    def update(
        self, job_id: str, sets: dict[str, Any], removes: list[str], field: str, value: Any
    ) -> bytes | None:
        """An update's `field` set to `value` (stored inline or in S3) and its other form
        removed; the bytes stored (None for none)."""
        stored = self.store(job_id, field, value)
        if stored is not None:
            sets[stored.attribute] = stored.value
        removes.extend(
            a for a in (field, f"{field}_ref") if stored is None or a != stored.attribute
        )
        return None if stored is None else stored.blob

    def blob(
        self, item: dict[str, Any], field: str, written: Mapping[str, bytes | None] = NONE_WRITTEN
    ) -> bytes | None:
        """The serialized payload `field` of `item` (None for none): inline, from S3, or,
        for a field in `written` (the bytes the caller has just stored), those bytes: a
        write reads back nothing it wrote (an S3 GET and download of a large output)."""
        if field in written:
            return written[field]
        if field in item:
            inline: bytes = item[field]["B"]
            return inline
        ref = item.get(f"{field}_ref")
        if ref is None:
            return None
        if self.s3 is None:
            raise Unavailable(f"job store: {field} is in S3 but no bucket is configured")
        with translated(f"reading the {field} of job {item['id']['S']}"):
            response = self.s3.get_object(Bucket=self.bucket, Key=ref["S"])
            with contextlib.closing(response["Body"]) as body:
                read: bytes = body.read()
                return read

    def drop(self, attributes: dict[str, dict[str, Any]]) -> None:
        """Delete the S3 objects named by `*_ref` attributes (a lost race, a failed write)."""
        for name, value in attributes.items():
            if name.endswith("_ref") and self.s3 is not None:
                with contextlib.suppress(ClientError, BotoCoreError):
                    self.s3.delete_object(Bucket=self.bucket, Key=value["S"])

    def drop_job(self, job_id: str) -> None:
        """Delete every object of one job."""
        if self.s3 is None:
            return
        pages = self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}{job_id}/"
        )
        for page in pages:
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if keys:
                self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
