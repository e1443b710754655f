"""`thaw image build`: a function project's images, from its locked dependencies.

    thaw image build [--tag T] [--wheelhouse DIR] [--gpu] [--http] [--json]

1. Lock. The project's [project].dependencies, thaw-runtime and torch (the CPU
   build; `--gpu`: the CUDA build) are resolved once, for CPython 3.11 on
   linux x86_64 (the image's interpreter), by pip itself (`pip install
   --dry-run --report`), into thaw.lock: one `name==version` line per package,
   each with its sha256 where every package's is known. A lock whose inputs
   (the dependency list, the torch build, the wheelhouse's file names) have
   not changed is used as it is; delete it to resolve again. docs/projects.md
   says why this and not `pip lock` or pip-compile.
2. Build. The project's Dockerfile installs thaw.lock with `--no-deps`; buildah
   (or podman) builds its `lambda` target (and with `--http` its `http`
   target). With `--wheelhouse DIR` every package comes from DIR, served on
   loopback to a build in a network namespace of its own
   (runtime/cli/wheelhouse.py): the build reaches no network.
3. Check. In the image, with no network, every handler module is imported and
   every declared dependency's modules too; a failure names the module and the
   missing package, and the command fails, before any invocation would have.

Only the standard library here; pip, buildah or podman are run as commands.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from runtime.cli import wheelhouse
from runtime.cli.init import project_name
from runtime.errors import ConfigError
from runtime.settings import find_project
from runtime.version import __version__

LOCK = "thaw.lock"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_CUDA_INDEX = "https://download.pytorch.org/whl/cu128"
# The image's interpreter and platform (the Dockerfile's python:3.11 on x86_64 glibc).
TARGET = (
    "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--abi", "abi3",
    "--abi", "none", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
    "--platform", "linux_x86_64", "--platform", "any",
)  # fmt: skip
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


class ImageBuildError(ConfigError):
    """A step of `thaw image build` failed; the message says which and why."""

    slug = "image-build"
    title = "Image build failed"


def build_command(args: argparse.Namespace) -> int:
    root = find_project(Path.cwd())
    if root is None:
        raise ConfigError(
            "thaw image build runs in a function project (a directory whose pyproject.toml "
            "has [tool.thaw]; `thaw init PATH` makes one)"
        )
    house = Path(args.wheelhouse).resolve() if args.wheelhouse else None
    if house is not None and not house.is_dir():
        raise ConfigError(f"--wheelhouse {args.wheelhouse}: not a directory")
    tag = args.tag or f"localhost/{project_name(root)}:latest"
    result: dict[str, Any] = {"project": str(root), "tag": tag}
    started = time.monotonic()
    lock, how = ensure_lock(root, gpu=args.gpu, house=house)
    result.update(lock=str(lock), lock_was=how, lock_s=round(time.monotonic() - started, 1))

    def say(text: str) -> None:
        if not args.json:
            print(text, file=sys.stderr)

    say(f"{LOCK}: {how} ({len(read_lock(lock))} packages)")
    targets = [("lambda", tag)] + ([("http", _http_tag(tag))] if args.http else [])
    for target, target_tag in targets:
        started = time.monotonic()
        say(f"building {target_tag} (target {target}{', offline' if house else ''})")
        build_image(root, target_tag, target, house, gpu=args.gpu)
        result[f"{target}_build_s"] = round(time.monotonic() - started, 1)
    started = time.monotonic()
    checked = check_image(tag)
    result.update(check_s=round(time.monotonic() - started, 1), imported=checked)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"built {', '.join(t for _, t in targets)}: {len(checked)} modules import")
    return 0


def _http_tag(tag: str) -> str:
    name, _, version = tag.rpartition(":") if ":" in tag.rsplit("/", 1)[-1] else (tag, "", "")
    return f"{name}:{version}-http" if version else f"{tag}:http"


# -- 1. the lock ----------------------------------------------------------------------


def requirements(root: Path) -> list[str]:
    """What the image installs: the project's dependencies, thaw-runtime, torch."""
    project = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {})
    declared = list(project.get("dependencies", []))
    names = {wheelhouse.normalize(m[1]) for d in declared if (m := _NAME.match(d))}
    wanted = [*declared]
    if "thaw-runtime" not in names:
        wanted.append("thaw-runtime")
    if "torch" not in names:
        # Which build is the index's choice (`resolve`): the CPU build is a local
        # version (+cpu) on its own index, which pip takes over PyPI's same version.
        wanted.append("torch")
    return wanted


