"""API keys for HTTP mode: a pure ASGI middleware that checks `Authorization: Bearer <key>`.

Keys have roles. Tenant keys reach invocations and their own jobs; operator
keys reach those and the instance-wide actions too (drain, load, unload: the
routes that call `require_operator`), and see readiness details. Each role's
keys come from two settings, and all four may be used at once:

    THAW_API_KEYS              tenant keys, plain, comma separated (from the
                               environment or a secret manager that injects it)
    THAW_API_KEYS_FILE         sha256 hashes of tenant keys, one per line:
                               `sha256:<64 hex> [name]`; blank lines and `#`
                               comments are skipped. The file never holds a plain key.
    THAW_OPERATOR_KEYS         operator keys, plain
    THAW_OPERATOR_KEYS_FILE    sha256 hashes of operator keys, as above

A key listed in both roles is an operator key. With no key configured at all
(loopback development, and Lambda, where IAM is the gate) every caller may
reach every route; a Function URL never reaches the operator routes
(runtime/aws/events.py).

Only sha256 digests are kept in memory. A presented key is hashed and compared
with `hmac.compare_digest` against *every* configured digest, with no early
exit, so the time taken says nothing about which key (or how much of one)
matched. The caller is then known by a key id, the first 16 hex digits of the
key's sha256: it is stored with jobs (isolation) and is safe to log, while the
key itself is never stored, logged or echoed.

/healthz and /readyz stay open: platform probes carry no credentials. A valid
key presented there is still known (an operator sees readiness details).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.errors import ConfigError, Forbidden, ThawError, Unauthorized
from runtime.settings import Settings

# Where the middleware leaves the caller's key id; `key_id_of` reads it.
KEY_ID_SCOPE = "thaw.key_id"
# Where it leaves whether that key is an operator's; `is_operator` reads it.
OPERATOR_SCOPE = "thaw.operator"
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
KEY_ID_HEX = 16
_HASH_LINE = re.compile(r"^sha256:([0-9a-fA-F]{64})(?:\s+(\S.*))?$")

# Renders a ThawError as an HTTP response (runtime.http.problems.problem_response): the
# middleware runs outside Starlette's exception handlers, and errors must keep
# one rendering path.
Render = Callable[[ThawError, str | None], Response]


def key_digest(key: bytes | str) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


def hash_line(key: str) -> str:
    """The THAW_API_KEYS_FILE line for `key`."""
    return f"sha256:{key_digest(key).hex()}"


def key_id(digest: bytes) -> str:
    """The public id of a key: a prefix of its sha256, never the key."""
    return digest.hex()[:KEY_ID_HEX]


def parse_key_file(text: str, where: str) -> list[bytes]:
    """Digests from THAW_API_KEYS_FILE text; any other line is a ConfigError."""
    digests: list[bytes] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = _HASH_LINE.match(stripped)
        if match is None:
            # The line is not echoed: it may be a plain key pasted by mistake.
            raise ConfigError(
                f"{where}: line {number} is not `sha256:<64 hex digits> [name]`; "
                "the file holds hashes of keys, never plain keys (see `thaw keys hash`)"
            )
        digests.append(bytes.fromhex(match.group(1)))
    return digests


def _read_key_file(name: str, path_text: str) -> list[bytes]:
    """The digests of key file `path_text` (setting `name`); unreadable or empty is an error."""
    path = Path(path_text)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{name}={path}: cannot read it ({exc})") from exc
    digests = parse_key_file(text, f"{name}={path}")
    if not digests:
        raise ConfigError(f"{name}={path}: holds no key hashes")
    return digests


@dataclass(frozen=True)
class KeyRing:
    """The sha256 digests of every accepted key, and which of them are operators'."""

    digests: tuple[bytes, ...]
    operators: frozenset[bytes] = frozenset()

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing | None:
        """The configured keys, or None when auth is off (no keys configured at all).

        A key file that is named but unreadable or empty is an error, never a
        silent fallback to no auth.
        """
        tenants = [key_digest(key) for key in settings.api_keys]
        if settings.api_keys_file:
            tenants.extend(_read_key_file("THAW_API_KEYS_FILE", settings.api_keys_file))
        operators = [key_digest(key) for key in settings.operator_keys]
        if settings.operator_keys_file:
            operators.extend(_read_key_file("THAW_OPERATOR_KEYS_FILE", settings.operator_keys_file))
        digests = tuple(dict.fromkeys([*tenants, *operators]))
        if not digests:
            return None
        return cls(digests, frozenset(operators))

    def identify(self, presented: bytes) -> str | None:
        """The key id of `presented` if it is one of ours, else None (constant time)."""
        found = self._match(presented)
        return key_id(found) if found is not None else None

    def _match(self, presented: bytes) -> bytes | None:
        digest = key_digest(presented)
        found: bytes | None = None
        for known in self.digests:
            # No break: every digest is compared whatever matched.
            if hmac.compare_digest(digest, known):
                found = known
        return found

    def caller(self, presented: bytes) -> tuple[str, bool] | None:
        """`(key id, is an operator)` of `presented` if it is one of ours (constant time)."""
        found = self._match(presented)
        if found is None:
            return None
        return key_id(found), found in self.operators


def key_id_of(request: Request) -> str | None:
    """The caller's API key id (set by `AuthMiddleware`), None when auth is off."""
    return request.scope.get(KEY_ID_SCOPE)


def is_operator(request: Request) -> bool:
    """Whether the caller may reach instance-wide actions: an operator key, or auth off."""
    if not getattr(request.app.state, "auth", False):
        return True
    return bool(request.scope.get(OPERATOR_SCOPE, False))


def require_operator(request: Request) -> None:
    """Refuse a caller that is no operator (403 `forbidden`)."""
    if not is_operator(request):
        raise Forbidden(
            f"{request.method} {request.url.path} is an instance-wide action: "
            "it needs an operator key (THAW_OPERATOR_KEYS)"
        )


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the one `Authorization: Bearer` header; None if absent or ambiguous."""
    values = [value for name, value in headers if name == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return None
    return token


class AuthMiddleware:
    """Refuse every request without a valid key, except the health probes."""

    def __init__(self, app: ASGIApp, keys: KeyRing, render: Render) -> None:
        self.app = app
        self.keys = keys
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope["headers"])
        found = self.keys.caller(token) if token is not None else None
        if found is not None:
            scope[KEY_ID_SCOPE], scope[OPERATOR_SCOPE] = found
        if scope["path"] in OPEN_PATHS:
            # Open whatever was presented: a probe never gets a 401.
            await self.app(scope, receive, send)
            return
        if found is None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            detail = (
                "missing `Authorization: Bearer <key>` header"
                if token is None
                else "the API key is not valid"
            )
            response = self.render(Unauthorized(detail), scope["path"])
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def print_hash_line(stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """`thaw keys hash`: read one key from stdin, print its THAW_API_KEYS_FILE line."""
    source = stdin if stdin is not None else sys.stdin
    key = source.readline().rstrip("\r\n")
    if not key:
        raise ConfigError("no key on stdin (pipe one key, e.g. from your secret manager)")
    print(hash_line(key), file=stdout if stdout is not None else sys.stdout)
    return 0
