"""Once READY, a model's answers do not depend on its bundle's files.

Users copy a new bundle version over an old one in place. The loader copies
every tensor into the process's own memory (on the CPU it never maps a bundle
file), so flipping a byte of a shard, truncating it, deleting it or copying
another version over the whole bundle after READY changes no answer and
cannot kill the process (a truncated mapping is SIGBUS). The next load hashes
the files again and refuses the changed bytes; with the original bytes back
it succeeds. A shard that changes between its verification and its read, or
during the read, fails the load too.

The fixture builder (tests/handlers/weights_sum.py) keeps the loader's tensors
without copying them, and every answer depends on every byte of every weight,
so an answer read from a file-backed mapping would change with the file.
Checked in-process (an `Instance`) and through a real `thaw serve`, for
multi-shard bundles, with and without a dtype conversion.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from runtime.bundles.manifest import MANIFEST, Manifest, build_bundle
from runtime.bundles.sources.local import LocalSource
from runtime.clock import ManualClock
from runtime.dispatch.answers import Completed
from runtime.errors import BundleError, IntegrityError, LoadFailed
from runtime.instance import Instance
from runtime.models import weights as weights_mod
from runtime.models.lifecycle import State
from runtime.models.weights import device as weights_device
from runtime.models.weights import format as weights_format
from runtime.registry import discover
from runtime.settings import Settings
from tests.handlers.weights_sum import describe
from tests.models.conftest import BundleFs
from tests.support import ServerProcess, make_bundle, settings_for

PROBLEM = "application/problem+json"
BACKOFF_S = 0.05
# Bundle variants: shards, floats per shard, config. 1 Mi floats (4 MiB) per
# shard reaches the huge-page advice; the float16 one converts while reading.
KINDS: dict[str, tuple[int, int, dict[str, Any]]] = {
    "f32-3-shards": (3, 1 << 20, {}),
    "f16-2-shards": (2, 3000, {"dtype": "float16"}),
}


# ---- bundle files and what they should answer ---------------------------------------------


def expected_answer(bundle_dir: Path, manifest: Manifest) -> dict[str, Any]:
    """What the handler must answer for these files, computed without the runtime's loader
    (and without mapping them: a later truncation must not reach this process either)."""
    import torch
    from safetensors.torch import load

    weights: dict[str, torch.Tensor] = {}
    for f in manifest.files:
        if f.path.endswith(".safetensors"):
            weights.update(load((bundle_dir / f.path).read_bytes()))
    target = manifest.load_dtype
    if target is not None:
        dtype = getattr(torch, target)
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    return describe(weights)


def shard_paths(bundle_dir: Path, manifest: Manifest) -> list[Path]:
    return [bundle_dir / f.path for f in manifest.files if f.path.endswith(".safetensors")]


def flip_byte(path: Path) -> None:
    """One byte of tensor data changed in place: same inode, same size."""
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))


def truncate(path: Path) -> None:
    os.truncate(path, 5)


def delete(path: Path) -> None:
    path.unlink()


MUTATIONS: dict[str, Callable[[Path], None]] = {
    "flip": flip_byte,
    "truncate": truncate,
    "delete": delete,
}


def refusal_of(mutation: str) -> tuple[type[BundleError], str, str]:
    """(error class, problem type slug, detail fragment) a reload after `mutation` gets."""
    if mutation == "flip":
        return IntegrityError, "integrity", "sha256 mismatch"
    if mutation == "truncate":
        return IntegrityError, "integrity", "does not match manifest size"
    # The local source reports a missing file as a bundle defect.
    return BundleError, "bundle-invalid", "missing"


def copy_version_over(root: Path, name: str, manifest: Manifest, *, seed: int) -> Manifest:
    """Build another version of bundle `name` and copy its files over the old ones, as
    `cp -r new/. old/` does: each file opened with O_TRUNC and rewritten, same inode."""
    staging = root.parent / f"staging-{name}-{seed}"
    shards = len(shard_paths(root / name, manifest))
    floats = manifest.files[0].size // 4  # about the same size; exactness does not matter
    new = make_bundle(
        staging,
        name,
        shards=shards,
        floats_per_shard=floats,
        seed=seed,
        config=dict(manifest.config),
    )
    for f in [*new.files, None]:
        rel = MANIFEST if f is None else f.path
        shutil.copyfile(staging / name / rel, root / name / rel)
    shutil.rmtree(staging)
    return new


def assert_not_mapped(maps: str, bundle_dir: Path) -> None:
    mapped = [line for line in maps.splitlines() if str(bundle_dir) in line]
    assert not mapped, f"bundle files are mapped into the process: {mapped}"


# ---- in-process ------------------------------------------------------------------------------


def wsum_settings(tmp_path: Path) -> Settings:
    return settings_for(
        tmp_path, handlers=("tests.handlers.weights_sum",), retry_backoff_s=BACKOFF_S
    )


async def call(instance: Instance, handler: str) -> dict[str, Any]:
    outcome = await instance.dispatcher.invoke(handler, {}, wait_s=60.0, request_id="test")
    assert isinstance(outcome, Completed)
    output: dict[str, Any] = outcome.output
    return output


def answer_fields(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: answer[k] for k in ("digest", "sums", "dtypes")}


@pytest.mark.anyio
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("mutation", list(MUTATIONS))
async def test_a_ready_model_ignores_its_files_until_reloaded_in_process(
    bundle_fs: BundleFs, tmp_path: Path, mutation: str, kind: str
) -> None:
    shards, floats, config = KINDS[kind]
    root = bundle_fs.root
    manifest = make_bundle(root, "wsum_a", shards=shards, floats_per_shard=floats, thaw=config)
    bundle_fs.seal()
    bundle_dir = root / "wsum_a"
    expected = expected_answer(bundle_dir, manifest)
    victim = shard_paths(bundle_dir, manifest)[-1]
    original = victim.read_bytes()
    clock = ManualClock()
    handlers = discover(("tests.handlers.weights_sum",))
    instance = Instance.create(wsum_settings(tmp_path), handlers, clock=clock)
    await instance.start()
    try:
        first = await call(instance, "wsum_a")
        assert answer_fields(first) == expected
        assert instance.cache.entries["wsum_a"].weights_read == bundle_fs.read
        assert_not_mapped(Path("/proc/self/maps").read_text(), bundle_dir)

        with bundle_fs.writable():
            MUTATIONS[mutation](victim)
        for _ in range(2):
            assert await call(instance, "wsum_a") == first

        await instance.cache.unload("wsum_a")
        error, _slug, fragment = refusal_of(mutation)
        with pytest.raises(error, match=fragment):
            await call(instance, "wsum_a")
        assert instance.cache.entries["wsum_a"].lifecycle.state is State.FAILED

        with bundle_fs.writable():
            victim.write_bytes(original)
        with pytest.raises(LoadFailed):  # within the back-off: not tried again
            await call(instance, "wsum_a")
        clock.advance(BACKOFF_S * 2)
        again = await call(instance, "wsum_a")
        assert answer_fields(again) == expected
        assert instance.cache.entries["wsum_a"].loads == 2
        assert instance.cache.entries["wsum_a"].weights_read == bundle_fs.read
    finally:
        await instance.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", list(KINDS))
async def test_a_version_copied_over_in_place_is_served_only_after_a_reload(
    tmp_path: Path, kind: str
) -> None:
    shards, floats, config = KINDS[kind]
    root = tmp_path / "bundles"
    manifest = make_bundle(root, "wsum_a", shards=shards, floats_per_shard=floats, thaw=config)
    old = expected_answer(root / "wsum_a", manifest)
    instance = Instance.create(wsum_settings(tmp_path), discover(("tests.handlers.weights_sum",)))
    await instance.start()
    try:
        first = await call(instance, "wsum_a")
        assert answer_fields(first) == old
        new_manifest = copy_version_over(root, "wsum_a", manifest, seed=7)
        new = expected_answer(root / "wsum_a", new_manifest)
        assert new["digest"] != old["digest"]
        assert await call(instance, "wsum_a") == first

        await instance.cache.unload("wsum_a")
        assert answer_fields(await call(instance, "wsum_a")) == new
    finally:
        await instance.stop()


# ---- changes between verification and read, and during the read ---------------------------


def fetched(root: Path, name: str) -> tuple[Path, Manifest]:
    source = LocalSource(root)
    manifest = source.manifest(name)
    return source.fetch(manifest, lambda n: None), manifest


def rewrite_in_place(path: Path) -> None:
    # Past the timestamp granularity of kernels without fine-grained ctime.
    time.sleep(0.02)
    flip_byte(path)


def replace_by_rename(path: Path) -> None:
    # Identical bytes under a new inode: the path no longer names what was read.
    temp = path.with_name(path.name + ".new")
    temp.write_bytes(path.read_bytes())
    os.replace(temp, path)


def grow(path: Path) -> None:
    with open(path, "ab") as handle:
        handle.write(b"\0" * 8)


AFTER_VERIFICATION: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncate": (truncate, "does not match manifest size"),
    "delete": (delete, "deleted since it was verified"),
    "grow": (grow, "does not match manifest size"),
    # The same size: only the stat the hash vouched for tells.
    "rewrite in place": (rewrite_in_place, "changed since it was verified"),
    "replace by rename": (replace_by_rename, "changed since it was verified"),
}


@pytest.mark.parametrize("device", ["cpu", "mapped"])
@pytest.mark.parametrize("mutation", list(AFTER_VERIFICATION))
def test_a_shard_changed_after_verification_is_refused_at_load(
    tmp_path: Path, mutation: str, device: str
) -> None:
    """Between the fetch (hashes match) and the load opening the shard, whatever
    happens to it; `mapped` is the path devices other than the CPU take."""
    make_bundle(tmp_path, "wsum_a", shards=2)
    bundle_dir, manifest = fetched(tmp_path, "wsum_a")
    verified = weights_mod.verified_stamps(bundle_dir, manifest)
    assert set(verified) == {f.path for f in manifest.files if f.path.endswith(".safetensors")}
    victim = shard_paths(bundle_dir, manifest)[1]
    change, fragment = AFTER_VERIFICATION[mutation]
    change(victim)
    if device == "mapped":
        # The device path's own checks, driven with the CPU (the one device here).
        rel, size = manifest.files[1].path, manifest.files[1].size
        with pytest.raises(IntegrityError, match=fragment) as caught:
            weights_device.load_mapped(victim, rel, size, "cpu", None, verified[rel])
    else:
        with pytest.raises(IntegrityError, match=fragment) as caught:
            weights_mod.load_weights(bundle_dir, manifest, "cpu", verified)
    assert caught.value.extra["file"] == manifest.files[1].path


def test_a_shard_changed_while_it_is_hashed_is_refused_by_verification(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes that hash right but are replaced during the hash: the stat after it differs."""
    from runtime.bundles import chunks as chunks_mod

    make_bundle(tmp_path, "wsum_a", shards=2)
    source = LocalSource(tmp_path)
    manifest = source.manifest("wsum_a")
    victim = shard_paths(tmp_path / "wsum_a", manifest)[0]
    real_file_digests = chunks_mod.file_digests

    def hash_then_replace(path: Path, chunk_bytes: int) -> tuple[str, list[str]]:
        digests = real_file_digests(path, chunk_bytes)
        if path == victim:
            replace_by_rename(victim)  # the same bytes, another file
        return digests

    monkeypatch.setattr(chunks_mod, "file_digests", hash_then_replace)
    with pytest.raises(IntegrityError, match="changed while it was being verified"):
        source.fetch(manifest, lambda n: None)
    monkeypatch.undo()
    source.fetch(manifest, lambda n: None)  # unchanged since: verified


