"""GET /openapi.json describes exactly the routes the app serves, with the contract's
error responses, the Prefer header and the job object."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.routing import Route

from runtime.http.app import ROUTES
from runtime.http.openapi import OPERATIONS, PROBLEM, build_openapi, http_routes
from tests.security.conftest import Launch
from tests.support import ServerProcess


@pytest.fixture(scope="module")
def document(launch_module: Launch) -> dict[str, Any]:
    server: ServerProcess = launch_module()
    response = httpx.get(f"{server.url}/openapi.json")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    served: dict[str, Any] = response.json()
    return served


def route_table() -> set[tuple[str, str]]:
    return {
        (route.path, method)
        for route in ROUTES
        if isinstance(route, Route)
        for method in (route.methods or set()) - {"HEAD"}
    }


def test_every_route_appears_with_its_methods_and_nothing_else(document: dict[str, Any]) -> None:
    described = {
        (path, method.upper()) for path, item in document["paths"].items() for method in item
    }
    assert described == route_table()
    assert ("/openapi.json", "GET") in described


def test_it_is_a_valid_openapi_31_document(document: dict[str, Any]) -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    assert document["openapi"].startswith("3.1")
    validator.validate(document)
    validator.validate(build_openapi(ROUTES, auth=True))


def test_the_served_document_is_the_built_one(document: dict[str, Any]) -> None:
    assert document == build_openapi(ROUTES, auth=False)
    assert "security" not in document  # this server has no keys


def test_error_responses_are_problem_json(document: dict[str, Any]) -> None:
    responses = document["components"]["responses"]
    for path, item in document["paths"].items():
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                if int(status) < 400 or (path, status) == ("/readyz", "503"):
                    continue  # readyz's 503 is the probe's answer, not an error
                name = response["$ref"].rsplit("/", 1)[1]
                assert PROBLEM in responses[name]["content"], (method, path, status)
    problem = document["components"]["schemas"]["Problem"]
    assert {"type", "title", "status", "detail"} <= set(problem["required"])


def test_invoke_documents_prefer_200_202_and_the_job(document: dict[str, Any]) -> None:
    invoke = document["paths"]["/invoke/{handler}"]["post"]
    assert {"$ref": "#/components/parameters/Prefer"} in invoke["parameters"]
    assert {"200", "202", "400", "404", "413", "429", "500", "503"} <= set(invoke["responses"])
    accepted = invoke["responses"]["202"]
    assert accepted["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Job"}
    assert accepted["headers"]["Location"]["required"] is True
    job = document["components"]["schemas"]["Job"]
    assert job["properties"]["status"]["enum"] == [
        "queued",
        "running",
        "succeeded",
        "failed",
        "cancelled",
    ]
    assert {"id", "handler", "status", "phase", "attempts", "created_at", "updated_at"} == set(
        job["required"]
    )
    summaries = {
        op["operationId"]: op["summary"]
        for item in document["paths"].values()
        for op in item.values()
    }
    assert summaries["invoke"].startswith("Invoke a handler")  # from the docstring


def test_a_route_without_a_description_is_refused() -> None:
    async def undocumented() -> None: ...

    with pytest.raises(KeyError, match="undocumented"):
        build_openapi([*ROUTES, Route("/x", undocumented)], auth=False)


def test_a_description_without_a_route_is_refused() -> None:
    routes = [r for r in http_routes(ROUTES) if r.endpoint.__name__ != "metrics"]
    with pytest.raises(KeyError, match="metrics"):
        build_openapi(routes, auth=False)
    assert set(OPERATIONS) == {r.endpoint.__name__ for r in http_routes(ROUTES)}
