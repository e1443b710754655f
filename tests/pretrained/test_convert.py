"""Source conversions (`runtime.bundles.convert`) and the built model bundles."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from handlers import classify, embed
from runtime.bundles.convert import convert_source
from runtime.bundles.manifest import read_manifest
from runtime.errors import BundleError
from tests.pretrained.conftest import PACKAGES, require_package

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def package_file(bundle: str, *parts: str) -> Path:
    require_package(bundle)
    spec = importlib.util.find_spec(PACKAGES[bundle])
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)), *parts)


def thaw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


@pytest.fixture(params=["minilm", "smollm2", "efficientnet"])
def built_bundle(request: pytest.FixtureRequest) -> Path:
    bundle: Path = request.getfixturevalue(f"{request.param}_bundle")
    return bundle


def test_bundle_holds_only_data_files_and_verifies(built_bundle: Path) -> None:
    on_disk = sorted(p.name for p in built_bundle.rglob("*"))
    assert all(name.endswith((".safetensors", ".json", ".txt")) for name in on_disk), on_disk
    assert "model.safetensors" in on_disk
    result = thaw("bundle", "verify", str(built_bundle))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"ok {built_bundle.name}@sha256:")
    assert read_manifest(built_bundle).per_request_bytes > 0


def test_memory_plans(minilm_bundle: Path, efficientnet_bundle: Path, smollm2_bundle: Path) -> None:
    assert read_manifest(minilm_bundle).per_request_bytes == embed.PER_REQUEST_BYTES
    assert read_manifest(efficientnet_bundle).per_request_bytes == classify.PER_REQUEST_BYTES
    config = read_manifest(smollm2_bundle).config
    kv_bytes = 4 * 2 * config["num_layers"] * config["num_kv_heads"] * config["head_dim"]
    # The KV cache for the whole context dominates; activations add a bounded chunk.
    per_request = read_manifest(smollm2_bundle).per_request_bytes
    assert kv_bytes * config["max_context_tokens"] < per_request < 3 * kv_bytes * 2048
    # float16 on disk, computed in float32 on CPU: the plan counts the resident size.
    file_bytes = (smollm2_bundle / "model.safetensors").stat().st_size
    assert 1.9 * file_bytes < read_manifest(smollm2_bundle).weights_bytes < 2.1 * file_bytes


def test_gguf_conversion(smollm2_bundle: Path) -> None:
    config = read_manifest(smollm2_bundle).config
    expected = {"num_layers": 30, "hidden_size": 576, "num_heads": 9, "num_kv_heads": 3}
    assert {k: config[k] for k in expected} == expected
    assert config["vocab_size"] == 49152 and config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True and config["chat_format"] == "chatml"
    assert "<|im_start|>" in config["chat_template"]
    with safe_open(str(smollm2_bundle / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [576, 576]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F16"
        assert f.get_slice("model.norm.weight").get_dtype() == "F32"
    assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(smollm2_bundle / "tokenizer.json"))
    text = "What is the capital of France? 1234 naïve café"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert tokenizer.token_to_id("<|im_start|>") == 1 and tokenizer.token_to_id("<|im_end|>") == 2
    # Digits split one by one, as SmolLM2's pre-tokenizer does.
    assert tokenizer.encode("2024").tokens == ["2", "0", "2", "4"]


def test_pth_conversion_keeps_every_weight(efficientnet_bundle: Path) -> None:
    source = package_file("efficientnet", "models", "efficientnet-lite0-57934424.pth")
    original = torch.load(str(source), weights_only=True, map_location="cpu")
    with safe_open(str(efficientnet_bundle / "model.safetensors"), "pt") as f:
        converted = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    kept = {k for k in original if not k.endswith("num_batches_tracked")}
    assert set(converted) == kept and len(kept) < len(original)
    assert all(torch.equal(converted[k], original[k]) for k in kept)


def test_cli_converts_a_pth(tmp_path: Path) -> None:
    source = package_file("efficientnet", "models", "efficientnet-lite0-57934424.pth")
    out = tmp_path / "efficientnet"
    result = thaw("bundle", "build", str(source), "--name", "efficientnet", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "296/296 tensors (100%)" in result.stderr  # progress lines
    assert sorted(p.name for p in out.iterdir()) == ["bundle.json", "model.safetensors"]
    assert thaw("bundle", "verify", str(out)).returncode == 0


def _bad_sources(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"definitely not gguf" * 100)
    truncated = tmp_path / "truncated.gguf"
    gguf = package_file("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(gguf, "rb") as handle:
        truncated.write_bytes(handle.read(4 * 1024 * 1024))
    not_zip = tmp_path / "random.pth"
    not_zip.write_bytes(bytes(range(256)) * 64)
    pickled = tmp_path / "pickled_object.pth"
    torch.save({"w": torch.zeros(2), "args": argparse.Namespace(lr=0.1)}, pickled)
    bare = tmp_path / "bare_tensor.pth"
    torch.save(torch.zeros(3), bare)
    return {
        "garbage": (garbage, "garbage.gguf: not a readable GGUF file"),
        "truncated": (truncated, "truncated.gguf: not a readable GGUF file"),
        "not_zip": (not_zip, "random.pth: not a readable checkpoint"),
        "pickled": (pickled, "pickled_object.pth: holds a pickled argparse.Namespace"),
        "bare": (bare, "bare_tensor.pth: holds no state dict of tensors"),
    }


@pytest.mark.parametrize("case", ["garbage", "truncated", "not_zip", "pickled", "bare"])
def test_corrupt_source_is_a_clear_error(tmp_path: Path, case: str) -> None:
    source, message = _bad_sources(tmp_path)[case]
    out = tmp_path / "out"
    result = thaw("bundle", "build", str(source), "--name", "bad", "--out", str(out))
    assert result.returncode != 0
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("thaw: error:")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (out / "bundle.json").exists()


def test_convert_refuses_unknown_formats(tmp_path: Path) -> None:
    source = tmp_path / "weights.onnx"
    source.write_bytes(b"x")
    with pytest.raises(BundleError, match="no conversion"):
        convert_source(source, tmp_path / "out", sys.stderr)
