"""Plain keys are dropped from the environment once the settings hold them: a real
`thaw serve` whose handler code looks for them finds nothing, and the keys work."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime.settings import SECRET_VARIABLES, forget_secrets
from tests.security.conftest import bearer, clean_env
from tests.support import ServerProcess

TENANT = "tenant-key-e2a9"
OPERATOR = "operator-key-77d0"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    (tmp_path / "bundles").mkdir()
    env = {
        **clean_env(tmp_path),
        "THAW_HANDLERS": "tests.handlers.environ",
        "THAW_API_KEYS": TENANT,
        "THAW_OPERATOR_KEYS": OPERATOR,
    }
    with ServerProcess(env) as started:
        yield started


@pytest.mark.process
def test_handler_code_cannot_read_the_keys_from_the_environment(server: ServerProcess) -> None:
    names = [*SECRET_VARIABLES, "THAW_HANDLERS"]
    answer = httpx.post(
        f"{server.url}/invoke/environ", json={"names": names}, headers=bearer(TENANT), timeout=30
    )
    assert answer.status_code == 200, answer.text
    seen = answer.json()
    assert seen["THAW_API_KEYS"] is None and seen["THAW_OPERATOR_KEYS"] is None
    assert seen["THAW_HANDLERS"] == "tests.handlers.environ"  # the rest stays
    # The keys themselves still work: they live in the settings.
    refused = httpx.post(f"{server.url}/drain", headers=bearer(TENANT), timeout=30)
    assert refused.status_code == 403
    assert TENANT not in server.log_path.read_text() and OPERATOR not in server.log_path.read_text()


def test_forget_secrets_leaves_every_other_variable() -> None:
    env = {"THAW_API_KEYS": "a", "THAW_OPERATOR_KEYS": "b", "THAW_WAIT_S": "3", "HOME": "/h"}
    forget_secrets(env)
    assert env == {"THAW_WAIT_S": "3", "HOME": "/h"}
