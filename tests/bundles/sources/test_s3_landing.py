"""A fresh node's first load from S3 lands each part in memory as it arrives.

Each test runs the fetch and the load in a fresh process (a child, against the
session's moto server), where torch is still to import, as on a fresh node: the
fetch writes the node cache and lands every part in the memory the tensors keep
(runtime/bundles/sources/arrival.py), checking each chunk as it completes. The
load then reads nothing back: its own reads (/proc/self/io `rchar`, counted
around the load alone) stay far below the shards' bytes, where a load of the
same cache in a process that imported torch first (no landing) reads them all.
A part with one flipped byte fails the fetch naming the file and the chunk, and
nothing of it stays in the node cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from runtime.bundles.manifest import MANIFEST, Manifest
from tests import aws_fixtures
from tests.aws_fixtures import client, make_bucket
from tests.models.test_verified_weights import CHUNK, expected, write_bundle

moto_endpoint = aws_fixtures.moto_endpoint  # fixtures: the session's moto server

ROOT = Path(__file__).resolve().parents[3]
PART = 256 * 1024  # ranges four to a chunk, fetched four at a time: they arrive out of order

_CHILD = """
import json, sys
from pathlib import Path
endpoint, bucket, cache, first = sys.argv[1:5]
if first == "torch":
    import torch  # imported first: no landing, the load reads the cache
from runtime.bundles.sources.s3 import S3Source
from runtime.errors import IntegrityError
from tests.aws_fixtures import client

source = S3Source(
    bucket, "bundles/", Path(cache), client=client(endpoint, "s3"),
    concurrency=4, part_bytes=PART, backoff_s=0.05,
)
manifest = source.manifest("wsum_a")
report = {}
try:
    fetched = source.fetch_for_load(manifest, lambda n: None)
except IntegrityError as exc:
    report.update(error=str(exc), extra=exc.extra)
    print(json.dumps(report))
    sys.exit(0)
landing = fetched.pending.landing
report["landing"] = landing is not None
# Shards landed as their parts arrived (none is left to read from the node cache).
report["arrived"] = sorted(rel for rel, s in getattr(landing, "shards", {}).items() if s.arrived)
import torch
from runtime.models import weights
from tests.handlers.weights_sum import describe

def rchar():
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("rchar")).split()[1])

before = rchar()
loaded = weights.open_weights(
    fetched.directory, manifest, "cpu", fetched.stamps, pending=fetched.pending
)
report["load_read"] = rchar() - before
report["weights"] = describe(loaded.take())
print(json.dumps(report))
""".replace("PART", str(PART))


def upload(endpoint: str, local: Path, manifest: Manifest, damage: dict[str, int]) -> str:
    """The bundle at s3://bucket/bundles/wsum_a/ (a byte flipped at `damage[path]`)."""
    bucket = make_bucket(endpoint)
    s3 = client(endpoint, "s3")
    for path in [MANIFEST, *(f.path for f in manifest.files)]:
        body = bytearray((local / path).read_bytes())
        if path in damage:
            body[damage[path]] ^= 0x10
        s3.put_object(Bucket=bucket, Key=f"bundles/wsum_a/{path}", Body=bytes(body))
    return bucket


def child(endpoint: str, bucket: str, cache: Path, first: str = "fetch") -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, endpoint, bucket, str(cache), first],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return report


def shard_bytes(manifest: Manifest) -> int:
    return sum(f.size for f in manifest.files if f.path.endswith(".safetensors"))


def test_the_first_load_after_an_s3_fetch_reads_nothing_back(
    moto_endpoint: str, tmp_path: Path
) -> None:
    manifest = write_bundle(tmp_path / "bundles", "wsum_a", shards=2, seed=11)
    local = tmp_path / "bundles" / "wsum_a"
    bucket = upload(moto_endpoint, local, manifest, {})
    cache = tmp_path / "cache"
    fresh = child(moto_endpoint, bucket, cache)
    assert fresh["landing"] is True
    shards = sorted(f.path for f in manifest.files if f.path.endswith(".safetensors"))
    assert fresh["arrived"] == shards  # every part landed as it arrived: nothing to read
    assert fresh["weights"] == expected(local, manifest)
    # The load's reads: the shards' headers (opened and checked), not their bytes.
    assert fresh["load_read"] < shard_bytes(manifest) // 16
    # The same cache loaded where torch came first (no landing): every byte is read.
    control = child(moto_endpoint, bucket, cache, first="torch")
    assert control["landing"] is False
    assert control["arrived"] == []
    assert control["load_read"] >= shard_bytes(manifest)
    assert control["weights"] == fresh["weights"]


def test_a_part_with_a_flipped_byte_fails_naming_file_and_chunk(
    moto_endpoint: str, tmp_path: Path
) -> None:
    manifest = write_bundle(tmp_path / "bundles", "wsum_a", shards=2, seed=12)
    local = tmp_path / "bundles" / "wsum_a"
    victim = manifest.files[1].path
    bucket = upload(moto_endpoint, local, manifest, {victim: 2 * CHUNK + 777})
    cache = tmp_path / "cache"
    report = child(moto_endpoint, bucket, cache)
    assert report["extra"] == {"file": victim, "chunk": 2}
    assert f"{victim}: sha256 mismatch in chunk 2" in report["error"]
    assert not list(cache.rglob("*.safetensors"))