@pytest.mark.anyio
async def test_a_load_refuses_a_shard_rewritten_between_its_fetch_and_its_read(
    tmp_path: Path,
) -> None:
    """Through the loader: after its fetch the load waits for memory (bundle `held`
    holds it, loading), and a shard is rewritten in place meanwhile, same size. The
    load fails naming the file; the retry hashes it again and refuses it; with its
    bytes back, it loads and answers as before."""
    from tests.handlers import held

    root = tmp_path / "bundles"
    manifest = make_bundle(root, "wsum_a", shards=2)
    holder = make_bundle(root, "held")
    victim = shard_paths(root / "wsum_a", manifest)[0]
    original = victim.read_bytes()
    # Room for either bundle, not both: wsum_a waits until `held` is READY, then evicts it.
    budget_bytes = manifest.weights_bytes + holder.weights_bytes - 1
    settings = dataclasses.replace(
        wsum_settings(tmp_path),
        memory_budget=budget_bytes,
        handlers=("tests.handlers.weights_sum", "tests.handlers.held"),
    )
    held.BUILD_GATE.clear()
    held.BUILDING.clear()
    clock = ManualClock()
    instance = Instance.create(settings, discover(settings.handlers), clock=clock)
    await instance.start()
    try:
        holding = asyncio.ensure_future(instance.prewarm("held"))
        await asyncio.to_thread(held.BUILDING.wait, 30)
        first = asyncio.ensure_future(call(instance, "wsum_a"))
        while instance.cache.budget.waiting("wsum_a") == 0:  # fetched, waiting for memory
            assert not first.done(), first
            await asyncio.sleep(0.005)
        assert instance.cache.entries["wsum_a"].lifecycle.state is State.FETCHED
        await asyncio.to_thread(rewrite_in_place, victim)
        held.BUILD_GATE.set()
        with pytest.raises(IntegrityError, match="changed since it was verified") as caught:
            await first
        assert caught.value.extra["file"] == manifest.files[0].path
        assert instance.cache.entries["wsum_a"].lifecycle.state is State.FAILED
        await holding

        clock.advance(BACKOFF_S * 2)
        with pytest.raises(IntegrityError, match="sha256 mismatch"):
            await call(instance, "wsum_a")

        victim.write_bytes(original)
        clock.advance(BACKOFF_S * 4)
        answer = await call(instance, "wsum_a")
        assert answer_fields(answer) == expected_answer(root / "wsum_a", manifest)
    finally:
        held.BUILD_GATE.set()
        await instance.stop()


