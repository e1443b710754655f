"""API keys for HTTP mode: a pure ASGI middleware that checks `Authorization: Bearer <key>`.

Keys come from two settings, and both may be used at once:

    THAW_API_KEYS        plain keys, comma separated (from the environment or a
                         secret manager that injects it)
    THAW_API_KEYS_FILE   sha256 hashes of keys, one per line:
                         `sha256:<64 hex> [name]`; blank lines and `#` comments
                         are skipped. The file never holds a plain key.

Only sha256 digests are kept in memory. A presented key is hashed and compared
with `hmac.compare_digest` against *every* configured digest, with no early
exit, so the time taken says nothing about which key (or how much of one)
matched. The caller is then known by a key id, the first 16 hex digits of the
key's sha256: it is stored with jobs (isolation) and is safe to log, while the
key itself is never stored, logged or echoed.

/healthz and /readyz stay open: platform probes carry no credentials.
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

from runtime.errors import ConfigError, ThawError, Unauthorized
from runtime.settings import Settings

# Where the middleware leaves the caller's key id; `key_id_of` reads it.
KEY_ID_SCOPE = "thaw.key_id"
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


@dataclass(frozen=True)
class KeyRing:
    """The sha256 digests of every accepted key."""

    digests: tuple[bytes, ...]

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing | None:
        """The configured keys, or None when auth is off (no keys configured at all).

        A key file that is named but unreadable or empty is an error, never a
        silent fallback to no auth.
        """
        digests = [key_digest(key) for key in settings.api_keys]
        if settings.api_keys_file:
            path = Path(settings.api_keys_file)
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"THAW_API_KEYS_FILE={path}: cannot read it ({exc})") from exc
            from_file = parse_key_file(text, f"THAW_API_KEYS_FILE={path}")
            if not from_file:
                raise ConfigError(f"THAW_API_KEYS_FILE={path}: holds no key hashes")
            digests.extend(from_file)
        if not digests:
            return None
        return cls(tuple(dict.fromkeys(digests)))

    def identify(self, presented: bytes) -> str | None:
        """The key id of `presented` if it is one of ours, else None (constant time)."""
        digest = key_digest(presented)
        found: bytes | None = None
        for known in self.digests:
            # No break: every digest is compared whatever matched.
            if hmac.compare_digest(digest, known):
                found = known
        return key_id(found) if found is not None else None


def key_id_of(request: Request) -> str | None:
    """The caller's API key id (set by `AuthMiddleware`), None when auth is off."""
    return request.scope.get(KEY_ID_SCOPE)


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
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope["headers"])
        found = self.keys.identify(token) if token is not None else None
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
        scope[KEY_ID_SCOPE] = found
        await self.app(scope, receive, send)


def print_hash_line(stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """`thaw keys hash`: read one key from stdin, print its THAW_API_KEYS_FILE line."""
    source = stdin if stdin is not None else sys.stdin
    key = source.readline().rstrip("\r\n")
    if not key:
        raise ConfigError("no key on stdin (pipe one key, e.g. from your secret manager)")
    print(hash_line(key), file=stdout if stdout is not None else sys.stdout)
    return 0
