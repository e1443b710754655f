"""On a read-only filesystem a CPU load maps its shards for the build, and copies
out of them only what the model keeps (runtime/models/weights/mapped.py).

A real tmpfs, sealed read-only (its superblock's flag, as a Lambda image's
filesystem is), holds real safetensors shards. Checked: which files count as
immutable (not a read-only bind mount of a writable filesystem); that a tensor
kept in any form (itself, a view, inside a list, as a numpy array, edited in
place) is the bytes it should be and stays so once the file is rewritten or
truncated; that a tensor dropped during the build leaves the file at once; that
after `detach` no page of a shard is mapped; unaligned tensors; and a failed
build leaving no mapping and no open descriptor behind. Through an `Instance`,
tests/models/test_detached_weights.py runs its after-READY checks on this
filesystem too.
"""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import weakref
from pathlib import Path
from typing import Any

import pytest

from runtime.bundles.manifest import Manifest, build_bundle
from runtime.models import weights as weights_mod
from runtime.models.weights import mapped
from tests.handlers.weights_sum import describe
from tests.models.test_detached_weights import (
    every_dtype,
    read_by_safetensors,
    write_safetensors,
)
from tests.support import ReadOnlyFs

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

PAGE = os.sysconf("SC_PAGE_SIZE")


def tensors_for_test() -> dict[str, Any]:
    """Sizes under a page, over several pages, and a page multiple; two dtypes."""
    import torch

    generator = torch.Generator().manual_seed(3)
    return {
        "big.a": torch.randn(5000, generator=generator),
        "big.b": torch.randn(3000, generator=generator),
        "big.c": torch.randn(2 * PAGE, generator=generator),
        "big.g": torch.randn(4 * PAGE, generator=generator),
        "small.d": torch.randn(7, generator=generator),
        "small.e": torch.randn(9, generator=generator),
        "half.f": torch.randn(1001, generator=generator).half(),
    }


def write_bundle(root: Path, name: str, tensors: dict[str, Any]) -> Manifest:
    from safetensors.torch import save_file

    src = root.parent / f"src-{name}"
    src.mkdir(parents=True, exist_ok=True)
    save_file(tensors, src / "model.safetensors")
    return build_bundle(src, name, out=root / name, config={})


def file_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges of this process that map `path`."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def open_fds_to(path: Path) -> list[str]:
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                fds.append(fd)
        except OSError:
            continue
    return fds


def test_only_a_filesystem_read_only_for_every_mount_is_immutable(
    read_only_fs: ReadOnlyFs, tmp_path: Path
) -> None:
    (read_only_fs.path / "f").write_bytes(b"x")
    writable = tmp_path / "rw"
    writable.mkdir()
    (writable / "f").write_bytes(b"x")
    bind = tmp_path / "bind"
    bind.mkdir()
    subprocess.run(["mount", "--bind", str(writable), str(bind)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(bind)], check=True)

        def immutable(path: Path) -> bool:
            fd = os.open(path, os.O_RDONLY)
            try:
                return mapped.immutable(fd)
            finally:
                os.close(fd)

        assert not immutable(read_only_fs.path / "f")  # not sealed yet
        read_only_fs.seal()
        assert immutable(read_only_fs.path / "f")
        assert not immutable(writable / "f")
        # The mount is read-only, the filesystem is not: another mount can still write it.
        assert os.statvfs(bind / "f").f_flag & os.ST_RDONLY
        assert not immutable(bind / "f")
    finally:
        subprocess.run(["umount", str(bind)], check=True)


