"""The DynamoDB jobs table: its schema, and the service's attribute values and expressions.

template.yaml declares the same table (`table_spec`); the store
(runtime/jobs/stores/dynamodb.py) writes every value through `attribute` and
names every attribute of an expression through `expression_names`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import orjson
from botocore.exceptions import ClientError

from runtime.jobs.job import Job, JobStatus
from runtime.jobs.stores.payloads import FIELDS as PAYLOAD_FIELDS

ACTIVE_INDEX = "active-created_at"
TTL_ATTRIBUTE = "expires_at"
# The conditions of the store's writes.
STATES = {":queued": "queued", ":running": "running"}
OWNED = "#owner = :owner AND #status = :running"
# A run's fencing token (the claim's `attempts`), or None: any run of the owner's.
Fence = int | None


def owned(owner: str, attempt: Fence) -> tuple[str, dict[str, Any]]:
    """The condition (and its values) of a write only `owner`'s run `attempt` may make."""
    values = {":owner": owner} | STATES
    if attempt is None:
        return OWNED, values
    return f"{OWNED} AND #attempts = :attempt", values | {":attempt": attempt}


# Queued, or running with a lapsed lease (the SQLite store's WHERE clauses).
PENDING = (
    "#expires_at > :now AND (#status = :queued OR (#status = :running AND #lease_until < :now))"
)
CLAIMABLE = f"#attempts < :max AND {PENDING}"
LOST = "#status = :running AND #lease_until < :now AND #attempts >= :max"
# A running job of an owner known to be dead, whatever its lease.
ORPHANED = "#owner = :dead AND #status = :running AND #attempts < :max AND #expires_at > :now"
ORPHAN_LOST = "#owner = :dead AND #status = :running AND #attempts >= :max"
PING_KEY = "thaw:ping"


def table_spec(table_name: str) -> dict[str, Any]:
    """`CreateTable` arguments; template.yaml declares the same schema."""
    return {
        "TableName": table_name,
        "AttributeDefinitions": [
            {"AttributeName": "id", "AttributeType": "S"},
            {"AttributeName": "active", "AttributeType": "S"},
            {"AttributeName": "created_at", "AttributeType": "N"},
        ],
        "KeySchema": [{"AttributeName": "id", "KeyType": "HASH"}],
        "GlobalSecondaryIndexes": [
            {
                "IndexName": ACTIVE_INDEX,
                "KeySchema": [
                    {"AttributeName": "active", "KeyType": "HASH"},
                    {"AttributeName": "created_at", "KeyType": "RANGE"},
                ],
                "Projection": {
                    "ProjectionType": "INCLUDE",
                    "NonKeyAttributes": ["status", "lease_until", "expires_at"],
                },
            }
        ],
        "BillingMode": "PAY_PER_REQUEST",
    }


def attribute(value: Any) -> dict[str, Any]:
    """A Python value as a DynamoDB attribute value (numbers exact, via repr)."""
    if isinstance(value, dict):
        return value  # already an attribute value (a payload)
    if isinstance(value, str):
        return {"S": value}
    if isinstance(value, bytes):
        return {"B": value}
    if isinstance(value, int) and not isinstance(value, bool):
        return {"N": str(value)}
    return {"N": format(Decimal(repr(float(value))), "f")}


def expression_names(*expressions: str) -> dict[str, str]:
    return {f"#{w}": w for w in re.findall(r"#(\w+)", " ".join(expressions))}


def expression_values(values: dict[str, Any], *expressions: str) -> dict[str, Any]:
    """The placeholders the expressions use (DynamoDB refuses unused ones), as attributes."""
    used = set(re.findall(r":\w+", " ".join(expressions)))
    return {k: attribute(v) for k, v in values.items() if k in used}


def boto_client(service: str) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "standard", "max_attempts": 5}, read_timeout=20)
    session: Any = boto3.session.Session()  # untyped boundary: the service name is a variable
    return session.client(service, config=config)


def condition_failed(exc: ClientError) -> bool:
    code: object = exc.response.get("Error", {}).get("Code")
    return code == "ConditionalCheckFailedException"


def create_table(client: Any, table_name: str, *, wait: bool = True) -> None:
    """Create the jobs table with TTL on (emulator, tests; template.yaml on AWS)."""
    client.create_table(**table_spec(table_name))
    if wait:
        client.get_waiter("table_exists").wait(
            TableName=table_name, WaiterConfig={"Delay": 1, "MaxAttempts": 60}
        )
    client.update_time_to_live(
        TableName=table_name,
        TimeToLiveSpecification={"Enabled": True, "AttributeName": TTL_ATTRIBUTE},
    )


def job_of(item: dict[str, Any], blob: Callable[[dict[str, Any], str], bytes | None]) -> Job:
    """The job an item holds; `blob` reads a payload field's bytes (inline or from S3)."""

    def opt(name: str, kind: str) -> Any:
        return item[name][kind] if name in item else None

    payloads = {name: blob(item, name) for name in PAYLOAD_FIELDS}
    lease = opt("lease_until", "N")
    return Job(
        id=item["id"]["S"],
        handler=item["handler"]["S"],
        status=JobStatus(item["status"]["S"]),
        phase=item["phase"]["S"],
        attempts=int(Decimal(item["attempts"]["N"])),
        created_at=float(item["created_at"]["N"]),
        updated_at=float(item["updated_at"]["N"]),
        expires_at=float(item[TTL_ATTRIBUTE]["N"]),
        input=_parsed(payloads["input"]),
        output=_parsed(payloads["output"]),
        error=_parsed(payloads["error"]),
        owner=opt("owner", "S"),
        lease_until=None if lease is None else float(lease),
        key_id=opt("key_id", "S"),
        progress=_parsed(payloads["progress"]),
        payload_bytes=sum(len(b) for b in payloads.values() if b is not None),
    )


def _parsed(blob: bytes | None) -> Any:
    return None if blob is None else orjson.loads(blob)
