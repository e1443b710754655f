"""Build and run Thaw's container image with no Docker engine and no registry.

    python scripts/image.py tools            buildah, podman, runc, debootstrap (as root,
                                             apt-get installs what is missing)
    python scripts/image.py base             the stand-in base image, from Debian packages
    python scripts/image.py wheels           the wheelhouse every pip in the build reads
    python scripts/image.py build [-f Dockerfile] [-t localhost/thaw:latest] [--target STAGE]
                                  [--build-arg K=V ...] [--json] [--verbose]
    python scripts/image.py size IMAGE       size and largest layers

`build` builds the Dockerfile's last stage unless told `--target`: for
Dockerfile that is the Lambda image (what `sam local` runs, template.yaml's
ImageUri), and `--target http -t localhost/thaw-http:latest` is the same image
as a plain container, run as an unprivileged user.

The Dockerfile starts `FROM python:3.11.9-slim-bookworm`; no registry can be
reached, so `base` makes a stand-in under that name: `debootstrap
--variant=minbase bookworm` with python3 and python3-venv, a venv at
/usr/local (so `python` and `pip` resolve as in the real image), docs and apt
caches dropped, imported with `podman import`. The root filesystem's tarball
is kept in the cache, so a store that lost the image gets it back in seconds.

`wheels` downloads, on the host, every wheel the image installs (torch's CPU
build included) at the versions installed in the interpreter running this
script (the project's .venv: what the tests ran against), and writes a PEP 503
index over them. `build` serves that index on 127.0.0.1 and passes it to the
Dockerfile as TORCH_INDEX_URL and PIP_INDEX_URL; the build runs in a network
namespace of its own that holds only a loopback interface (`unshare --net`),
so nothing in it can reach a network even if something tried.
The index, its server and that namespace are runtime/cli/wheelhouse.py's,
which `thaw image build --wheelhouse` (a function project's image) uses too.

buildah runs with `--isolation chroot` on overlay storage, podman and buildah
with runc, cgroupfs and file events (a containers.conf in the cache, used
through CONTAINERS_CONF unless that is set): what works on a host with no
systemd and a hybrid cgroup layout, where crun does not.

The cache is THAW_IMAGE_CACHE, default .thaw/image in the checkout.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.cli.progress import Bars

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python scripts/image.py` puts scripts/ there, not the root
    sys.path.insert(0, str(ROOT))

from runtime.cli import wheelhouse  # noqa: E402  (the standard library only)

BASE_TAG = "docker.io/library/python:3.11.9-slim-bookworm"
DEFAULT_TAG = "localhost/thaw:latest"
SUITE = "bookworm"
MIRROR = os.environ.get("THAW_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# Each is also the Debian package that provides it (runc is podman's runtime here:
# crun fails on a hybrid cgroup layout).
TOOLS = ("buildah", "podman", "runc", "debootstrap")
# Left out of the stand-in: documentation, translations, apt's downloads and lists,
# and files debootstrap copies from the host.
BASE_PRUNE = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/cache/apt",
    "var/lib/apt/lists",
    "var/cache/debconf/templates.dat-old",
    "etc/resolv.conf",
    "etc/hostname",
    "usr/local/bin/Activate.ps1",
)
# podman and buildah on a host without systemd, with a hybrid cgroup layout (crun
# fails there). podman's default limits on open files and processes are above this
# host's hard limits, which runc may not raise: containers get Lambda's 1024 of
# each unless told otherwise.
CONTAINERS_CONF = """\
# Written by scripts/image.py.
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
"""


class ImageError(Exception):
    """A step failed; the message says which and why."""


class Unavailable(ImageError):
    """The tools cannot run here (not root, no user namespaces, nothing to install them)."""


def cache_dir() -> Path:
    path = Path(os.environ.get("THAW_IMAGE_CACHE") or ROOT / ".thaw" / "image").resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def engine_env() -> dict[str, str]:
    """The environment for podman and buildah: the host's, with our containers.conf."""
    env = dict(os.environ)
    if "CONTAINERS_CONF" not in env:
        conf = cache_dir() / "containers.conf"
        if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
            conf.write_text(CONTAINERS_CONF)
        env["CONTAINERS_CONF"] = str(conf)
    return env


