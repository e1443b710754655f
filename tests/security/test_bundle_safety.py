"""Bundle safety: links, special files, absurd headers and oversized manifests are
refused with a clear error and without allocating what they claim; a bundle
that changes after its manifest was read fails the hash check.

The server tests load through a real `thaw serve` (and measure its peak RSS);
the file-type tests drive the production `LocalSource` directly.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import struct
import threading
from pathlib import Path

import httpx
import orjson
import pytest

from runtime.bundles.manifest import MANIFEST, MAX_MANIFEST_BYTES, Manifest, build_bundle
from runtime.bundles.sources.local import LocalSource
from runtime.bundles.sources.source import Progress
from runtime.errors import BundleError, IntegrityError
from tests.security.conftest import PROBLEM, Launch
from tests.support import ServerProcess

MiB = 1024 * 1024


def write_safetensors(path: Path, values: int = 4) -> None:
    """A valid safetensors file, written by hand (no torch in the test process)."""
    header = orjson.dumps(
        {"layer.weight": {"dtype": "F32", "shape": [values], "data_offsets": [0, 4 * values]}}
    )
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * (4 * values))


def write_header_claim(path: Path, claimed_bytes: int) -> None:
    """A file whose safetensors header length claims `claimed_bytes` (it holds 64)."""
    path.write_bytes(struct.pack("<Q", claimed_bytes) + b"{" + b" " * 63)


def bundle_of(root: Path, name: str, files: dict[str, bytes]) -> Path:
    src = root / f".src-{name}"
    src.mkdir(parents=True)
    for rel, content in files.items():
        (src / rel).write_bytes(content)
    build_bundle(src, name, out=root / name)
    shutil.rmtree(src)
    return root / name


# ---- through a real server ------------------------------------------------------------


def vm_kib(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None
    return int(match.group(1))


def peak_growth_mib(server: ServerProcess, request: httpx.Request) -> tuple[httpx.Response, float]:
    """The response to `request` and how far the server's peak RSS rose above its RSS
    before it (the peak is reset first, so earlier peaks, e.g. torch's import, don't hide
    a new one)."""
    assert server.proc is not None
    pid = server.proc.pid
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # 5: reset VmHWM to VmRSS
    except OSError as exc:
        pytest.skip(f"cannot reset the peak RSS of the server: {exc}")
    before = vm_kib(pid, "VmRSS")
    with httpx.Client(timeout=90) as client:
        response = client.send(request)
    return response, (vm_kib(pid, "VmHWM") - before) / 1024


@pytest.fixture(scope="module")
def server(launch_module: Launch, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("bundles")
    src = root / ".alpha"
    src.mkdir()
    write_safetensors(src / "model.safetensors")
    build_bundle(src, "alpha", out=root / "alpha")

    src = root / ".beta"
    src.mkdir()
    write_header_claim(src / "model.safetensors", 100 * MiB)
    build_bundle(src, "beta", out=root / "beta")

    # A symlink to /etc/passwd, listed with /etc/passwd's true size and hash, so
    # only the file-type check can refuse it.
    passwd = Path("/etc/passwd").read_bytes()
    gamma = bundle_of(root, "gamma", {"passwd.txt": passwd})
    (gamma / "passwd.txt").unlink()
    (gamma / "passwd.txt").symlink_to("/etc/passwd")

    huge = root / "huge"
    huge.mkdir()
    with open(huge / MANIFEST, "wb") as handle:
        handle.truncate(50 * MiB)  # sparse: 50 MB on paper, nothing on disk
    return launch_module(
        THAW_BUNDLE_SOURCE=str(root),
        THAW_HANDLERS="tests.handlers.loadlog",
        THAW_RETRY_BACKOFF_S="0.01",
        # The first test measures the server's peak RSS around one refusal. The
        # framework preload maps torch's libraries on a thread of its own, at a time
        # no request orders (late, on a busy machine): its pages would count as the
        # refusal's, so this server loads the framework at its first load only.
        THAW_PRELOAD_FRAMEWORK="0",
    )


def invoke(server: ServerProcess, name: str) -> httpx.Request:
    return httpx.Request(
        "POST", f"{server.url}/invoke/{name}", json={}, headers={"Prefer": "wait=60"}
    )


def assert_bundle_invalid(response: httpx.Response, *fragments: str) -> None:
    assert response.status_code == 500, response.text
    assert response.headers["content-type"] == PROBLEM
    problem = response.json()
    assert problem["type"].endswith("/bundle-invalid"), problem
    for fragment in fragments:
        assert fragment in problem["detail"], problem


def test_a_50_mb_manifest_is_refused_without_reading_it(server: ServerProcess) -> None:
    # First in the module: the server has not loaded torch (nor preloaded it), so its
    # RSS is small and steady, and a 50 MB read would show plainly.
    response, growth_mib = peak_growth_mib(server, invoke(server, "huge"))
    print(f"peak RSS growth refusing a 50 MB manifest: {growth_mib:.2f} MiB")
    assert_bundle_invalid(response, f"larger than {MAX_MANIFEST_BYTES} bytes")
    assert growth_mib < 16, f"peak RSS rose {growth_mib:.1f} MiB refusing a 50 MB manifest"


def test_a_symlink_to_etc_passwd_is_refused(server: ServerProcess) -> None:
    with httpx.Client(timeout=90) as client:
        response = client.send(invoke(server, "gamma"))
    assert_bundle_invalid(response, "passwd.txt", "symbolic link")
    assert "root:" not in response.text


def test_a_100_mb_header_claim_is_refused_without_allocating_it(server: ServerProcess) -> None:
    with httpx.Client(timeout=90) as client:
        warm = client.send(invoke(server, "alpha"))  # imports torch, loads a good bundle
    assert warm.status_code == 200, warm.text
    response, growth_mib = peak_growth_mib(server, invoke(server, "beta"))
    print(f"peak RSS growth refusing a 100 MB header claim: {growth_mib:.2f} MiB")
    assert_bundle_invalid(response, f"header claims {100 * MiB} bytes")
    assert growth_mib < 32, f"peak RSS rose {growth_mib:.1f} MiB refusing a 100 MB header"
    assert httpx.get(f"{server.url}/healthz").status_code == 200


# ---- the local source, directly ---------------------------------------------------------


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "bundles").mkdir()
    return tmp_path / "bundles"


def fetch(root: Path, name: str) -> Path:
    source = LocalSource(root)
    return source.fetch(source.manifest(name), lambda n: None)


def fetch_with_timeout(root: Path, name: str, timeout_s: float = 10.0) -> BaseException | None:
    """fetch in a daemon thread: a reader that opens a FIFO would block forever."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fetch(root, name)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert outcome, f"fetch still running after {timeout_s} s: it opened a special file"
    return outcome[0]