def test_a_container_image_mounted_read_only_is_immutable(tmp_path: Path) -> None:
    """An overlay (a container's image) whose only mount is read-only, as
    `podman run --read-only` leaves it: its filesystem's own options still say rw."""
    if not (ReadOnlyFs.available() and mapped.supported()):
        pytest.skip("needs the right to mount (root)")
    dirs = {name: tmp_path / name for name in ("lower", "upper", "work", "root")}
    for path in dirs.values():
        path.mkdir()
    (dirs["lower"] / "f").write_bytes(b"x")
    layers = f"lowerdir={dirs['lower']},upperdir={dirs['upper']},workdir={dirs['work']}"
    subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", layers, str(dirs["root"])], check=True
    )
    try:

        def immutable() -> bool:
            fd = os.open(dirs["root"] / "f", os.O_RDONLY)
            try:
                return mapped.immutable(fd)
            finally:
                os.close(fd)

        assert not immutable()
        subprocess.run(["mount", "-o", "remount,bind,ro", str(dirs["root"])], check=True)
        [line] = [
            line
            for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4] == str(dirs["root"])
        ]
        mount_options, super_options = line.split()[5], line.split(" - ")[1].split()[2]
        assert "ro" in mount_options.split(",") and "rw" in super_options.split(",")
        assert immutable()
    finally:
        subprocess.run(["umount", str(dirs["root"])], check=True)


def test_a_writable_filesystem_is_copied_and_a_read_only_one_mapped(
    read_only_fs: ReadOnlyFs, tmp_path: Path
) -> None:
    tensors = tensors_for_test()
    on_ro = write_bundle(read_only_fs.path, "b", tensors)
    on_rw = write_bundle(tmp_path / "rw", "b", tensors)
    read_only_fs.seal()
    copied = weights_mod.open_weights(tmp_path / "rw" / "b", on_rw, "cpu")
    assert copied.how == "copied"
    copied.close()
    loaded = weights_mod.open_weights(read_only_fs.path / "b", on_ro, "cpu")
    assert loaded.how == "mapped"
    got = loaded.take()
    assert sorted(got) == sorted(tensors)
    assert all(got[k].equal(tensors[k]) for k in tensors)
    loaded.detach()