def run(
    argv: Sequence[str],
    *,
    what: str,
    timeout_s: float = 600.0,
    capture: bool = True,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
) -> str:
    """Run a command; its output comes back, or an ImageError naming the step."""
    try:
        done = subprocess.run(
            list(argv),
            input=stdin,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None,
            timeout=timeout_s,
            env=env if env is not None else engine_env(),
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ImageError(f"{what}: still running after {timeout_s:.0f} s") from exc
    except OSError as exc:
        raise ImageError(f"{what}: cannot run {argv[0]}: {exc.strerror}") from exc
    output = (done.stdout or b"").decode("utf-8", "replace")
    if done.returncode != 0:
        raise ImageError(f"{what} failed (exit {done.returncode}):\n{output[-4000:]}")
    return output


# -- tools ------------------------------------------------------------------------------


def unavailable_reason() -> str | None:
    """Why the image cannot be built and run here, or None."""
    if sys.platform != "linux":
        return "container builds need Linux"
    if os.geteuid() != 0:
        return "needs root: the build uses rootful buildah/podman and debootstrap"
    if shutil.which("unshare") is None:
        return "util-linux's unshare is missing"
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "true"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        return f"no user namespaces: {probe.stderr.decode(errors='replace').strip()}"
    return None


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def ensure_tools(install: bool = True) -> None:
    """Raise Unavailable unless every tool is here (as root, apt-get installs missing ones)."""
    reason = unavailable_reason()
    if reason is not None:
        raise Unavailable(reason)
    missing = missing_tools()
    if not missing:
        return
    if not install or shutil.which("apt-get") is None:
        raise Unavailable(f"missing {', '.join(missing)} and no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Waits for a dpkg lock another installer holds, rather than failing.
    apt = ["apt-get", "-q", "-o", "DPkg::Lock::Timeout=300"]
    try:
        run([*apt, "update"], what="apt-get update", env=env)
        command = [*apt, "install", "-y", "--no-install-recommends", *TOOLS]
        run(command, what="apt-get install", env=env)
    except ImageError as exc:
        raise Unavailable(f"cannot install {', '.join(missing)}: {exc}") from exc
    still = missing_tools()
    if still:
        raise Unavailable(f"apt-get installed no {', '.join(still)}")


# -- the stand-in base image ------------------------------------------------------------


def image_exists(ref: str) -> bool:
    done = subprocess.run(
        ["podman", "image", "exists", ref], env=engine_env(), capture_output=True, check=False
    )
    return done.returncode == 0


def ensure_base(tag: str = BASE_TAG) -> str:
    """The stand-in base image in the store: 'present', 'imported' or 'built'."""
    if image_exists(tag):
        return "present"
    tarball = cache_dir() / f"base-{SUITE}.tar"
    how = "imported"
    if not tarball.exists():
        how = "built"
        _debootstrap(tarball)
    run(
        [
            "podman",
            "import",
            "--change",
            "ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--change",
            "ENV LANG=C.UTF-8",
            "--change",
            'CMD ["python3"]',
            "--change",
            "LABEL io.thaw.stand-in=debootstrap",
            str(tarball),
            tag,
        ],
        what="podman import",
        timeout_s=300,
    )
    return how


def _debootstrap(tarball: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=cache_dir()))
    try:
        run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv",
                SUITE,
                str(work),
                MIRROR,
            ],
            what="debootstrap",
            timeout_s=1200,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        # A venv at /usr/local: `python` and `pip` resolve as in the python image,
        # and pip installs into /usr/local, never into Debian's own packages.
        run(
            ["chroot", str(work), "/usr/bin/python3", "-m", "venv", "/usr/local"],
            what="venv at /usr/local",
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
        )
        for relative in BASE_PRUNE:
            path = work / relative
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        for activate in (work / "usr/local/bin").glob("activate*"):
            activate.unlink()
        partial = tarball.with_suffix(".part")
        run(
            ["tar", "--numeric-owner", "--xattrs", "-C", str(work), "-cf", str(partial), "."],
            what="tar of the root filesystem",
            env=dict(os.environ),
        )
        partial.replace(tarball)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- the wheelhouse ---------------------------------------------------------------------


def torch_version(dockerfile: Path = ROOT / "Dockerfile") -> str:
    match = re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile.read_text(), re.MULTILINE)
    if match is None:
        raise ImageError(f"{dockerfile} sets no ARG TORCH_VERSION")
    return match.group(1)


def requirements() -> list[str]:
    """What the image's pip installs: torch, the project's dependencies, its build backend."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [
        f"torch=={torch_version()}",
        *project["project"]["dependencies"],
        *project["build-system"]["requires"],
    ]


def constraints() -> list[str]:
    """Pins from this interpreter's installed distributions: the versions tests ran with."""
    pins = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and _normalize(name) not in ("thaw-runtime", "thaw", "pip"):
            pins[_normalize(name)] = f"{name}=={dist.version}"
    return sorted(pins.values())


_normalize = wheelhouse.normalize


