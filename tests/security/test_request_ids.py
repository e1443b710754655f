"""Request ids: new and unpredictable for every request, whatever the caller sends;
a caller's X-Request-Id is kept apart as its correlation id, so two requests
never share a `ctx.request_id` (the handler's own view of it)."""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import pytest

from runtime.http.edge import new_request_id
from tests.security.inprocess import TENANT_A, auth, serving, settings_under

pytestmark = pytest.mark.anyio


def test_generated_ids_are_random_not_a_counter() -> None:
    ids = [new_request_id() for _ in range(2000)]  # past one draw of the block
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{24}", i) for i in ids)
    # A counter (or a counter behind a fixed prefix) shares a long common prefix
    # between neighbours; 96 random bits almost never share more than a few digits.
    # Characters, not path parts, are what is compared here.
    shared = [len(os.path.commonprefix(p)) for p in itertools.pairwise(ids)]  # noqa: RUF071
    assert max(shared) < 12 and sum(shared) / len(shared) < 1.0


async def test_a_chosen_request_id_is_a_correlation_id_never_the_request_id(
    tmp_path: Path,
) -> None:
    settings = settings_under(tmp_path, handlers=("tests.emulator.context_handler",))
    async with serving(settings) as (_, client):
        chosen = {"X-Request-Id": "same-id-7", **auth(TENANT_A)}
        first = await client.post("/invoke/client_context", json={}, headers=chosen)
        second = await client.post("/invoke/client_context", json={}, headers=chosen)
        plain = await client.post("/invoke/client_context", json={}, headers=auth(TENANT_A))
    for answer in (first, second, plain):
        assert answer.status_code == 200, answer.text
    # The caller's id comes back as its correlation id, on both answers.
    assert first.headers["x-request-id"] == second.headers["x-request-id"] == "same-id-7"
    # The handler saw two ids of its own, named beside the correlation id.
    seen = [first.json()["request_id"], second.json()["request_id"]]
    assert len(set(seen)) == 2 and "same-id-7" not in seen
    assert seen == [first.headers["x-thaw-request-id"], second.headers["x-thaw-request-id"]]
    # Without one, the request's own id is the X-Request-Id, and no second header.
    assert plain.headers["x-request-id"] == plain.json()["request_id"]
    assert "x-thaw-request-id" not in plain.headers
