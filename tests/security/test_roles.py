"""Keys have roles: a tenant key reaches invocations and its own jobs, never the
instance-wide actions (drain, load, unload), which only an operator key
reaches; a Function URL never reaches them at all; docs/security.md names the
key of every route."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import orjson
import pytest
from starlette.routing import Route

from runtime.aws.events import (
    HttpRequest,
    event_from_request,
    is_operator_route,
    request_from_event,
)
from runtime.errors import NotFound
from runtime.http.app import ROUTES
from runtime.http.auth import KeyRing, hash_line, key_id
from runtime.http.openapi import OPERATOR_ONLY
from tests.security.inprocess import OPERATOR, TENANT_A, auth, serving, settings_under

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]
INSTANCE_WIDE = [
    ("POST", "/drain"),
    ("POST", "/models/tempconv/load"),
    ("DELETE", "/models/tempconv"),
]


def concrete(route: Route) -> str:
    """A path the route matches: every `{param}` named `echo`."""
    return re.sub(r"\{[^}]+\}", "echo", route.path)


def routes() -> list[tuple[str, str, str]]:
    """(method, path, endpoint name) of every route of the app."""
    found = []
    for route in ROUTES:
        assert isinstance(route, Route)
        for method in sorted((route.methods or set()) - {"HEAD"}):
            found.append((method, concrete(route), route.endpoint.__name__))
    return found


async def test_a_tenant_key_reaches_no_instance_wide_action(tmp_path: Path) -> None:
    async with serving(settings_under(tmp_path)) as (app, client):
        for method, path in INSTANCE_WIDE:
            answer = await client.request(method, path, headers=auth(TENANT_A))
            assert answer.status_code == 403, (method, path, answer.text)
            assert answer.headers["content-type"] == "application/problem+json"
            assert answer.json()["type"].endswith("/forbidden")
            assert "operator key" in answer.json()["detail"]
        # The drain was refused, not begun: the instance still takes work.
        assert not app.state.instance.draining
        served = await client.post("/invoke/echo", json={"x": 1}, headers=auth(TENANT_A))
        assert served.status_code == 200 and served.json() == {"x": 1}


async def test_an_operator_key_reaches_them_and_every_tenant_route(tmp_path: Path) -> None:
    async with serving(settings_under(tmp_path)) as (app, client):
        op = auth(OPERATOR)
        # Past the role check: the bundle is what is unknown now.
        load = await client.post("/models/nothing-here/load", headers=op)
        assert load.status_code == 404 and load.json()["type"].endswith("/unknown-bundle")
        unload = await client.delete("/models/nothing-here", headers=op)
        assert unload.status_code == 404
        served = await client.post("/invoke/echo", json={"y": 2}, headers=op)
        assert served.json() == {"y": 2}
        drained = await client.post("/drain", headers=op)
        assert drained.status_code == 202
        assert app.state.instance.draining


async def test_only_the_instance_wide_routes_need_an_operator(tmp_path: Path) -> None:
    """Every route of the app, with a tenant key: 403 exactly for the operator routes,
    and those are exactly what the Function URL path refuses and OpenAPI marks."""
    async with serving(settings_under(tmp_path)) as (_, client):
        forbidden = set()
        for method, path, name in routes():
            answer = await client.request(method, path, headers=auth(TENANT_A), json={})
            if answer.status_code == 403:
                forbidden.add((method, path))
                assert name in OPERATOR_ONLY, (method, path)
            else:
                assert name not in OPERATOR_ONLY, (method, path, answer.status_code)
    assert forbidden == {(m, p.replace("tempconv", "echo")) for m, p in INSTANCE_WIDE}
    for method, path, _ in routes():
        assert is_operator_route(method, path) == ((method, path) in forbidden), (method, path)


def function_url_event(method: str, path: str) -> dict[str, object]:
    request = HttpRequest(method, path, headers=[("content-type", "application/json")])
    event = event_from_request(request, request_id="r-1", domain="u.lambda-url.test", now_s=0.0)
    decoded: dict[str, object] = orjson.loads(orjson.dumps(event))
    return decoded


@pytest.mark.parametrize(
    ("method", "path"),
    [
        *INSTANCE_WIDE,
        # Spelled otherwise, routed the same once the app decodes the path.
        ("POST", "/dr%61in"),
        ("POST", "/models/tempconv%2Fload"),
        ("DELETE", "/models/%74empconv"),
    ],
)
def test_a_function_url_never_reaches_an_instance_wide_action(method: str, path: str) -> None:
    with pytest.raises(NotFound, match="Function URL"):
        request_from_event(function_url_event(method, path))


def test_a_function_url_reaches_every_tenant_route() -> None:
    for method, path, name in routes():
        if name in OPERATOR_ONLY:
            continue
        request = request_from_event(function_url_event(method, path))
        assert (request.method, request.path) == (method, path)


def test_the_security_doc_names_the_key_of_every_route() -> None:
    text = (ROOT / "docs" / "security.md").read_text()
    rows = dict(re.findall(r"^\| `([A-Z]+ /[^`]*)` \| (\w+)", text, flags=re.MULTILINE))
    for route in ROUTES:
        assert isinstance(route, Route)
        if route.path in ("/healthz", "/readyz"):
            role = "none"
        else:
            role = "operator" if route.endpoint.__name__ in OPERATOR_ONLY else "tenant"
        for method in sorted((route.methods or set()) - {"HEAD"}):
            # As the document writes the path: a convertor (`{model:path}`) is not its name.
            path = re.sub(r"{(\w+):\w+}", r"{\1}", route.path)
            row = f"{method} {path}"
            assert rows.get(row) == role, f"docs/security.md: {row} needs {role}"


async def test_no_keys_at_all_leaves_every_route_open(tmp_path: Path) -> None:
    """Loopback development: no key configured, every caller is an operator."""
    settings = settings_under(tmp_path, api_keys=(), operator_keys=())
    async with serving(settings) as (_, client):
        load = await client.post("/models/nothing-here/load")
        assert load.status_code == 404


def test_a_key_file_can_hold_operator_keys(tmp_path: Path) -> None:
    keys = tmp_path / "operators"
    keys.write_text(f"{hash_line('op-from-file')} on-call\n")
    ring = KeyRing.from_settings(
        settings_under(tmp_path, operator_keys=(), operator_keys_file=str(keys))
    )
    assert ring is not None
    assert ring.caller(b"op-from-file") == (
        key_id(hashlib.sha256(b"op-from-file").digest()),
        True,
    )
    assert ring.caller(TENANT_A.encode()) == (
        key_id(hashlib.sha256(TENANT_A.encode()).digest()),
        False,
    )
    assert ring.caller(b"nobody") is None
