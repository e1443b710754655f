"""`FirstRoute` (runtime/http/routing.py) matches the app's first route as
Starlette's router would have: the same endpoint reached with the same scope,
and every request it does not match fully left to the router's own walk (a
route further down, 405, 404), for the app's real route table and for other
tables of the same shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Route, Router
from starlette.types import Message, Receive, Scope, Send

from runtime.http.app import ROUTES, create_app
from runtime.http.routing import AppState, Endpoint, FirstRoute
from tests.inproc import settings_for

pytestmark = pytest.mark.anyio

# What `Router.app` adds to a request's scope on its way to a route.
ROUTED_KEYS = ("router", "route", "endpoint", "path_params")


async def _receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message: Message) -> None:
    return None


def _scope(method: str, path: str, root_path: str = "", **extra: Any) -> Scope:
    return {
        "type": "http",
        "method": method,
        "path": root_path + path,
        "root_path": root_path,
        "headers": [],
        "query_string": b"",
        # In an app (Starlette's __call__ sets it), the router raises its 404 and 405.
        "app": object(),
        **extra,
    }


async def _outcome(app: Any, scope: Scope) -> tuple[Any, ...]:
    """What serving `scope` came to: the route reached and the routing keys of its
    scope, or the status of the HTTPException the router raised (405, 404)."""
    reached: list[Scope] = []

    def spy(route: Route) -> None:
        async def app(s: Scope, receive: Receive, send: Send) -> None:
            reached.append(dict(s))

        route.app = app

    for route in app.router.routes if isinstance(app, FirstRoute) else app.routes:
        assert isinstance(route, Route)
        spy(route)
    try:
        await app(scope, _receive, _send)
    except HTTPException as exc:
        return ("raised", exc.status_code, exc.headers)
    assert len(reached) == 1, reached
    seen = reached[0]
    return ("reached", *(seen.get(key) for key in ROUTED_KEYS))


async def endpoint(request: Any) -> Response:
    return Response()


def _tables() -> list[list[Route]]:
    return [
        # The app's own table: the warm path first.
        [Endpoint(r.path, r.endpoint, methods=r.methods or ()) for r in ROUTES],  # type: ignore[attr-defined]
        # A first route with two parameters and a typed convertor.
        [
            Endpoint("/a/{name}/b/{n:int}", endpoint, methods=["GET"]),
            Endpoint("/a/{name}/b/{rest:path}", endpoint, methods=["GET", "POST"]),
        ],
    ]


CASES = [
    ("POST", "/invoke/echo", ""),
    ("POST", "/invoke/a.b-c_d:e", ""),
    ("POST", "/invoke/echo", "/behind/a/proxy"),
    ("GET", "/invoke/echo", ""),  # the first route, another method: 405 from the walk
    ("HEAD", "/invoke/echo", ""),
    ("POST", "/invoke/", ""),
    ("POST", "/invoke/echo/", ""),
    ("POST", "/invoke/echo/more", ""),
    ("POST", "/invoke", ""),
    ("GET", "/jobs/abc", ""),
    ("DELETE", "/jobs/abc", ""),
    ("POST", "/jobs/echo", ""),
    ("GET", "/healthz", ""),
    ("GET", "/v1/models/org/model-name", ""),
    ("GET", "/a/x/b/12", ""),
    ("HEAD", "/a/x/b/12", ""),
    ("GET", "/a/x/b/twelve", ""),
    ("POST", "/a/x/b/12", ""),
    ("GET", "/a/x/b/", ""),
    ("GET", "/nowhere", ""),
]


@pytest.mark.parametrize("table", range(len(_tables())))
@pytest.mark.parametrize(("method", "path", "root_path"), CASES)
async def test_the_first_route_is_matched_as_the_router_matches_it(
    table: int, method: str, path: str, root_path: str
) -> None:
    # Fresh tables for each side: the spies replace each route's app.
    router = Router(routes=_tables()[table], redirect_slashes=False)
    first = FirstRoute(Router(routes=_tables()[table], redirect_slashes=False))
    expected = await _outcome(router, _scope(method, path, root_path))
    got = await _outcome(first, _scope(method, path, root_path))
    # The routes are equal in what they route, not the same objects.
    assert _comparable(got) == _comparable(expected)


async def test_path_params_already_in_the_scope_are_kept_beside_the_route_s() -> None:
    """A mounted app's scope may carry its mount's params: both merge them in."""
    given = {"tenant": "t1"}
    for app in (
        Router(routes=_tables()[0], redirect_slashes=False),
        FirstRoute(Router(routes=_tables()[0], redirect_slashes=False)),
    ):
        outcome = await _outcome(app, _scope("POST", "/invoke/echo", path_params=given))
        assert outcome[0] == "reached"
        assert outcome[4] == {"tenant": "t1", "handler": "echo"}
    assert given == {"tenant": "t1"}  # copied, not changed in place


async def test_a_table_whose_first_route_is_not_an_endpoint_is_walked_as_before() -> None:
    first = FirstRoute(Router(routes=[Route("/x", endpoint, methods=["GET"])]))
    assert first.route is None
    outcome = await _outcome(first, _scope("GET", "/x"))
    assert outcome[0] == "reached"
    assert outcome[2].path == "/x"


def _comparable(outcome: tuple[Any, ...]) -> tuple[Any, ...]:
    if outcome[0] != "reached":
        return outcome
    _, router, route, endpoint, params = outcome
    return ("reached", type(router), route.path, tuple(sorted(route.methods)), endpoint, params)


@pytest.mark.parametrize("root_path", ["", "/behind/a/proxy"])
async def test_the_warm_path_is_matched_without_the_router_s_walk(root_path: str) -> None:
    first = FirstRoute(Router(routes=_tables()[0], redirect_slashes=False))
    walked: list[str] = []
    walk = first.router.middleware_stack

    async def counting(scope: Scope, receive: Receive, send: Send) -> None:
        walked.append(scope["path"])
        await walk(scope, receive, send)

    first.router.middleware_stack = counting
    assert (await _outcome(first, _scope("POST", "/invoke/echo", root_path)))[0] == "reached"
    assert walked == []
    # Anything else is the router's: here a 405 for the warm path's other methods.
    assert (await _outcome(first, _scope("GET", "/invoke/echo", root_path)))[:2] == ("raised", 405)
    assert walked == [root_path + "/invoke/echo"]


def test_the_app_state_reads_its_values_as_plain_attributes() -> None:
    """`AppState` keeps `State`'s behaviour (attributes, items, iteration, a missing
    name's AttributeError) with each value in the instance's own attributes, where
    the ordinary lookup finds it before `State.__getattr__` is ever asked."""
    state = AppState()
    state.instance = "the instance"
    state["intake"] = "the intake"
    assert vars(state)["instance"] == "the instance"
    assert vars(state)["intake"] == "the intake"
    assert (state.instance, state["instance"]) == ("the instance", "the instance")
    assert (state.intake, state["intake"]) == ("the intake", "the intake")
    assert sorted(state) == ["instance", "intake"]
    assert len(state) == 2
    state.instance = "replaced"
    assert (state.instance, state["instance"]) == ("replaced", "replaced")
    del state.instance
    del state["intake"]
    assert "instance" not in vars(state) and "intake" not in vars(state)
    assert len(state) == 0
    with pytest.raises(AttributeError):
        _ = state.instance
    with pytest.raises(KeyError):
        _ = state["intake"]


def test_the_app_s_state_is_an_app_state(tmp_path: Path) -> None:
    assert isinstance(create_app(settings_for(tmp_path)).state, AppState)