def test_what_a_build_keeps_is_copied_out_and_nothing_of_the_file_stays_mapped(
    read_only_fs: ReadOnlyFs,
) -> None:
    import torch

    expected = tensors_for_test()
    manifest = write_bundle(read_only_fs.path, "b", expected)
    read_only_fs.seal()
    shard = read_only_fs.path / "b" / "model.safetensors"
    digest = sha256(shard)

    loaded = weights_mod.open_weights(read_only_fs.path / "b", manifest, "cpu")
    assert loaded.how == "mapped"
    assert file_ranges(shard)
    [region] = [weakref.ref(r) for r in loaded._regions]
    weights = loaded.take()
    # A builder keeps tensors in every form a builder might, edits one in place, and
    # drops the rest.
    model: dict[str, Any] = {
        "same": weights["big.a"],
        "view": weights["big.b"][10:20],
        "listed": [weights["small.d"]],
        "as numpy": weights["half.f"].numpy(),
        "edited": weights["big.c"].mul_(2),
    }
    dropped = weights["big.g"]
    start, end = dropped.data_ptr(), dropped.data_ptr() + dropped.nbytes
    del weights, dropped
    gc.collect()
    # The dropped tensor's whole pages left the file as it was freed, before detach.
    interior = (-(-start // PAGE) * PAGE, end - end % PAGE)
    assert interior[1] > interior[0]
    assert not any(a < interior[1] and interior[0] < b for a, b in file_ranges(shard))

    copied = loaded.detach()
    assert copied > 0
    kept = ("big.a", "big.b", "small.d", "half.f", "big.c")
    # Whole pages of what was kept (each tensor at most two pages more), never everything.
    assert copied <= sum(expected[k].nbytes + 2 * PAGE for k in kept)
    assert copied < sum(t.nbytes for t in expected.values())
    assert file_ranges(shard) == []
    assert open_fds_to(shard) == []

    def check() -> None:
        assert model["same"].equal(expected["big.a"])
        assert model["view"].equal(expected["big.b"][10:20])
        assert model["listed"][0].equal(expected["small.d"])
        assert torch.from_numpy(model["as numpy"]).equal(expected["half.f"])
        assert model["edited"].equal(expected["big.c"] * 2)

    check()
    assert sha256(shard) == digest  # the edit was the process's own page
    with read_only_fs.writable():
        with open(shard, "r+b") as handle:
            handle.seek(0)
            handle.write(b"\xff" * (shard.stat().st_size // 2))
        check()
        os.truncate(shard, 5)  # a mapping left behind would be SIGBUS on the next read
        check()
    # The model goes: the region, whose end unmaps the whole range, goes with it.
    assert region() is not None
    model.clear()
    gc.collect()
    assert region() is None


@pytest.mark.parametrize("dtype", [None, "float16", "bfloat16"])
def test_every_dtype_reads_as_safetensors_reads_it(
    read_only_fs: ReadOnlyFs, dtype: str | None
) -> None:
    """Every dtype the reader takes, a float32 tensor at an odd offset among them
    (mapped.py copies that one: a view of it would be unaligned), and a conversion."""

    src = read_only_fs.path.parent / "src"
    src.mkdir()
    tensors = every_dtype()
    write_safetensors(src / "a.safetensors", tensors[:7])
    write_safetensors(src / "b.safetensors", tensors[7:])
    out = read_only_fs.path / "mixed"
    manifest = build_bundle(src, "mixed", out=out, thaw={"dtype": dtype} if dtype else {})
    read_only_fs.seal()
    loaded = weights_mod.open_weights(out, manifest, "cpu")
    assert loaded.how == "mapped"
    got = loaded.take()
    loaded.detach()

    reference = read_by_safetensors(src, dtype)
    assert sorted(got) == sorted(reference)
    assert describe(got) == describe(reference)
    for name, tensor in got.items():
        assert tensor.data_ptr() % tensor.element_size() == 0, name
    assert file_ranges(out / "a.safetensors") == file_ranges(out / "b.safetensors") == []


def test_a_converted_tensor_leaves_the_file_at_load(read_only_fs: ReadOnlyFs) -> None:
    """thaw.dtype converts while loading: the converted copy is the process's own."""
    import torch

    expected = tensors_for_test()
    src = read_only_fs.path.parent / "src-h"
    src.mkdir()
    from safetensors.torch import save_file

    save_file(expected, src / "model.safetensors")
    manifest = build_bundle(src, "h", out=read_only_fs.path / "h", thaw={"dtype": "bfloat16"})
    read_only_fs.seal()
    loaded = weights_mod.open_weights(read_only_fs.path / "h", manifest, "cpu")
    tensors = loaded.take()
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert loaded.detach() == 0  # nothing the model holds views the file
    for name, tensor in expected.items():
        assert tensors[name].equal(tensor.to(torch.bfloat16))


def test_a_failed_build_leaves_no_mapping_and_no_descriptor(read_only_fs: ReadOnlyFs) -> None:
    manifest = write_bundle(read_only_fs.path, "b", tensors_for_test())
    read_only_fs.seal()
    shard = read_only_fs.path / "b" / "model.safetensors"
    loaded = weights_mod.open_weights(read_only_fs.path / "b", manifest, "cpu")
    [region] = [weakref.ref(r) for r in loaded._regions]
    weights = loaded.take()
    kept_by_a_traceback = weights["big.a"]
    loaded.close()  # the build failed: the loader gives up on it
    assert open_fds_to(shard) == []
    assert loaded.detach() == 0  # an abandoned build's late detach does nothing
    assert file_ranges(shard)  # still viewed: the error's frames hold a tensor
    assert kept_by_a_traceback.sum().item() == pytest.approx(float(weights["big.a"].sum()))
    del weights, kept_by_a_traceback
    gc.collect()
    assert file_ranges(shard) == []
    assert region() is None
