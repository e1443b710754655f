"""A function project's image (`thaw image build`), built offline from a wheelhouse and run.

A project made by `thaw init --example encoder` (its declared dependency:
transformers), a tiny BertModel saved with `save_pretrained` and built into its
bundles/. `thaw image build --wheelhouse DIR` locks the dependencies into
thaw.lock and builds the Lambda image with buildah in a network namespace that
holds only loopback (runtime/cli/wheelhouse.py), on the stand-in base image
scripts/image.py makes. Then: a handler module importing a package the project
did not declare fails the build, naming the module and the package; the
project's declared dependency imports in the image; and the handler answers
through `thaw emulate --image` as transformers does in-process.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.cli.init import create
from runtime.cli.main import main as thaw
from scripts import image as image_script
from tests.deploy.conftest import ROOT, record
from tests.emulator.conftest import Emulator
from tests.emulator.test_invoke_api import lambda_client

pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.process]

TAG = "localhost/thaw-test-project:latest"
IDS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]


@pytest.fixture(scope="module")
def engine_env() -> dict[str, str]:
    """The tools and the stand-in base image, or a skip saying why they cannot be had."""
    with (image_script.cache_dir() / "prepare.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # beside tests/deploy/conftest.py's preparation
        try:
            image_script.ensure_tools()
            image_script.ensure_base()
        except image_script.Unavailable as exc:
            pytest.skip(f"container image tests: {exc}")
    return image_script.engine_env()


@pytest.fixture(scope="module")
def wheelhouse(engine_env: dict[str, str]) -> Path:
    """The repository image's wheelhouse, plus transformers with its dependencies (at
    this suite's versions) and a wheel of this checkout: everything the project's image
    installs, and nothing fetched during the build."""
    transformers = pytest.importorskip("transformers")
    with (image_script.cache_dir() / "prepare.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        base, _ = image_script.ensure_wheels()
    key = hashlib.sha256(
        f"{(base / 'KEY').read_text()} {transformers.__version__}".encode()
    ).hexdigest()[:16]
    house = image_script.cache_dir() / "project-wheelhouse"
    if not (house / "KEY").exists() or (house / "KEY").read_text() != key:
        shutil.rmtree(house, ignore_errors=True)
        house.mkdir()
        constraints = house / "constraints.txt"
        constraints.write_text("\n".join(image_script.constraints()) + "\n")
        download = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:"]
        download += ["--dest", str(house), "--constraint", str(constraints), "transformers"]
        subprocess.run(download, check=True, timeout=900)
        constraints.unlink()
        (house / "KEY").write_text(key)
    for wheel in base.glob("*.whl"):
        if not (house / wheel.name).exists():
            shutil.copy2(wheel, house / wheel.name)
    for old in house.glob("thaw_runtime-*.whl"):
        old.unlink()
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    # Zip entries dated by SOURCE_DATE_EPOCH: the same code makes the same wheel, the
    # same thaw.lock and so a cached install layer.
    env = {**os.environ, "SOURCE_DATE_EPOCH": "315532800"}
    subprocess.run([*build, "-w", str(house), str(ROOT)], check=True, timeout=300, env=env)
    return house


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[float]]]:
    """The encoder project with its bundle built; what transformers answers for IDS."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    where = tmp_path_factory.mktemp("project")
    create(where / "fn", "encoder")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    model = transformers.BertModel(config).eval()
    model.save_pretrained(where / "saved")
    built = thaw(["bundle", "build", str(where / "saved"), "--name", "encoder", "--out",
                  str(where / "fn" / "bundles" / "encoder")])  # fmt: skip
    assert built == 0
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor(IDS)).last_hidden_state.mean(1).tolist()
    return where / "fn", expected


