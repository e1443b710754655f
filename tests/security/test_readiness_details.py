"""Unauthenticated /readyz says only ready or not and the class of what is wrong;
the details (a database path, a job id) go to the log and to operators."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import httpx
import pytest

from runtime.http.app import create_app
from runtime.instance import Instance
from tests.security.inprocess import OPERATOR, TENANT_A, auth, settings_under

pytestmark = pytest.mark.anyio
SECRET_DETAIL = "/srv/private/jobs.sqlite3: disk I/O error writing job Zx9-secret-job-id"


async def test_readiness_details_only_for_operators(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = settings_under(tmp_path)
    instance = Instance.create(settings)
    app = create_app(settings, instance)
    async with app.router.lifespan_context(app):
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        async with client:
            assert (await client.get("/readyz")).json() == {"status": "ready"}
            # The job store's condition, as its manager reports one it cannot write.
            with caplog.at_level(logging.ERROR, logger="thaw.health"):
                instance.health.report("job-store", SECRET_DETAIL)
            for headers in ({}, auth(TENANT_A), {"Authorization": "Bearer not-a-key"}):
                answer = await client.get("/readyz", headers=headers)
                assert answer.status_code == 503
                assert answer.json() == {
                    "status": "unhealthy",
                    "conditions": [{"condition": "job-store"}],
                }, headers
                assert "secret" not in answer.text and "/srv" not in answer.text
            detailed = await client.get("/readyz", headers=auth(OPERATOR))
            assert detailed.status_code == 503
            body = detailed.json()
            assert body["status"] == "unhealthy"
            assert body["conditions"][0]["condition"] == "job-store"
            assert body["conditions"][0]["detail"] == SECRET_DETAIL
    # The log has it for whoever runs the instance.
    assert any(SECRET_DETAIL in record.getMessage() for record in caplog.records)


async def test_a_broken_handler_module_keeps_readiness_and_tells_only_operators_where(
    tmp_path: Path,
) -> None:
    """A module that fails to import leaves the instance ready (the rest serves); a
    probe learns which module, an operator also its file, line and error."""
    module = f"thaw_broken_probe_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(
        "import os\nraise RuntimeError('/srv/private/token.txt is missing')\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        settings = settings_under(tmp_path)
        settings = dataclasses.replace(settings, handlers=(*settings.handlers, module))
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
            async with client:
                for headers in ({}, auth(TENANT_A)):
                    answer = await client.get("/readyz", headers=headers)
                    assert answer.status_code == 200
                    assert answer.json() == {
                        "status": "ready",
                        "broken_modules": [{"module": module}],
                    }
                    assert "/srv" not in answer.text
                models = await client.get("/models", headers=auth(TENANT_A))
                assert models.json()["broken_modules"] == [{"module": module, "handlers": []}]
                detailed = (await client.get("/readyz", headers=auth(OPERATOR))).json()
                [broken] = detailed["broken_modules"]
                assert broken["module"] == module and broken["line"] == 2
                assert broken["file"].endswith(f"{module}.py")
                assert broken["error"] == "RuntimeError: /srv/private/token.txt is missing"
                listed = await client.get("/models", headers=auth(OPERATOR))
                assert listed.json()["broken_modules"] == [broken]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(module, None)


async def test_problems_are_never_sniffed(tmp_path: Path) -> None:
    settings = settings_under(tmp_path)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        async with client:
            answers = [
                await client.get("/no-such-route/<script>", headers=auth(TENANT_A)),
                await client.post("/invoke/echo"),  # no key: 401 from the auth layer
                await client.post("/drain", headers=auth(TENANT_A)),  # 403
                await client.post(
                    "/invoke/echo", content=b"{not json", headers=auth(TENANT_A)
                ),  # 400
            ]
    assert [a.status_code for a in answers] == [404, 401, 403, 400]
    for answer in answers:
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.headers["x-content-type-options"] == "nosniff"
