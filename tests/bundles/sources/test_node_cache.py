"""The node cache keeps what is in use, not every version a node has seen.

A bundle updated in S3 while a node lives leaves its old version behind on
each reload; on Lambda's /tmp a few updates filled the disk and every load
after that failed for room. Versions a process holds (from its fetch until its
model leaves memory) stay; others go once a newer version of the bundle is
fetched, or when a fetch needs their room. Holds are flocks, so another process
holding a version (a real one, below) keeps it as this one's own hold does. A
fill under way keeps the room it reserved from a fetch started beside it.

Against the session's moto server, real safetensors bundles, a real tmpfs for
the room cases, and a real process for the other holder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from runtime.bundles.manifest import MANIFEST, Manifest, build_bundle
from runtime.bundles.sources import nodecache
from runtime.bundles.sources.s3 import S3Source
from runtime.bundles.verify import verify_bundle
from runtime.dispatch.answers import Completed
from runtime.errors import LoadFailed
from runtime.instance import Instance
from runtime.registry import discover
from tests import aws_fixtures
from tests.aws_fixtures import client, make_bucket
from tests.bundles.sources.test_s3 import Counter
from tests.jobs.tmpfs import fill, mounted
from tests.support import settings_for

moto_endpoint = aws_fixtures.moto_endpoint  # fixtures: the session's moto server
aws_env = aws_fixtures.aws_env

PREFIX = "bundles"


def upload(bucket: str, endpoint: str, work: Path, name: str, seed: int) -> Manifest:
    """A real two-shard bundle `name` (its bytes set by `seed`) at s3://bucket/bundles/name/."""
    src = work / f"src-{name}-{seed}"
    src.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    for index in range(2):
        tensors = {f"layer{index}.weight": torch.randn(96, 256, generator=generator)}
        save_file(tensors, str(src / f"model-{index}.safetensors"))
    out = work / f"out-{name}-{seed}"
    manifest = build_bundle(src, name, version=str(seed), out=out)
    s3 = client(endpoint, "s3")
    for path in [MANIFEST, *(f.path for f in manifest.files)]:
        s3.put_object(Bucket=bucket, Key=f"{PREFIX}/{name}/{path}", Body=(out / path).read_bytes())
    return manifest


def source(bucket: str, endpoint: str, cache: Path) -> S3Source:
    return S3Source(bucket, f"{PREFIX}/", cache, client=client(endpoint, "s3"), concurrency=2)


def first_version(endpoint: str, tmp_path: Path) -> tuple[str, Path, S3Source, Manifest, Path]:
    """A bucket with `tiny`'s first version, fetched (and held) into a cache: (bucket,
    cache, the source, the manifest, its directory)."""
    bucket = make_bucket(endpoint)
    cache = tmp_path / "cache"
    src = source(bucket, endpoint, cache)
    manifest = upload(bucket, endpoint, tmp_path, "tiny", seed=1)
    return bucket, cache, src, manifest, src.fetch(manifest, lambda n: None)


def versions(cache: Path, name: str) -> list[str]:
    bundle = cache / name
    return sorted(p.name for p in bundle.iterdir()) if bundle.exists() else []


def test_a_new_version_replaces_the_old_one_on_disk(moto_endpoint: str, tmp_path: Path) -> None:
    bucket, cache, src, old, old_dir = first_version(moto_endpoint, tmp_path)
    src.release(old)  # its model left memory

    new = upload(bucket, moto_endpoint, tmp_path, "tiny", seed=2)
    assert src.manifest("tiny") == new != old
    new_dir = src.fetch(new, lambda n: None)

    assert versions(cache, "tiny") == [new_dir.name]
    assert not old_dir.exists()
    assert verify_bundle(new_dir) == new


