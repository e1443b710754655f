"""schemathesis's own CLI against a live `thaw serve` on the /v1 routes only: every
check in the examples, coverage and fuzzing phases, open and with API keys. The
server serves the fake OpenAI handlers (tests/handlers/openai_fakes.py), so the
document's operations answer as they do for a user's handlers: what the fuzzer
sends is answered with a documented status, in OpenAI's error shape where it is
refused, and never a 5xx.

Half the bodies name a model the server has (a dictionary for `body.model`), so
requests reach the handlers and their answers are checked against the
document; the others name random models, each a documented 404. The examples
phase sends the document's own examples, which name the shipped handlers (not
served here: 404 in OpenAI's shape).

One check is left out, `positive_data_acceptance` (a body the document allows
must not be a 400): the document is one for every handler and states OpenAI's
bounds, which every handler is held to (`negative_data_rejection` checks them);
a handler's own, tighter limits (generate's context, the fake's 64 tokens) are
its documented 400s, which the document cannot list per handler.
tests/openai/test_errors.py checks both kinds of refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.security.conftest import Launch, launch_module, run_schemathesis  # noqa: F401
from tests.support import make_bundle

pytest.importorskip("schemathesis")

KEY = "schemathesis-openai-5e1b"
MODELS = """
[dictionaries.models]
values = ["fake_embed", "fake-embedding-3", "fake_chat", "fake-chat"]

[parameters]
"body.model" = { dictionary = "models", probability = 0.5 }
"""


@pytest.mark.parametrize("auth", [False, True], ids=["open", "keys"])
def test_every_check_passes_on_the_v1_routes(
    launch_module: Launch,  # noqa: F811
    tmp_path: Path,
    auth: bool,
) -> None:
    bundles = tmp_path / "bundles"
    make_bundle(bundles, "lexicon")
    env = {
        "THAW_HANDLERS": "tests.handlers.openai_fakes",
        "THAW_BUNDLE_SOURCE": str(bundles),
        "THAW_MAX_BODY_BYTES": "65536",
        "THAW_WAIT_S": "5",
    }
    if auth:
        env["THAW_API_KEYS"] = KEY
    server = launch_module(**env)
    report = run_schemathesis(
        server.url,
        tmp_path,
        MODELS,
        phases=("examples", "coverage", "fuzzing"),
        max_examples=30,
        key=KEY if auth else None,
        extra=("--include-path-regex", "^/v1/", "--exclude-checks", "positive_data_acceptance"),
        timeout_s=400,
    )
    assert "5 selected" in report, report[-4000:]
    # The dictionary's models reached the handlers: no operation only ever met a 404.
    assert "Missing test data" not in report, report[-4000:]
    assert server.proc is not None and server.proc.poll() is None, server.log()
