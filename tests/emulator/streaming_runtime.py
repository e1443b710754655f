"""A handler module that, imported at init, becomes a streaming Runtime API client.

It answers every event by a response posted in streaming mode, written by hand
with the standard library's `http.client` (chunked body, then trailers), as
the custom-runtime documentation describes it: the event's `chunks` (strings)
each as one chunk, `gap_s` seconds apart; with `error` set, the trailers
`Lambda-Runtime-Function-Error-Type: <error>` and
`Lambda-Runtime-Function-Error-Body: <base64 of {"errorType", "errorMessage"}>`.

Thaw's own loop never starts: the import does not return.
"""

from __future__ import annotations

import base64
import http
import http.client
import json
import os
import time

ADDRESS = os.environ["AWS_LAMBDA_RUNTIME_API"]
PREFIX = "/2018-06-01/runtime"


def _stream(request_id: str, event: dict[str, object]) -> None:
    connection = http.client.HTTPConnection(ADDRESS)
    connection.putrequest("POST", f"{PREFIX}/invocation/{request_id}/response")
    connection.putheader("Lambda-Runtime-Function-Response-Mode", "streaming")
    connection.putheader("Transfer-Encoding", "chunked")
    connection.putheader(
        "Trailer", "Lambda-Runtime-Function-Error-Type, Lambda-Runtime-Function-Error-Body"
    )
    connection.putheader("Content-Type", "application/octet-stream")
    connection.endheaders()
    chunks = event.get("chunks", [])
    assert isinstance(chunks, list)
    for index, text in enumerate(chunks):
        if index:
            time.sleep(float(str(event.get("gap_s", 0))))
        data = str(text).encode()
        connection.send(b"%x\r\n%b\r\n" % (len(data), data))
    end = b"0\r\n"
    error = event.get("error")
    if isinstance(error, str):
        body = json.dumps({"errorType": error, "errorMessage": f"{error} midway"}).encode()
        end += f"Lambda-Runtime-Function-Error-Type: {error}\r\n".encode()
        end += b"Lambda-Runtime-Function-Error-Body: " + base64.b64encode(body) + b"\r\n"
    connection.send(end + b"\r\n")
    response = connection.getresponse()
    response.read()
    connection.close()


def _serve() -> None:
    while True:
        connection = http.client.HTTPConnection(ADDRESS)
        connection.request("GET", f"{PREFIX}/invocation/next")
        response = connection.getresponse()
        event = response.read()
        if response.status != http.HTTPStatus.OK:
            os._exit(0)  # the emulator is stopping this instance
        request_id = response.getheader("Lambda-Runtime-Aws-Request-Id")
        connection.close()
        assert request_id is not None
        _stream(request_id, json.loads(event))


if os.environ.get("STREAMING_RUNTIME") == "serve":
    _serve()
