"""Error answers, in-process: a method a path does not
serve (405 with Allow), a trailing slash (404, never a redirect), and handler
output JSON cannot carry (500 invalid-output, never a silent null)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.inproc import Served, serving, settings_for

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = "application/problem+json"
HANDLERS = (
    "handlers.echo",
    "handlers.tempconv",
    "tests.handlers.nonfinite",
    "tests.handlers.unserialisable",
)


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    root = tmp_path_factory.mktemp("errors")
    settings = settings_for(root, bundle_source=str(ROOT / "bundles"), handlers=HANDLERS)
    async with serving(settings, timeout_s=90) as served:
        yield served


def problem(response: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body: dict[str, Any] = response.json()
    assert body["status"] == status and body["type"].endswith(f"/{slug}"), body
    return body


async def invoke(server: Served, handler: str, event: Any) -> httpx.Response:
    return await server.client.post(f"/invoke/{handler}", json=event, headers={"Prefer": "wait=60"})


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/invoke/echo", {"POST"}),
        ("GET", "/invoke/echo", {"POST"}),
        # Two routes share /jobs/{job_id}: the path serves both of their methods (the
        # deprecated POST /jobs/{handler} only where the segment names a handler).
        ("PATCH", "/jobs/abc", {"DELETE", "GET", "HEAD"}),
        ("POST", "/jobs/abc", {"DELETE", "GET", "HEAD"}),
        ("PATCH", "/jobs/echo", {"DELETE", "GET", "HEAD", "POST"}),
        ("GET", "/handlers/echo/jobs", {"POST"}),
        ("POST", "/healthz", {"GET", "HEAD"}),
        ("GET", "/drain", {"POST"}),
        ("DELETE", "/models", {"GET", "HEAD"}),
        ("GET", "/models/tempconv/load", {"POST"}),
        ("PUT", "/models/tempconv", {"DELETE"}),
    ],
)
async def test_a_method_the_path_does_not_serve_is_405_naming_the_ones_it_does(
    server: Served, method: str, path: str, allowed: set[str]
) -> None:
    response = await server.client.request(method, path)
    body = problem(response, 405, "method-not-allowed")
    assert {m.strip() for m in response.headers["allow"].split(",")} == allowed
    assert set(body["allow"]) == allowed
    assert method in body["detail"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/invoke/echo/"),
        ("POST", "/jobs/echo/"),
        ("POST", "/handlers/echo/jobs/"),
        ("GET", "/jobs/abc/"),
        ("GET", "/healthz/"),
        ("GET", "/models/"),
        ("POST", "/drain/"),
    ],
)
async def test_a_trailing_slash_is_404_not_a_redirect(
    server: Served, method: str, path: str
) -> None:
    response = await server.client.request(method, path, json={}, follow_redirects=False)
    problem(response, 404, "not-found")
    assert "location" not in response.headers
    assert (await server.client.get("/readyz")).status_code == 200  # nothing drained


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("form", ["float", "numpy_scalar", "numpy_float32", "numpy_array"])
@pytest.mark.parametrize("depth", [1, 6])
async def test_a_non_finite_number_anywhere_in_the_output_is_500_invalid_output(
    server: Served, value: str, form: str, depth: int
) -> None:
    event = {"value": value, "as": form, "depth": depth}
    body = problem(await invoke(server, "nonfinite", event), 500, "invalid-output")
    assert body["handler"] == "nonfinite"
    assert body["at"].startswith("$.result") and "non-finite" in body["detail"]


@pytest.mark.parametrize(
    "event",
    [
        {"value": "none", "depth": 6},
        {"value": "1.5", "as": "numpy_array", "depth": 3},
        {"value": "-2.5", "as": "numpy_float32", "depth": 2},
    ],
)
async def test_finite_output_with_nulls_is_served_as_it_is(
    server: Served, event: dict[str, Any]
) -> None:
    response = await invoke(server, "nonfinite", event)
    assert response.status_code == 200, response.text
    assert response.json()["ok"] is True
    echoed = {"a": None, "b": [1.5, None, {"c": None, "d": "null"}], "e": 1e308}
    response = await invoke(server, "echo", echoed)
    assert response.status_code == 200 and response.json() == echoed


async def test_the_shipped_fahrenheit_refuses_an_overflow_instead_of_answering_null(
    server: Served,
) -> None:
    body = problem(
        await invoke(server, "fahrenheit", {"celsius": [20.0, 1e300]}), 500, "invalid-output"
    )
    assert body["at"] == "$.fahrenheit[1]"
    served = await invoke(server, "fahrenheit", {"celsius": [20.0, -40.0]})
    assert served.status_code == 200 and served.json() == {"fahrenheit": [68.0, -40.0]}


async def test_output_json_cannot_express_is_500_invalid_output(server: Served) -> None:
    body = problem(await invoke(server, "unserialisable", {}), 500, "invalid-output")
    assert "not JSON-serialisable" in body["detail"]
    assert json.loads((await server.client.get("/healthz")).content) == {"status": "ok"}


async def test_the_openapi_document_names_these_answers(server: Served) -> None:
    document = (await server.client.get("/openapi.json")).json()
    responses = document["components"]["responses"]
    assert responses["MethodNotAllowed"]["headers"]["Allow"]["required"] is True
    assert "405" in document["info"]["description"]
    for path in ("/invoke/{handler}", "/handlers/{handler}/jobs"):
        documented = document["paths"][path]["post"]["responses"]
        assert documented["408"] == {"$ref": "#/components/responses/RequestTimeout"}
        assert documented["503"] == {"$ref": "#/components/responses/Unavailable"}
    unavailable = responses["Unavailable"]
    assert "Retry-After" in unavailable["headers"]
    assert "drained" in unavailable["description"] and "overloaded" in unavailable["description"]
    assert "invalid-output" in responses["InternalError"]["description"]
