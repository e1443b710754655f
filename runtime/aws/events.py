"""Function URL / API Gateway v2 HTTP events <-> HTTP requests and responses.

    request_from_event(event)   Lambda event (version "2.0")  -> HttpRequest   (the Lambda loop)
    result_from_response(resp)  HttpResponse -> proxy result {statusCode, headers, body, ...}
    event_from_request(...)     an HTTP request -> Function URL event          (the emulator)
    response_from_payload(raw)  a function's response payload -> HttpResponse  (the emulator)

Every function here either returns or raises `InvalidEvent` (400
`invalid-event`), whatever it is given: events arrive from outside and a
malformed one must become a clean error, never a crash of the loop. The one
other refusal: an event for an operator route (drain, load, unload) is
`NotFound`, as if the route did not exist. Whoever may invoke a Function URL
is a tenant; instance-wide actions are an operator's, and Lambda manages its
own instances. Bodies are
base64 whenever they are not text, so binary bodies survive both directions.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, quote, unquote

import orjson

from runtime.errors import InvalidEvent, NotFound

Headers = list[tuple[str, str]]

# RFC 9110 token: what a method or a header name may hold.
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
# Control characters other than tab cannot appear in a header value on the wire.
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_TEXT_TYPES = ("text/", "application/json", "application/xml", "application/javascript")
_TEXT_SUFFIXES = ("+json", "+xml")
# Kept by `quote`: RFC 3986 unreserved, sub-delims, ':' '@' '/' and existing escapes.
_PATH_SAFE = "/%:@!$&'()*+,;=-._~"
_QUERY_SAFE = _PATH_SAFE + "?"
# The routes that need an operator key over HTTP (runtime/http/auth.py's
# `require_operator`), matched on the decoded path as the app routes it.
OPERATOR_ROUTES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("POST", re.compile(r"^/drain$")),
    ("POST", re.compile(r"^/models/[^/]+/load$")),
    ("DELETE", re.compile(r"^/models/[^/]+$")),
)


def is_operator_route(method: str, path: str) -> bool:
    """Whether `method path` reaches an instance-wide action (percent-escapes decoded)."""
    decoded = unquote(path)
    return any(m == method and pattern.match(decoded) for m, pattern in OPERATOR_ROUTES)


# The ASGI transport computes these from the body it is given.
_FRAMING = frozenset({"content-length", "transfer-encoding"})


@dataclass(frozen=True)
class HttpRequest:
    method: str
    path: str
    query: str = ""
    headers: Headers = field(default_factory=list)
    body: bytes = b""

    @property
    def target(self) -> str:
        """Path and query, percent-encoded where the event held raw characters."""
        target = quote(self.path, safe=_PATH_SAFE)
        if self.query:
            target += "?" + quote(self.query, safe=_QUERY_SAFE)
        return target

    @property
    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return [(k.encode("ascii"), v.encode("utf-8")) for k, v in self.headers]

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(frozen=True)
class HttpResponse:
    status: int
    headers: Headers = field(default_factory=list)
    body: bytes = b""


def is_http_event(event: Any) -> bool:
    """True for an event that claims the HTTP v2 shape (it may still be malformed)."""
    return isinstance(event, dict) and event.get("version") == "2.0" and "requestContext" in event


def _is_text(content_type: str | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media.startswith(_TEXT_TYPES) or media.endswith(_TEXT_SUFFIXES)


def _str_field(obj: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str):
        raise InvalidEvent(f"{where}{key} must be a string")
    return value


def _check_header(name: Any, value: Any, where: str) -> tuple[str, str]:
    if not isinstance(name, str) or not _TOKEN.match(name):
        raise InvalidEvent(f"{where}: header name {name!r} is not a token")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise InvalidEvent(f"{where}: header {name!r} must have a string value")
    text = _utf8(str(value), f"{where}: header {name!r}")
    if _BAD_VALUE.search(text):
        raise InvalidEvent(f"{where}: header {name!r} holds a control character")
    return name.lower(), text


def _utf8(text: str, what: str) -> str:
    """`text`, refused when it cannot be encoded (lone surrogates from a JSON event)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidEvent(f"{what} is not valid text") from exc
    return text