DURING_READ: dict[str, Callable[[Path], None]] = {
    "rewrite in place": rewrite_in_place,
    "truncate": truncate,
    "replace by rename": replace_by_rename,
    "delete": delete,
}


@pytest.mark.parametrize("config", [{}, {"dtype": "float16"}], ids=["as-stored", "converted"])
@pytest.mark.parametrize("mutation", list(DURING_READ))
def test_a_shard_changed_while_being_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutation: str, config: dict[str, Any]
) -> None:
    make_bundle(tmp_path, "wsum_a", shards=2, floats_per_shard=4096, thaw=config)
    bundle_dir, manifest = fetched(tmp_path, "wsum_a")
    victim = shard_paths(bundle_dir, manifest)[0]
    # Small reads, so the file changes after its first read and before its last.
    real_preadv = os.preadv
    reads = 0

    def preadv(fd: int, buffers: list[Any], offset: int) -> int:
        nonlocal reads
        reads += 1
        if reads == 2:
            DURING_READ[mutation](victim)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    with pytest.raises(IntegrityError, match="changed while it was being read"):
        weights_mod.load_weights(bundle_dir, manifest, "cpu", chunk_bytes=1024)
    assert reads >= 2, "the shard was not changed during the read"


@pytest.mark.parametrize("mutation", ["rewrite in place", "replace by rename", "delete"])
def test_the_device_path_refuses_a_shard_changed_while_safetensors_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutation: str
) -> None:
    """Devices other than the CPU load through safetensors (which copies to the device);
    its checks are driven here with the CPU, the one device this machine has."""
    import safetensors.torch

    make_bundle(tmp_path, "wsum_a", shards=1)
    bundle_dir, manifest = fetched(tmp_path, "wsum_a")
    victim = shard_paths(bundle_dir, manifest)[0]
    rel, size = manifest.files[0].path, manifest.files[0].size
    intact = weights_device.load_mapped(victim, rel, size, "cpu", None)
    assert describe(intact) == expected_answer(bundle_dir, manifest)
    real = safetensors.torch.load_file

    def load_file(path: str, device: str = "cpu") -> dict[str, Any]:
        # Copies, so that nothing this test holds maps the file it changes.
        tensors = {k: v.clone() for k, v in real(path, device=device).items()}
        DURING_READ[mutation](victim)
        return tensors

    monkeypatch.setattr(safetensors.torch, "load_file", load_file)
    with pytest.raises(IntegrityError, match="changed while it was being read"):
        weights_device.load_mapped(victim, rel, size, "cpu", None)