def image_build(root: Path, house: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [str(Path(sys.executable).parent / "thaw"), "image", "build", "--json"]
    argv += ["--wheelhouse", str(house), "--tag", TAG]
    run_env = {k: v for k, v in env.items() if k != "PYTHONPATH" and not k.startswith("THAW_")}
    return subprocess.run(argv, cwd=root, env=run_env, capture_output=True, text=True, timeout=1800)


@pytest.fixture(scope="module")
def built(
    project: tuple[Path, list[list[float]]], wheelhouse: Path, engine_env: dict[str, str]
) -> Iterator[dict[str, object]]:
    root, _ = project
    done = image_build(root, wheelhouse, engine_env)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    record(
        "project_image", {k: v for k, v in result.items() if k.endswith("_s") or k == "lock_was"}
    )
    yield result
    subprocess.run(["podman", "rmi", TAG], env=engine_env, capture_output=True, check=False)


def test_the_lock_pins_the_declared_dependency_and_the_cpu_torch(
    built: dict[str, object], project: tuple[Path, list[list[float]]]
) -> None:
    root, _ = project
    lock = (root / "thaw.lock").read_text()
    import torch
    import transformers

    assert f"transformers=={transformers.__version__} " in lock
    assert f"torch=={torch.__version__} " in lock and "+cpu" in torch.__version__
    assert "thaw-runtime==" in lock and "--hash=sha256:" in lock
    assert {"handlers.encoder", "transformers", "runtime"} <= set(built["imported"])  # type: ignore[call-overload]


def test_the_declared_dependency_imports_in_the_image(
    built: dict[str, object], engine_env: dict[str, str]
) -> None:
    import transformers

    probe = "import transformers, tokenizers; print(transformers.__version__)"
    argv = ["podman", "run", "--rm", "--network", "none", "--entrypoint", "python", TAG]
    done = subprocess.run(
        [*argv, "-c", probe], env=engine_env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == transformers.__version__


def test_the_handler_answers_through_thaw_emulate_image(
    built: dict[str, object],
    project: tuple[Path, list[list[float]]],
    engine_env: dict[str, str],
    tmp_path: Path,
) -> None:
    root, expected = project
    env = {k: v for k, v in engine_env.items() if not k.startswith(("THAW_", "AWS_LAMBDA"))}
    env["THAW_STATE_DIR"] = str(tmp_path / "state")
    emulator = Emulator(tmp_path / "emulator", env, "--image", TAG, template=root / "template.yaml")
    try:
        client = lambda_client(emulator)
        payload = json.dumps({"handler": "embed", "input": {"input_ids": IDS}}).encode()
        answer = client.invoke(FunctionName="Function", Payload=payload)
        assert "FunctionError" not in answer, answer["Payload"].read()
        said = json.loads(answer["Payload"].read())
        while said.get("thaw") == "job" and said.get("status") in ("queued", "running"):
            # A cold start longer than the wait (a busy machine): polled, as a caller does.
            poll = json.dumps({**said["poll"], "wait_s": 30}).encode()
            said = json.loads(
                client.invoke(FunctionName="Function", Payload=poll)["Payload"].read()
            )
        assert "output" in said, said
        got = said["output"]["embeddings"]
        worst = max(
            abs(a - b)
            for row, ref in zip(got, expected, strict=True)
            for a, b in zip(row, ref, strict=True)
        )
        assert worst <= 1e-5, worst
        # Only the project's handlers are in the image.
        with emulator.client() as http:
            assert http.post("/invoke/echo", json={}).status_code == 404
    finally:
        code = emulator.stop()
    assert code == 0, emulator.errors()


def test_a_handler_importing_an_undeclared_package_fails_the_build(
    built: dict[str, object],
    project: tuple[Path, list[list[float]]],
    wheelhouse: Path,
    engine_env: dict[str, str],
) -> None:
    root, _ = project
    module = root / "handlers" / "tables.py"
    module.write_text('"""Reads tables."""\n\nimport pandas  # noqa: F401\n')
    try:
        done = image_build(root, wheelhouse, engine_env)
    finally:
        module.unlink()
    assert done.returncode != 0
    assert "handlers.tables" in done.stderr and "missing package: pandas" in done.stderr
    assert done.stderr.count("\n") < 20, done.stderr  # the finding, not a build log
    assert os.path.exists(root / "thaw.lock")