def _decode_body(body: Any, is_base64: Any, where: str) -> bytes:
    if body is None:
        return b""
    if not isinstance(body, str):
        raise InvalidEvent(f"{where}body must be a string")
    if not isinstance(is_base64, bool):
        raise InvalidEvent(f"{where}isBase64Encoded must be a boolean")
    if not is_base64:
        return _utf8(body, f"{where}body").encode("utf-8")
    try:
        return base64.b64decode(body.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise InvalidEvent(f"{where}body is not valid base64") from exc


def _encode_body(body: bytes, content_type: str | None) -> tuple[str, bool]:
    if _is_text(content_type) or (content_type is None and not body):
        try:
            return body.decode("utf-8"), False
        except UnicodeDecodeError:
            pass
    return base64.b64encode(body).decode("ascii"), True


def request_from_event(event: Any) -> HttpRequest:
    """The HTTP request a Function URL / HTTP API v2 event describes."""
    if not is_http_event(event):
        raise InvalidEvent('not an HTTP event: expected version "2.0" and requestContext')
    context = event["requestContext"]
    http = context.get("http") if isinstance(context, dict) else None
    if not isinstance(http, dict):
        raise InvalidEvent("requestContext.http must be an object")
    method = _str_field(http, "method", "requestContext.http.")
    if not _TOKEN.match(method):
        raise InvalidEvent(f"requestContext.http.method {method!r} is not a token")
    path = event.get("rawPath", http.get("path"))
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidEvent("rawPath must be a string starting with '/'")
    query = _utf8(_str_field(event, "rawQueryString", "", default=""), "rawQueryString")
    _utf8(path, "rawPath")
    if is_operator_route(method.upper(), path):
        raise NotFound(f"no route for {method.upper()} {path} through a Function URL")
    headers: Headers = []
    raw_headers = event.get("headers") or {}
    if not isinstance(raw_headers, dict):
        raise InvalidEvent("headers must be an object")
    for name, value in raw_headers.items():
        key, text = _check_header(name, value, "headers")
        if key not in _FRAMING:
            headers.append((key, text))
    cookies = event.get("cookies") or []
    if not isinstance(cookies, list) or not all(isinstance(c, str) for c in cookies):
        raise InvalidEvent("cookies must be a list of strings")
    if cookies:
        headers = [(k, v) for k, v in headers if k != "cookie"]
        headers.append(_check_header("cookie", "; ".join(cookies), "cookies"))
    body = _decode_body(event.get("body"), event.get("isBase64Encoded", False), "")
    return HttpRequest(method.upper(), path, query, headers, body)


def result_from_response(response: HttpResponse) -> dict[str, Any]:
    """The proxy result (payload format 2.0) a Function URL turns back into `response`."""
    headers: dict[str, str] = {}
    cookies: list[str] = []
    for name, value in response.headers:
        key = name.lower()
        if key == "set-cookie":
            cookies.append(value)
        elif key in headers:
            headers[key] = f"{headers[key]}, {value}"
        else:
            headers[key] = value
    body, is_base64 = _encode_body(response.body, headers.get("content-type"))
    result: dict[str, Any] = {
        "statusCode": response.status,
        "headers": headers,
        "body": body,
        "isBase64Encoded": is_base64,
    }
    if cookies:
        result["cookies"] = cookies
    return result


def event_from_request(
    request: HttpRequest,
    *,
    request_id: str,
    domain: str,
    source_ip: str = "127.0.0.1",
    now_s: float,
) -> dict[str, Any]:
    """The Function URL event Lambda would deliver for `request`."""
    headers: dict[str, str] = {}
    cookies: list[str] = []
    for name, value in request.headers:
        key = name.lower()
        if key == "cookie":
            cookies.extend(part.strip() for part in value.split(";") if part.strip())
        elif key in headers:
            headers[key] = f"{headers[key]},{value}"
        else:
            headers[key] = value
    params: dict[str, str] = {}
    for key, value in parse_qsl(request.query, keep_blank_values=True):
        params[key] = f"{params[key]},{value}" if key in params else value
    body, is_base64 = _encode_body(request.body, headers.get("content-type"))
    stamp = datetime.fromtimestamp(now_s, UTC)
    event: dict[str, Any] = {
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": request.path,
        "rawQueryString": request.query,
        "headers": headers,
        "requestContext": {
            "accountId": "anonymous",
            "apiId": domain.split(".", 1)[0],
            "domainName": domain,
            "domainPrefix": domain.split(".", 1)[0],
            "http": {
                "method": request.method,
                "path": request.path,
                "protocol": "HTTP/1.1",
                "sourceIp": source_ip,
                "userAgent": headers.get("user-agent", ""),
            },
            "requestId": request_id,
            "routeKey": "$default",
            "stage": "$default",
            "time": stamp.strftime("%d/%b/%Y:%H:%M:%S +0000"),
            "timeEpoch": int(now_s * 1000),
        },
        "isBase64Encoded": is_base64,
    }
    if cookies:
        event["cookies"] = cookies
    if params:
        event["queryStringParameters"] = params
    if request.body:
        event["body"] = body
    return event


def response_from_payload(payload: bytes) -> HttpResponse:
    """What a Function URL answers for a function's response payload.

    A JSON object with `statusCode` is a proxy result; anything else is sent
    as a 200 `application/json` body, as Function URLs do.
    """
    try:
        result = orjson.loads(payload)
    except orjson.JSONDecodeError:
        result = None
    if not (isinstance(result, dict) and "statusCode" in result):
        return HttpResponse(200, [("content-type", "application/json")], payload)
    status = result["statusCode"]
    if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
        raise InvalidEvent("result statusCode must be an integer from 100 to 599")
    raw_headers = result.get("headers") or {}
    if not isinstance(raw_headers, dict):
        raise InvalidEvent("result headers must be an object")
    headers = [_check_header(k, v, "result headers") for k, v in raw_headers.items()]
    headers = [(k, v) for k, v in headers if k not in _FRAMING]
    cookies = result.get("cookies") or []
    if not isinstance(cookies, list):
        raise InvalidEvent("result cookies must be a list of strings")
    headers += [_check_header("set-cookie", c, "result cookies") for c in cookies]
    body = _decode_body(result.get("body"), result.get("isBase64Encoded", False), "result ")
    return HttpResponse(status, headers, body)
