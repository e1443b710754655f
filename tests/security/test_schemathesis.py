"""schemathesis's own CLI against a live `thaw serve`, as a user would run it: every
check (`--checks all`) in every phase, the coverage phase included (each path's
undocumented methods must be 405 with an `Allow` that lists exactly the
documented ones), and the stateful phase, which follows the document's links
from a 202's job to its poll and cancel. /drain is left out: it ends the server.

Three runs: the plain one a user would make (open, and with API keys), where
handler names are random and answered 404; and one that draws handler names
from a dictionary half of the time, so that requests reach a handler and make
jobs for the stateful phase to follow. `echo` is the one named there: `raises`
answers 500 by design, which `not_a_server_error` (one of "all") counts as a
failure; tests/security/test_fuzz.py covers it. That run leaves out one check,
`use_after_free`: the contract's `DELETE /jobs/{id}` cancels a job and leaves
it readable (`GET` answers it, `status: cancelled`), where the check expects a
DELETE to remove what it names. The plain runs keep it (they make no job).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.security.conftest import Launch, run_schemathesis

pytest.importorskip("schemathesis")

KEY = "schemathesis-key-7d03a1"
HANDLERS = """
[dictionaries.handlers]
values = ["echo"]

[parameters]
handler = { dictionary = "handlers", probability = 0.5 }
"""


@pytest.mark.parametrize(
    ("auth", "handlers"),
    [(False, False), (True, False), (False, True)],
    ids=["open", "keys", "jobs"],
)
def test_every_check_in_every_phase_passes(
    launch: Launch, tmp_path: Path, auth: bool, handlers: bool
) -> None:
    env = {"THAW_MAX_BODY_BYTES": "65536", "THAW_WAIT_S": "2"}
    if auth:
        env["THAW_API_KEYS"] = KEY
    server = launch(**env)
    report = run_schemathesis(
        server.url,
        tmp_path,
        HANDLERS if handlers else "",
        phases=("examples", "coverage", "fuzzing", "stateful"),
        max_examples=20,
        key=KEY if auth else None,
        extra=(
            "--exclude-path",
            "/drain",
            *(("--exclude-checks", "use_after_free") if handlers else ()),
        ),
    )
    if handlers:
        # The stateful phase followed the document's links (it made jobs and polled them).
        assert "API Links:" in report and "0 covered" not in report, report[-4000:]
    assert server.proc is not None and server.proc.poll() is None, server.log()