def ensure_lock(root: Path, *, gpu: bool, house: Path | None) -> tuple[Path, str]:
    """(thaw.lock, 'kept' or 'resolved')."""
    wanted = requirements(root)
    inputs = {
        "requirements": wanted,
        "gpu": gpu,
        "wheelhouse": sorted(p.name for p in house.glob("*.whl")) if house else None,
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    lock = root / LOCK
    if lock.exists() and f"# inputs: {key}\n" in lock.read_text():
        return lock, "kept"
    pins = resolve(wanted, gpu=gpu, house=house)
    lines = [
        f"# {LOCK}: written by `thaw image build` (thaw-runtime {__version__}); the image",
        "# installs exactly this (`pip install --no-deps -r thaw.lock`). Do not edit: change",
        "# pyproject.toml's dependencies and build again (docs/projects.md).",
        f"# Resolved for CPython 3.11 on linux x86_64, torch {'CUDA' if gpu else 'CPU'} build,",
        f"# from {'the wheelhouse ' + str(house) if house else 'the package indexes'}.",
        f"# inputs: {key}",
    ]
    hashed = all(digest for _, _, digest in pins)
    for name, version, digest in pins:
        lines.append(f"{name}=={version}" + (f" \\\n    --hash=sha256:{digest}" if hashed else ""))
    lock.write_text("\n".join(lines) + "\n")
    return lock, "resolved"


def resolve(wanted: list[str], *, gpu: bool, house: Path | None) -> list[tuple[str, str, str]]:
    """(name, version, sha256 or '') of every package the image needs, sorted, as pip
    resolves them for the image's interpreter."""
    if house is not None:
        source = ["--no-index", "--find-links", str(house)]
    else:
        index = TORCH_CUDA_INDEX if gpu else TORCH_CPU_INDEX
        source = ["--extra-index-url", index]
    with tempfile.TemporaryDirectory(prefix="thaw-lock-") as tmp:
        report = Path(tmp) / "report.json"
        argv = [
            sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
            "--disable-pip-version-check", "--only-binary=:all:", *TARGET,
            "--target", str(Path(tmp) / "target"), "--report", str(report), *source, *wanted,
        ]  # fmt: skip
        env = dict(os.environ)
        if house is not None:  # DIR only: no pip.conf's or environment's indexes or links
            env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
            env["PIP_CONFIG_FILE"] = os.devnull
        done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise ImageBuildError(f"resolving {LOCK} failed:\n{done.stderr.strip()[-3000:]}")
        installs = json.loads(report.read_text())["install"]
    pins = []
    for item in installs:
        meta, info = item["metadata"], item.get("download_info", {})
        digest = info.get("archive_info", {}).get("hashes", {}).get("sha256", "")
        url = urlparse(info.get("url", ""))
        if not digest and url.scheme == "file":
            digest = wheelhouse.sha256(Path(unquote(url.path)))
        pins.append((wheelhouse.normalize(meta["name"]), meta["version"], digest))
    return sorted(pins)


def read_lock(lock: Path) -> dict[str, str]:
    """name -> version of every package thaw.lock pins."""
    pins = {}
    for line in lock.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not name.startswith("#"):
            pins[name] = version.split()[0]
    return pins


# -- 2. the build ---------------------------------------------------------------------


def _engine() -> str:
    for tool in ("buildah", "podman", "docker"):
        if shutil.which(tool):
            return tool
    raise ImageBuildError("no buildah, podman or docker on PATH to build the image with")


def build_image(root: Path, tag: str, target: str, house: Path | None, *, gpu: bool) -> None:
    index = TORCH_CUDA_INDEX if gpu else TORCH_CPU_INDEX
    request: dict[str, object] = {
        "dockerfile": str(root / "Dockerfile"),
        "context": str(root),
        "tag": tag,
        "target": target,
        "quiet": True,
    }
    if house is not None:
        if shutil.which("buildah") is None:
            raise ImageBuildError("--wheelhouse builds with buildah, which is not on PATH")
        with tempfile.TemporaryDirectory(prefix="thaw-wheelhouse-") as served:
            # The index beside links to the wheels: DIR itself is left as it was.
            for wheel in house.glob("*.whl"):
                (Path(served) / wheel.name).symlink_to(wheel)
            wheelhouse.write_index(Path(served))
            done = wheelhouse.build_offline({**request, "house": served})
        if done.returncode != 0:
            output = (done.stdout or b"").decode("utf-8", "replace")
            raise ImageBuildError(f"build of {tag} failed:\n{output[-4000:]}")
        return
    tool = _engine()
    verb = ["bud", "--layers"] if tool == "buildah" else ["build"]
    argv = [tool, *verb, "--build-arg", f"TORCH_INDEX_URL={index}", "--target", target]
    argv += ["-f", str(root / "Dockerfile"), "-t", tag, str(root)]
    ran = subprocess.run(argv, capture_output=True, text=True, check=False)
    if ran.returncode != 0:
        raise ImageBuildError(f"build of {tag} failed:\n{(ran.stdout + ran.stderr)[-4000:]}")


# -- 3. the check ---------------------------------------------------------------------


def check_image(tag: str) -> list[str]:
    """Run `check_here` in the image, with no network; the modules that imported."""
    tool = "podman" if shutil.which("podman") else "docker"
    argv = [tool, "run", "--rm", "--network", "none", "--entrypoint", "python", tag]
    argv += ["-m", "runtime.cli.image"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError) as exc:
        raise ImageBuildError(
            f"the import check in {tag} printed no result (exit {done.returncode}):\n"
            f"{(done.stdout + done.stderr)[-3000:]}"
        ) from exc
    if found["failed"]:
        lines = [
            f"  {f['module']}: {f['error']}"
            + (f" (missing package: {f['missing']})" if f.get("missing") else "")
            for f in found["failed"]
        ]
        raise ImageBuildError(f"in {tag}, modules that do not import:\n" + "\n".join(lines))
    imported: list[str] = found["imported"]
    return imported


def check_here(root: Path) -> dict[str, list[Any]]:
    """Import every handler module of the project at `root` and every top-level module
    of each declared dependency; what imported and what failed (module, error, missing)."""
    import importlib
    import importlib.metadata as metadata
    import pkgutil

    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    modules = [
        f"handlers.{m.name}"
        for m in pkgutil.iter_modules([str(root / "handlers")])
        if not m.name.startswith("_")
    ]
    project = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {})
    provides: dict[str, list[str]] = {}
    for module, dists in metadata.packages_distributions().items():
        for dist in dists:
            provides.setdefault(wheelhouse.normalize(dist), []).append(module)
    failed: list[dict[str, str]] = []
    for requirement in project.get("dependencies", []):
        match = _NAME.match(requirement)
        if match is None or ";" in requirement:
            continue
        name = wheelhouse.normalize(match[1])
        if name not in provides:
            failed.append({"module": name, "error": "not installed", "missing": name})
            continue
        modules += sorted(m for m in provides[name] if not m.startswith("_") and "." not in m)
    imported = []
    for module in dict.fromkeys(modules):
        try:
            importlib.import_module(module)
        except Exception as exc:  # user code: any error is the answer
            missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
            failed.append({"module": module, "error": f"{type(exc).__name__}: {exc}"})
            if missing:
                failed[-1]["missing"] = missing
        else:
            imported.append(module)
    return {"imported": imported, "failed": failed}


if __name__ == "__main__":
    print(json.dumps(check_here(find_project(Path.cwd()) or Path(os.getcwd()))))