def ensure_wheels() -> tuple[Path, str]:
    """(wheelhouse, 'present' or 'downloaded'); a changed requirement set downloads afresh."""
    wanted = {"requirements": requirements(), "constraints": constraints()}
    key = hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:16]
    house = cache_dir() / "wheelhouse"
    stamp = house / "KEY"
    if stamp.exists() and stamp.read_text() == key:
        return house, "present"
    fresh = Path(tempfile.mkdtemp(prefix="wheelhouse-", dir=cache_dir()))
    try:
        (fresh / "constraints.txt").write_text("\n".join(wanted["constraints"]) + "\n")
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--only-binary=:all:",
                "--dest",
                str(fresh),
                "--constraint",
                str(fresh / "constraints.txt"),
                *wanted["requirements"],
            ],
            what="pip download",
            timeout_s=1200,
            env=dict(os.environ),
        )
        (fresh / "constraints.txt").unlink()
        wheelhouse.write_index(fresh)
        (fresh / "KEY").write_text(key)
        if house.exists():
            shutil.rmtree(house)
        fresh.replace(house)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    return house, "downloaded"


# -- the build --------------------------------------------------------------------------


@dataclass
class Layer:
    size_bytes: int
    created_by: str


@dataclass
class Figures:
    image: str
    dockerfile: str
    build_s: float
    size_bytes: int
    layers: list[Layer] = field(default_factory=list)
    base: str = ""
    wheels: str = ""
    network_isolated: bool = False


_STEP = re.compile(r"^STEP (\d+)/(\d+): (.*)$")


def follow_steps(
    argv: Sequence[str], *, what: str, live: Bars, timeout_s: float, env: dict[str, str]
) -> str:
    """Run a build whose `STEP n/N: ...` lines move a bar on the terminal; the tail
    of its output is kept for the ImageError, as `run` keeps a quiet build's."""
    task = live.add(what, None, unit="items")
    tail: collections.deque[str] = collections.deque(maxlen=200)
    try:
        proc = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
        )
    except OSError as exc:
        raise ImageError(f"{what}: cannot run {argv[0]}: {exc.strerror}") from exc
    timed_out = threading.Event()

    def expire() -> None:
        timed_out.set()
        proc.kill()

    killer = threading.Timer(timeout_s, expire)
    killer.start()
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            tail.append(line)
            step = _STEP.match(line)
            if step:
                n, total, text = int(step[1]), int(step[2]), step[3]
                short = text if len(text) <= 48 else text[:47] + "…"
                live.update(task, description=f"{what}: {short}", completed=n - 1, total=total)
        code = proc.wait()
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if timed_out.is_set():
        raise ImageError(f"{what}: still running after {timeout_s:g} s")
    output = "\n".join(tail)
    if code != 0:
        raise ImageError(f"{what} failed (exit {code}):\n{output[-4000:]}")
    live.update(task, description=f"{what}: done", completed=1, total=1)
    return output


def build(
    dockerfile: Path = ROOT / "Dockerfile",
    tag: str = DEFAULT_TAG,
    build_args: Sequence[str] = (),
    context: Path = ROOT,
    quiet: bool = True,
    as_json: bool = False,
    target: str | None = None,
) -> Figures:
    """Build `dockerfile` hermetically: stand-in base, local wheelhouse, no network.

    On a terminal (and not --json or --verbose) each stage shows a bar, and the
    build's bar follows buildah's STEP lines (runtime/cli/progress.py); piped,
    the output is what it always was.
    """
    try:
        from runtime.cli.progress import bars
    except ImportError:  # run outside the project's environment: no bars
        return _build(dockerfile, tag, build_args, context, quiet, None, target)
    with bars(as_json or not quiet) as live:
        return _build(dockerfile, tag, build_args, context, quiet, live, target)


