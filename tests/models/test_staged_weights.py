"""The device path's staging pipeline (runtime/models/weights/staging.py).

On the CPU it runs in its smoke mode (host memory as the "device", no stream):
tensors of every layout land byte for byte as safetensors reads them, chunks
spanning several tensors and tensors spanning several chunks and slots; a
dtype conversion happens once the bytes landed; a flipped byte fails naming the
file and the chunk, and nothing of the load stays. On a CUDA device (a machine
that has one) the same checks run through `open_weights`, with pinned slots and
copies on a stream of their own.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

from runtime.bundles.manifest import Manifest, build_bundle
from runtime.bundles.sources.local import LocalSource
from runtime.errors import IntegrityError
from runtime.models import weights as weights_mod
from runtime.models.weights.cpu import Shard
from runtime.models.weights.staging import read_to_device
from tests.handlers.weights_sum import describe

CHUNK = 64 * 1024


def write_bundle(root: Path) -> Manifest:
    """Three shards of tensors of assorted dtypes and sizes, some smaller than a
    chunk, some spanning several, one empty."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(5)
    src = root / "src"
    src.mkdir(parents=True)
    for i in range(3):
        tensors: dict[str, Any] = {
            f"s{i}.big": torch.randn(50_000 + i, generator=generator),
            f"s{i}.half": torch.randn(3, 7_001, generator=generator).half(),
            f"s{i}.ids": torch.randint(0, 1000, (999,), generator=generator),
            f"s{i}.mask": torch.rand(333, generator=generator) > 0.5,
            f"s{i}.scalar": torch.tensor(3.5),
            f"s{i}.empty": torch.empty(0, 4),
        }
        save_file(tensors, src / f"model-{i + 1:05d}-of-00003.safetensors")
    return build_bundle(src, "staged", out=root / "staged", chunk_bytes=CHUNK)


def reference(bundle_dir: Path, manifest: Manifest, dtype: Any = None) -> dict[str, Any]:
    from safetensors.torch import load

    weights: dict[str, Any] = {}
    for f in manifest.files:
        weights.update(load((bundle_dir / f.path).read_bytes()))
    if dtype is not None:
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    return describe(weights)


def opened(bundle_dir: Path, manifest: Manifest) -> list[Shard]:
    return [Shard(bundle_dir / f.path, f.path, f.size) for f in manifest.files]


@pytest.mark.parametrize("converted", [False, True], ids=["as-stored", "float16"])
@pytest.mark.parametrize("stage_bytes", [4096, 1 << 20])
def test_the_staged_pipeline_lands_every_byte_checked(
    tmp_path: Path, converted: bool, stage_bytes: int
) -> None:
    import torch

    manifest = write_bundle(tmp_path)
    bundle_dir = tmp_path / "staged"
    dtype = torch.float16 if converted else None
    checks = {f.path: f for f in manifest.files}
    shards = opened(bundle_dir, manifest)
    counted: list[int] = []
    try:
        # Checked chunks (64 KiB) set the slots' size; unchecked shards use stage_bytes.
        half = dict(list(checks.items())[:2])
        tensors = read_to_device(
            shards, "cpu", dtype, half, counted.append, readers=4, stage_bytes=stage_bytes
        )
    finally:
        for shard in shards:
            shard.close()
    assert describe(tensors) == reference(bundle_dir, manifest, dtype)
    data = sum(f.size for f in manifest.files[2:]) - (shards[2].data_start)
    assert sum(counted) == sum(f.size for f in manifest.files[:2]) + data


def test_a_flipped_byte_fails_the_staged_load_naming_file_and_chunk(tmp_path: Path) -> None:
    manifest = write_bundle(tmp_path)
    bundle_dir = tmp_path / "staged"
    victim = manifest.files[1]
    path = bundle_dir / victim.path
    raw = bytearray(path.read_bytes())
    at = len(raw) * 2 // 3
    raw[at] ^= 0x04
    path.write_bytes(bytes(raw))
    # Tensors other tests of this worker process left alive are theirs: held here, so
    # that none of theirs is freed and its id taken by one of this load's.
    before = big_tensors()
    shards = opened(bundle_dir, manifest)
    try:
        with pytest.raises(IntegrityError, match="sha256 mismatch in chunk") as caught:
            read_to_device(shards, "cpu", None, {f.path: f for f in manifest.files}, readers=4)
    finally:
        for shard in shards:
            shard.close()
    assert caught.value.extra == {"file": victim.path, "chunk": at // CHUNK}
    del caught
    kept = {id(tensor) for tensor in before}
    alive = [tensor for tensor in big_tensors() if id(tensor) not in kept]
    assert not alive  # nothing of the failed load is kept


def big_tensors() -> list[Any]:
    import torch

    gc.collect()
    return [
        o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.numel() >= 50_000
    ]


@pytest.mark.gpu
def test_a_cuda_load_goes_through_the_staging_pool(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (runs on a device machine)")
    manifest = write_bundle(tmp_path)
    source = LocalSource(tmp_path)
    fetched = source.fetch_for_load(manifest, lambda n: None)
    assert fetched.pending  # every shard left to the load's chunk checks
    loaded = weights_mod.open_weights(
        fetched.directory, manifest, "cuda", fetched.stamps, pending=fetched.pending
    )
    tensors = loaded.take()
    loaded.detach()
    assert loaded.how == "device"
    assert all(t.device.type == "cuda" for t in tensors.values())
    on_host = {k: v.cpu() for k, v in tensors.items()}
    assert describe(on_host) == reference(fetched.directory, manifest)


def test_a_header_longer_than_a_chunk_is_checked_by_both_pipelines(tmp_path: Path) -> None:
    """Chunks holding nothing but header bytes (checked from the bytes `Shard` read)."""
    import torch
    from safetensors.torch import save_file

    from runtime.models.weights.cpu import read_shards

    src = tmp_path / "src"
    src.mkdir()
    tensors = {"w": torch.randn(70_000, generator=torch.Generator().manual_seed(1))}
    save_file(tensors, src / "model.safetensors", metadata={"pad": "x" * (3 * CHUNK)})
    manifest = build_bundle(src, "h", out=tmp_path / "h", chunk_bytes=CHUNK)
    checks = {f.path: f for f in manifest.files}
    expected = reference(tmp_path / "h", manifest)
    for read in (
        lambda shards: read_shards(shards, None, pending=checks),
        lambda shards: read_to_device(shards, "cpu", None, checks, readers=4),
    ):
        shards = opened(tmp_path / "h", manifest)
        try:
            assert shards[0].data_start > 3 * CHUNK
            assert describe(read(shards)) == expected
        finally:
            for shard in shards:
                shard.close()