def test_a_version_this_process_holds_stays_until_released(
    moto_endpoint: str, tmp_path: Path
) -> None:
    bucket, cache, src, old, old_dir = first_version(moto_endpoint, tmp_path)  # held
    new = upload(bucket, moto_endpoint, tmp_path, "tiny", seed=2)
    new_dir = src.fetch(new, lambda n: None)
    assert versions(cache, "tiny") == sorted([old_dir.name, new_dir.name])
    assert verify_bundle(old_dir) == old  # whole, not half-removed

    src.release(old)
    src.release(old)  # idempotent
    src.fetch(new, lambda n: None)  # complete already: nothing downloaded, the old one goes
    assert versions(cache, "tiny") == [new_dir.name]


def test_a_version_another_process_holds_stays_until_it_exits(
    moto_endpoint: str, tmp_path: Path
) -> None:
    bucket, cache, src, old, old_dir = first_version(moto_endpoint, tmp_path)
    src.release(old)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path\n"
            "from runtime.bundles.sources import nodecache\n"
            "nodecache.hold(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()",
            str(old_dir),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        new = upload(bucket, moto_endpoint, tmp_path, "tiny", seed=2)
        new_dir = src.fetch(new, lambda n: None)
        assert verify_bundle(old_dir) == old
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    src.fetch(new, lambda n: None)
    assert versions(cache, "tiny") == [new_dir.name]


def test_what_interrupted_fetches_and_removals_left_is_cleared(
    moto_endpoint: str, tmp_path: Path
) -> None:
    """A version directory a killed fetch left (no marker, no holder) and one a killed
    removal had renamed away go with the next fetch of the bundle."""
    bucket = make_bucket(moto_endpoint)
    cache = tmp_path / "cache"
    src = source(bucket, moto_endpoint, cache)
    manifest = upload(bucket, moto_endpoint, tmp_path, "tiny", seed=1)
    half = cache / "tiny" / ("0" * 64)
    half.mkdir(parents=True)
    (half / "model-0.safetensors").write_bytes(b"partial")
    gone = cache / "tiny" / f".thaw-gone-{'1' * 64}-4242"
    gone.mkdir()
    (gone / "model-1.safetensors").write_bytes(b"left behind")
    directory = src.fetch(manifest, lambda n: None)
    assert versions(cache, "tiny") == [directory.name]


