"""The `Prefer` request header (RFC 7240): `wait=<seconds>` and `respond-async`.

Unknown preferences are ignored, as the RFC asks; a `wait` that is not a
non-negative number is a client error, since silently ignoring a deadline
would break the caller's timeout.
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
                raise InvalidPrefer(f"Prefer: malformed preference {pref!r}")
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
