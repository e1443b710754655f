"""The exception tree. Every deliberate error is a `ThawError`.

    ThawError                      500 internal
    ├── ConfigError                500 config
    │   └── BrokenHandler          500 broken-handler  (its handler module failed to import)
    ├── BadRequest                 400 bad-request
    │   ├── InvalidJSON            400 invalid-json
    │   ├── InvalidInput           400 invalid-input   (a handler rejects its event)
    │   ├── InvalidPrefer          400 invalid-prefer
    │   └── InvalidEvent           400 invalid-event   (a Lambda event of no known shape)
    ├── Unauthorized               401 unauthorized    (WWW-Authenticate)
    ├── Forbidden                  403 forbidden       (an operator route, a tenant key)
    ├── MethodNotAllowed           405 method-not-allowed (Allow)
    ├── RequestTimeout             408 request-timeout (a body not received in time)
    ├── NotFound                   404 not-found
    │   ├── UnknownHandler         404 unknown-handler
    │   ├── UnknownBundle          404 unknown-bundle
    │   └── UnknownJob             404 unknown-job
    ├── Conflict                   409 conflict
    │   └── Cancelled              409 cancelled       (a job its client cancelled)
    ├── PayloadTooLarge            413 payload-too-large
    ├── QueueFull                  429 queue-full      (Retry-After)
    │   └── QuotaExceeded          429 quota-exceeded  (one key's share: held connections, jobs)
    ├── HandlerError               500 handler-error   (user code raised)
    │   ├── HandlerTimeout         500 handler-timeout (ran past THAW_RUN_TIMEOUT_S)
    │   └── InvalidOutput          500 invalid-output  (not JSON, or a non-finite number)
    ├── BundleError                500 bundle-invalid  (manifest or layout defect)
    │   └── IntegrityError         500 integrity       (size or sha256 mismatch)
    ├── WorkerLost                 500 worker-lost     (a job's instance died, attempts used up)
    ├── ResponseTooLarge           500 response-too-large (on Lambda: over a buffered answer's 6 MB)
    └── Unavailable                503 unavailable
        ├── LoadFailed             503 load-failed     (a load failed; retried after back-off)
        ├── Draining               503 drained         (retryable: submit it again)
        ├── InsufficientMemory     503 insufficient-memory
        ├── StorageUnavailable     503 storage-unavailable (the job store cannot write)
        ├── Overloaded             503 overloaded      (too many request bytes buffered)
        └── WarmingUp              503 warming-up      (not ready by a jobless deadline)

Each class knows its HTTP status, its problem type slug and its title (a test
checks this drawing against the classes). The slug is also a job's
`error.type`, the Lambda `errorType` and the CLI's, so one name follows an
error through every surface (on Lambda, an exception of a handler's own code
is named by its class instead, as AWS's Python runtime names it);
runtime/wire/render.py is the one place an error becomes a problem, a job error, a
Lambda error or a CLI line. Job-only errors are classes too: `Cancelled`,
`WorkerLost`, and `Draining` for work a drain cut off. Foreign errors are translated once,
at the boundary where they are caught, with `raise ... from exc`.
"""

from __future__ import annotations

from typing import Any, ClassVar


class ThawError(Exception):
    """Root of every deliberate runtime error."""

    status: ClassVar[int] = 500
    slug: ClassVar[str] = "internal"
    title: ClassVar[str] = "Internal error"
    # Sending the same request again may succeed (a job error says so).
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        # Fields added to the problem details (e.g. `limit_bytes`, `handler`).
        self.extra = extra
        # Seconds a client should wait before retrying; rendered as Retry-After.
        self.retry_after_s: float | None = extra.pop("retry_after_s", None)


class ConfigError(ThawError):
    """A setting or template value is invalid."""

    slug = "config"
    title = "Invalid configuration"


class BrokenHandler(ConfigError):
    """The handler asked for is declared in a handler module that failed to import."""

    slug = "broken-handler"
    title = "Handler module failed to import"


class BadRequest(ThawError):
    """The request cannot be processed as sent."""

    status = 400
    slug = "bad-request"
    title = "Bad request"


class InvalidJSON(BadRequest):
    """The body is not valid JSON."""

    slug = "invalid-json"
    title = "Malformed JSON body"


class InvalidInput(BadRequest):
    """A handler rejected its event; `field` names the offending field."""

    slug = "invalid-input"
    title = "Invalid input"

    def __init__(self, field: str, message: str, **extra: Any) -> None:
        super().__init__(f"{field}: {message}", field=field, **extra)
        self.field = field


class InvalidPrefer(BadRequest):
    """The Prefer header could not be parsed."""

    slug = "invalid-prefer"
    title = "Invalid Prefer header"


class InvalidEvent(BadRequest):
    """A Lambda event (or a function's proxy result) has no shape Thaw knows."""

    slug = "invalid-event"
    title = "Invalid event"