@pytest.mark.parametrize("other_is", ["unused", "held", "left by a killed removal"])
def test_a_fetch_short_of_room_removes_unused_versions_of_other_bundles(
    moto_endpoint: str, tmp_path: Path, other_is: str
) -> None:
    """Too little room for `tiny`: an unused version of `other` goes, and so does one
    a removal killed midway had renamed away (and `tiny` is fetched); a held one
    stays (and the fetch fails, saying what it needs)."""
    bucket = make_bucket(moto_endpoint)
    with mounted(tmp_path / "cache", "2m") as cache:
        src = source(bucket, moto_endpoint, cache)
        other = upload(bucket, moto_endpoint, tmp_path, "other", seed=3)
        other_dir = src.fetch(other, lambda n: None)
        if other_is != "held":
            src.release(other)
        if other_is == "left by a killed removal":
            other_dir = other_dir.rename(other_dir.with_name(f".thaw-gone-{other_dir.name}-1"))
        tiny = upload(bucket, moto_endpoint, tmp_path, "tiny", seed=1)
        filler = fill(cache)
        with filler.open("r+b") as out:  # leave about half of what `tiny` needs
            out.truncate(filler.stat().st_size - tiny.total_bytes // 2)
        if other_is == "held":
            with pytest.raises(LoadFailed, match=r"needs [\d.]+ MiB in the node cache"):
                src.fetch(tiny, lambda n: None)
            assert verify_bundle(other_dir) == other
            assert versions(cache, "tiny") == []
        else:
            tiny_dir = src.fetch(tiny, lambda n: None)
            assert verify_bundle(tiny_dir) == tiny
            assert not other_dir.exists()


def test_fetches_under_way_keep_the_room_they_reserved(moto_endpoint: str, tmp_path: Path) -> None:
    """Room for one of two bundles: while the first is downloading, the second's fetch
    counts what the first has yet to write and fails at once, before a byte of its
    own, instead of both passing the check and filling the disk between them."""
    bucket = make_bucket(moto_endpoint)
    with mounted(tmp_path / "cache", "2m") as cache:
        first = upload(bucket, moto_endpoint, tmp_path, "first", seed=3)
        second = upload(bucket, moto_endpoint, tmp_path, "second", seed=4)
        filler = fill(cache)
        with filler.open("r+b") as out:  # room for one and a half
            out.truncate(filler.stat().st_size - first.total_bytes * 3 // 2)
        downloading, go = threading.Event(), threading.Event()

        def hold_up(**_: Any) -> None:
            downloading.set()
            assert go.wait(60)

        slow = source(bucket, moto_endpoint, cache)
        slow.client.meta.events.register("before-send.s3.GetObject", hold_up)
        fetched: list[Path] = []

        def fetch_first() -> None:
            fetched.append(slow.fetch(first, lambda n: None))

        fetching = threading.Thread(target=fetch_first)
        fetching.start()
        try:
            assert downloading.wait(60)
            other = source(bucket, moto_endpoint, cache)
            counter = Counter(other.client)
            with pytest.raises(LoadFailed, match="other fetches under way are still") as caught:
                other.fetch(second, lambda n: None)
            assert counter.gets() == 0
            assert "needs" in caught.value.message
        finally:
            go.set()
            fetching.join(60)
        assert verify_bundle(fetched[0]) == first
        slow.release(first)
        assert verify_bundle(other.fetch(second, lambda n: None)) == second  # `first` went


def test_the_least_recently_held_version_goes_first(moto_endpoint: str, tmp_path: Path) -> None:
    bucket = make_bucket(moto_endpoint)
    with mounted(tmp_path / "cache", "2m") as cache:
        src = source(bucket, moto_endpoint, cache)
        dirs: dict[str, Path] = {}
        for seed, name in enumerate(("first", "second"), start=3):
            manifest = upload(bucket, moto_endpoint, tmp_path, name, seed=seed)
            dirs[name] = src.fetch(manifest, lambda n: None)
            src.release(manifest)
        os.utime(dirs["second"] / nodecache.USE_LOCK, (1, 1))  # held long ago
        tiny = upload(bucket, moto_endpoint, tmp_path, "tiny", seed=1)
        filler = fill(cache)
        with filler.open("r+b") as out:  # room for `tiny` once one of them goes
            out.truncate(filler.stat().st_size - tiny.total_bytes // 2)
        src.fetch(tiny, lambda n: None)
        assert dirs["first"].exists() and not dirs["second"].exists()


# ---- through an instance: a READY model holds its version --------------------------------


async def invoke(instance: Instance) -> Any:
    outcome = await instance.dispatcher.invoke("wsum_a", {}, wait_s=60.0, request_id="t")
    assert isinstance(outcome, Completed)
    return outcome.output


@pytest.mark.anyio
async def test_a_loaded_model_holds_its_version_until_unloaded(
    aws_env: str, tmp_path: Path
) -> None:
    bucket = make_bucket(aws_env)
    cache = tmp_path / "cache"
    first = upload(bucket, aws_env, tmp_path, "wsum_a", seed=1)
    settings = settings_for(
        tmp_path,
        bundle_source=f"s3://{bucket}/{PREFIX}",
        cache_dir=str(cache),
        handlers=("tests.handlers.weights_sum",),
    )
    instance = Instance.create(settings, discover(settings.handlers))
    await instance.start()
    try:
        await invoke(instance)
        [first_version] = versions(cache, "wsum_a")
        # Another process on the node fetches a newer version: the READY one stays.
        second = upload(bucket, aws_env, tmp_path, "wsum_a", seed=2)
        other = source(bucket, aws_env, cache)
        other.fetch(second, lambda n: None)
        other.release(second)
        assert first_version in versions(cache, "wsum_a")
        assert verify_bundle(cache / "wsum_a" / first_version) == first

        await instance.cache.unload("wsum_a")
        await invoke(instance)  # loads the current (second) version, the first goes
        assert versions(cache, "wsum_a") == [second.id.partition(":")[2]]
    finally:
        await instance.stop()
