"""The /v1 routes under a real `thaw serve` process, as a user runs it: the official
client (sync) with a Thaw API key as its OpenAI key, embeddings, a streamed chat
ending in [DONE], the model list, and a wrong key. A handler module whose two
handlers claim one model name stops the server at start, naming both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.security.conftest import Launch, clean_env, launch  # noqa: F401 - the fixture
from tests.support import SAFETY_S, make_bundle

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

KEY = "sk-thaw-serve-31c9"


def test_the_official_client_against_thaw_serve(launch: Launch, tmp_path: Path) -> None:  # noqa: F811
    bundles = tmp_path / "bundles"
    make_bundle(bundles, "lexicon")
    server = launch(
        THAW_HANDLERS="tests.handlers.openai_fakes",
        THAW_BUNDLE_SOURCE=str(bundles),
        THAW_API_KEYS=KEY,
    )
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY) as oa:
        vectors = oa.embeddings.create(model="fake-embedding-3", input=["a b", "c"])
        stream = oa.chat.completions.create(
            model="fake_chat",
            messages=[{"role": "user", "content": "over real http"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        names = [model.id for model in oa.models.list()]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0) as bad:
        try:
            bad.models.list()
        except openai.AuthenticationError as exc:
            refused: openai.AuthenticationError | None = exc
        else:
            refused = None
    raw = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "fake_chat", "messages": [{"role": "user", "content": "x"}], "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=SAFETY_S,
    )
    assert [d.embedding for d in vectors.data] == [[3.0, 2.0, 0.5], [1.0, 1.0, 0.5]]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "over real http"
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert "fake-embedding-3" in names and "fake-chat" in names
    assert refused is not None and refused.code == "invalid_api_key"
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.endswith("data: [DONE]\n\n") and raw.headers["x-request-id"]
    assert server.proc is not None and server.proc.poll() is None, server.log()


def test_two_handlers_claiming_one_model_name_stop_the_server(tmp_path: Path) -> None:
    env = {**clean_env(tmp_path), "THAW_HANDLERS": "tests.handlers.openai_clash"}
    (tmp_path / "bundles").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", "serve", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=SAFETY_S,
        check=False,
    )
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert "'shared-model'" in said and "first_embed" in said and "second_embed" in said, said
