"""Bundles in S3 (`s3://bucket/prefix`), fetched into the node cache.

A bundle lives at `<prefix>/<name>/bundle.json` plus its files. Fetching makes
every file local and verified in the node cache (`nodecache.py`), where a
later instance on the node (a new Lambda sandbox reusing /tmp, a restarted
container) finds it complete and downloads nothing.

Why it is built this way:

- Files are cut into ranges of `part_bytes` and all ranges of all files are
  fetched by `fetch_concurrency` threads; one S3 stream is slower than the
  network, many are not.
- sha256 is computed while streaming: each file's hash follows the contiguous
  prefix that has reached disk (`transfer.FileTransfer`); bytes that arrive
  out of order are read back from the page cache when the prefix reaches them.
- Data goes to a temporary name and is renamed only once its hash matched; a
  marker holding the manifest id is written last. A later fetch that finds
  the marker and every file at its size uses them as they are (re-hashing
  would read every byte again). A directory without a matching marker is
  half-populated (a killed fetch): its renamed files were verified once and
  are re-hashed, not downloaded again.
- A per-version lock (flock) makes two processes on one node fetch once; the
  second waits and then finds the marker.
- Stalls: the client's socket read timeout is `fetch_stall_s`, and it bounds
  each `recv`, not the transfer, so a silent stream is aborted while a slow
  but progressing one never is. An aborted range is retried from the last
  byte written, with jittered back-off; retries reset whenever a try made
  progress. botocore's own (standard mode) retries cover the request itself.
- For a load while the framework is still to import (landing.py), each part
  of a shard also lands in the memory its tensors will keep as it arrives, and
  each chunk is checked from there once whole (arrival.py); shards found in the
  node cache are read into memory during the import. The load reads nothing back.
- Any failure removes everything this fetch wrote. Errors are translated once,
  here: UnknownBundle (no manifest), IntegrityError (size or hash), BundleError
  (a listed file is missing), LoadFailed (S3 unreachable after retries).

boto3 is imported only by this module, and this module only when an s3://
source is configured.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from runtime.bundles.chunks import Fetched, Pending
from runtime.bundles.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    BundleFile,
    Manifest,
    parse_manifest,
)
from runtime.bundles.sources import arrival, nodecache
from runtime.bundles.sources.arrival import ArrivingShard
from runtime.bundles.sources.landing import Landing, load_dtype
from runtime.bundles.sources.source import Progress
from runtime.bundles.sources.transfer import FileTransfer
from runtime.bundles.stamps import shard_stamps
from runtime.errors import BundleError, ConfigError, LoadFailed, UnknownBundle
from runtime.settings import Settings

PART_BYTES = 64 * 1024 * 1024
# One read from a stream. A stall loses at most the chunk in progress: the retry
# resumes after the last whole chunk written.
CHUNK_BYTES = 256 * 1024
_MISSING = frozenset({"NoSuchKey", "NoSuchBucket", "404", "NotFound"})
_RETRYABLE = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
        "RequestTimeTooSkewed",
    }
)


def make_client(*, stall_s: float, concurrency: int, **client_kwargs: Any) -> Any:
    """An S3 client whose socket read timeout is the stall limit.

    The endpoint comes from AWS_ENDPOINT_URL (boto3 reads it) unless
    `endpoint_url` is passed; tests pass explicit endpoint and credentials.
    """
    import boto3
    from botocore.config import Config

    config = Config(
        # Each botocore try of a silent request costs a stall period; our own retries
        # (around body stalls too) multiply with these, so keep them few.
        retries={"mode": "standard", "max_attempts": 3},
        connect_timeout=stall_s,
        read_timeout=stall_s,
        max_pool_connections=max(10, concurrency + 2),
        tcp_keepalive=True,
    )
    return boto3.session.Session().client("s3", config=config, **client_kwargs)


def parse_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix` -> ("bucket", "some/prefix/")."""
    if not url.startswith("s3://"):
        raise ConfigError(f"THAW_BUNDLE_SOURCE={url!r}: expected s3://bucket/prefix")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket or "/" in bucket:
        raise ConfigError(f"THAW_BUNDLE_SOURCE={url!r}: no bucket name")
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ConfigError(f"THAW_BUNDLE_SOURCE={url!r}: prefix has an empty or dot segment")
    return bucket, f"{prefix}/" if prefix else ""


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


@dataclass
class _Part:
    """One byte range [start, end) of one file; `pos` is the next byte to write."""

    transfer: FileTransfer
    start: int
    end: int
    pos: int


class _Retry(Exception):
    """A transient failure of one range; the caller backs off and resumes."""


