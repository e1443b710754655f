"""The S3 bundle source against a moto server: fetch, verify, cache, stalls.

A real three-shard safetensors bundle is built in tmp_path and uploaded. Requests
are counted with a botocore event hook on the client the test hands the
source (its constructor seam); stalls come from a real misbehaving proxy.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.bundles.manifest import MANIFEST, Manifest, build_bundle
from runtime.bundles.sources import open_source
from runtime.bundles.sources.nodecache import MARKER
from runtime.bundles.sources.s3 import S3Source, make_client, parse_url
from runtime.bundles.verify import verify_bundle
from runtime.errors import BundleError, ConfigError, IntegrityError, LoadFailed, UnknownBundle
from tests import aws_fixtures
from tests.aws_fixtures import CREDENTIALS, client, make_bucket
from tests.bundles.sources.s3_proxy import misbehaving_proxy
from tests.jobs.tmpfs import fill, mounted
from tests.support import settings_for

moto_endpoint = aws_fixtures.moto_endpoint  # fixtures: the session's moto server
aws_env = aws_fixtures.aws_env

PART = 64 * 1024  # small ranges, so every shard is fetched as several parallel GETs
CHUNK = 16 * 1024
# The stall limit in the proxy tests: several times any pause a loaded CI machine
# puts between two reads of a healthy stream (the trickle pauses 0.2 s).
STALL_S = 1.0
NAME = "tiny"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three real safetensors shards (~130-200 KB each) plus a config file."""
    src = tmp_path_factory.mktemp("tiny-src")
    generator = torch.Generator().manual_seed(0)
    for index, rows in enumerate((128, 160, 200)):
        tensors = {
            f"layer{index}.weight": torch.randn(rows, 256, generator=generator),
            f"layer{index}.bias": torch.randn(256, generator=generator),
        }
        save_file(tensors, str(src / f"model-{index:05d}-of-00003.safetensors"))
    (src / "config.json").write_text('{"hidden": 256}')
    return src


@pytest.fixture
def uploaded(moto_endpoint: str, shards: Path, tmp_path: Path) -> tuple[str, Manifest, Path]:
    """(bucket, manifest, local copy) with the bundle at s3://bucket/bundles/tiny/."""
    local = tmp_path / "tiny"
    manifest = build_bundle(shards, NAME, version="1", out=local)
    bucket = make_bucket(moto_endpoint)
    s3 = client(moto_endpoint, "s3")
    for path in [MANIFEST, *(f.path for f in manifest.files)]:
        s3.put_object(Bucket=bucket, Key=f"bundles/{NAME}/{path}", Body=(local / path).read_bytes())
    s3.put_object(Bucket=bucket, Key="bundles/README.txt", Body=b"not a bundle")
    s3.put_object(Bucket=bucket, Key="bundles/junk/notes.txt", Body=b"no manifest here")
    return bucket, manifest, local


class Counter:
    """Counts HTTP requests a client sends, by operation (a botocore event hook)."""

    def __init__(self, s3: Any) -> None:
        self.ops: list[str] = []
        self._lock = threading.Lock()
        s3.meta.events.register("before-send.s3", self._count)

    def _count(self, event_name: str, **_: Any) -> None:
        with self._lock:
            self.ops.append(event_name.rpartition(".")[2])  # before-send.s3.<Operation>

    def gets(self) -> int:
        return self.ops.count("GetObject")


def source(bucket: str, cache: Path, s3: Any, **kwargs: Any) -> S3Source:
    kwargs.setdefault("part_bytes", PART)
    kwargs.setdefault("chunk_bytes", CHUNK)
    kwargs.setdefault("backoff_s", 0.05)
    return S3Source(bucket, "bundles/", cache, client=s3, concurrency=4, **kwargs)


def ranges(manifest: Manifest, part: int = PART) -> int:
    return sum(math.ceil(f.size / part) for f in manifest.files)


def files_in(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file()) if directory.exists() else []


def progress_sink() -> tuple[list[int], Callable[[int], None]]:
    seen: list[int] = []
    return seen, seen.append


