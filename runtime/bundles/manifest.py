"""Bundle manifests: parse, validate, identify, build and verify.

A bundle is a directory holding `bundle.json` and data files (safetensors, JSON
or plain text). Its immutable id is `name@sha256:<hex>` of the canonical
manifest (sorted keys, no whitespace), so any change to a file's hash, the
config or the memory plan gives a new id.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any

import orjson

from runtime.bundles import chunks
from runtime.bundles.chunks import file_digests
from runtime.bundles.chunks import sha256_file as sha256_file  # where it was imported from
from runtime.errors import BundleError

MANIFEST = "bundle.json"
# Format 2 adds the top-level "thaw" object (Thaw's own load settings, apart from the
# model's config); format 1 manifests still load, their `config["dtype"]` as it was.
FORMAT_VERSION = 2
READ_FORMATS = frozenset({1, FORMAT_VERSION})
MAX_MANIFEST_BYTES = 1024 * 1024
DATA_SUFFIXES = frozenset({".safetensors", ".json", ".txt"})
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"})
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TOP_FIELDS = {"format", "name", "version", "files", "config", "memory", "thaw"}
# Thaw's own settings for a load (format 2): `dtype` converts floating tensors once.
_THAW_FIELDS = {"dtype"}
_FILE_FIELDS = {"path", "size", "sha256"}
# Format 2: a file's per-chunk digests (runtime/bundles/chunks.py), both or neither.
_CHUNK_FIELDS = {"chunk_bytes", "chunks"}
_MEMORY_FIELDS = {"weights_bytes", "per_request_bytes", "kv_bytes_per_token"}


@dataclass(frozen=True)
class BundleFile:
    path: str
    size: int
    sha256: str
    # Format 2: the sha256 of each `chunk_bytes` range of the file, in order (chunks.py).
    chunk_bytes: int = 0
    chunks: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"path": self.path, "size": self.size, "sha256": self.sha256}
        if self.chunks or self.chunk_bytes:
            entry.update(chunk_bytes=self.chunk_bytes, chunks=list(self.chunks))
        return entry


@dataclass(frozen=True)
class Manifest:
    name: str
    version: str
    files: tuple[BundleFile, ...]
    config: dict[str, Any] = field(default_factory=dict)
    weights_bytes: int = 0
    per_request_bytes: int = 0
    # A generation model's KV cache per token of a sequence (prompt and completion);
    # per_request_bytes holds a whole context of it. 0: not a generation model.
    kv_bytes_per_token: int = 0
    # Thaw's own load settings (format 2's top-level "thaw"): never read from `config`,
    # which is the model's own (a Hugging Face config.json, verbatim).
    thaw: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT_VERSION

    @property
    def load_dtype(self) -> str | None:
        """The dtype floating tensors are converted to once at load (None: as stored):
        `thaw.dtype` in format 2, `config["dtype"]` in format 1."""
        settings = self.thaw if self.format >= 2 else self.config
        value = settings.get("dtype")
        return None if value is None else str(value)

    # `id` and `total_bytes` are cached (a manifest is immutable): the one hashes the
    # canonical form, the other is read by the estimate of every cold request.
    @cached_property
    def id(self) -> str:
        digest = hashlib.sha256(self.canonical()).hexdigest()
        return f"{self.name}@sha256:{digest}"

    @property
    def short_id(self) -> str:
        return self.id[: len(self.name) + 1 + 7 + 12]

    @cached_property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            **({"thaw": self.thaw} if self.format >= 2 else {}),
            "name": self.name,
            "version": self.version,
            "files": [f.to_dict() for f in self.files],
            "config": self.config,
            "memory": {
                "weights_bytes": self.weights_bytes,
                "per_request_bytes": self.per_request_bytes,
                # Written only where declared: the ids of other bundles stay as they were.
                **(
                    {"kv_bytes_per_token": self.kv_bytes_per_token}
                    if self.kv_bytes_per_token
                    else {}
                ),
            },
        }

    def canonical(self) -> bytes:
        return orjson.dumps(self.to_dict(), option=orjson.OPT_SORT_KEYS)


def check_relative_path(path: Any, where: str) -> str:
    """A manifest path: relative POSIX, no `..`, an allowed data suffix."""
    if not isinstance(path, str) or not path:
        raise BundleError(f"{where}: path must be a non-empty string")
    if "\\" in path or "\x00" in path:
        raise BundleError(f"{where}: path {path!r} has a forbidden character")
    pure = PurePosixPath(path)
    if pure.is_absolute():
        raise BundleError(f"{where}: path {path!r} is absolute")
    if any(part in ("..", ".", "") for part in path.split("/")):
        raise BundleError(f"{where}: path {path!r} must not contain '..' or empty parts")
    suffix = pure.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        raise BundleError(f"{where}: {path!r} is a pickle-based format; use safetensors")
    if suffix not in DATA_SUFFIXES:
        raise BundleError(
            f"{where}: {path!r} has an unsupported type (allowed: .safetensors, .json, .txt)"
        )
    if pure.name == MANIFEST:
        raise BundleError(f"{where}: {path!r} cannot list the manifest itself")
    return path


# Byte counts past 2^53 (8 PiB) are no real bundle's, would not survive a JSON
# client's doubles, and their sums could pass the 64 bits a manifest is written in.
MAX_BYTE_COUNT = 2**53


def _non_negative_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BundleError(f"{where} must be a non-negative integer")
    if value > MAX_BYTE_COUNT:
        raise BundleError(f"{where} must be at most {MAX_BYTE_COUNT}")
    return value


def parse_manifest(raw: bytes | str) -> Manifest:
    """Parse and validate manifest text; any defect raises `BundleError`."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise BundleError(f"{MANIFEST}: larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BundleError(f"{MANIFEST}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise BundleError(f"{MANIFEST}: must be a JSON object")
    unknown = sorted(set(data) - _TOP_FIELDS)
    if unknown:
        raise BundleError(f"{MANIFEST}: unknown field {unknown[0]!r}")
    for required in ("format", "name", "version", "files"):
        if required not in data:
            raise BundleError(f"{MANIFEST}: missing field {required!r}")
    fmt = data["format"]
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt not in READ_FORMATS:
        raise BundleError(
            f"{MANIFEST}: unsupported format {fmt!r} "
            f"(this runtime reads {', '.join(map(str, sorted(READ_FORMATS)))})"
        )
    thaw = _thaw_settings(data, fmt)
    name = data["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise BundleError(f"{MANIFEST}: field 'name' must match {_NAME.pattern}")
    version = data["version"]
    if not isinstance(version, str) or not version or len(version) > 128:
        raise BundleError(f"{MANIFEST}: field 'version' must be a non-empty string")
    files_raw = data["files"]
    if not isinstance(files_raw, list) or not files_raw:
        raise BundleError(f"{MANIFEST}: field 'files' must be a non-empty list")
    files: list[BundleFile] = []
    seen: set[str] = set()
    for index, entry in enumerate(files_raw):
        where = f"{MANIFEST}: files[{index}]"
        if not isinstance(entry, dict):
            raise BundleError(f"{where} must be an object")
        extra = sorted(set(entry) - _FILE_FIELDS - (_CHUNK_FIELDS if fmt >= 2 else set()))
        if extra:
            raise BundleError(f"{where}: unknown field {extra[0]!r}")
        missing = sorted(_FILE_FIELDS - set(entry))
        if missing:
            raise BundleError(f"{where}: missing field {missing[0]!r}")
        path = check_relative_path(entry["path"], where)
        if path in seen:
            raise BundleError(f"{where}: duplicate path {path!r}")
        seen.add(path)
        size = _non_negative_int(entry["size"], f"{where}.size")
        digest = entry["sha256"]
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise BundleError(f"{where}.sha256 must be 64 lowercase hex digits")
        files.append(BundleFile(path, size, digest, *_chunk_digests(entry, size, where)))
    config = data.get("config", {})
    if not isinstance(config, dict):
        raise BundleError(f"{MANIFEST}: field 'config' must be an object")
    memory = data.get("memory", {})
    if not isinstance(memory, dict):
        raise BundleError(f"{MANIFEST}: field 'memory' must be an object")
    extra_mem = sorted(set(memory) - _MEMORY_FIELDS)
    if extra_mem:
        raise BundleError(f"{MANIFEST}: unknown field 'memory.{extra_mem[0]}'")
    weights_bytes = _non_negative_int(
        memory.get("weights_bytes", sum(f.size for f in files if f.path.endswith(".safetensors"))),
        f"{MANIFEST}: memory.weights_bytes",
    )
    per_request = _non_negative_int(
        memory.get("per_request_bytes", 0), f"{MANIFEST}: memory.per_request_bytes"
    )
    kv_per_token = _non_negative_int(
        memory.get("kv_bytes_per_token", 0), f"{MANIFEST}: memory.kv_bytes_per_token"
    )
    return Manifest(
        name, version, tuple(files), config, weights_bytes, per_request, kv_per_token, thaw, fmt
    )


def _thaw_settings(data: dict[str, Any], fmt: int) -> dict[str, Any]:
    """The manifest's "thaw" object: format 2 only, known keys only."""
    if "thaw" not in data:
        return {}
    if fmt < 2:
        raise BundleError(f"{MANIFEST}: field 'thaw' needs format 2 (this manifest is {fmt})")
    thaw = data["thaw"]
    if not isinstance(thaw, dict):
        raise BundleError(f"{MANIFEST}: field 'thaw' must be an object")
    extra = sorted(set(thaw) - _THAW_FIELDS)
    if extra:
        raise BundleError(f"{MANIFEST}: unknown field 'thaw.{extra[0]}'")
    dtype = thaw.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise BundleError(f"{MANIFEST}: field 'thaw.dtype' must be a string")
    return dict(thaw)


def _chunk_digests(entry: dict[str, Any], size: int, where: str) -> tuple[int, tuple[str, ...]]:
    """A format-2 file entry's `chunk_bytes` and `chunks`, checked against its size."""
    present = _CHUNK_FIELDS & set(entry)
    if not present:
        return 0, ()
    if present != _CHUNK_FIELDS:
        missing = sorted(_CHUNK_FIELDS - present)[0]
        raise BundleError(
            f"{where}: missing field {missing!r} (chunk_bytes and chunks go together)"
        )
    chunk_bytes = entry["chunk_bytes"]
    if (
        isinstance(chunk_bytes, bool)
        or not isinstance(chunk_bytes, int)
        or not chunks.MIN_CHUNK_BYTES <= chunk_bytes <= chunks.MAX_CHUNK_BYTES
    ):
        raise BundleError(
            f"{where}.chunk_bytes must be an integer from {chunks.MIN_CHUNK_BYTES} "
            f"to {chunks.MAX_CHUNK_BYTES}"
        )
    digests = entry["chunks"]
    expected = chunks.chunk_count(size, chunk_bytes)
    if not isinstance(digests, list) or len(digests) != expected:
        raise BundleError(
            f"{where}.chunks must list {expected} digests ({size} bytes in chunks of "
            f"{chunk_bytes}), not {len(digests) if isinstance(digests, list) else digests!r}"
        )
    for index, digest in enumerate(digests):
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise BundleError(f"{where}.chunks[{index}] must be 64 lowercase hex digits")
    return chunk_bytes, tuple(digests)


def read_manifest(bundle_dir: Path) -> Manifest:
    path = bundle_dir / MANIFEST
    try:
        st = path.lstat()
    except FileNotFoundError as exc:
        raise BundleError(f"{path}: no {MANIFEST}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise BundleError(f"{path}: must be a regular file")
    if st.st_size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{MANIFEST}: larger than {MAX_MANIFEST_BYTES} bytes")
    return parse_manifest(path.read_bytes())


def write_manifest(out_dir: Path, manifest: Manifest) -> None:
    text = orjson.dumps(manifest.to_dict(), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    tmp = out_dir / f".{MANIFEST}.tmp"
    tmp.write_bytes(text + b"\n")
    os.replace(tmp, out_dir / MANIFEST)


def build_bundle(
    src: Path,
    name: str,
    *,
    version: str = "1",
    out: Path | None = None,
    config: dict[str, Any] | None = None,
    per_request_bytes: int = 0,
    weights_bytes: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    kv_bytes_per_token: int = 0,
    thaw: dict[str, Any] | None = None,
    chunk_bytes: int = chunks.CHUNK_BYTES,
) -> Manifest:
    """Write a bundle from a directory (or one file) of safetensors/JSON/text files.

    `config` is the model's, handed to its builder as it is; `thaw` is Thaw's own
    load settings (e.g. `{"dtype": "float16"}`), written as the manifest's "thaw".

    Files are copied into `out` (default: `src` itself when it is a directory)
    and the manifest written last, so a half-built bundle has no manifest. A
    build that fails (a full disk, a bad source file) removes the copies it
    made, and `out` when it made that too: the space comes back.
    `on_progress(done, total)` is told the bytes hashed so far, of all there are.
    """
    if not _NAME.match(name):
        raise BundleError(f"name {name!r} must match {_NAME.pattern}")
    if not src.exists():
        raise BundleError(f"{src}: does not exist")
    sources = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
    root = src if src.is_dir() else src.parent
    out_dir = out if out is not None else root
    made_dir = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    copies: list[Path] = []  # what this build wrote, removed if it fails
    try:
        files: list[BundleFile] = []
        sources = [
            p for p in sources if p.relative_to(root).as_posix() != MANIFEST and p.name[0] != "."
        ]
        total = sum(p.lstat().st_size for p in sources)
        done = 0

        def hashed(n: int) -> None:
            nonlocal done
            done += n
            assert on_progress is not None
            on_progress(done, total)

        for path in sources:
            rel = path.relative_to(root).as_posix()
            check_relative_path(rel, str(path))
            if path.is_symlink():
                raise BundleError(f"{rel}: is a symbolic link")
            target = out_dir / rel
            if target.resolve() != path.resolve():
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.exists():  # a file already there is not this build's to remove
                    copies.append(target)
                shutil.copyfile(path, target)
            # A shard's chunk digests let a load check it on every core as it reads it.
            step = chunk_bytes if rel.endswith(".safetensors") else 0
            digest, parts = file_digests(target, step, hashed if on_progress is not None else None)
            files.append(
                BundleFile(rel, target.stat().st_size, digest, step if parts else 0, tuple(parts))
            )
        if not files:
            raise BundleError(f"{src}: no safetensors, JSON or text files to bundle")
        if weights_bytes is None:
            weights_bytes = sum(f.size for f in files if f.path.endswith(".safetensors"))
        manifest = Manifest(
            name=name,
            version=version,
            files=tuple(files),
            config=dict(config or {}),
            weights_bytes=weights_bytes,
            per_request_bytes=per_request_bytes,
            kv_bytes_per_token=kv_bytes_per_token,
            thaw=dict(thaw or {}),
        )
        write_manifest(out_dir, manifest)
        return manifest
    except BaseException:
        for copy in copies:
            copy.unlink(missing_ok=True)
        if made_dir:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
