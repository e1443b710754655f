"""A new user's whole path, outside this repository, with Thaw installed as a package.

In a temporary directory: a plain venv (no system site-packages) into which
pip installs a wheel of this checkout, not editable, with its dependencies,
torch and transformers (pip's own resolution, from the indexes and wheel
directories this machine's pip is configured with); then, with that venv's
`thaw` only:

    thaw init fn --example encoder        a project of one's own
    (a tiny BertModel, save_pretrained)   the user's model
    thaw bundle build ../saved --name encoder      no --config: the HF folder as it is
    thaw invoke embed                     equal to transformers in-process (<= 1e-5)
    thaw serve                            a 202 job polled to success; Thaw's examples 404
    a builder that raises                 the user's file and line on stderr

Each step's time is printed (run with -s to see it): docs/projects.md quotes them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.process]

ROOT = Path(__file__).resolve().parents[2]
IDS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
TIMES: dict[str, float] = {}

MAKE_MODEL = """
import json, sys, torch, transformers
torch.manual_seed(0)
config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
    num_attention_heads=2, intermediate_size=64, max_position_embeddings=32)
model = transformers.BertModel(config).eval()
model.save_pretrained(sys.argv[1])
with torch.inference_mode():
    out = model(input_ids=torch.tensor(json.loads(sys.argv[2]))).last_hidden_state.mean(1)
print(json.dumps(out.tolist()))
"""

FAULTY = """\
from runtime import bundle, handler


@bundle("faulty")
def build_faulty(config):
    raise ValueError("this builder cannot build")  # line 6


@handler("boom", uses=["faulty"])
def boom(event, faulty, ctx):
    return {}
