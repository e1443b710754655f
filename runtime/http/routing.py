"""How a request reaches its endpoint: `Endpoint` routes and the app around them.

Starlette wraps every request in two middlewares of its own (one answers a 500
for an exception nothing handled, one maps exceptions to handlers) and every
endpoint in a third layer doing the same mapping again, each with its own
`send` wrapper that every message passes through. In Thaw all three are
`Edge`'s job already (runtime/http/edge.py): it renders every exception a
route raises through `render_error`, the one place errors become answers, and
answers past a half-sent response by closing the connection. So `ThawApp`'s
middleware stack is the app's own middleware alone (`Edge`, and the auth layer
when keys are set) in front of the router, and an `Endpoint` calls its
function and sends its answer, nothing between: those layers were a large
share of the Python calls of a warm invocation.

Starlette's router walks its routes in order and asks each one whether it
matches, through a generic protocol (a `Match` and a child scope per route).
The app's first route is the warm path (`POST /invoke/{handler}`), so
`FirstRoute` asks that one route directly, with the route's own regex and
convertors, and hands every other request to the router: the same match and
the same scope, for far less work on the request that matters most.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.requests import Request
from starlette.routing import Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

# What an endpoint answers is itself an ASGI app: a Response, or an event stream.
EndpointFunction = Callable[[Request], Awaitable[ASGIApp]]


def route_path(scope: Scope) -> str:
    """The path the router matches: the scope's, less its `root_path` when it starts
    with it (Starlette's own rule, kept here: its helper lives in a private module)."""
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    if not root_path or not path.startswith(root_path):
        return path
    if path == root_path:
        return ""
    if path[len(root_path)] == "/":
        return path[len(root_path) :]
    return path


def endpoint_app(endpoint: EndpointFunction) -> ASGIApp:
    """The ASGI app of one endpoint: its answer to the request, sent; what it raises
    goes up to `Edge`."""
    if not inspect.iscoroutinefunction(endpoint):
        # A sync endpoint would block the loop: every endpoint of Thaw is async.
        raise TypeError(f"endpoint {endpoint.__qualname__} must be an async def")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        response = await endpoint(Request(scope, receive, send))
        await response(scope, receive, send)

    return app


class Endpoint(Route):
    """A route whose endpoint is called as `endpoint_app` calls it (see the module)."""

    def __init__(
        self,
        path: str,
        endpoint: EndpointFunction,
        *,
        methods: Collection[str],
        include_in_schema: bool = True,
    ) -> None:
        super().__init__(path, endpoint, methods=list(methods), include_in_schema=include_in_schema)
        self.app = endpoint_app(endpoint)


class AppState(State):
    """Starlette's `State`, each of its values a plain attribute as well.

    `State` keeps its values in a dict that its `__getattr__` reads, and Python
    calls `__getattr__` only once the ordinary lookup has failed: each read of
    `app.state.instance` built and dropped an AttributeError first (two per
    warm invocation). Here the ordinary lookup finds the value; the dict stays
    what `State`'s other readers (iteration, items) see."""

    def __setattr__(self, key: str, value: Any) -> None:
        super().__setattr__(key, value)
        object.__setattr__(self, key, value)

    def __delattr__(self, key: str) -> None:
        super().__delattr__(key)
        object.__delattr__(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        self.__setattr__(key, value)

    def __delitem__(self, key: str) -> None:
        self.__delattr__(key)


class ThawApp(Starlette):
    """Starlette's app, its middleware stack the app's own middleware and the router.

    Without Starlette's outer error middleware and its exception middleware, an
    exception is `Edge`'s to render (the app must be given `Edge` as its first
    middleware: `create_app` does). Routing errors still arrive as Starlette's
    `HTTPException` (404, 405), which `render_error` maps. Its `state` is an
    `AppState`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = AppState()

    def build_middleware_stack(self) -> ASGIApp:
        app: ASGIApp = FirstRoute(self.router)
        for cls, args, kwargs in reversed(self.user_middleware):
            app = cls(app, *args, **kwargs)
        return app


class FirstRoute:
    """The router, its first route (an `Endpoint`) matched before the router's walk.

    A request that route matches fully (path and method) gets the scope
    `Router.app` would give it (`router`, `route`, `endpoint`, `path_params`)
    and goes straight to the route's app; any other request, and the lifespan,
    go to the router, whose walk answers it as before (a route further down,
    405, 404). The route's own `path_regex` and `param_convertors` decide the
    match, so it matches exactly what the router would have matched first.
    """

    def __init__(self, router: Router) -> None:
        self.router = router
        first = router.routes[0] if router.routes else None
        self.route = first if isinstance(first, Endpoint) else None
        self.methods: Collection[str] = () if self.route is None else self.route.methods or ()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.route
        if route is not None and scope["type"] == "http" and scope["method"] in self.methods:
            match = route.path_regex.match(route_path(scope))
            if match is not None:
                params = scope.get("path_params")
                path_params = dict(params) if params else {}
                for key, value in match.groupdict().items():
                    path_params[key] = route.param_convertors[key].convert(value)
                if "router" not in scope:
                    scope["router"] = self.router
                scope["route"] = route
                scope["endpoint"] = route.endpoint
                scope["path_params"] = path_params
                await route.app(scope, receive, send)
                return
        await self.router(scope, receive, send)