class Unauthorized(ThawError):
    """Missing or wrong credentials."""

    status = 401
    slug = "unauthorized"
    title = "Unauthorized"


class Forbidden(ThawError):
    """A valid key without the role the route needs (an operator route, a tenant key)."""

    status = 403
    slug = "forbidden"
    title = "Forbidden"


class MethodNotAllowed(ThawError):
    """The path exists but not for this method; `allow` lists the methods it has."""

    status = 405
    slug = "method-not-allowed"
    title = "Method not allowed"

    def __init__(self, message: str, *, allow: list[str], **extra: Any) -> None:
        super().__init__(message, allow=allow, **extra)
        self.allow = allow


class RequestTimeout(ThawError):
    """The request body did not arrive within THAW_BODY_TIMEOUT_S."""

    status = 408
    slug = "request-timeout"
    title = "Request timeout"


class NotFound(ThawError):
    """The named thing does not exist."""

    status = 404
    slug = "not-found"
    title = "Not found"


class UnknownHandler(NotFound):
    """No handler of that name is registered."""

    slug = "unknown-handler"
    title = "Unknown handler"


class UnknownBundle(NotFound):
    """No bundle of that name is in the bundle source."""

    slug = "unknown-bundle"
    title = "Unknown bundle"


class UnknownJob(NotFound):
    """No job of that id (or not one this caller may see)."""

    slug = "unknown-job"
    title = "Unknown job"


class Conflict(ThawError):
    """The request conflicts with the current state."""

    status = 409
    slug = "conflict"
    title = "Conflict"


class Cancelled(Conflict):
    """The job was cancelled before it finished."""

    slug = "cancelled"
    title = "Cancelled"


class PayloadTooLarge(ThawError):
    """The body exceeds THAW_MAX_BODY_BYTES."""

    status = 413
    slug = "payload-too-large"
    title = "Payload too large"


class QueueFull(ThawError):
    """The handler's bounded queue is full; retry later."""

    status = 429
    slug = "queue-full"
    title = "Queue full"


class QuotaExceeded(QueueFull):
    """One key (or the instance) holds all it may: held connections or stored jobs."""

    slug = "quota-exceeded"
    title = "Quota exceeded"


class HandlerError(ThawError):
    """User handler or builder code raised."""

    slug = "handler-error"
    title = "Handler error"


class HandlerTimeout(HandlerError):
    """A handler ran past THAW_RUN_TIMEOUT_S."""

    slug = "handler-timeout"
    title = "Handler timed out"


class InvalidOutput(HandlerError):
    """A handler's output cannot be sent: not JSON, or a non-finite number."""

    slug = "invalid-output"
    title = "Invalid handler output"


class BundleError(ThawError):
    """A bundle's manifest or layout is defective."""

    slug = "bundle-invalid"
    title = "Invalid bundle"


class IntegrityError(BundleError):
    """A bundle file's size or sha256 does not match its manifest."""

    slug = "integrity"
    title = "Bundle integrity check failed"


class WorkerLost(ThawError):
    """A job's instance stopped (died, timed out) and its attempts are used up."""

    slug = "worker-lost"
    title = "Worker lost"


class ResponseTooLarge(ThawError):
    """On Lambda: an answer larger than a buffered response may be (runtime/aws/limits.py);
    a stream carries it."""

    slug = "response-too-large"
    title = "Response too large"


class Unavailable(ThawError):
    """The service cannot take this request now."""

    status = 503
    slug = "unavailable"
    title = "Service unavailable"


class LoadFailed(Unavailable):
    """A bundle failed to load; the next attempt waits for a back-off."""

    slug = "load-failed"
    title = "Model load failed"


class Draining(Unavailable):
    """The instance is draining: new work is refused, and work cut off by the end
    of the grace (a waiting caller, a job) ends with this error."""

    slug = "drained"
    title = "Draining"
    retryable = True


class InsufficientMemory(Unavailable):
    """The bundle cannot fit in the memory budget."""

    slug = "insufficient-memory"
    title = "Insufficient memory"


class StorageUnavailable(Unavailable):
    """The job store cannot write (full disk, a replaced or unreadable file, an
    unreachable table): nothing that needs a durable record is accepted."""

    slug = "storage-unavailable"
    title = "Job storage unavailable"


class Overloaded(Unavailable):
    """Too many request bytes are buffered across connections (THAW_MAX_BUFFERED_BYTES)."""

    slug = "overloaded"
    title = "Overloaded"


class WarmingUp(Unavailable):
    """A caller that takes no job (the OpenAI routes) asked for work that cannot answer
    by its deadline (a cold load): the load goes on; send it again after Retry-After."""

    slug = "warming-up"
    title = "Warming up"
    retryable = True
