"""Bundle manifests: build, verify, and one clear message per defect."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.bundles.manifest import MANIFEST, build_bundle, parse_manifest
from runtime.errors import BundleError
from tests.jobs.tmpfs import fill, mounted
from tests.support import make_bundle

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)


def thaw(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


@pytest.fixture(scope="module")
def good_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bundles")
    make_bundle(root, "good", shards=2, config={"layers": 2})
    return root / "good"


def test_build_and_verify_roundtrip(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.ones(4)}, src / "model.safetensors")
    (src / "vocab.txt").write_text("a\nb\n")
    (src / "extra.json").write_text("{}")
    out = tmp_path / "out"
    built = thaw("bundle", "build", str(src), "--name", "toy", "--version", "v2", "--out", str(out))
    assert built.returncode == 0, built.stderr
    assert "toy@sha256:" in built.stdout
    manifest = json.loads((out / MANIFEST).read_text())
    assert {f["path"] for f in manifest["files"]} == {
        "model.safetensors",
        "vocab.txt",
        "extra.json",
    }
    assert manifest["version"] == "v2"
    verified = thaw("bundle", "verify", str(out))
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.split()[1] == built.stdout.split()[1]  # the same immutable id


def test_id_changes_with_content(good_bundle: Path) -> None:
    manifest = parse_manifest((good_bundle / MANIFEST).read_bytes())
    raw = json.loads((good_bundle / MANIFEST).read_text())
    raw["config"]["layers"] = 3
    assert parse_manifest(json.dumps(raw)).id != manifest.id
    assert manifest.id.startswith("good@sha256:") and len(manifest.id) == len("good@sha256:") + 64


def test_build_refuses_pickle_source(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    result = thaw("bundle", "build", str(src), "--name", "bad")
    assert result.returncode != 0
    assert "pytorch_model.bin" in result.stderr and "pickle" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_build_onto_a_full_disk_says_so_in_one_line_and_keeps_nothing(
    good_bundle: Path, tmp_path: Path
) -> None:
    """`thaw bundle build` writing into a filesystem too small for the bundle: exit 1
    with the OS's reason and the file, no traceback; the copies it made and the
    directory it made are gone, and the source is as it was."""
    before = {p.name: p.read_bytes() for p in good_bundle.iterdir()}
    with mounted(tmp_path / "disk", "64k") as disk:
        filler = fill(disk)  # what else is on that disk: no room is left
        out = disk / "built"
        done = thaw("bundle", "build", str(good_bundle), "--name", "copy", "--out", str(out))
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr
        [line] = done.stderr.strip().splitlines()
        assert line.startswith("thaw: error: [Errno 28] No space left on device")
        assert str(out) in line
        assert list(disk.iterdir()) == [filler]
        as_json = thaw(
            "bundle", "build", str(good_bundle), "--name", "c", "--out", str(out), "--json"
        )
        assert as_json.returncode == 1
        assert "No space left" in json.loads(as_json.stdout)["error"]["message"]
    assert {p.name: p.read_bytes() for p in good_bundle.iterdir()} == before


def test_a_build_that_fails_midway_removes_only_what_it_wrote(
    good_bundle: Path, tmp_path: Path
) -> None:
    """A defect found after some files were copied (a symbolic link, sorted last):
    the copies go, and a file the output directory already held stays."""
    src = tmp_path / "src"
    src.mkdir()
    for shard in good_bundle.glob("*.safetensors"):
        (src / shard.name).write_bytes(shard.read_bytes())
    (src / "zz-link.json").symlink_to(src / next(src.iterdir()).name)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(BundleError, match=r"zz-link\.json: is a symbolic link"):
        build_bundle(src, "halfway", out=out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    fresh = tmp_path / "fresh"
    with pytest.raises(BundleError, match="symbolic link"):
        build_bundle(src, "halfway", out=fresh)
    assert not fresh.exists()


def _copy(good: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "bundle"
    shutil.copytree(good, target)
    return target


def _edit(mutate: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(bundle: Path) -> None:
        data = json.loads((bundle / MANIFEST).read_text())
        mutate(data)
        (bundle / MANIFEST).write_text(json.dumps(data))

    return apply


def _flip_byte(bundle: Path) -> None:
    shard = bundle / "model-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))


def _set_file(index: int, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        data["files"][index][key] = value

    return mutate


DEFECTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "flipped byte": (_flip_byte, "model-00001.safetensors: sha256 mismatch"),
    "size mismatch": (_edit(_set_file(0, "size", 7)), "model-00000.safetensors: size"),
    "hash mismatch": (_edit(_set_file(0, "sha256", "0" * 64)), "model-00000.safetensors: sha256"),
    "missing file": (
        lambda b: (b / "model-00001.safetensors").unlink(),
        "model-00001.safetensors: listed in bundle.json but missing",
    ),
    "unlisted file": (
        lambda b: (b / "notes.txt").write_text("hi"),
        "notes.txt: present in the bundle but not listed",
    ),
    "pickle path": (_edit(_set_file(0, "path", "model.pt")), "pickle-based format"),
    "pickle ckpt": (_edit(_set_file(0, "path", "weights.ckpt")), "pickle-based format"),
    "absolute path": (_edit(_set_file(0, "path", "/etc/passwd.txt")), "is absolute"),
    "dotdot path": (_edit(_set_file(0, "path", "../x.safetensors")), "'..'"),
    "unknown field": (_edit(lambda d: d.update(extra=1)), "unknown field 'extra'"),
    "unknown file field": (_edit(_set_file(0, "mode", 1)), "unknown field 'mode'"),
    "missing name": (_edit(lambda d: d.pop("name")), "missing field 'name'"),
    "bad format": (_edit(lambda d: d.update(format=3)), "unsupported format 3"),
    "bad sha": (_edit(_set_file(0, "sha256", "xyz")), "sha256 must be 64 lowercase hex"),
    "negative size": (_edit(_set_file(0, "size", -1)), "size must be a non-negative integer"),
    "files not list": (_edit(lambda d: d.update(files={})), "'files' must be a non-empty list"),
    "bad memory": (
        _edit(lambda d: d.update(memory={"weights_bytes": "x"})),
        "memory.weights_bytes must be a non-negative integer",
    ),
    "not json": (lambda b: (b / MANIFEST).write_text("{nope"), "not valid JSON"),
    "not object": (lambda b: (b / MANIFEST).write_text("[]"), "must be a JSON object"),
    "no manifest": (lambda b: (b / MANIFEST).unlink(), "no bundle.json"),
    "symlink": (
        lambda b: (
            (b / "model-00001.safetensors").unlink(),
            (b / "model-00001.safetensors").symlink_to("/etc/passwd"),
        ),
        "model-00001.safetensors: is a symbolic link",
    ),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_verify_names_each_defect_in_one_line(
    defect: str, good_bundle: Path, tmp_path: Path
) -> None:
    bundle = _copy(good_bundle, tmp_path)
    damage, expected = DEFECTS[defect]
    damage(bundle)
    result = thaw("bundle", "verify", str(bundle))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0], lines[0]


def test_parse_manifest_rejects_huge_manifest() -> None:
    with pytest.raises(BundleError, match="larger than"):
        parse_manifest(b" " * (2 * 1024 * 1024))