"""


def _user_env() -> dict[str, str]:
    """The environment a user's shell has: none of the suite's PYTHONPATH or THAW_*."""
    return {
        k: v
        for k, v in os.environ.items()
        if k != "PYTHONPATH" and not k.startswith(("THAW_", "VIRTUAL_ENV"))
    }


def _step(name: str, argv: list[str], cwd: Path, timeout_s: float = 600) -> str:
    started = time.monotonic()
    done = subprocess.run(
        argv, cwd=cwd, env=_user_env(), capture_output=True, text=True, timeout=timeout_s
    )
    TIMES[name] = time.monotonic() - started
    assert done.returncode == 0, f"{name}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain venv with this checkout's wheel installed (not editable), torch and
    transformers; versions pinned to the ones this suite runs with, for speed and so
    that nothing newer than what was tested is picked."""
    where = tmp_path_factory.mktemp("adopter")
    assert ROOT not in where.parents
    wheels = where / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _step(
        "pip wheel (this checkout)",
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
        cwd=where,
    )
    frozen = subprocess.run(
        [*pip, "freeze", "--exclude-editable"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    pins = [line for line in frozen if "==" in line and not line.startswith("thaw")]
    (where / "constraints.txt").write_text("\n".join(pins) + "\n")
    _step("python -m venv", [sys.executable, "-m", "venv", str(where / "venv")], cwd=where)
    python = where / "venv" / "bin" / "python"
    _step(
        "pip install thaw-runtime[torch] transformers",
        [
            str(python),
            "-m",
            "pip",
            "--disable-pip-version-check",
            "-q",
            "install",
            "--find-links",
            str(wheels),
            "--constraint",
            str(where / "constraints.txt"),
            "thaw-runtime[torch]",
            "transformers",
        ],
        cwd=where,
    )
    # Installed as a package: the runtime from site-packages, and no `handlers` package.
    probe = "import runtime, importlib.util as u; print(runtime.__file__, u.find_spec('handlers'))"
    said = subprocess.run(
        [str(python), "-c", probe],
        cwd=where,
        env=_user_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "site-packages" in said and said.strip().endswith("None"), said
    return where


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def server(venv: Path, expected: list[list[float]]) -> Iterator[str]:
    port = _free_port()
    started = time.monotonic()
    proc = subprocess.Popen(
        [str(venv / "venv" / "bin" / "thaw"), "serve", "--port", str(port)],
        cwd=venv / "fn",
        env=_user_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):  # a guard against a hang, not a bound on the start
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            pytest.fail("thaw serve never answered /healthz")
        TIMES["thaw serve (to /healthz)"] = time.monotonic() - started
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def expected(venv: Path) -> list[list[float]]:
    """The project made, the user's model saved and built into its bundles/; what
    transformers itself answers for IDS."""
    thaw = str(venv / "venv" / "bin" / "thaw")
    _step("thaw init fn --example encoder", [thaw, "init", "fn", "--example", "encoder"], venv)
    python = str(venv / "venv" / "bin" / "python")
    said = _step(
        "save_pretrained (tiny BertModel)",
        [python, "-c", MAKE_MODEL, str(venv / "saved"), json.dumps(IDS)],
        venv,
    )
    _step(
        "thaw bundle build ../saved --name encoder",
        [thaw, "bundle", "build", "../saved", "--name", "encoder"],
        venv / "fn",
    )
    assert (venv / "fn" / "bundles" / "encoder" / "bundle.json").is_file()
    answer: list[list[float]] = json.loads(said)
    return answer


def test_invoke_equals_transformers(venv: Path, expected: list[list[float]]) -> None:
    thaw = str(venv / "venv" / "bin" / "thaw")
    out = _step(
        "thaw invoke embed (cold)",
        [thaw, "invoke", "embed", "--event", json.dumps({"input_ids": IDS})],
        venv / "fn",
    )
    _assert_close(json.loads(out)["embeddings"], expected)


def test_serve_answers_a_job_and_only_the_projects_handlers(
    expected: list[list[float]], server: str
) -> None:
    started = time.monotonic()
    with httpx.Client(base_url=server, timeout=60) as client:
        answer = client.post(
            "/invoke/embed", json={"input_ids": IDS}, headers={"Prefer": "respond-async"}
        )
        assert answer.status_code == 202, answer.text
        location = answer.headers["Location"]
        while (job := client.get(location, params={"wait": 10}).json())["status"] in (
            "queued",
            "running",
        ):
            pass
        TIMES["thaw serve: 202 job to succeeded"] = time.monotonic() - started
        assert job["status"] == "succeeded", job
        _assert_close(job["output"]["embeddings"], expected)
        for example in ("echo", "fahrenheit", "classify", "generate"):
            missing = client.post(f"/invoke/{example}", json={})
            assert missing.status_code == 404, (example, missing.text)
        names = [model["name"] for model in client.get("/models").json()["models"]]
        assert names == ["encoder"]


def test_a_builder_that_raises_shows_the_users_file_and_line(
    venv: Path, expected: list[list[float]]
) -> None:
    project = venv / "fn"
    (project / "handlers" / "faulty.py").write_text(FAULTY)
    thaw = str(venv / "venv" / "bin" / "thaw")
    _step(
        "thaw bundle build (second bundle)",
        [thaw, "bundle", "build", "../saved", "--name", "faulty"],
        project,
    )
    done = subprocess.run(
        [thaw, "invoke", "boom"],
        cwd=project,
        env=_user_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert done.stdout == ""
    assert f'{project / "handlers" / "faulty.py"}", line 6' in done.stderr, done.stderr
    assert "ValueError: this builder cannot build" in done.stderr, done.stderr
    _print_times()


def _assert_close(got: list[list[float]], expected: list[list[float]]) -> None:
    assert len(got) == len(expected)
    worst = max(
        abs(a - b)
        for row, ref in zip(got, expected, strict=True)
        for a, b in zip(row, ref, strict=True)
    )
    assert worst <= 1e-5, worst


def _print_times() -> None:
    width = max(len(name) for name in TIMES)
    print("\n" + "\n".join(f"{name:<{width}}  {s:7.1f} s" for name, s in TIMES.items()))
    print(textwrap.dedent(f"  (python {sys.version.split()[0]}, {os.cpu_count()} cores)"))