def test_an_intact_bundle_fetches(root: Path) -> None:
    bundle_of(root, "ok", {"a.txt": b"a", "b.json": b"{}"})
    assert fetch(root, "ok") == root / "ok"


def test_a_hard_link_to_an_outside_file_is_refused(root: Path) -> None:
    secret = root.parent / "outside.txt"
    secret.write_bytes(b"outside data")
    bundle = bundle_of(root, "hard", {"data.txt": b"outside data"})
    (bundle / "data.txt").unlink()
    os.link(secret, bundle / "data.txt")  # same bytes, same hash: only the link count tells
    with pytest.raises(BundleError, match=r"data\.txt: has 2 hard links"):
        fetch(root, "hard")


def test_a_symlink_inside_the_bundle_is_refused(root: Path) -> None:
    outside = root.parent / "outside.txt"
    outside.write_bytes(b"same")
    bundle = bundle_of(root, "sym", {"data.txt": b"same"})
    (bundle / "data.txt").unlink()
    (bundle / "data.txt").symlink_to(outside)
    with pytest.raises(BundleError, match=r"data\.txt: is a symbolic link"):
        fetch(root, "sym")


def test_a_symlinked_directory_is_refused(root: Path) -> None:
    outside = root.parent / "elsewhere"
    outside.mkdir()
    (outside / "x.txt").write_bytes(b"x")
    bundle = bundle_of(root, "dirlink", {"keep.txt": b"k"})
    manifest = orjson.loads((bundle / MANIFEST).read_bytes())
    digest = hashlib.sha256(b"x").hexdigest()
    manifest["files"].append({"path": "sub/x.txt", "size": 1, "sha256": digest})
    (bundle / MANIFEST).write_bytes(orjson.dumps(manifest))
    (bundle / "sub").symlink_to(outside, target_is_directory=True)
    with pytest.raises(BundleError, match="sub"):
        fetch(root, "dirlink")


def test_a_symlinked_manifest_is_refused(root: Path) -> None:
    real = bundle_of(root.parent, "linked", {"a.txt": b"a"})
    (root / "linked").mkdir()
    (root / "linked" / "a.txt").write_bytes(b"a")
    (root / "linked" / MANIFEST).symlink_to(real / MANIFEST)
    with pytest.raises(BundleError, match="must be a regular file"):
        LocalSource(root).manifest("linked")


def test_a_fifo_is_refused_without_opening_it(root: Path) -> None:
    bundle = bundle_of(root, "fifo", {"data.txt": b""})
    (bundle / "data.txt").unlink()
    os.mkfifo(bundle / "data.txt")
    error = fetch_with_timeout(root, "fifo")
    assert isinstance(error, BundleError) and "is not a regular file" in str(error)


def test_a_device_file_is_refused(root: Path) -> None:
    bundle = bundle_of(root, "dev", {"data.txt": b""})
    (bundle / "data.txt").unlink()
    try:
        os.mknod(bundle / "data.txt", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    error = fetch_with_timeout(root, "dev")
    assert isinstance(error, BundleError) and "is not a regular file" in str(error)


class ChangesAfterManifest(LocalSource):
    """A source whose bundle changes between reading the manifest and fetching it: the
    window in which the runtime estimates and admits a load before touching files."""

    def __init__(self, root: Path, rel: str, content: bytes) -> None:
        super().__init__(root)
        self.rel = rel
        self.content = content

    def fetch(self, manifest: Manifest, on_progress: Progress) -> Path:
        path = self.root / manifest.name / self.rel
        tmp = path.with_name(".swap")
        tmp.write_bytes(self.content)
        os.replace(tmp, path)  # an atomic swap, as a deploy tool would do it
        return super().fetch(manifest, on_progress)


@pytest.mark.parametrize(
    ("content", "error"),
    [(b"model-v2", "sha256 mismatch"), (b"model-v2-longer", "does not match manifest size")],
)
def test_a_shard_swapped_after_the_manifest_read_fails_the_check(
    root: Path, content: bytes, error: str
) -> None:
    bundle_of(root, "swapped", {"weights.txt": b"model-v1"})
    source = ChangesAfterManifest(root, "weights.txt", content)
    manifest = source.manifest("swapped")
    with pytest.raises(IntegrityError, match=error):
        source.fetch(manifest, lambda n: None)
