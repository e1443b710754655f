"""Error answers against a real `thaw serve` process: a method a path does not
serve (405 with Allow), a trailing slash (404, never a redirect), and handler
output JSON cannot carry (500 invalid-output, never a silent null)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("errors")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THAW_", "AWS_LAMBDA"))}
    env.update(
        {
            "THAW_CACHE_DIR": str(root / "cache"),
            "THAW_STATE_DIR": str(root / "state"),
            "THAW_JOB_STORE": f"sqlite:///{root / 'jobs.sqlite3'}",
            "THAW_BUNDLE_SOURCE": str(ROOT / "bundles"),
            "THAW_HANDLERS": (
                "handlers.echo,handlers.tempconv,tests.handlers.nonfinite,"
                "tests.handlers.unserialisable"
            ),
            "PYTHONUNBUFFERED": "1",
        }
    )
    with ServerProcess(env) as started:
        yield started


def problem(response: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body: dict[str, Any] = response.json()
    assert body["status"] == status and body["type"].endswith(f"/{slug}"), body
    return body


def invoke(server: ServerProcess, handler: str, event: Any) -> httpx.Response:
    return httpx.post(
        f"{server.url}/invoke/{handler}", json=event, headers={"Prefer": "wait=60"}, timeout=90
    )


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
def test_a_method_the_path_does_not_serve_is_405_naming_the_ones_it_does(
    server: ServerProcess, method: str, path: str, allowed: set[str]
) -> None:
    response = httpx.request(method, f"{server.url}{path}")
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
def test_a_trailing_slash_is_404_not_a_redirect(
    server: ServerProcess, method: str, path: str
) -> None:
    response = httpx.request(method, f"{server.url}{path}", json={}, follow_redirects=False)
    problem(response, 404, "not-found")
    assert "location" not in response.headers
    assert httpx.get(f"{server.url}/readyz").status_code == 200  # nothing drained


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("form", ["float", "numpy_scalar", "numpy_float32", "numpy_array"])
@pytest.mark.parametrize("depth", [1, 6])
def test_a_non_finite_number_anywhere_in_the_output_is_500_invalid_output(
    server: ServerProcess, value: str, form: str, depth: int
) -> None:
    event = {"value": value, "as": form, "depth": depth}
    body = problem(invoke(server, "nonfinite", event), 500, "invalid-output")
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
def test_finite_output_with_nulls_is_served_as_it_is(
    server: ServerProcess, event: dict[str, Any]
) -> None:
    response = invoke(server, "nonfinite", event)
    assert response.status_code == 200, response.text
    assert response.json()["ok"] is True
    echoed = {"a": None, "b": [1.5, None, {"c": None, "d": "null"}], "e": 1e308}
    response = invoke(server, "echo", echoed)
    assert response.status_code == 200 and response.json() == echoed


def test_the_shipped_fahrenheit_refuses_an_overflow_instead_of_answering_null(
    server: ServerProcess,
) -> None:
    body = problem(invoke(server, "fahrenheit", {"celsius": [20.0, 1e300]}), 500, "invalid-output")
    assert body["at"] == "$.fahrenheit[1]"
    served = invoke(server, "fahrenheit", {"celsius": [20.0, -40.0]})
    assert served.status_code == 200 and served.json() == {"fahrenheit": [68.0, -40.0]}


def test_output_json_cannot_express_is_500_invalid_output(server: ServerProcess) -> None:
    body = problem(invoke(server, "unserialisable", {}), 500, "invalid-output")
    assert "not JSON-serialisable" in body["detail"]
    assert json.loads(httpx.get(f"{server.url}/healthz").content) == {"status": "ok"}


def test_the_openapi_document_names_these_answers(server: ServerProcess) -> None:
    document = httpx.get(f"{server.url}/openapi.json").json()
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