def test_names_and_manifest(moto_endpoint: str, uploaded: Any, tmp_path: Path) -> None:
    bucket, manifest, _ = uploaded
    src = source(bucket, tmp_path / "cache", client(moto_endpoint, "s3"))
    assert src.names() == [NAME]
    assert src.manifest(NAME) == manifest
    assert src.describe() == f"s3://{bucket}/bundles/"
    for missing in ("nope", "junk", "../tiny", "a/b", ".hidden", ""):
        with pytest.raises(UnknownBundle):
            src.manifest(missing)


def test_fetch_downloads_in_parallel_ranges_verifies_and_caches(
    moto_endpoint: str, uploaded: Any, tmp_path: Path
) -> None:
    bucket, manifest, local = uploaded
    s3 = client(moto_endpoint, "s3")
    counter = Counter(s3)
    src = source(bucket, tmp_path / "cache", s3)
    seen, report = progress_sink()
    directory = src.fetch(manifest, report)
    assert directory == tmp_path / "cache" / NAME / manifest.id.partition(":")[2]
    assert counter.gets() == ranges(manifest) > len(manifest.files)
    assert sum(seen) == manifest.total_bytes
    for f in manifest.files:
        assert (directory / f.path).read_bytes() == (local / f.path).read_bytes()
    assert verify_bundle(directory) == manifest  # bundle.json written; marker ignored
    assert (directory / MARKER).read_text().strip() == manifest.id
    for f in manifest.files:
        if f.path.endswith(".safetensors"):
            loaded = load_file(str(directory / f.path))
            expected = load_file(str(local / f.path))
            assert loaded.keys() == expected.keys()
            assert all(torch.equal(loaded[k], expected[k]) for k in loaded)
    assert not [p for p in files_in(tmp_path / "cache") if ".thaw-tmp-" in p.name]
    assert [p.name for p in files_in(tmp_path / "cache") if p.suffix == ".lock"] == []


def test_a_second_instance_reuses_the_cache_without_downloading(
    moto_endpoint: str, uploaded: Any, tmp_path: Path
) -> None:
    bucket, manifest, _ = uploaded
    cache = tmp_path / "cache"
    source(bucket, cache, client(moto_endpoint, "s3")).fetch(manifest, lambda n: None)
    s3 = client(moto_endpoint, "s3")
    counter = Counter(s3)
    second = source(bucket, cache, s3)
    current = second.manifest(NAME)
    assert counter.ops == ["GetObject"]  # only bundle.json
    seen, report = progress_sink()
    directory = second.fetch(current, report)
    assert counter.ops == ["GetObject"]  # fetch sent no request at all
    assert sum(seen) == manifest.total_bytes
    assert verify_bundle(directory) == manifest


def test_a_half_populated_cache_is_completed_not_redownloaded(
    moto_endpoint: str, uploaded: Any, tmp_path: Path
) -> None:
    bucket, manifest, _ = uploaded
    cache = tmp_path / "cache"
    directory = source(bucket, cache, client(moto_endpoint, "s3")).fetch(manifest, lambda n: None)
    # What a fetch killed mid-way leaves: no marker, one file missing, a temp file.
    (directory / MARKER).unlink()
    lost = next(f for f in manifest.files if f.path.endswith(".safetensors"))
    (directory / lost.path).unlink()
    (directory / ".thaw-tmp-0-1-2").write_bytes(b"partial")
    s3 = client(moto_endpoint, "s3")
    counter = Counter(s3)
    again = source(bucket, cache, s3).fetch(manifest, lambda n: None)
    assert again == directory
    assert counter.gets() == math.ceil(lost.size / PART)
    assert not (directory / ".thaw-tmp-0-1-2").exists()
    assert verify_bundle(directory) == manifest