# ---- the reader against safetensors' own ------------------------------------------------------


def write_safetensors(path: Path, tensors: list[tuple[str, Any]]) -> None:
    """A safetensors file with the tensors in this order (safetensors' writer would sort
    them by alignment; this keeps a float32 tensor at an odd offset)."""
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = bytearray()
    codes = {v: k for k, v in weights_format.SAFETENSORS_DTYPES.items()}
    for name, tensor in tensors:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        code = codes[str(tensor.dtype).removeprefix("torch.")]
        header[name] = {
            "dtype": code,
            "shape": list(tensor.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    body = orjson.dumps(header)
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + bytes(data))


def every_dtype() -> list[tuple[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(3)
    floats = torch.randn(777, generator=g)
    tensors = [
        ("half.odd", floats[:3].to(torch.float16)),  # 6 bytes: what follows is misaligned
        ("f32.misaligned", floats[:100]),
        ("f32.matrix", floats[:24].reshape(2, 3, 4)),
        ("f32.scalar", floats[5].clone()),
        ("f32.empty", torch.empty(0, 7)),
        ("f64", floats[:50].double()),
        ("bf16", floats[:333].to(torch.bfloat16)),
        ("i64", torch.randint(-(2**40), 2**40, (9,), generator=g)),
        ("i32", torch.randint(-(2**30), 2**30, (10,), dtype=torch.int32, generator=g)),
        ("i16", torch.randint(-300, 300, (11,), dtype=torch.int16, generator=g)),
        ("i8", torch.randint(-100, 100, (13,), dtype=torch.int8, generator=g)),
        ("u8", torch.randint(0, 255, (17,), dtype=torch.uint8, generator=g)),
        ("bool", torch.rand(19, generator=g) > 0.5),
        ("c64", torch.randn(4, dtype=torch.complex64, generator=g)),
    ]
    if hasattr(torch, "float8_e4m3fn"):
        tensors.append(("f8", (floats[:21] / 8).to(torch.float8_e4m3fn)))
    return tensors


def read_by_safetensors(src: Path, dtype: str | None) -> dict[str, Any]:
    """Every tensor of src/*.safetensors as safetensors reads it, converted to `dtype`."""
    import torch
    from safetensors.torch import load

    reference: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        reference.update(load(path.read_bytes()))
    if dtype is not None:
        target = getattr(torch, dtype)
        reference = {k: v.to(target) if v.is_floating_point() else v for k, v in reference.items()}
    return reference


@pytest.mark.parametrize("chunk", [16 * 1024 * 1024, 8], ids=["one-read", "8-byte-reads"])
@pytest.mark.parametrize("dtype", [None, "float16", "bfloat16"])
def test_the_reader_matches_safetensors_for_every_dtype(
    tmp_path: Path, dtype: str | None, chunk: int
) -> None:

    src = tmp_path / "src"
    src.mkdir()
    tensors = every_dtype()
    write_safetensors(src / "a.safetensors", tensors[:7])
    write_safetensors(src / "b.safetensors", tensors[7:])
    manifest = build_bundle(
        src, "mixed", out=tmp_path / "mixed", thaw={"dtype": dtype} if dtype else {}
    )
    loaded = weights_mod.load_weights(tmp_path / "mixed", manifest, "cpu", chunk_bytes=chunk)

    reference = read_by_safetensors(src, dtype)
    assert sorted(loaded) == sorted(reference)
    assert describe(loaded) == describe(reference)
    for name, tensor in loaded.items():
        assert tensor.is_contiguous(), name
        assert tensor.data_ptr() % tensor.element_size() == 0, name


def header_bytes(header: Any, data_bytes: int) -> bytes:
    body = orjson.dumps(header)
    return struct.pack("<Q", len(body)) + body + b"\0" * data_bytes


MALFORMED: dict[str, tuple[bytes, str]] = {
    "not json": (struct.pack("<Q", 4) + b"{nop" + b"\0" * 8, "not JSON"),
    "not an object": (header_bytes([1, 2], 0), "not a JSON object"),
    "unknown dtype": (
        header_bytes({"t": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, 8),
        "unsupported dtype",
    ),
    "size disagrees with shape": (
        header_bytes({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8),
        "8 bytes for shape [3]",
    ),
    "negative dimension": (
        header_bytes({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8),
        "shape",
    ),
    "hole between tensors": (
        header_bytes(
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
            },
            12,
        ),
        "starts at byte 8, expected 4",
    ),
    "overlapping tensors": (
        header_bytes(
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            8,
        ),
        "expected 8",
    ),
    "trailing bytes": (
        header_bytes({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 16),
        "cover 8 of the 16",
    ),
    "claims past the end": (
        header_bytes({"t": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}}, 8),
        "cover 4096 of the 8",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_header_is_refused(tmp_path: Path, case: str) -> None:
    content, fragment = MALFORMED[case]
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(content)
    manifest = build_bundle(src, "bad", out=tmp_path / "bad")
    with pytest.raises(BundleError, match=r"model\.safetensors: not a readable safetensors") as err:
        weights_mod.load_weights(tmp_path / "bad", manifest, "cpu")
    assert fragment in str(err.value)


# ---- through a real server -------------------------------------------------------------------


@pytest.fixture
def server_env(thaw_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    return {
        **thaw_env,
        "THAW_BUNDLE_SOURCE": str(tmp_path / "bundles"),
        "THAW_HANDLERS": "tests.handlers.weights_sum",
        # A real process on the system clock: no back-off to wait out between tries.
        "THAW_RETRY_BACKOFF_S": "0",
        "THAW_LOG_LEVEL": "INFO",
    }


@pytest.fixture
def server(server_env: dict[str, str]) -> Iterator[ServerProcess]:
    process = ServerProcess(server_env)
    try:
        yield process.start()
    finally:
        process.kill()


def invoke(client: httpx.Client, name: str) -> httpx.Response:
    return client.post(f"/invoke/{name}", json={}, headers={"Prefer": "wait=60"})


def assert_alive(server: ServerProcess, client: httpx.Client) -> None:
    assert server.proc is not None
    code = server.proc.poll()
    assert code is None, f"server died (exit {code}; SIGBUS is {-signal.SIGBUS}):\n{server.log()}"
    assert client.get("/healthz").status_code == 200


def test_a_server_answers_the_same_whatever_happens_to_its_bundle_files(
    bundle_fs: BundleFs, server: ServerProcess
) -> None:
    root = bundle_fs.root
    manifests = {
        "wsum_a": make_bundle(root, "wsum_a", shards=3, floats_per_shard=1 << 20),
        "wsum_b": make_bundle(
            root, "wsum_b", shards=2, floats_per_shard=3000, thaw={"dtype": "float16"}, seed=1
        ),
    }
    bundle_fs.seal()
    victims = {name: shard_paths(root / name, m)[1] for name, m in manifests.items()}
    originals = {name: path.read_bytes() for name, path in victims.items()}
    with server.client() as client:
        answers: dict[str, dict[str, Any]] = {}
        for name, manifest in manifests.items():
            response = invoke(client, name)
            assert response.status_code == 200, response.text
            answers[name] = response.json()
            assert answer_fields(answers[name]) == expected_answer(root / name, manifest)
        models = {m["name"]: m for m in client.get("/models").json()["models"]}
        assert {models[name]["weights_read"] for name in manifests} == {bundle_fs.read}
        assert_not_mapped(server.maps(), root)

        for mutation, change in MUTATIONS.items():
            with bundle_fs.writable():
                for path in victims.values():
                    change(path)
            for _ in range(2):
                for name, answer in answers.items():
                    response = invoke(client, name)
                    assert response.status_code == 200, (mutation, response.text)
                    assert response.json() == answer, f"answer of {name} changed ({mutation})"
            assert_alive(server, client)

            _error, slug, fragment = refusal_of(mutation)
            for name in answers:
                assert client.delete(f"/models/{name}").status_code < 300
                refused = invoke(client, name)
                assert refused.status_code == 500, (mutation, refused.text)
                assert refused.headers["content-type"] == PROBLEM
                problem = refused.json()
                assert problem["type"].endswith(f"/{slug}"), (mutation, problem)
                assert fragment in problem["detail"], (mutation, problem)
            with bundle_fs.writable():
                for name, path in victims.items():
                    path.write_bytes(originals[name])
            for name, answer in answers.items():
                response = invoke(client, name)
                assert response.status_code == 200, (mutation, response.text)
                assert answer_fields(response.json()) == answer_fields(answer)
            assert_alive(server, client)

        # Another version copied over both bundles, file by file, in place.
        with bundle_fs.writable():
            new = {
                name: copy_version_over(root, name, manifest, seed=11)
                for name, manifest in manifests.items()
            }
        current = {name: invoke(client, name).json() for name in answers}
        for name, answer in answers.items():
            assert answer_fields(current[name]) == answer_fields(answer)
        assert_alive(server, client)
        for name, manifest in new.items():
            assert client.delete(f"/models/{name}").status_code < 300
            response = invoke(client, name)
            assert response.status_code == 200, response.text
            assert answer_fields(response.json()) == expected_answer(root / name, manifest)
            assert answer_fields(response.json()) != answer_fields(answers[name])
        assert_not_mapped(server.maps(), root)
    code = server.terminate()
    assert code == 0, f"server exited {code} (SIGBUS is {-signal.SIGBUS}):\n{server.log()}"
