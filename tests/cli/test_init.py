"""`thaw init` and project mode: a new project's shape, its tests passing as created,
and every `thaw` command in it serving its handlers and bundles only.

The `thaw` console script runs here as a user runs it (its sys.path holds the
script's directory, not the working directory), with PYTHONPATH naming this
checkout, whose own `handlers` package the project's must win over.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest

from runtime.cli.init import EXAMPLES, create
from runtime.errors import ConfigError
from runtime.settings import Settings, find_project

ROOT = Path(__file__).resolve().parents[2]
THAW = Path(sys.executable).parent / "thaw"
SHAPE = (
    "pyproject.toml",
    "template.yaml",
    "Dockerfile",
    ".gitignore",
    ".dockerignore",
    "bundles/README.md",
    "handlers/__init__.py",
    "tests/conftest.py",
)


def thaw(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(THAW), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, **env},
    )


@pytest.fixture
def blank(tmp_path: Path) -> Path:
    project = tmp_path / "my-function"
    create(project, "blank")
    return project


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_each_example_has_the_projects_shape(example: str, tmp_path: Path) -> None:
    project = tmp_path / "Some Project"
    written = create(project, example)
    for relative in SHAPE:
        assert (project / relative).is_file(), relative
    handlers = sorted(p.name for p in (project / "handlers").glob("*.py") if p.stem != "__init__")
    assert len(handlers) == 1 and (project / "tests" / f"test_{handlers[0]}").is_file()
    assert not any("{{" in p.read_text() for p in written)
    meta = tomllib.loads((project / "pyproject.toml").read_text())
    assert meta["tool"]["thaw"] == {} and meta["project"]["name"] == "some-project"
    assert meta["project"]["dependencies"] == ["thaw-runtime", *EXAMPLES[example]]
    assert find_project(project / "handlers") == project
    assert "localhost/some-project:latest" in (project / "template.yaml").read_text()


@pytest.mark.process
def test_thaw_init_says_what_next_and_refuses_a_directory_that_is_not_empty(
    tmp_path: Path,
) -> None:
    made = thaw("init", str(tmp_path / "fn"), "--example", "causal-lm", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert "thaw bundle build" in made.stdout and "thaw invoke generate" in made.stdout
    assert (tmp_path / "fn" / "handlers" / "generate.py").is_file()
    tests = tmp_path / "fn" / "tests"  # a directory that is not empty
    done = thaw("init", str(tests), cwd=tmp_path)
    assert done.returncode != 0
    assert done.stderr.startswith("thaw: error: ") and "is not empty" in done.stderr
    assert sorted(p.name for p in tests.iterdir()) == ["conftest.py", "test_generate.py"]
    assert (tests / "conftest.py").read_text().startswith('"""`invoke`')  # left as it was
    with pytest.raises(ConfigError, match="no example 'gpt'"):
        create(tmp_path / "new", "gpt")


@pytest.mark.process
def test_the_blank_projects_tests_pass_as_created(blank: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=blank,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("example", ["encoder", "causal-lm"])
def test_the_transformers_examples_tests_pass_as_created(example: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    create(tmp_path / example, example)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path / example,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout and "skipped" not in done.stdout


@pytest.mark.process
def test_a_project_serves_its_handlers_only(blank: Path) -> None:
    said = thaw("invoke", "hello", "--event", '{"name": "Ada"}', cwd=blank / "handlers")
    assert said.returncode == 0, said.stderr
    assert json.loads(said.stdout)["greeting"] == "hello, Ada"
    # The checkout's own examples are on PYTHONPATH, and not served.
    assert str(ROOT) in os.environ["PYTHONPATH"]
    missing = thaw("invoke", "echo", "--event", "{}", cwd=blank)
    assert missing.returncode != 0 and "no handler named 'echo'" in missing.stderr
    # THAW_HANDLERS still names the modules served.
    named = thaw("invoke", "echo", "--event", "{}", cwd=blank, THAW_HANDLERS="handlers.echo")
    assert named.returncode != 0 and "handlers.echo" in named.stderr  # the project's has none
    other = thaw("invoke", "hello", "--event", "{}", cwd=blank, THAW_HANDLERS="tests.handlers.echo")
    assert other.returncode != 0 and "no handler named 'hello'" in other.stderr


@pytest.mark.process
def test_a_bundle_built_anywhere_in_a_project_lands_in_its_bundles(
    blank: Path, tmp_path: Path
) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "config.json").write_text('{"model_type": "tiny", "hidden_size": 2}')
    save_file({"w": np.ones((2, 2), dtype=np.float32)}, str(saved / "model.safetensors"))
    done = thaw("bundle", "build", str(saved), "--name", "tiny", cwd=blank / "tests")
    assert done.returncode == 0, done.stderr
    assert (blank / "bundles" / "tiny" / "bundle.json").is_file()
    assert not (blank / "tests" / "bundles").exists()


@pytest.mark.process
def test_emulate_reads_the_projects_template_and_serves_its_handlers(blank: Path) -> None:
    proc = subprocess.Popen(
        [str(THAW), "emulate", "--port", "0"],
        cwd=blank / "handlers",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert "listening on http://127.0.0.1:" in first and "(Function;" in first, first
        url = first.split("listening on ")[1].split()[0]
        invoke = f"{url}/2015-03-31/functions/Function/invocations"
        said = httpx.post(invoke, json={"handler": "hello", "input": {"name": "Ada"}}, timeout=60)
        assert said.json()["output"]["greeting"] == "hello, Ada"
        assert httpx.post(f"{url}/invoke/echo", json={}, timeout=60).status_code == 404
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.process
def test_outside_a_project_the_error_says_how_to_make_one(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(THAW), "invoke", "hello"], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert done.returncode != 0
    assert "no `handlers` package to serve" in done.stderr and "thaw init" in done.stderr


def test_settings_take_the_projects_bundles_unless_told(
    blank: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(blank / "tests")
    settings = Settings.from_env({})
    assert settings.project_dir == str(blank)
    assert settings.bundle_source == str(blank / "bundles")
    assert sys.path[0] == str(blank)
    told = Settings.from_env({"THAW_BUNDLE_SOURCE": "s3://b/p"})
    assert told.bundle_source == "s3://b/p"
    monkeypatch.chdir(blank.parent)
    assert Settings.from_env({}).project_dir == "" and find_project(blank.parent) is None
    # This checkout is a project too.
    assert find_project(ROOT / "runtime" / "cli") == ROOT


def test_a_pyproject_without_the_table_is_not_a_project(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.thawing]\n')
    assert find_project(tmp_path) is None
    (tmp_path / "pyproject.toml").write_text('[tool.thaw\nname = "x"\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        find_project(tmp_path)


@pytest.mark.process
def test_the_template_passes_cfn_lint_and_the_dockerfile_hadolint(tmp_path: Path) -> None:
    create(tmp_path / "p", "encoder")
    for tool, path in (("cfn-lint", "template.yaml"), ("hadolint", "Dockerfile")):
        found = shutil.which(tool) or shutil.which(tool, path=str(Path(sys.executable).parent))
        if found is None:
            pytest.skip(f"{tool} not installed (the dev extra has it)")
        done = subprocess.run(
            [found, str(tmp_path / "p" / path)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
