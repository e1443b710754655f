"""GET /openapi.json describes exactly the routes the app serves, with the contract's
error responses, the Prefer header and the job object; it is valid OpenAPI 3.1 (no
two paths differ only in their variables' names), its 202s link to the job's poll
and cancel, and every answer declares X-Request-Id."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from runtime.http.app import ROUTES
from runtime.http.openapi import OPERATIONS, PROBLEM, build_openapi, http_routes
from tests.inproc import serving
from tests.security.conftest import light_settings


async def fetch_document(root: Path) -> httpx.Response:
    async with serving(light_settings(root)) as served:
        return await served.client.get("/openapi.json")


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    response = asyncio.run(fetch_document(tmp_path_factory.mktemp("server")))
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    served: dict[str, Any] = response.json()
    return served


def route_table() -> set[tuple[str, str]]:
    """Every (path, method) served, but routes kept out of the document (the deprecated
    POST /jobs/{handler})."""
    return {
        # The document names a path's variables, not their convertors (`{model:path}`).
        (re.sub(r"{(\w+):\w+}", r"{\1}", route.path), method)
        for route in ROUTES
        if isinstance(route, Route) and route.include_in_schema
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
    openai_error = {"$ref": "#/components/schemas/OpenAIError"}
    for path, item in document["paths"].items():
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                if int(status) < 400 or (path, status) == ("/readyz", "503"):
                    continue  # readyz's 503 is the probe's answer, not an error
                if path.startswith("/v1/"):  # OpenAI's routes: OpenAI's error body
                    body = response["content"]["application/json"]["schema"]
                    assert body == openai_error, (method, path, status)
                    continue
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


def test_invoke_and_jobs_document_their_event_streams(document: dict[str, Any]) -> None:
    paths = document["paths"]
    for path, method in (("/invoke/{handler}", "post"), ("/jobs/{job_id}", "get")):
        content = paths[path][method]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
        assert "event: result" in content["text/event-stream"]["schema"]["description"]


def test_no_two_paths_differ_only_in_their_variables_names(document: dict[str, Any]) -> None:
    # OpenAPI 3.1 §4.8.8: templated paths with the same hierarchy but different
    # names are identical, and must not both appear.
    shapes = [re.sub(r"{[^}]+}", "{}", path) for path in document["paths"]]
    assert len(shapes) == len(set(shapes)), sorted(shapes)


def test_the_submit_route_and_its_deprecated_alias(document: dict[str, Any]) -> None:
    submit = document["paths"]["/handlers/{handler}/jobs"]["post"]
    assert submit["operationId"] == "submit_job"
    assert set(submit["responses"]) >= {"202", "400", "404", "413", "429", "503"}
    assert "/jobs/{handler}" not in document["paths"]
    served = {route.path for route in ROUTES if isinstance(route, Route)}
    assert "/jobs/{handler}" in served  # still answers, deprecated (tests/http/test_contract.py)
    assert "POST /jobs/{handler}" in document["info"]["description"]


def test_a_202_links_to_the_jobs_poll_and_cancel(document: dict[str, Any]) -> None:
    operation_ids = {
        op["operationId"] for item in document["paths"].values() for op in item.values()
    }
    for path in ("/invoke/{handler}", "/handlers/{handler}/jobs"):
        links = document["paths"][path]["post"]["responses"]["202"]["links"]
        assert links["GetJob"]["operationId"] == "get_job"
        assert links["CancelJob"]["operationId"] == "cancel_job"
        for link in links.values():
            assert link["operationId"] in operation_ids
            assert link["parameters"] == {"job_id": "$response.body#/id"}
    get_job = document["paths"]["/jobs/{job_id}"]["get"]
    assert [p["name"] for p in get_job["parameters"] if p.get("in") == "path"] == ["job_id"]


def test_every_answer_declares_x_request_id(document: dict[str, Any]) -> None:
    components = document["components"]
    assert components["headers"]["RequestId"]["required"] is True
    expected = {"$ref": "#/components/headers/RequestId"}
    for path, item in document["paths"].items():
        for method, operation in item.items():
            assert {"$ref": "#/components/parameters/RequestId"} in operation["parameters"]
            for status, response in operation["responses"].items():
                if "$ref" in response:
                    response = components["responses"][response["$ref"].rsplit("/", 1)[1]]
                assert response["headers"]["X-Request-Id"] == expected, (method, path, status)
    invoke = document["paths"]["/invoke/{handler}"]["post"]["responses"]
    for status in ("200", "202"):
        assert invoke[status]["headers"]["Vary"] == {"$ref": "#/components/headers/VaryPrefer"}
    prefer = components["parameters"]["Prefer"]
    assert "respond-async, wait=5" in prefer["examples"]["async unless quick"]["value"]


def test_a_route_without_a_description_is_refused() -> None:
    async def undocumented() -> None: ...

    with pytest.raises(KeyError, match="undocumented"):
        build_openapi([*ROUTES, Route("/x", undocumented)], auth=False)


def test_a_description_without_a_route_is_refused() -> None:
    routes = [r for r in http_routes(ROUTES) if r.endpoint.__name__ != "metrics"]
    with pytest.raises(KeyError, match="metrics"):
        build_openapi(routes, auth=False)
    assert set(OPERATIONS) == {r.endpoint.__name__ for r in http_routes(ROUTES)}