def test_two_instances_fetching_at_once_download_once(
    moto_endpoint: str, uploaded: Any, tmp_path: Path
) -> None:
    bucket, manifest, _ = uploaded
    cache = tmp_path / "cache"
    clients = [client(moto_endpoint, "s3") for _ in range(2)]
    counters = [Counter(s3) for s3 in clients]
    barrier = threading.Barrier(2)
    results: list[Path] = []

    def fetch(s3: Any) -> None:
        barrier.wait()
        results.append(source(bucket, cache, s3).fetch(manifest, lambda n: None))

    threads = [threading.Thread(target=fetch, args=(s3,)) for s3 in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 2 and results[0] == results[1]
    assert sum(c.gets() for c in counters) == ranges(manifest)


@pytest.mark.parametrize("tamper", ["flip", "truncate", "extend"])
def test_a_tampered_object_is_refused_and_nothing_is_cached(
    moto_endpoint: str, uploaded: Any, tmp_path: Path, tamper: str
) -> None:
    bucket, manifest, local = uploaded
    victim = manifest.files[1]
    data = bytearray((local / victim.path).read_bytes())
    if tamper == "flip":
        data[len(data) // 2] ^= 0xFF
    elif tamper == "truncate":
        del data[-PART:]
    else:
        data += b"\0" * 10
    s3 = client(moto_endpoint, "s3")
    s3.put_object(Bucket=bucket, Key=f"bundles/{NAME}/{victim.path}", Body=bytes(data))
    with pytest.raises(IntegrityError) as caught:
        source(bucket, tmp_path / "cache", s3).fetch(manifest, lambda n: None)
    assert victim.path in caught.value.message
    assert list((tmp_path / "cache").iterdir()) == []  # not even an empty directory


def test_a_missing_object_is_a_bundle_error(
    moto_endpoint: str, uploaded: Any, tmp_path: Path
) -> None:
    bucket, manifest, _ = uploaded
    s3 = client(moto_endpoint, "s3")
    s3.delete_object(Bucket=bucket, Key=f"bundles/{NAME}/{manifest.files[0].path}")
    with pytest.raises(BundleError, match="missing"):
        source(bucket, tmp_path / "cache", s3).fetch(manifest, lambda n: None)
    assert files_in(tmp_path / "cache") == []


def test_a_bundle_the_cache_cannot_hold_fails_before_a_byte_is_fetched(
    moto_endpoint: str, uploaded: Any, tmp_path: Path
) -> None:
    """The node cache's filesystem has less room than the bundle: the fetch says so,
    with the sizes, before any download (it would fill the disk the job store and
    the platform share), and succeeds once the room is there."""
    bucket, manifest, _ = uploaded
    with mounted(tmp_path / "cache", "2m") as cache:
        filler = fill(cache)
        with filler.open("r+b") as out:  # leave about half of what the bundle needs
            out.truncate(filler.stat().st_size - manifest.total_bytes // 2)
        s3 = client(moto_endpoint, "s3")
        counter = Counter(s3)
        src = source(bucket, cache, s3)
        with pytest.raises(LoadFailed, match=r"needs [\d.]+ MiB in the node cache") as caught:
            src.fetch(manifest, lambda n: None)
        assert "THAW_CACHE_DIR" in caught.value.message
        assert caught.value.extra["free_bytes"] < manifest.total_bytes
        assert counter.gets() == 0
        assert files_in(cache) == [filler]
        filler.unlink()
        directory = src.fetch(manifest, lambda n: None)
        assert verify_bundle(directory) == manifest
        assert counter.gets() == ranges(manifest)


def test_a_disk_that_fills_mid_fetch_fails_the_load_and_keeps_nothing(
    moto_endpoint: str, uploaded: Any, tmp_path: Path
) -> None:
    """Room at the start, none once the first range is asked for (another writer
    filled the disk): the load fails naming the full cache, not an internal
    OSError, nothing of the fetch is left, and the next fetch succeeds."""
    bucket, manifest, local = uploaded
    with mounted(tmp_path / "cache", "2m") as cache:
        s3 = client(moto_endpoint, "s3")
        filled: list[Path] = []
        lock = threading.Lock()

        def fill_once(**_: Any) -> None:
            with lock:
                if not filled:
                    filled.append(fill(cache))

        s3.meta.events.register("before-send.s3.GetObject", fill_once)
        src = source(bucket, cache, s3)
        with pytest.raises(LoadFailed, match="the disk filled while bundle 'tiny'"):
            src.fetch(manifest, lambda n: None)
        assert files_in(cache) == filled  # the filler alone: no partial file, no marker
        s3.meta.events.unregister("before-send.s3.GetObject", fill_once)
        filled[0].unlink()
        directory = src.fetch(manifest, lambda n: None)
        for f in manifest.files:
            assert (directory / f.path).read_bytes() == (local / f.path).read_bytes()


def _proxied(url: str, stall_s: float) -> Any:
    return make_client(stall_s=stall_s, concurrency=4, endpoint_url=url, **CREDENTIALS)


def test_a_stalled_transfer_is_aborted_and_resumed(
    moto_endpoint: str, uploaded: Any, tmp_path: Path
) -> None:
    bucket, manifest, local = uploaded
    largest = max(manifest.files, key=lambda f: f.size)
    victim, size = largest.path, largest.size

    def plan(method: str, path: str, attempt: int) -> str:
        return "stall" if path.endswith(victim) and attempt == 1 else "pass"

    with misbehaving_proxy(moto_endpoint, plan) as (url, proxy):
        src = source(bucket, tmp_path / "cache", _proxied(url, STALL_S), part_bytes=2**30)
        started = time.monotonic()
        directory = src.fetch(manifest, lambda n: None)
        elapsed = time.monotonic() - started
        gets = proxy.gets(victim)
    assert len(gets) == 2
    assert gets[0].range == f"bytes=0-{size - 1}"
    resumed_at = (size // 3) // CHUNK * CHUNK  # after the last whole chunk before the stall
    assert gets[1].range == f"bytes={resumed_at}-{size - 1}"
    assert (directory / victim).read_bytes() == (local / victim).read_bytes()
    # It waited out the stall limit before giving up on the stalled GET (resumed above).
    assert elapsed >= STALL_S


def test_a_slow_but_progressing_transfer_is_not_aborted(
    moto_endpoint: str, uploaded: Any, tmp_path: Path
) -> None:
    bucket, manifest, local = uploaded
    victim = max(manifest.files, key=lambda f: f.size).path

    def plan(method: str, path: str, attempt: int) -> str:
        return "trickle" if path.endswith(victim) else "pass"

    with misbehaving_proxy(moto_endpoint, plan) as (url, proxy):
        src = source(bucket, tmp_path / "cache", _proxied(url, STALL_S), part_bytes=2**30)
        started = time.monotonic()
        directory = src.fetch(manifest, lambda n: None)
        elapsed = time.monotonic() - started
        gets = proxy.gets(victim)
    assert len(gets) == 1
    assert elapsed > 2 * STALL_S  # longer than the stall limit, yet never cut
    assert (directory / victim).read_bytes() == (local / victim).read_bytes()


def test_a_transfer_that_never_recovers_fails_cleanly(
    moto_endpoint: str, uploaded: Any, tmp_path: Path
) -> None:
    bucket, manifest, _ = uploaded
    largest = max(manifest.files, key=lambda f: f.size)
    only_victim = dataclasses.replace(manifest, files=(largest,))

    def plan(method: str, path: str, attempt: int) -> str:
        return "dead" if path.endswith(largest.path) else "pass"

    with misbehaving_proxy(moto_endpoint, plan) as (url, proxy):
        src = source(
            bucket, tmp_path / "cache", _proxied(url, STALL_S), part_bytes=2**30, max_attempts=2
        )
        with pytest.raises(LoadFailed, match="no progress"):
            src.fetch(only_victim, lambda n: None)
        assert len(proxy.gets(largest.path)) == 2
    assert files_in(tmp_path / "cache") == []


def test_from_settings_and_open_source(aws_env: str, tmp_path: Path) -> None:
    settings = settings_for(
        tmp_path, bundle_source="s3://models/prod/bundles/", cache_dir=str(tmp_path)
    )
    src = open_source(settings)
    assert isinstance(src, S3Source)
    assert (src.bucket, src.prefix, src.cache_dir) == ("models", "prod/bundles/", tmp_path)
    assert src.concurrency == settings.fetch_concurrency


@pytest.mark.parametrize(
    ("url", "expected"),
    [("s3://b", ("b", "")), ("s3://b/", ("b", "")), ("s3://b/p/q", ("b", "p/q/"))],
)
def test_parse_url(url: str, expected: tuple[str, str]) -> None:
    assert parse_url(url) == expected


@pytest.mark.parametrize("url", ["s3://", "s3:///p", "s3://b/../x", "s3://b/a//c", "http://b"])
def test_parse_url_refuses(url: str) -> None:
    with pytest.raises(ConfigError):
        parse_url(url)
