"""The manifest's "thaw" object (format 2): Thaw's own load settings, apart from the
model's config, so a model's `dtype` key never changes how Thaw loads it. Format 1
manifests keep `config["dtype"]`'s meaning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from runtime.bundles.manifest import FORMAT_VERSION, build_bundle, parse_manifest, read_manifest
from runtime.errors import BundleError
from runtime.models import weights as weights_mod


def _source(tmp_path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.arange(6, dtype=torch.float32)}, src / "model.safetensors")
    return src


def _loaded_dtype(bundle_dir: Path) -> str:
    manifest = read_manifest(bundle_dir)
    weights = weights_mod.load_weights(bundle_dir, manifest, "cpu")
    return str(weights["w"].dtype).removeprefix("torch.")


def test_format_2_reads_dtype_from_thaw_never_from_config(tmp_path: Path) -> None:
    src = _source(tmp_path)
    # A Hugging Face config.json names its own dtype: the model's, not a load setting.
    model_config = {"model_type": "bert", "dtype": "float16", "torch_dtype": "bfloat16"}
    kept = build_bundle(src, "kept", out=tmp_path / "kept", config=model_config)
    assert kept.format == FORMAT_VERSION == 2 and kept.load_dtype is None
    assert _loaded_dtype(tmp_path / "kept") == "float32"
    converted = build_bundle(
        src, "half", out=tmp_path / "half", config=model_config, thaw={"dtype": "float16"}
    )
    assert converted.load_dtype == "float16" and converted.config == model_config
    assert _loaded_dtype(tmp_path / "half") == "float16"
    written = orjson.loads((tmp_path / "half" / "bundle.json").read_bytes())
    assert written["thaw"] == {"dtype": "float16"} and written["config"] == model_config


def test_format_1_keeps_config_dtype(tmp_path: Path) -> None:
    src = _source(tmp_path)
    build_bundle(src, "old", out=tmp_path / "old")
    path = tmp_path / "old" / "bundle.json"
    data = orjson.loads(path.read_bytes())
    del data["thaw"]
    for entry in data["files"]:  # format 1 has no chunk digests
        entry.pop("chunk_bytes", None)
        entry.pop("chunks", None)
    data.update(format=1, config={"dtype": "bfloat16"})
    path.write_bytes(orjson.dumps(data))
    manifest = read_manifest(tmp_path / "old")
    assert manifest.format == 1 and manifest.load_dtype == "bfloat16"
    assert _loaded_dtype(tmp_path / "old") == "bfloat16"
    # Written back as it was read: a format 1 bundle's id does not change.
    assert orjson.loads(manifest.canonical()) == data


def _manifest(**fields: Any) -> bytes:
    base: dict[str, Any] = {
        "format": 2,
        "name": "m",
        "version": "1",
        "files": [{"path": "a.json", "size": 2, "sha256": "0" * 64}],
    }
    return orjson.dumps({**base, **fields})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"format": 1, "thaw": {}}, "field 'thaw' needs format 2"),
        ({"thaw": []}, "field 'thaw' must be an object"),
        ({"thaw": {"memory": 1}}, "unknown field 'thaw.memory'"),
        ({"thaw": {"dtype": 16}}, "'thaw.dtype' must be a string"),
    ],
)
def test_bad_thaw_settings_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(BundleError, match=message):
        parse_manifest(_manifest(**fields))


def test_unknown_dtype_fails_the_load_naming_it(tmp_path: Path) -> None:
    src = _source(tmp_path)
    manifest = build_bundle(src, "odd", out=tmp_path / "odd", thaw={"dtype": "float7"})
    with pytest.raises(BundleError, match="dtype 'float7' is not one of"):
        weights_mod.load_weights(tmp_path / "odd", manifest, "cpu")
