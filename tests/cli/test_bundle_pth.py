"""`thaw bundle build` on a source directory that holds a legacy `.pth`.

Refused by default with the exact command that converts it; converted with
`--convert-pth` (tensors only: `torch.load(weights_only=True)`), and the
bundle's weights are the module's own; a checkpoint carrying a pickled
callable (an `os.system` payload) is refused without running it. Real `thaw`
processes: their exit codes and lines are the point.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def thaw(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("THAW_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


def tiny_module() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    ).eval()


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A directory as a user has it: a state dict saved with torch.save, and a config."""
    folder = tmp_path / "src"
    folder.mkdir()
    torch.save(tiny_module().state_dict(), folder / "model.pth")
    (folder / "config.json").write_text('{"layers": 2}')
    return folder


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("thaw: error:")]


def test_a_folder_with_a_pth_is_refused_with_the_command_that_converts_it(
    source: Path, tmp_path: Path
) -> None:
    result = thaw("bundle", "build", str(source), "--name", "tiny", cwd=tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    [line] = error_lines(result.stderr)
    assert "model.pth: a pickle-based checkpoint" in line
    assert f"thaw bundle build {source} --name tiny --convert-pth" in line
    assert not (source / "bundle.json").exists() and not (tmp_path / "bundles").exists()


def test_convert_pth_writes_a_bundle_whose_weights_load_into_the_module(
    source: Path, tmp_path: Path
) -> None:
    result = thaw("bundle", "build", str(source), "--name", "tiny", "--convert-pth", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "bundles" / "tiny"  # the default, said on stdout
    assert result.stdout.startswith("built tiny@sha256:") and f" in {Path('bundles/tiny')} " in (
        result.stdout
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "bundle.json",
        "config.json",
        "model.safetensors",
    ]
    assert sorted(p.name for p in source.iterdir()) == ["config.json", "model.pth"]  # untouched
    manifest = orjson.loads((out / "bundle.json").read_bytes())
    [converted] = manifest["config"]["converted"]
    assert converted["file"] == "model.pth" and converted["format"] == "pth"
    assert thaw("bundle", "verify", str(out), cwd=tmp_path).returncode == 0

    from safetensors.torch import load_file

    module = tiny_module()
    rebuilt = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )
    weights = load_file(out / "model.safetensors")
    # The training counter is dropped; every weight and running statistic is kept.
    assert set(weights) == set(module.state_dict()) - {"1.num_batches_tracked"}
    rebuilt.load_state_dict(weights, strict=False)
    rebuilt.eval()
    x = torch.randn(3, 4)
    assert torch.equal(rebuilt(x), module(x))


class Payload:
    """Unpickled, it would run a shell command that leaves a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("as_flag", [True, False])
def test_a_pickled_callable_is_refused_without_running_it(tmp_path: Path, as_flag: bool) -> None:
    folder = tmp_path / "src"
    folder.mkdir()
    marker = tmp_path / "ran"
    torch.save({"w": torch.zeros(2), "x": Payload(marker)}, folder / "model.pth")
    # A directory with --convert-pth, and the single-file form.
    src = str(folder) if as_flag else str(folder / "model.pth")
    args = ["--convert-pth"] if as_flag else []
    result = thaw("bundle", "build", src, "--name", "evil", *args, cwd=tmp_path)
    assert result.returncode == 1
    [line] = error_lines(result.stderr)
    assert "model.pth: holds a pickled posix.system; only tensors are converted" in line
    assert not marker.exists(), "the payload ran"
    assert not (tmp_path / "bundles" / "evil" / "bundle.json").exists()
