"""`thaw image build`'s steps that need no container engine: the lock and the check.

The lock is resolved by pip from a wheelhouse of this machine's wheels (the
image wheelhouse scripts/image.py keeps, when it is there; else a small one
made here), for the image's interpreter; the check runs in-process on a
project, as it runs inside the image.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.cli.image import ImageBuildError, check_here, ensure_lock, read_lock
from runtime.cli.init import create

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.process  # pip runs as a process of its own


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this checkout and the wheels of what it and the blank project need
    (from pip's configured local wheel directories: no download)."""
    torch = pytest.importorskip("torch")
    if "+cpu" not in torch.__version__:
        # Pinned to a PyPI build, pip would fetch it with its CUDA wheels (gigabytes).
        pytest.skip(f"torch {torch.__version__} is not a CPU build whose wheel is local")
    house = tmp_path_factory.mktemp("wheelhouse")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    env = {**os.environ, "SOURCE_DATE_EPOCH": "315532800"}
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(house), str(ROOT)],
        check=True,
        timeout=300,
        env=env,
    )
    frozen = subprocess.run(
        [*pip, "freeze", "--exclude-editable"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    (house / "constraints.txt").write_text(
        "\n".join(p for p in frozen if "==" in p and not p.startswith("thaw")) + "\n"
    )
    done = subprocess.run(
        [*pip, "download", "--only-binary=:all:", "--dest", str(house), "--constraint",
         str(house / "constraints.txt"), "--find-links", str(house), "thaw-runtime", "torch"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"no local wheels for the runtime's dependencies: {done.stderr[-500:]}")
    (house / "constraints.txt").unlink()
    return house


def test_the_lock_is_resolved_once_from_the_wheelhouse(wheelhouse: Path, tmp_path: Path) -> None:
    create(tmp_path / "fn", "blank")
    lock, how = ensure_lock(tmp_path / "fn", gpu=False, house=wheelhouse)
    assert how == "resolved" and lock == tmp_path / "fn" / "thaw.lock"
    pins = read_lock(lock)
    import numpy
    import torch

    assert pins["torch"] == torch.__version__ and pins["numpy"] == numpy.__version__
    assert "thaw-runtime" in pins and "handlers" not in pins
    lines = [line for line in lock.read_text().splitlines() if "==" in line]
    assert len(lines) == len(pins) and all(line.endswith(" \\") for line in lines)
    assert lock.read_text().count("--hash=sha256:") == len(pins)
    # Unchanged inputs: kept as it is. A new dependency: resolved again.
    assert ensure_lock(tmp_path / "fn", gpu=False, house=wheelhouse)[1] == "kept"
    pyproject = tmp_path / "fn" / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace(
            '"thaw-runtime",', '"thaw-runtime",\n    "nothing-by-this-name-3141",'
        )
    )
    with pytest.raises(ImageBuildError, match="nothing-by-this-name-3141"):
        ensure_lock(tmp_path / "fn", gpu=False, house=wheelhouse)


def test_the_check_names_the_module_and_the_missing_package(tmp_path: Path) -> None:
    root = tmp_path / "fn"
    create(root, "blank")
    (root / "handlers" / "tables.py").write_text("import pandas_is_not_here  # noqa: F401\n")
    pyproject = root / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace('"thaw-runtime",', '"thaw-runtime",\n    "undeclared-dist",')
    )

    # In the image the check is a process of its own; here, this process's `handlers`
    # (the checkout's, if a test imported it) steps aside and comes back.
    def ours(name: str) -> bool:
        return name == "handlers" or name.startswith("handlers.")

    saved_path = list(sys.path)
    saved = {name: sys.modules.pop(name) for name in [m for m in sys.modules if ours(m)]}
    try:
        found = check_here(root)
    finally:
        sys.path[:] = saved_path
        for name in [m for m in sys.modules if ours(m)]:
            del sys.modules[name]
        sys.modules.update(saved)
    assert "handlers.hello" in found["imported"] and "runtime" in found["imported"]
    failed = {f["module"]: f for f in found["failed"]}
    assert failed["handlers.tables"]["missing"] == "pandas_is_not_here"
    assert "ModuleNotFoundError" in failed["handlers.tables"]["error"]
    assert failed["undeclared-dist"] == {
        "module": "undeclared-dist",
        "error": "not installed",
        "missing": "undeclared-dist",
    }
