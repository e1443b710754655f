"""Bad input, nothing served: each byte of a shard is checked (chunk by chunk, as the
load reads it) before any tensor reaches a builder.

One bundle (`wsum_a`, shards of 4 MiB in chunks of 1 MiB) is damaged in one way per
test, through an `Instance` that also serves a healthy bundle (`wsum_b`): a byte
flipped in the middle of a shard, a shard truncated or rewritten after its stamp was
recorded, chunk digests that disagree with the file digest, a bundle larger than
the memory budget. Each load fails with an error naming the file (and the chunk);
no tensor of the failed load stays alive; `wsum_b` answers as before. A bundle of
the old manifest format (whole-file digests only) still loads, hashed by the fetch.
A multi-shard bundle with a `model.safetensors.index.json` is loaded by a real
`thaw serve`, whose peak RSS stays within the bytes kept plus 10 % plus 512 MiB.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from runtime.bundles import chunks
from runtime.bundles.manifest import MANIFEST, Manifest, build_bundle
from runtime.clock import ManualClock
from runtime.dispatch.answers import Completed
from runtime.errors import InsufficientMemory, IntegrityError, ThawError
from runtime.instance import Instance
from runtime.models.lifecycle import State
from runtime.registry import discover
from tests.handlers.weights_sum import describe
from tests.support import ServerProcess, settings_for, until

MIB = 1024 * 1024
CHUNK = MIB
FLOATS = MIB  # 4 MiB per shard: four chunks and a bit (the header)
BACKOFF_S = 0.05


def write_bundle(root: Path, name: str, *, shards: int, seed: int, index: bool = False) -> Manifest:
    """A real safetensors bundle, chunked by CHUNK; with `index`, as a Hugging Face
    sharded checkpoint lays it out (an index file naming each tensor's shard)."""
    import torch
    from safetensors.torch import save_file

    src = root.parent / f"src-{name}"
    src.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {
            f"layers.{i}.weight": torch.randn(FLOATS, generator=generator),
            f"layers.{i}.bias": torch.randn(7, generator=generator),
        }
        save_file(tensors, src / shard)
        weight_map.update(dict.fromkeys(tensors, shard))
    if index:
        body = {"metadata": {"total_size": 4 * (FLOATS + 7) * shards}, "weight_map": weight_map}
        (src / "model.safetensors.index.json").write_bytes(orjson.dumps(body))
    return build_bundle(src, name, out=root / name, chunk_bytes=CHUNK)


def expected(bundle_dir: Path, manifest: Manifest) -> dict[str, Any]:
    from safetensors.torch import load

    weights = {}
    for f in manifest.files:
        if f.path.endswith(".safetensors"):
            weights.update(load((bundle_dir / f.path).read_bytes()))
    return describe(weights)


def big_tensors() -> int:
    """Tensors of a megabyte or more alive in this process."""
    import torch

    gc.collect()
    return sum(
        1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.nbytes >= MIB // 2
    )


@dataclasses.dataclass
class Served:
    instance: Instance
    clock: ManualClock
    root: Path
    victim: Manifest
    other: Manifest
    # Big tensors alive while wsum_a is not loaded (wsum_b's).
    kept: int = 0

    async def call(self, name: str) -> dict[str, Any]:
        outcome = await self.instance.dispatcher.invoke(name, {}, wait_s=60.0, request_id="t")
        assert isinstance(outcome, Completed)
        return {k: outcome.output[k] for k in ("digest", "sums", "dtypes")}

    def shard(self, index: int = 0) -> Path:
        return self.root / "wsum_a" / self.victim.files[index].path

    async def refused(self, error: type[ThawError], fragment: str) -> ThawError:
        """wsum_a's next load fails so; nothing of it stays; wsum_b still answers."""
        self.clock.advance(BACKOFF_S * 100)
        with pytest.raises(error, match=fragment) as caught:
            await self.call("wsum_a")
        assert self.instance.cache.entries["wsum_a"].lifecycle.state is State.FAILED
        assert big_tensors() == self.kept
        assert await self.call("wsum_b") == expected(self.root / "wsum_b", self.other)
        return caught.value


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    root = tmp_path / "bundles"
    victim = write_bundle(root, "wsum_a", shards=2, seed=1)
    other = write_bundle(root, "wsum_b", shards=1, seed=2)
    settings = settings_for(
        tmp_path, handlers=("tests.handlers.weights_sum",), retry_backoff_s=BACKOFF_S
    )
    # Its wall clock is past the files' times: a verified shard is stamped at once.
    clock = ManualClock()
    instance = Instance.create(settings, discover(settings.handlers), clock=clock)
    await instance.start()
    try:
        state = Served(instance, clock, root, victim, other)
        assert await state.call("wsum_b") == expected(root / "wsum_b", other)
        state.kept = big_tensors()  # wsum_b's
        yield state
    finally:
        await instance.stop()


def chunk_of(manifest: Manifest, offset: int) -> int:
    return offset // manifest.files[0].chunk_bytes


@pytest.mark.anyio
async def test_one_flipped_byte_in_the_middle_of_a_shard_fails_naming_file_and_chunk(
    served: Served,
) -> None:
    path = served.shard()
    middle = path.stat().st_size // 2
    with open(path, "r+b") as handle:
        handle.seek(middle)
        byte = handle.read(1)
        handle.seek(middle)
        handle.write(bytes([byte[0] ^ 0x10]))
    error = await served.refused(IntegrityError, "sha256 mismatch in chunk")
    assert error.extra == {
        "file": served.victim.files[0].path,
        "chunk": chunk_of(served.victim, middle),
    }
    assert served.victim.files[0].path in error.message


@pytest.mark.anyio
async def test_a_shard_truncated_after_it_was_stamped_fails_naming_it(served: Served) -> None:
    first = await served.call("wsum_a")
    assert first == expected(served.root / "wsum_a", served.victim)
    stamps = orjson.loads((Path(served.instance.settings.state_dir) / "verified.json").read_bytes())
    assert any(served.victim.files[0].path in files for files in stamps.values())
    await served.instance.cache.unload("wsum_a")
    served.kept = big_tensors()
    os.truncate(served.shard(), served.victim.files[0].size - 100)
    error = await served.refused(IntegrityError, "does not match manifest size")
    assert error.extra["file"] == served.victim.files[0].path


@pytest.mark.anyio
async def test_a_shard_rewritten_after_it_was_stamped_is_checked_again(served: Served) -> None:
    await served.call("wsum_a")
    await served.instance.cache.unload("wsum_a")
    served.kept = big_tensors()
    path = served.shard(1)
    raw = bytearray(path.read_bytes())
    at = len(raw) - 10  # in the last chunk, the same size
    raw[at] ^= 0x01
    time.sleep(0.02)  # past the timestamp granularity of kernels without fine ctime
    path.write_bytes(bytes(raw))
    error = await served.refused(IntegrityError, "sha256 mismatch in chunk")
    assert error.extra == {
        "file": served.victim.files[1].path,
        "chunk": chunk_of(served.victim, at),
    }


@pytest.mark.anyio
async def test_chunk_digests_that_disagree_with_the_file_digest_fail_the_load(
    served: Served,
) -> None:
    manifest_path = served.root / "wsum_a" / MANIFEST
    data = orjson.loads(manifest_path.read_bytes())
    data["files"][0]["chunks"][1] = data["files"][0]["chunks"][2]
    manifest_path.write_bytes(orjson.dumps(data))
    error = await served.refused(IntegrityError, "sha256 mismatch in chunk 1 ")
    assert error.extra == {"file": served.victim.files[0].path, "chunk": 1}


@pytest.mark.anyio
async def test_a_bundle_larger_than_the_budget_fails_and_the_other_keeps_serving(
    served: Served,
) -> None:
    budget = served.instance.cache.budget
    budget.set_limit(served.victim.weights_bytes - 1)
    error = await served.refused(InsufficientMemory, "'wsum_a' needs")
    assert error.extra["need_bytes"] >= served.victim.weights_bytes


@pytest.mark.anyio
async def test_a_format_1_bundle_still_loads(served: Served) -> None:
    manifest_path = served.root / "wsum_a" / MANIFEST
    data = orjson.loads(manifest_path.read_bytes())
    data.pop("thaw", None)
    for entry in data["files"]:
        del entry["chunk_bytes"], entry["chunks"]
    data["format"] = 1
    manifest_path.write_bytes(orjson.dumps(data))
    assert await served.call("wsum_a") == expected(served.root / "wsum_a", served.victim)
    entry = served.instance.cache.entries["wsum_a"]
    assert entry.manifest is not None and entry.manifest.format == 1
    # And a flipped byte is still refused, by the fetch's whole-file hash.
    await served.instance.cache.unload("wsum_a")
    served.kept = big_tensors()
    path = served.shard()
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    time.sleep(0.02)
    path.write_bytes(bytes(raw))
    await served.refused(IntegrityError, "sha256 mismatch")


def test_a_sharded_bundle_with_an_index_loads_in_a_real_server(
    tmp_path: Path, thaw_env: dict[str, str]
) -> None:
    root = tmp_path / "bundles"
    manifest = write_bundle(root, "wsum_a", shards=4, seed=3, index=True)
    assert any(f.path == "model.safetensors.index.json" for f in manifest.files)
    assert all(
        len(f.chunks) == chunks.chunk_count(f.size, CHUNK)
        for f in manifest.files
        if f.path.endswith(".safetensors")
    )
    env = {
        **thaw_env,
        "THAW_BUNDLE_SOURCE": str(root),
        "THAW_HANDLERS": "tests.handlers.weights_sum",
        "THAW_LOG_LEVEL": "INFO",
    }
    with ServerProcess(env) as server, server.client(timeout=120) as client:
        answer = client.post("/invoke/wsum_a", json={}, headers={"Prefer": "wait=110"})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert {k: body[k] for k in ("digest", "sums", "dtypes")} == expected(
            root / "wsum_a", manifest
        )
        pid = body["pid"]
        status = Path(f"/proc/{pid}/status").read_text()
        peak_kib = int(next(s for s in status.splitlines() if s.startswith("VmHWM:")).split()[1])
        kept = manifest.weights_bytes
        assert peak_kib * 1024 <= kept * 1.1 + 512 * MIB, status
        listed = until(lambda: client.get("/models").json(), "the models listing")
        assert [m["state"] for m in listed["models"] if m["name"] == "wsum_a"] == ["ready"]


def test_shards_are_stamped_only_once_a_load_checked_every_chunk(tmp_path: Path) -> None:
    """The fetch stamps what it hashed (the index file), never the shards it left to the
    load; a load that refused a chunk stamps nothing; one that checked them all does."""
    from runtime.bundles.sources.local import LocalSource
    from runtime.bundles.stamps import VerifiedStamps
    from runtime.models import weights as weights_mod

    root = tmp_path / "bundles"
    manifest = write_bundle(root, "wsum_a", shards=2, seed=1, index=True)
    bundle_dir = root / "wsum_a"
    stamps = VerifiedStamps(tmp_path / "verified.json", clock=ManualClock())
    source = LocalSource(root, stamps)
    key = stamps.key(bundle_dir, manifest.id)
    shards = [f for f in manifest.files if f.path.endswith(".safetensors")]

    def stamped(rel: str) -> bool:
        return stamps.unchanged(key, rel, os.stat(bundle_dir / rel))

    victim = bundle_dir / shards[1].path
    original = victim.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x80
    victim.write_bytes(bytes(damaged))
    fetched = source.fetch_for_load(manifest, lambda n: None)
    assert set(fetched.pending.files) == {f.path for f in shards}
    assert stamped("model.safetensors.index.json")
    with pytest.raises(IntegrityError, match="sha256 mismatch in chunk") as caught:
        weights_mod.load_weights(
            bundle_dir, manifest, "cpu", fetched.stamps, pending=fetched.pending
        )
    assert caught.value.extra["file"] == shards[1].path
    assert not any(stamped(f.path) for f in shards)

    victim.write_bytes(original)
    fetched = source.fetch_for_load(manifest, lambda n: None)
    tensors = weights_mod.load_weights(
        bundle_dir, manifest, "cpu", fetched.stamps, pending=fetched.pending
    )
    assert describe(tensors) == expected(bundle_dir, manifest)
    assert all(stamped(f.path) for f in shards)
    again = source.fetch_for_load(manifest, lambda n: None)
    assert not again.pending  # a second instance on this node hashes nothing