class S3Source:
    """Bundles under one S3 prefix, cached on the node."""

    def __init__(
        self,
        bucket: str,
        prefix: str,
        cache_dir: Path,
        *,
        client: Any = None,
        concurrency: int = 8,
        stall_s: float = 30.0,
        part_bytes: int = PART_BYTES,
        chunk_bytes: int = CHUNK_BYTES,
        max_attempts: int = 5,
        backoff_s: float = 0.5,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self.cache_dir = cache_dir
        self.concurrency = max(1, concurrency)
        self.part_bytes = max(1, part_bytes)
        self.chunk_bytes = max(1, chunk_bytes)
        self.max_attempts = max(1, max_attempts)
        self.backoff_s = backoff_s
        # The seam: tests pass a client (their own endpoint, an event hook).
        self.client = client or make_client(stall_s=stall_s, concurrency=self.concurrency)
        # Versions this process uses, manifest id -> the descriptor of its hold
        # (nodecache.hold): from its fetch until `release`.
        self._held: dict[str, int] = {}
        self._held_lock = threading.Lock()
        # Landings not yet let go of, by manifest id (`release` discards what the load left).
        self._landings: dict[str, Landing] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> S3Source:
        bucket, prefix = parse_url(settings.bundle_source)
        return cls(
            bucket,
            prefix,
            settings.cache_path,
            concurrency=settings.fetch_concurrency,
            stall_s=settings.fetch_stall_s,
        )

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def _key(self, name: str, rel: str) -> str:
        if not name or "/" in name or name.startswith("."):
            raise UnknownBundle(f"no bundle named {name!r}")
        key = f"{self.prefix}{name}/{rel}"
        if not key.startswith(self.prefix) or ".." in key.split("/"):
            raise BundleError(f"{rel!r}: key escapes the bundle prefix")
        return key

    def names(self) -> list[str]:
        found: list[str] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix
            )
            for page in pages:
                for item in page.get("Contents", []):
                    name, _, rest = str(item["Key"])[len(self.prefix) :].partition("/")
                    if rest == MANIFEST and name:
                        found.append(name)
        except (ClientError, BotoCoreError) as exc:
            raise LoadFailed(f"cannot list {self.describe()}: {exc}") from exc
        return sorted(found)

    def manifest(self, name: str) -> Manifest:
        key = self._key(name, MANIFEST)
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            with contextlib.closing(response["Body"]) as body:
                raw: bytes = body.read(MAX_MANIFEST_BYTES + 1)
        except ClientError as exc:
            if _error_code(exc) in _MISSING:
                raise UnknownBundle(f"no bundle named {name!r} in {self.describe()}") from exc
            raise LoadFailed(f"cannot read s3://{self.bucket}/{key}: {exc}") from exc
        except BotoCoreError as exc:
            raise LoadFailed(f"cannot read s3://{self.bucket}/{key}: {exc}") from exc
        manifest = parse_manifest(raw)
        if manifest.name != name:
            raise BundleError(
                f"s3://{self.bucket}/{key}: names {manifest.name!r}, expected {name!r}"
            )
        return manifest

    def fetch(self, manifest: Manifest, on_progress: Progress) -> Path:
        return self._fetch(manifest, on_progress, None)

    def _fetch(
        self,
        manifest: Manifest,
        on_progress: Progress,
        arrivals: dict[str, ArrivingShard] | None,
    ) -> Path:
        directory = nodecache.version_dir(self.cache_dir, manifest)
        lock = threading.Lock()

        def report(n_bytes: int) -> None:
            with lock:  # callers may keep a plain counter; worker threads call this
                on_progress(n_bytes)

        self._hold(manifest, directory)
        try:
            fetched = False
            if not nodecache.is_complete(directory, manifest):
                with nodecache.filling(self.cache_dir, manifest):
                    if not nodecache.is_complete(directory, manifest):  # not done while we waited
                        self._populate(directory, manifest, report, arrivals)
                        fetched = True
            if not fetched:
                for f in manifest.files:
                    report(f.size)
        except BaseException:
            self.release(manifest)
            raise
        # The bundle's other versions, unless a process (this one too) still holds them.
        nodecache.prune(self.cache_dir, manifest)
        return directory

    def fetch_for_load(self, manifest: Manifest, on_progress: Progress) -> Fetched:
        """`fetch`: every file is hashed as its parts arrive, nothing is left to the load's
        checks. While the framework is still to import, the shards land in memory too
        (`Fetched.pending.landing`): as their parts arrive, or read from the node cache."""
        arrivals = arrival.arrivals_for(self.cache_dir, manifest)
        try:
            directory = self._fetch(manifest, on_progress, arrivals)
            pending = Pending(landing=arrival.settle(directory, manifest, arrivals))
        except BaseException:
            for arriving in (arrivals or {}).values():
                arriving.close()
            raise
        if pending.landing is not None:
            old = self._landings.pop(manifest.id, None)
            if old is not None:
                old.discard()
            self._landings[manifest.id] = pending.landing  # type: ignore[assignment]
        stamps = shard_stamps(directory, [f.path for f in manifest.files])
        return Fetched(directory, stamps, pending)

    def release(self, manifest: Manifest) -> None:
        landing = self._landings.pop(manifest.id, None)
        if landing is not None:
            landing.discard()
        with self._held_lock:
            fd = self._held.pop(manifest.id, None)
        if fd is not None:
            os.close(fd)

    def _hold(self, manifest: Manifest, directory: Path) -> None:
        with self._held_lock:
            if manifest.id in self._held:
                return
        fd = nodecache.hold(directory)
        with self._held_lock:
            if manifest.id in self._held:  # held meanwhile by another thread of ours
                os.close(fd)
            else:
                self._held[manifest.id] = fd

    def _populate(
        self,
        directory: Path,
        manifest: Manifest,
        report: Progress,
        arrivals: dict[str, ArrivingShard] | None,
    ) -> None:
        """Fetch what is missing, marker last; on failure remove it all. Needs the node lock."""
        try:
            self._fetch_missing(directory, manifest, report, arrivals)
        except BaseException as exc:
            nodecache.discard(directory)
            full = nodecache.out_of_room(exc, directory, manifest)
            if full is not None:
                raise full from exc
            raise

    def _fetch_missing(
        self,
        directory: Path,
        manifest: Manifest,
        report: Progress,
        arrivals: dict[str, ArrivingShard] | None,
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / nodecache.MARKER).unlink(missing_ok=True)
        for stale in directory.glob(f"{FileTransfer.TMP_PREFIX}*"):
            stale.unlink()  # left by a killed fetch; we hold the lock, so no one owns them
        missing: list[tuple[int, BundleFile]] = []
        for index, f in enumerate(manifest.files):
            final = directory / f.path
            if FileTransfer.already_verified(final, f):  # half-populated dir
                report(f.size)
                continue
            final.unlink(missing_ok=True)
            missing.append((index, f))
        nodecache.ensure_room(directory, manifest, [f for _, f in missing])
        transfers: list[FileTransfer] = []
        try:
            dtype = load_dtype(manifest)[1]
            for index, f in missing:
                key = self._key(manifest.name, f.path)
                sink = None
                if arrivals is not None and f.path.endswith(".safetensors"):
                    entry = f if f.chunks else None
                    sink = arrivals[f.path] = ArrivingShard(f.path, f.size, entry, dtype)
                transfers.append(FileTransfer(f, directory / f.path, directory, index, key, sink))
            self._download(transfers, report)
        finally:
            for transfer in transfers:
                transfer.discard()
        nodecache.mark_complete(directory, manifest)

    def _download(self, transfers: list[FileTransfer], report: Progress) -> None:
        parts = [
            _Part(t, start, end, start)
            for t in transfers
            for start, end in t.ranges(self.part_bytes)
        ]
        for t in transfers:
            if t.file.size == 0:
                t.finish()  # nothing to fetch; the hash of b"" is still checked
        parts = [p for p in parts if p.end > p.start]
        if not parts:
            return
        abort = threading.Event()
        pool = ThreadPoolExecutor(max_workers=min(self.concurrency, len(parts)))
        try:
            futures = [pool.submit(self._fetch_part, p, abort, report) for p in parts]
            for future in as_completed(futures):
                future.result()
        except BaseException:
            abort.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _fetch_part(self, part: _Part, abort: threading.Event, report: Progress) -> None:
        failures = 0
        while part.pos < part.end and not abort.is_set():
            before = part.pos
            try:
                self._stream(part, abort, report)
            except _Retry as exc:
                failures = 0 if part.pos > before else failures + 1
                if failures >= self.max_attempts:
                    raise LoadFailed(
                        f"s3://{self.bucket}/{part.transfer.key}: no progress after "
                        f"{failures} attempts ({exc.__cause__ or exc})"
                    ) from exc.__cause__
                delay = min(10.0, self.backoff_s * 2 ** max(0, failures - 1))
                abort.wait(delay * random.uniform(0.5, 1.0))
        if part.pos >= part.end and part.transfer.part_done():
            part.transfer.finish()

    def _stream(self, part: _Part, abort: threading.Event, report: Progress) -> None:
        t = part.transfer
        where = f"s3://{self.bucket}/{t.key}"
        try:
            response = self.client.get_object(
                Bucket=self.bucket, Key=t.key, Range=f"bytes={part.pos}-{part.end - 1}"
            )
        except ClientError as exc:
            code = _error_code(exc)
            if code in _MISSING:
                raise BundleError(
                    f"{t.file.path}: listed in {MANIFEST} but {where} is missing"
                ) from exc
            if code in ("InvalidRange", "416"):
                raise t.size_mismatch("shorter than") from exc
            if code in _RETRYABLE:
                raise _Retry(code) from exc
            raise LoadFailed(f"cannot read {where}: {exc}") from exc
        except BotoCoreError as exc:
            raise _Retry(str(exc)) from exc
        total = str(response.get("ContentRange", "")).rpartition("/")[2]
        if not total.isdigit():
            raise LoadFailed(f"{where}: the answer to a ranged GET has no Content-Range")
        if int(total) != t.file.size:
            raise t.size_mismatch("larger than" if int(total) > t.file.size else "shorter than")
        with contextlib.closing(response["Body"]) as body:
            while part.pos < part.end and not abort.is_set():
                try:
                    data: bytes = body.read(min(self.chunk_bytes, part.end - part.pos))
                except (BotoCoreError, OSError) as exc:
                    raise _Retry(str(exc)) from exc
                if not data:
                    raise _Retry(f"{where}: stream ended early")
                t.write(part.pos, data)
                part.pos += len(data)
                report(len(data))
