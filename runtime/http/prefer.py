"""The `Prefer` request header (RFC 7240): `wait=<seconds>` and `respond-async`.

Unknown preferences are ignored, as the RFC asks, and so are malformed ones
(a token with a space or a quote in it is no preference this server
understands); a `wait` that is not a non-negative number is a client error,
since silently ignoring a deadline would break the caller's timeout. So is a
header line past MAX_HEADER_CHARS. That is the whole of what is refused, and
what the OpenAPI document says (runtime/http/openapi.py).

What `POST /invoke/{handler}` makes of them (runtime.http.routes.invoke), the common
reading of RFC 7240 §4.1 and §4.3:

    wait=S                  answer within S seconds: 200 if the work can finish
                            by then (the deadline rule), else 202 with a job
    respond-async           202 with a job at once
    respond-async, wait=S   as `wait=S`: 200 if it can within S seconds, else 202
    neither                 as `wait=THAW_WAIT_S`

A 202 answering `respond-async` says `Preference-Applied: respond-async`; every
answer of the route says `Vary: Prefer`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from runtime.errors import InvalidPrefer

MAX_HEADER_CHARS = 1024


@dataclass(frozen=True)
class Preferences:
    wait_s: float | None = None
    respond_async: bool = False


NO_PREFERENCES = Preferences()


def parse_prefer(values: list[str]) -> Preferences:
    """Parse every Prefer header line; the first occurrence of a preference wins."""
    if not values:
        return NO_PREFERENCES
    return _parse(tuple(values))


# Clients repeat the same few headers (`wait=5`, `respond-async`): parse each once.
@functools.lru_cache(maxsize=256)
def _parse(values: tuple[str, ...]) -> Preferences:
    wait_s: float | None = None
    respond_async = False
    seen: set[str] = set()
    for value in values:
        if len(value) > MAX_HEADER_CHARS:
            raise InvalidPrefer(f"Prefer header longer than {MAX_HEADER_CHARS} characters")
        for item in value.split(","):
            pref = item.split(";", 1)[0].strip()
            if not pref:
                continue
            token, sep, raw = pref.partition("=")
            token = token.strip().lower()
            raw = raw.strip().strip('"')
            if not token or any(c in token for c in ' \t"'):
                continue  # malformed: not a preference this server understands
            if token in seen:
                continue
            seen.add(token)
            if token == "wait":
                if not sep:
                    raise InvalidPrefer("Prefer: wait needs a value in seconds, e.g. wait=5")
                try:
                    wait_s = float(raw)
                except ValueError:
                    raise InvalidPrefer(
                        f"Prefer: wait={raw!r} is not a number of seconds"
                    ) from None
                if not math.isfinite(wait_s) or wait_s < 0:
                    raise InvalidPrefer(f"Prefer: wait={raw!r} must be a non-negative number")
            elif token == "respond-async":
                respond_async = True
    return Preferences(wait_s=wait_s, respond_async=respond_async)
