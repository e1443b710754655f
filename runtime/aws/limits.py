"""Lambda's payload limits and the words AWS answers them with: one home, shared by the
Lambda loop (which refuses to post a buffered answer Lambda would refuse) and the
emulator (which refuses what Lambda refuses, as Lambda does).

    limit                               bytes       over it
    synchronous request (Invoke,        6 291 456   413 RequestEntityTooLargeException
      InvokeWithResponseStream)                     "Request must be smaller than 6291456
                                                    bytes for the InvokeFunction operation"
    asynchronous request (Event)        1 048 576   413 RequestEntityTooLargeException
                                                    "N byte payload is too large for the
                                                    Event invocation type (limit 1048576 bytes)"
    buffered response                   6 291 556   the Runtime API answers the runtime 413
                                                    RequestEntityTooLarge; the caller gets a
                                                    function error Function.ResponseSizeTooLarge
    streamed response                   200 MB      (not enforced: the first 6 MB uncapped,
                                                    the rest at 2 MB/s)

Sources:
- Lambda quotas, "Invocation payload (request and response)": 6 MB each for
  synchronous invocations, 1 MB for asynchronous ones, 200 MB for a streamed
  response: https://docs.aws.amazon.com/lambda/latest/dg/gettingstarted-limits.html
- Invoke: "For synchronous invocations, the maximum payload size is 6 MB. For
  asynchronous invocations, the maximum payload size is 1 MB."; its error list
  calls the 413 RequestTooLargeException, but the service answers
  `RequestEntityTooLargeException` (the code SDKs raise, as every report of it
  shows, e.g. github.com/pelmers/streetwarp-web issue 14):
  https://docs.aws.amazon.com/lambda/latest/api/API_Invoke.html
- Response streaming: "payloads up to 200 MB, compared to the 6 MB maximum for
  buffered responses":
  https://docs.aws.amazon.com/lambda/latest/dg/configuration-response-streaming.html
- The response limit's exact bytes (6 MiB + 100) and messages: the Runtime
  Interface Emulator, github.com/aws/aws-lambda-runtime-interface-emulator
  (lambda/interop/model.go: `ErrorResponseTooLarge`, `MaxPayloadSize`; the
  Runtime API's 413 body in lambda/rapi/handler/invocationresponse_test.go);
  the same text is what deployed functions report (e.g. aws/aws-lambda-dotnet's
  integration tests: "Response payload size (7340060 bytes) exceeded maximum
  allowed payload size (6291556 bytes).").
- The Event message: what the Invoke API answers an oversized Event payload
  (e.g. "264496 byte payload is too large for the Event invocation type (limit
  262144 bytes)", github.com/ASFHyP3/hyp3 issue 2241, from before the 1 MB raise).
"""

from __future__ import annotations

from runtime.errors import ResponseTooLarge

MAX_SYNC_REQUEST_BYTES = 6 * 1024 * 1024
MAX_EVENT_REQUEST_BYTES = 1024 * 1024
# Not a round 6 MiB: Lambda lets a response take 100 bytes more (the RIE's MaxPayloadSize).
MAX_RESPONSE_BYTES = 6 * 1024 * 1024 + 100
MAX_STREAMED_RESPONSE_BYTES = 200 * 1024 * 1024

REQUEST_TOO_LARGE = "RequestEntityTooLargeException"
RESPONSE_TOO_LARGE = "Function.ResponseSizeTooLarge"
# What the Runtime API answers a runtime whose posted response is over the limit.
RUNTIME_API_TOO_LARGE = "RequestEntityTooLarge"


def sync_request_message(operation: str = "InvokeFunction") -> str:
    return (
        f"Request must be smaller than {MAX_SYNC_REQUEST_BYTES} bytes for the {operation} operation"
    )


def event_request_message(size: int) -> str:
    return (
        f"{size} byte payload is too large for the Event invocation type "
        f"(limit {MAX_EVENT_REQUEST_BYTES} bytes)"
    )


def response_message(size: int) -> str:
    """The caller's errorMessage for a response of `size` bytes over the limit."""
    return (
        f"Response payload size ({size} bytes) exceeded maximum allowed payload size "
        f"({MAX_RESPONSE_BYTES} bytes)."
    )


def runtime_api_message() -> str:
    """The Runtime API's errorMessage to a runtime that posted too large a response."""
    return f"Exceeded maximum allowed payload size ({MAX_RESPONSE_BYTES} bytes)."


def too_large(size: int) -> ResponseTooLarge:
    """What Thaw's Lambda loop answers in place of a buffered answer of `size` bytes
    that Lambda would refuse: it says why, and what carries it (a stream)."""
    return ResponseTooLarge(
        f"the answer is {size} bytes, over the {MAX_RESPONSE_BYTES} bytes Lambda lets a "
        "buffered response carry (docs.aws.amazon.com/lambda/latest/dg/gettingstarted-"
        'limits.html); stream it, up to 200 MB: {"stream": true} on a direct invocation, '
        "or Accept: text/event-stream on a Function URL in RESPONSE_STREAM invoke mode"
    )
