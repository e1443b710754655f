"""The /v1 routes through a Lambda Function URL under `thaw emulate`, in both invoke
modes (BUFFERED, and RESPONSE_STREAM with THAW_INVOKE_MODE), with the official
`openai` client against the emulator's Function URL: embeddings, a streamed chat
ending in [DONE], and a cold load longer than the client's timeout, waited out by
the client's own retries (the Lambda loop takes the next event while the load
goes on, so the retry lands on the same sandbox)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.emulator.conftest import Emulator, emulator_env
from tests.support import make_bundle

pytestmark = pytest.mark.process  # starts a process (tests/conftest.py)

TEMPLATE = """
AWSTemplateFormatVersion: "2010-09-09"
Transform: AWS::Serverless-2016-10-31
Resources:
  OpenAIFunction:
    Type: AWS::Serverless::Function
    Properties:
      PackageType: Image
      Timeout: 60
      FunctionUrlConfig: {{AuthType: NONE, InvokeMode: {mode}}}
      Environment:
        Variables:
          THAW_HANDLERS: tests.handlers.openai_fakes
          THAW_INVOKE_MODE: {mode}
          THAW_DEFAULT_INIT_S: "{load_s}"
"""
LOAD_S = 6.0
TIMEOUT_S = 3.0


@pytest.fixture(scope="module", params=["BUFFERED", "RESPONSE_STREAM"])
def emulated(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Emulator]:
    root = tmp_path_factory.mktemp(f"openai-{request.param.lower()}")
    env = emulator_env(root)
    make_bundle(
        root / "bundles",
        "lexicon",
        config={"sleep_s": LOAD_S, "load_log": str(root / "lexicon-loads.log")},
    )
    template = root / "template.yaml"
    template.write_text(TEMPLATE.format(mode=request.param, load_s=LOAD_S))
    emu = Emulator(root, env, "--max-sandboxes", "1", template=template)
    # The sandbox itself starts first (its process, not the model): the Lambda
    # environment's own init is not the load this module is about.
    with httpx.Client(base_url=emu.url, timeout=120) as http:
        assert http.get("/healthz").status_code == 200
    yield emu
    emu.stop()


def test_a_cold_call_then_warm_ones_through_the_function_url(emulated: Emulator) -> None:
    statuses: list[int] = []
    hooks = {"response": [lambda response: statuses.append(response.status_code)]}
    with openai.OpenAI(
        base_url=f"{emulated.url}/v1",
        api_key="k",
        timeout=TIMEOUT_S,
        http_client=openai.DefaultHttpxClient(event_hooks=hooks),  # type: ignore[arg-type]
    ) as oa:
        cold = oa.embeddings.create(model="fake_embed", input="through lambda")
        stream = oa.chat.completions.create(
            model="fake-chat",
            messages=[{"role": "user", "content": "x y z"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        whole = oa.completions.create(model="fake_chat", prompt="a b", max_tokens=1)
        with pytest.raises(openai.NotFoundError) as missing:
            oa.models.retrieve("nobody")
    assert cold.data[0].embedding == [14.0, 2.0, 0.5]
    # The cold attempt(s) answered 503 before the client's timeout, then the answer.
    first_ok = statuses.index(200)
    assert first_ok >= 1 and set(statuses[:first_ok]) == {503}, statuses
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "x y z"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert whole.choices[0].text == "a" and whole.choices[0].finish_reason == "length"
    assert missing.value.code == "model_not_found"
    assert missing.value.request_id
    loads = (emulated.out_path.parent / "lexicon-loads.log").read_text()
    assert len(loads.splitlines()) == 1  # one load, however many attempts
