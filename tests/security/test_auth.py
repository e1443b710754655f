"""API keys in HTTP mode: the app (in-process) refuses every request without a valid
key, except the health probes, and never learns more than a key's hash; a real
`thaw serve` refuses to start on a plain key in its key file."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from runtime.errors import ConfigError
from runtime.http.auth import (
    KeyRing,
    bearer_token,
    hash_line,
    key_id,
    parse_key_file,
    print_hash_line,
)
from runtime.settings import Settings
from tests.inproc import serving
from tests.security.conftest import PROBLEM, bearer, clean_env, light_settings
from tests.support import free_port

PLAIN_KEY = "plain-key-7c1f0d9e"
FILE_KEY = "file-key-b3a41e55"


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[httpx.AsyncClient]:
    keys_file = tmp_path_factory.mktemp("keys") / "keys"
    keys_file.write_text(f"# team keys\n\n{hash_line(FILE_KEY)} ci-runner\n")
    settings = Settings.from_env(
        {"THAW_API_KEYS": f"{PLAIN_KEY}, other-key", "THAW_API_KEYS_FILE": str(keys_file)}
    )
    root = tmp_path_factory.mktemp("server")
    async with serving(
        light_settings(root, api_keys=settings.api_keys, api_keys_file=settings.api_keys_file)
    ) as served:
        yield served.client


def assert_unauthorized(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["content-type"] == PROBLEM
    assert response.headers["www-authenticate"] == 'Bearer realm="thaw"'
    problem = response.json()
    assert problem["type"].endswith("/unauthorized") and problem["status"] == 401


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
@pytest.mark.anyio
async def test_probes_need_no_key(server: httpx.AsyncClient, path: str) -> None:
    assert (await server.get(path)).status_code == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/invoke/echo"),
        ("POST", "/handlers/echo/jobs"),
        ("POST", "/jobs/echo"),  # the deprecated submit route
        ("GET", "/jobs/abc"),
        ("DELETE", "/jobs/abc"),
        ("GET", "/models"),
        ("POST", "/models/tempconv/load"),
        ("DELETE", "/models/tempconv"),
        ("POST", "/drain"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("GET", "/no-such-route"),  # routes cannot be probed without a key
    ],
)
@pytest.mark.anyio
async def test_every_other_endpoint_needs_a_key(
    server: httpx.AsyncClient, method: str, path: str
) -> None:
    assert_unauthorized(await server.request(method, path, json={}))


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer wrong-key",
        f"Basic {PLAIN_KEY}",
        f"Bearer{PLAIN_KEY}",
        "Bearer",
        f"Bearer {PLAIN_KEY}x",
        f"Bearer {hash_line(FILE_KEY)}",  # the stored hash is not a credential
        f"Bearer {hashlib.sha256(FILE_KEY.encode()).hexdigest()}",
    ],
)
@pytest.mark.anyio
async def test_wrong_credentials_are_refused_without_echo(
    server: httpx.AsyncClient, authorization: str
) -> None:
    response = await server.post(
        "/invoke/echo", json={"x": 1}, headers={"Authorization": authorization}
    )
    assert_unauthorized(response)
    token = authorization.partition(" ")[2]
    assert not token or token not in response.text


@pytest.mark.anyio
async def test_two_authorization_headers_are_refused(server: httpx.AsyncClient) -> None:
    headers = [("Authorization", f"Bearer {PLAIN_KEY}"), ("Authorization", "Bearer other-key")]
    assert_unauthorized(await server.post("/invoke/echo", json={}, headers=headers))


@pytest.mark.parametrize(
    "authorization",
    [f"Bearer {PLAIN_KEY}", "Bearer other-key", f"bearer {FILE_KEY}", f"BEARER   {FILE_KEY}"],
)
@pytest.mark.anyio
async def test_configured_keys_are_accepted(server: httpx.AsyncClient, authorization: str) -> None:
    response = await server.post(
        "/invoke/echo", json={"x": 1}, headers={"Authorization": authorization}
    )
    assert response.status_code == 200, response.text
    assert response.json() == {"x": 1}


@pytest.mark.anyio
async def test_openapi_declares_the_bearer_scheme(server: httpx.AsyncClient) -> None:
    document = (await server.get("/openapi.json", headers=bearer(PLAIN_KEY))).json()
    assert document["security"] == [{"apiKey": []}]
    assert document["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert document["paths"]["/healthz"]["get"]["security"] == []
    assert "401" in document["paths"]["/invoke/{handler}"]["post"]["responses"]


@pytest.mark.process
def test_a_plain_key_in_the_key_file_stops_the_server_without_echoing_it(
    tmp_path: Path,
) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{hash_line(FILE_KEY)}\n{PLAIN_KEY}\n")
    env = {**clean_env(tmp_path), "THAW_API_KEYS_FILE": str(keys_file)}
    result = subprocess.run(
        [sys.executable, "-m", "runtime.cli.main", "serve", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0
    assert "line 2" in result.stderr and "never plain keys" in result.stderr
    assert PLAIN_KEY not in result.stderr + result.stdout


# ---- the key ring, without a server -----------------------------------------------------


def test_key_file_parsing() -> None:
    digest = hashlib.sha256(b"k").digest()
    text = f"# comment\n\n  sha256:{digest.hex().upper()}  laptop of ana \n"
    assert parse_key_file(text, "keys") == [digest]
    with pytest.raises(ConfigError, match="line 1"):
        parse_key_file("sha256:abc\n", "keys")
    with pytest.raises(ConfigError, match="line 1") as caught:
        parse_key_file("hunter2\n", "keys")
    assert "hunter2" not in str(caught.value)


def test_key_ring_from_settings(tmp_path: Path) -> None:
    assert KeyRing.from_settings(Settings()) is None
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="no key hashes"):
        KeyRing.from_settings(Settings(api_keys_file=str(empty)))
    with pytest.raises(ConfigError, match="cannot read"):
        KeyRing.from_settings(Settings(api_keys_file=str(tmp_path / "missing")))
    ring = KeyRing.from_settings(Settings(api_keys=("a", "b")))
    assert ring is not None
    assert ring.identify(b"a") == key_id(hashlib.sha256(b"a").digest())
    assert ring.identify(b"c") is None


class CountingDigests(tuple[bytes, ...]):
    """A digest tuple that counts how many entries a lookup looked at."""

    seen = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        for item in super().__iter__():
            CountingDigests.seen += 1
            yield item


def test_identify_compares_every_key_even_after_a_match() -> None:
    digests = CountingDigests(hashlib.sha256(k.encode()).digest() for k in ("a", "b", "c", "d"))
    ring = KeyRing(digests)
    CountingDigests.seen = 0
    assert ring.identify(b"a") is not None
    assert CountingDigests.seen == 4, "identify stopped early: its time tells which key matched"


def test_key_id_is_a_hash_prefix_never_the_key() -> None:
    ring = KeyRing.from_settings(Settings(api_keys=("s3cr3t",)))
    assert ring is not None
    found = ring.identify(b"s3cr3t")
    assert found == hashlib.sha256(b"s3cr3t").hexdigest()[:16]
    assert "s3cr3t" not in (found or "")


@pytest.mark.parametrize(
    ("headers", "token"),
    [
        ([(b"authorization", b"Bearer abc")], b"abc"),
        ([(b"authorization", b"  bearer   abc  ")], b"abc"),
        ([(b"authorization", b"Basic abc")], None),
        ([(b"authorization", b"Bearer")], None),
        ([], None),
        ([(b"authorization", b"Bearer a"), (b"authorization", b"Bearer a")], None),
    ],
)
def test_bearer_token(headers: list[tuple[bytes, bytes]], token: bytes | None) -> None:
    assert bearer_token(headers) == token


def test_hash_helper_prints_the_key_file_line() -> None:
    out = io.StringIO()
    assert print_hash_line(io.StringIO("k\n"), out) == 0
    assert out.getvalue() == f"sha256:{hashlib.sha256(b'k').hexdigest()}\n"
    with pytest.raises(ConfigError):
        print_hash_line(io.StringIO(""), out)
