"""`thaw bundle build`'s word on what admission and the load will assume: a bundle
built without --per-request-bytes and with nothing to estimate it from gets a
warning saying what admission reserves; a --config 'dtype' is the model's own key
(warned), Thaw's load dtype is --dtype, written to the manifest's "thaw"."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from runtime.bundles.manifest import read_manifest
from runtime.cli.main import main


def build(src: Path, *args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["bundle", "build", str(src), *args])
    return code, err.getvalue()


def source(tmp_path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.zeros(16)}, src / "model.safetensors")
    return src


def test_no_per_request_bytes_and_no_estimate_warns_what_admission_assumes(
    tmp_path: Path,
) -> None:
    code, err = build(source(tmp_path), "--name", "plain", "--out", str(tmp_path / "plain"))
    assert code == 0, err
    [warning] = [line for line in err.splitlines() if line.startswith("thaw: warning:")]
    assert "no --per-request-bytes" in warning
    manifest = read_manifest(tmp_path / "plain")
    assert manifest.per_request_bytes == 0
    weights = manifest.weights_bytes
    assert f"reserves the weights' {weights} bytes and nothing per request" in warning


def test_a_given_per_request_bytes_is_not_warned_about(tmp_path: Path) -> None:
    src = source(tmp_path)
    for given in ("0", "4096"):
        out = tmp_path / f"given-{given}"
        code, err = build(src, "--name", "given", "--out", str(out), "--per-request-bytes", given)
        assert code == 0 and "warning" not in err, err
        assert read_manifest(out).per_request_bytes == int(given)


def test_config_dtype_is_the_models_own_and_dtype_is_thaws(tmp_path: Path) -> None:
    src = source(tmp_path)
    code, err = build(
        src, "--name", "m", "--out", str(tmp_path / "m"), "--config", '{"dtype": "float16"}'
    )
    assert code == 0
    assert "--config's 'dtype' is handed to the builder as the model's own" in err
    manifest = read_manifest(tmp_path / "m")
    assert manifest.config == {"dtype": "float16"} and manifest.load_dtype is None
    code, err = build(src, "--name", "h", "--out", str(tmp_path / "h"), "--dtype", "bfloat16")
    assert code == 0, err
    converted = read_manifest(tmp_path / "h")
    assert converted.thaw == {"dtype": "bfloat16"} and converted.config == {}
