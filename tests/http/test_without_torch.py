"""torch is an extra: without it the control plane serves, and a model load fails
with one clear `load-failed` naming the missing package, every time."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.support import make_bundle

NO_TORCH = Path(__file__).resolve().parent / "no_torch"


def test_without_torch_the_control_plane_serves_and_loads_fail_clearly(
    serve: Any, bundles: Path
) -> None:
    make_bundle(bundles, "alpha")
    path = os.pathsep.join([str(NO_TORCH), os.environ.get("PYTHONPATH", "")])
    server = serve(PYTHONPATH=path)
    with server.client() as client:
        assert client.post("/invoke/echo", json={"a": 1}).json() == {"a": 1}
        assert client.get("/openapi.json").status_code == 200
        models = client.get("/models")
        assert models.status_code == 200
        assert "alpha" in {m["name"] for m in models.json()["models"]}
        answers = [
            client.post("/invoke/alpha", json={}, headers={"prefer": "wait=20"}) for _ in range(2)
        ]
    for answer in answers:
        assert answer.status_code == 503, answer.text
        problem = answer.json()
        assert problem["type"].endswith("/load-failed")
        detail = problem["detail"]
        assert "'torch'" in detail and "thaw-runtime[torch]" in detail, problem
    # The server said what it serves once it listened, without importing torch.
    log = server.log()
    assert f"serving {server.url}" in log and "alpha" in log and "echo" in log
