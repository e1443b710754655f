"""API fuzzing: schemathesis reads /openapi.json from a live `thaw serve` and sends
positive and negative cases to every operation but /drain (which stops the
server). No answer is a 5xx, every error is application/problem+json, and every
answer conforms to the document (status, content type, schema, headers). With
keys on, schemathesis also checks that each operation refuses a request
without them.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.security.conftest import PROBLEM, Launch, bearer
from tests.support import ServerProcess

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

KEY = "fuzz-key-41c7e2"
EXAMPLES_PER_OPERATION = 25
# The fuzzer never sends these: /drain ends the server (tests/server covers it).
SKIPPED = {("POST", "/drain")}
# Handlers worth hitting by name, besides the fuzzer's random names (404s).
HANDLERS = ["echo", "raises"]
PINNED = {"Prefer": "wait=5", "X-Request-Id": "fuzz"}


def fuzz(server: ServerProcess, headers: dict[str, str]) -> int:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=headers)
    sent = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if (operation.method.upper(), operation.path) in SKIPPED:
            continue
        strategies = [
            operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
            # Headers are pinned in negative cases: unknown preferences and malformed
            # request ids are ignored by contract, not refused.
            operation.as_strategy(generation_mode=GenerationMode.NEGATIVE, headers=PINNED),
        ]
        if operation.path.startswith(("/invoke/", "/handlers/")):
            strategies += [
                operation.as_strategy(path_parameters={"handler": name}) for name in HANDLERS
            ]

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=st.one_of(strategies))
        def check(case: Any) -> None:
            nonlocal sent
            sent += 1
            response = case.call(base_url=server.url, headers=headers, timeout=30)
            # The one 5xx by design: 500 handler-error when user code raises.
            by_design = case.path_parameters.get("handler") == "raises" and (
                response.status_code == 500 and b"/handler-error" in response.content
            )
            assert response.status_code < 500 or by_design, (
                f"{case.method} {case.formatted_path}: {response.status_code} {response.content!r}"
            )
            if response.status_code >= 400 and case.path != "/readyz":
                content_type = response.headers.get("content-type", [""])[0]
                # The /v1 routes answer OpenAI's error body (application/json) instead.
                wanted = "application/json" if case.path.startswith("/v1/") else PROBLEM
                assert content_type == wanted, (case.method, case.formatted_path, content_type)
            case.validate_response(response, headers=headers, excluded_checks=[not_a_server_error])

        check()
    return sent


@pytest.mark.parametrize("auth", [False, True], ids=["open", "keys"])
def test_fuzz_every_operation_against_the_live_document(launch: Launch, auth: bool) -> None:
    env = {"THAW_MAX_BODY_BYTES": "65536", "THAW_WAIT_S": "2"}
    if auth:
        env["THAW_API_KEYS"] = KEY
    server = launch(**env)
    sent = fuzz(server, bearer(KEY) if auth else {})
    assert sent >= 10 * EXAMPLES_PER_OPERATION // 2
    assert server.proc is not None and server.proc.poll() is None, server.log()
