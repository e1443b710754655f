"""The Function URL event adapter: any input gives a result or InvalidEvent, never a crash."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.aws.events import (
    HttpRequest,
    HttpResponse,
    InvalidEvent,
    event_from_request,
    request_from_event,
    response_from_payload,
    result_from_response,
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats()
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)
token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
header_value = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30
).map(str.strip)
# Events shaped like the real thing, with any field swapped for junk.
http_like = st.fixed_dictionaries(
    {
        "version": st.sampled_from(["2.0", "1.0", 2]),
        "rawPath": st.one_of(st.text(max_size=30), st.just("/invoke/echo"), json_values),
        "rawQueryString": st.one_of(st.text(max_size=30), json_values),
        "headers": st.one_of(st.dictionaries(st.text(max_size=10), json_values), json_values),
        "cookies": st.one_of(st.lists(st.text(max_size=10)), json_values),
        "requestContext": st.one_of(
            st.fixed_dictionaries(
                {"http": st.fixed_dictionaries({"method": st.one_of(token, json_values)})}
            ),
            json_values,
        ),
        "body": st.one_of(st.none(), st.text(max_size=40), json_values),
        "isBase64Encoded": st.one_of(st.booleans(), json_values),
    }
)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(json_values, http_like))
def test_any_event_gives_a_request_or_the_documented_error(event: Any) -> None:
    try:
        request = request_from_event(event)
    except InvalidEvent as exc:
        assert exc.status == 400 and exc.slug == "invalid-event"
        return
    # Whatever was accepted can be sent in process without another error.
    url = httpx.URL("http://lambda" + request.target)
    assert url.raw_path.startswith(b"/")
    httpx.Headers(request.raw_headers)


@settings(max_examples=100)
@given(st.one_of(st.binary(max_size=60), json_values.map(orjson.dumps)))
def test_any_payload_gives_a_response_or_the_documented_error(payload: bytes) -> None:
    try:
        response = response_from_payload(payload)
    except InvalidEvent:
        return
    assert 100 <= response.status <= 599


@settings(max_examples=100)
@given(
    st.fixed_dictionaries(
        {
            "statusCode": st.one_of(st.integers(0, 700), json_values),
            "headers": st.one_of(st.dictionaries(st.text(max_size=8), json_values), json_values),
            "cookies": st.one_of(st.lists(st.text(max_size=8)), json_values),
            "body": st.one_of(st.text(max_size=20), json_values),
            "isBase64Encoded": st.one_of(st.booleans(), json_values),
        }
    )
)
def test_any_proxy_result_gives_a_response_or_the_documented_error(result: dict[str, Any]) -> None:
    try:
        response = response_from_payload(orjson.dumps(result))
    except InvalidEvent:
        return
    assert response.status == result["statusCode"]


requests = st.builds(
    HttpRequest,
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    path=st.text(alphabet="abcdefghij/-._~%20", max_size=20).map(lambda p: "/" + p),
    query=st.text(alphabet="abc=&123", max_size=20),
    headers=st.lists(st.tuples(token, header_value), max_size=5),
    body=st.binary(max_size=64),
)


@settings(max_examples=100)
@given(requests)
def test_request_survives_a_trip_through_a_function_url_event(request: HttpRequest) -> None:
    event = orjson.loads(
        orjson.dumps(event_from_request(request, request_id="r", domain="d.example", now_s=0.0))
    )
    back = request_from_event(event)
    assert (back.method, back.path, back.query, back.body) == (
        request.method,
        request.path,
        request.query,
        request.body,
    )
    sent = {k.lower() for k, _ in request.headers if k.lower() not in {"content-length"}}
    assert sent <= {k for k, _ in back.headers} | {"transfer-encoding"}


@settings(max_examples=100)
@given(
    status=st.integers(100, 599),
    headers=st.lists(st.tuples(token, header_value), max_size=5),
    cookies=st.lists(header_value.filter(bool), max_size=3),
    body=st.binary(max_size=64),
    content_type=st.sampled_from([None, "application/json", "text/plain", "image/png"]),
)
def test_response_survives_a_trip_through_a_proxy_result(
    status: int,
    headers: list[tuple[str, str]],
    cookies: list[str],
    body: bytes,
    content_type: str | None,
) -> None:
    headers = [(k, v) for k, v in headers if k not in {"set-cookie", "content-type"}]
    headers += [("set-cookie", c) for c in cookies]
    if content_type:
        headers.append(("content-type", content_type))
    payload = orjson.dumps(result_from_response(HttpResponse(status, headers, body)))
    back = response_from_payload(payload)
    assert back.status == status
    assert back.body == body
    assert sorted(v for k, v in back.headers if k == "set-cookie") == sorted(cookies)
    if content_type:
        assert ("content-type", content_type) in back.headers


def test_binary_body_is_base64_and_json_is_text() -> None:
    binary = result_from_response(HttpResponse(200, [("content-type", "image/png")], b"\x89PNG"))
    assert binary["isBase64Encoded"] is True
    assert base64.b64decode(binary["body"]) == b"\x89PNG"
    text = result_from_response(HttpResponse(202, [("content-type", "application/json")], b"{}"))
    assert text == {
        "statusCode": 202,
        "headers": {"content-type": "application/json"},
        "body": "{}",
        "isBase64Encoded": False,
    }


def test_location_and_retry_after_are_kept() -> None:
    headers = [
        ("location", "/jobs/abc"),
        ("retry-after", "3"),
        ("content-type", "application/json"),
    ]
    result = result_from_response(HttpResponse(202, headers, b"{}"))
    assert result["headers"]["location"] == "/jobs/abc"
    assert result["headers"]["retry-after"] == "3"


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ({"version": "2.0", "requestContext": {}}, "requestContext.http"),
        (
            {"version": "2.0", "requestContext": {"http": {"method": "GET"}}, "rawPath": "x"},
            "rawPath",
        ),
        (
            {
                "version": "2.0",
                "rawPath": "/",
                "requestContext": {"http": {"method": "GET"}},
                "body": "%%%",
                "isBase64Encoded": True,
            },
            "base64",
        ),
    ],
)
def test_malformed_events_name_the_defect(event: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidEvent, match=message):
        request_from_event(event)


def test_payload_without_status_code_is_a_json_200() -> None:
    response = response_from_payload(b'{"output": 1}')
    assert (response.status, response.body) == (200, b'{"output": 1}')
    assert ("content-type", "application/json") in response.headers
