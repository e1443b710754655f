"""Jobs in one DynamoDB table (payloads too large for an item in S3).

Same contract and semantics as the SQLite store; how they map here:

- One item per job, hash key `id`. Every state change is one `UpdateItem`
  whose `ConditionExpression` is the SQLite store's WHERE clause, so two
  instances never both own a job: DynamoDB applies a single-item write
  atomically, and a failed condition is SQLite's "0 rows updated".
- `expires_at` is a Number of whole epoch seconds, the table's TTL attribute.
  TTL deletion is lazy (up to days late), so `get()`, `claim()` and `lapsed()`
  treat an item past `expires_at` as absent; `purge_expired()` deletes now.
- `input`, `output`, `error` and `progress` are orjson bytes in Binary
  attributes, or S3 objects when too large for an item (`payloads.py`).
  Timestamps are Numbers written from `repr(float)`, so they read back equal.
- `lapsed()` queries a *sparse* GSI, `active-created_at`: `active` exists only
  while a job is queued or running, so the index holds just those, oldest
  first, and the query never reads finished jobs (a Scan would read them all).
  The index is eventually consistent, which is enough: it only nominates
  candidates, and `claim()` decides. All active jobs share one index key,
  which caps index writes near 1000/s, far above a function's job rate.
- `owned()` lists the running jobs of one owner: the active index nominates
  the running ones, and a consistent `BatchGetItem` of their owners picks them.
  Only an instance that finds a dead owner on its node asks (at start-up).
- `ping()`: an `UpdateItem` of an absent item, conditional on its existing (a write).
- Service errors become `StorageUnavailable`; a duplicate id in `create()` is `Conflict`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any
from urllib.parse import parse_qs, urlsplit

import orjson
from botocore.exceptions import ClientError

from runtime.clock import SYSTEM, Clock
from runtime.errors import ConfigError, Conflict
from runtime.jobs.job import Job, JobStatus, cancelled_error, lost_error
from runtime.jobs.stores.dynamodb_table import (
    ACTIVE_INDEX,
    CLAIMABLE,
    LOST,
    ORPHAN_LOST,
    ORPHANED,
    PENDING,
    PING_KEY,
    STATES,
    TTL_ATTRIBUTE,
    Fence,
    attribute,
    boto_client,
    condition_failed,
    create_table,
    expression_names,
    expression_values,
    job_of,
    owned,
    table_spec,
)
from runtime.jobs.stores.not_now import NOT_NOW, NotNow, T
from runtime.jobs.stores.payloads import FIELDS, Payloads, translated

__all__ = ["ACTIVE_INDEX", "TTL_ATTRIBUTE", "DynamoDBJobStore", "table_spec"]


class DynamoDBJobStore:
    """The JobStore contract on DynamoDB (+ S3 for large payloads)."""

    def __init__(
        self,
        table: str,
        *,
        ttl_s: float,
        clock: Clock = SYSTEM,
        bucket: str | None = None,
        prefix: str = "jobs/",
        client: Any = None,
        s3_client: Any = None,
    ) -> None:
        self.table = table
        self.ttl_s = ttl_s
        # Items hold epoch seconds (TTL, leases other instances compare): the wall clock.
        self.clock = clock
        self._owned: list[Any] = []
        if client is None:
            client = boto_client("dynamodb")
            self._owned.append(client)
        if s3_client is None and bucket is not None:
            s3_client = boto_client("s3")
            self._owned.append(s3_client)
        self.client = client
        self.payloads = Payloads(s3_client, bucket, prefix)

    @classmethod
    def from_url(cls, url: str, *, ttl_s: float, clock: Clock = SYSTEM) -> DynamoDBJobStore:
        """`dynamodb://table?bucket=name&prefix=jobs/`; the endpoint is AWS_ENDPOINT_URL's."""
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        if parts.scheme != "dynamodb" or not re.fullmatch(r"[A-Za-z0-9_.-]{3,255}", parts.netloc):
            raise ConfigError(f"THAW_JOB_STORE={url!r}: expected dynamodb://table?bucket=name")
        unknown = sorted(set(query) - {"bucket", "prefix"}) or ([parts.path] if parts.path else [])
        if unknown:
            raise ConfigError(f"THAW_JOB_STORE={url!r}: unknown part {unknown[0]!r}")
        prefix = query.get("prefix", ["jobs"])[0].strip("/")
        return cls(
            parts.netloc,
            ttl_s=ttl_s,
            clock=clock,
            bucket=query.get("bucket", [None])[0],
            prefix=f"{prefix}/" if prefix else "",
        )

    @classmethod
    def create_table(cls, client: Any, table_name: str, *, wait: bool = True) -> None:
        """Create the jobs table with TTL on (emulator, tests; template.yaml on AWS)."""
        create_table(client, table_name, wait=wait)

    def _update(
        self,
        job_id: str,
        sets: dict[str, Any],
        removes: list[str],
        condition: str,
        values: dict[str, Any],
        *,
        increment: str | None = None,
        return_new: bool = False,
    ) -> dict[str, Any] | None:
        """One conditional UpdateItem; None when the condition did not hold."""
        assignments = [f"#{k} = :set_{k}" for k in sets]
        if increment:
            assignments.append(f"#{increment} = #{increment} + :one")
            values = {**values, ":one": 1}
        expression = f"SET {', '.join(assignments)}"
        if removes:
            expression += f" REMOVE {', '.join(f'#{k}' for k in removes)}"
        attribute_values = {f":set_{k}": v for k, v in sets.items()} | values
        args: dict[str, Any] = {
            "TableName": self.table,
            "Key": {"id": {"S": job_id}},
            "UpdateExpression": expression,
            "ConditionExpression": condition,
            "ExpressionAttributeNames": expression_names(expression, condition),
            "ExpressionAttributeValues": expression_values(attribute_values, expression, condition),
            "ReturnValues": "ALL_NEW" if return_new else "NONE",
        }
        with translated(f"updating job {job_id}"):
            try:
                attributes: dict[str, Any] = self.client.update_item(**args).get("Attributes", {})
            except ClientError as exc:
                if condition_failed(exc):
                    return None
                raise
        return attributes

    def _owned_update(
        self, job_id: str, owner: str, sets: dict[str, Any], removes: list[str], attempt: Fence,
        return_new: bool = False,
    ) -> dict[str, Any] | None:  # fmt: skip
        """An update only the running job's owner (with `attempt`: that run of it) may
        make; drops its S3 objects if refused. The item's attributes (all of them as
        written with `return_new`), or None when refused."""
        condition, values = owned(owner, attempt)
        try:
            done = self._update(job_id, sets, removes, condition, values, return_new=return_new)
        except BaseException:
            self.payloads.drop(sets)
            raise
        if done is None:
            self.payloads.drop(sets)
        return done

    def create_many(self, jobs: Sequence[Job]) -> list[Conflict | None]:
        """One conditional put per job: DynamoDB batches take no conditions."""
        outcomes: list[Conflict | None] = []
        for job in jobs:
            try:
                self.create(job)
            except Conflict as conflict:
                outcomes.append(conflict)
            else:
                outcomes.append(None)
        return outcomes

    def create(self, job: Job) -> None:
        now = self.clock.wall()
        job.created_at = job.updated_at = now
        job.expires_at = float(math.ceil(now + self.ttl_s))
        fields: dict[str, Any] = {
            "id": job.id,
            "handler": job.handler,
            "status": str(job.status),
            "phase": job.phase,
            "attempts": job.attempts,
            "created_at": now,
            "updated_at": now,
            TTL_ATTRIBUTE: job.expires_at,
            "active": None if job.status.final else "1",
            "owner": job.owner,
            "key_id": job.key_id,
            "lease_until": job.lease_until,
        }
        item = {k: attribute(v) for k, v in fields.items() if v is not None}
        blobs: dict[str, Any] = {}
        try:
            for field in FIELDS:
                stored = self.payloads.store(job.id, field, getattr(job, field))
                if stored is not None:
                    item[stored.attribute] = blobs[stored.attribute] = stored.value
            with translated(f"creating job {job.id}"):
                try:
                    self.client.put_item(
                        TableName=self.table,
                        Item=item,
                        ConditionExpression="attribute_not_exists(#id)",
                        ExpressionAttributeNames={"#id": "id"},
                    )
                except ClientError as exc:
                    if condition_failed(exc):
                        raise Conflict(f"job id {job.id!r} already exists") from exc
                    raise
        except BaseException:
            self.payloads.drop(blobs)
            raise

    def get(self, job_id: str) -> Job | None:
        with translated(f"reading job {job_id}"):
            response = self.client.get_item(
                TableName=self.table, Key={"id": {"S": job_id}}, ConsistentRead=True
            )
        item = response.get("Item")
        if item is None or float(item[TTL_ATTRIBUTE]["N"]) <= self.clock.wall():
            return None
        return job_of(item, self.payloads.blob)

    def claim(self, job_id: str, owner: str, lease_s: float, max_attempts: int) -> Job | None:
        values = {":max": max_attempts, ":now": self.clock.wall()} | STATES
        return self._take(job_id, owner, lease_s, max_attempts, CLAIMABLE, LOST, values)

    def claim_orphan(
        self, job_id: str, dead_owner: str, owner: str, lease_s: float, max_attempts: int
    ) -> Job | None:
        values = {":max": max_attempts, ":now": self.clock.wall(), ":dead": dead_owner} | STATES
        return self._take(job_id, owner, lease_s, max_attempts, ORPHANED, ORPHAN_LOST, values)

    def _take(
        self,
        job_id: str,
        owner: str,
        lease_s: float,
        max_attempts: int,
        claimable: str,
        lost: str,
        values: dict[str, Any],
    ) -> Job | None:
        """Claim the job if `claimable` holds; else fail it as lost if `lost` holds."""
        now = values[":now"]
        claimed = self._update(
            job_id,
            {
                "status": "running",
                "owner": owner,
                "lease_until": now + lease_s,
                "phase": "claimed",
                "updated_at": now,
            },
            ["error", "error_ref"],
            claimable,
            values,
            increment="attempts",
            return_new=True,
        )
        if claimed is not None:
            return job_of(claimed, self.payloads.blob)
        self._update(
            job_id,
            {
                "status": "failed",
                "phase": "failed",
                "error": orjson.dumps(lost_error(max_attempts)),
                "updated_at": now,
            },
            ["owner", "active", "error_ref"],
            lost,
            values,
        )
        return None

    def owned(self, owner: str, limit: int = 100) -> list[str]:
        running = self._active("#status = :running", {":running": "running"})
        found: list[str] = []
        # BatchGetItem takes at most 100 keys; the index gives them oldest first.
        for start in range(0, len(running), 100):
            owners = self._owners_of(running[start : start + 100])
            found.extend(i for i in running[start : start + 100] if owners.get(i) == owner)
            if len(found) >= limit:
                break
        return found[:limit]

    def _owners_of(self, ids: list[str]) -> dict[str, str | None]:
        """Owner per job id, read consistently (the index holds no owner)."""
        owners: dict[str, str | None] = {}
        keys: list[dict[str, Any]] = [{"id": {"S": i}} for i in ids]
        with translated("reading job owners"):
            while keys:
                response = self.client.batch_get_item(
                    RequestItems={
                        self.table: {
                            "Keys": keys,
                            "ConsistentRead": True,
                            "ProjectionExpression": "#id, #owner, #status",
                            "ExpressionAttributeNames": expression_names("#id #owner #status"),
                        }
                    }
                )
                for item in response.get("Responses", {}).get(self.table, []):
                    running = item.get("status", {}).get("S") == "running"
                    owners[item["id"]["S"]] = item.get("owner", {}).get("S") if running else None
                keys = response.get("UnprocessedKeys", {}).get(self.table, {}).get("Keys", [])
        return owners

    def ping(self, owner: str) -> None:
        self._update(PING_KEY, {"owner": owner}, [], "attribute_exists(#id)", {})

    def heartbeat(self, job_id: str, owner: str, lease_s: float, *, attempt: Fence = None) -> bool:
        # A job that is still being worked on must not expire under its worker.
        now = self.clock.wall()
        sets = {"lease_until": now + lease_s, TTL_ATTRIBUTE: float(math.ceil(now + self.ttl_s))}
        return self._owned_update(job_id, owner, sets, [], attempt) is not None

    def set_phase(
        self, job_id: str, owner: str, phase: str, progress: Any = None, *, attempt: Fence = None
    ) -> bool:
        sets: dict[str, Any] = {"phase": phase, "updated_at": self.clock.wall()}
        removes: list[str] = []
        self.payloads.update(job_id, sets, removes, "progress", progress)
        return self._owned_update(job_id, owner, sets, removes, attempt) is not None

    def finish(
        self, job_id: str, owner: str, status: JobStatus, output: Any = None,
        error: dict[str, Any] | None = None, *, attempt: Fence = None,
    ) -> Job | None:  # fmt: skip
        if not status.final:
            raise ValueError(f"finish() needs a final status, got {status}")
        now = self.clock.wall()
        sets: dict[str, Any] = {
            "status": str(status),
            "phase": str(status),
            "updated_at": now,
            # Results are kept for the TTL counted from when the job ended.
            TTL_ATTRIBUTE: float(math.ceil(now + self.ttl_s)),
        }
        removes = ["lease_until", "progress", "progress_ref", "active"]
        written = {"output": self.payloads.update(job_id, sets, removes, "output", output)}
        try:
            written["error"] = self.payloads.update(job_id, sets, removes, "error", error)
        except BaseException:
            self.payloads.drop(sets)
            raise
        # The item as written comes back with the write: no read (a billed call) after
        # it, and its output and error are the bytes just stored, not read back from S3.
        item = self._owned_update(job_id, owner, sets, removes, attempt, return_new=True)
        if item is None:
            return None
        return job_of(item, partial(self.payloads.blob, written=written))

    def cancel(self, job_id: str) -> Job | None:
        self._update(
            job_id,
            {
                "status": "cancelled",
                "phase": "cancelled",
                "error": orjson.dumps(cancelled_error()),
                "updated_at": self.clock.wall(),
            },
            ["output", "output_ref", "error_ref", "active"],
            "#status IN (:queued, :running)",
            STATES,
        )
        return self.get(job_id)

    def lapsed(self, limit: int = 100) -> list[str]:
        return self._active(PENDING, {":now": self.clock.wall()} | STATES, limit)

    def _active(self, only: str, values: dict[str, Any], limit: int | None = None) -> list[str]:
        """Ids of active (queued or running) jobs matching `only`, oldest first."""
        keys = "#active = :one"
        values = {":one": "1"} | values
        ids: list[str] = []
        with translated("listing active jobs"):
            pages = self.client.get_paginator("query").paginate(
                TableName=self.table,
                IndexName=ACTIVE_INDEX,
                KeyConditionExpression=keys,
                FilterExpression=only,
                ExpressionAttributeNames=expression_names(keys, only),
                ExpressionAttributeValues=expression_values(values, keys, only),
                ScanIndexForward=True,
            )
            for page in pages:
                ids.extend(item["id"]["S"] for item in page.get("Items", []))
                if limit is not None and len(ids) >= limit:
                    break
        return ids if limit is None else ids[:limit]

    def purge_expired(self) -> int:
        """Delete expired items now (TTL does, much later) and their S3 payloads. A Scan."""
        expired = "#expires_at <= :now"
        names, values = expression_names(expired, "#id"), {":now": attribute(self.clock.wall())}
        purged = 0
        with translated("purging expired jobs"):
            pages = self.client.get_paginator("scan").paginate(
                TableName=self.table,
                FilterExpression=expired,
                ProjectionExpression="#id",
                ExpressionAttributeNames=names,
                ExpressionAttributeValues=values,
            )
            for item in (item for page in pages for item in page.get("Items", [])):
                try:
                    self.client.delete_item(
                        TableName=self.table,
                        Key={"id": item["id"]},
                        ConditionExpression=expired,
                        ExpressionAttributeNames=expression_names(expired),
                        ExpressionAttributeValues=values,
                    )
                except ClientError as exc:
                    if not condition_failed(exc):
                        raise
                    continue
                purged += 1
                self.payloads.drop_job(item["id"]["S"])
        return purged

    def now(self, call: Callable[[], T], *, writes: bool) -> T | NotNow:
        return NOT_NOW  # over a network: a call may always wait

    def close(self) -> None:
        for client in self._owned:
            client.close()
        self._owned.clear()