def _build(
    dockerfile: Path,
    tag: str,
    build_args: Sequence[str],
    context: Path,
    quiet: bool,
    live: Bars | None,
    target: str | None = None,
) -> Figures:
    stage = live.add("stand-in base image", None, unit="items") if live else None
    base = ensure_base()
    if live is not None and stage is not None:
        live.update(stage, description="stand-in base image: ready", completed=1, total=1)
        stage = live.add("wheelhouse", None, unit="items")
    house, wheels = ensure_wheels()
    if live is not None and stage is not None:
        live.update(stage, description=f"wheelhouse: {wheels}", completed=1, total=1)
    request = {
        "dockerfile": str(dockerfile),
        "tag": tag,
        "build_args": list(build_args),
        "context": str(context),
        "house": str(house),
        "target": target,
        # Followed on a terminal: buildah's STEP lines are what the bar counts.
        "quiet": quiet and live is None,
    }
    isolated = wheelhouse.can_unshare_net()
    request["isolated"] = isolated
    inner = [sys.executable, str(Path(__file__).resolve()), "_offline", json.dumps(request)]
    argv = ["unshare", "--net", "--", *inner] if isolated else inner
    started = time.monotonic()
    what = f"build of {dockerfile.name}"
    if live is not None:
        follow_steps(argv, what=what, live=live, timeout_s=1800, env=engine_env())
    else:
        run(argv, what=what, timeout_s=1800, capture=quiet)
    build_s = time.monotonic() - started
    figures = measure(tag)
    figures.dockerfile = dockerfile.name
    figures.build_s = round(build_s, 1)
    figures.base, figures.wheels, figures.network_isolated = base, wheels, isolated
    return figures


def _offline(request: dict[str, object]) -> int:
    """In the build's own network namespace: serve the wheelhouse, run buildah
    (runtime/cli/wheelhouse.py, as `thaw image build --wheelhouse` does)."""
    return wheelhouse.run_in_namespace({**request, "pull": "never"})


def measure(image: str) -> Figures:
    """Size of `image` and its layers, largest first."""
    info = json.loads(run(["podman", "image", "inspect", image], what="podman image inspect"))
    history = json.loads(
        run(["podman", "history", "--no-trunc", "--format", "json", image], what="podman history")
    )
    layers = [
        Layer(int(entry.get("size") or 0), _short(str(entry.get("CreatedBy") or "")))
        for entry in history
    ]
    layers.sort(key=lambda layer: layer.size_bytes, reverse=True)
    return Figures(image, "", 0.0, int(info[0]["Size"]), [x for x in layers if x.size_bytes][:5])


def _short(created_by: str) -> str:
    text = re.sub(r"^\|\d+ (\S+=\S+ )*", "", created_by)
    text = re.sub(r"^/bin/sh -c #\(nop\) ", "", text)
    text = re.sub(r"^/bin/sh -c ", "RUN ", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= 90 else text[:87] + "..."


def _megabytes(size: int) -> str:
    return f"{size / 1e6:,.0f} MB"


def describe(figures: Figures) -> str:
    lines = [
        f"{figures.image} from {figures.dockerfile}: built in {figures.build_s:.1f} s "
        f"(base {figures.base}, wheelhouse {figures.wheels}, "
        f"network {'isolated' if figures.network_isolated else 'NOT isolated'}), "
        f"{_megabytes(figures.size_bytes)}",
        "largest layers:",
    ]
    lines += [f"  {_megabytes(x.size_bytes):>9}  {x.created_by}" for x in figures.layers]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("tools", help="check (and as root install) buildah, podman, runc, debootstrap")
    sub.add_parser("base", help="the stand-in python:3.11.9-slim-bookworm")
    sub.add_parser("wheels", help="download the wheelhouse")
    build_cmd = sub.add_parser("build", help="build an image hermetically")
    build_cmd.add_argument("-f", "--file", default=str(ROOT / "Dockerfile"))
    build_cmd.add_argument("-t", "--tag", default=DEFAULT_TAG)
    build_cmd.add_argument("--build-arg", action="append", default=[])
    build_cmd.add_argument("--target", help="the stage to build (default: the last)")
    build_cmd.add_argument("--json", action="store_true", help="print the figures as JSON")
    build_cmd.add_argument("--verbose", action="store_true", help="show buildah's output")
    size_cmd = sub.add_parser("size", help="size and largest layers of an image")
    size_cmd.add_argument("image")
    offline = sub.add_parser("_offline")  # the build, inside its own network namespace
    offline.add_argument("request")
    args = parser.parse_args(argv)
    try:
        if args.command == "_offline":
            return _offline(json.loads(args.request))
        ensure_tools()
        engine_env()  # writes the cache's containers.conf, which README's commands use
        if args.command == "tools":
            print("buildah, podman, runc and debootstrap are installed")
        elif args.command == "base":
            print(f"{BASE_TAG}: {ensure_base()}")
        elif args.command == "wheels":
            house, how = ensure_wheels()
            print(f"{house}: {how}")
        elif args.command == "build":
            figures = build(
                Path(args.file),
                args.tag,
                args.build_arg,
                quiet=not args.verbose,
                as_json=args.json,
                target=args.target,
            )
            print(json.dumps(asdict(figures), indent=2) if args.json else describe(figures))
        elif args.command == "size":
            print(describe(measure(args.image)))
    except ImageError as exc:
        print(f"image.py: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, Unavailable) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
