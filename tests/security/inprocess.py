"""The app in-process for the security tests: `create_app` behind an httpx ASGI
transport, its lifespan run, and keys of both roles."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette

from runtime.http.app import create_app
from runtime.settings import Settings
from tests.support import settings_for

TENANT_A = "tenant-a-5d1c"
TENANT_B = "tenant-b-91e0"
OPERATOR = "operator-07aa"
HANDLERS = ("handlers.echo", "tests.handlers.sleepy", "tests.handlers.raises")


def settings_under(root: Path, **overrides: Any) -> Settings:
    """Settings with every piece of state under `root`, tenant and operator keys on."""
    (root / "bundles").mkdir(parents=True, exist_ok=True)
    values: dict[str, Any] = {
        "handlers": HANDLERS,
        "api_keys": (TENANT_A, TENANT_B),
        "operator_keys": (OPERATOR,),
        "drain_grace_s": 0.5,
        **overrides,
    }
    return settings_for(root, **values)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@contextlib.asynccontextmanager
async def serving(settings: Settings) -> AsyncIterator[tuple[Starlette, httpx.AsyncClient]]:
    """The app for `settings`, started, and a client of it; stopped however the block ends."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://thaw", timeout=30
        ) as client:
            yield app, client
