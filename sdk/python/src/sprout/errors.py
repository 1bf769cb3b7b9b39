"""The exceptions the SDK raises.

Every error answer of sproutd has the body
``{"error": {"code", "message", "field"?, "state"?}}`` (docs/api.md, "Errors");
the SDK raises it as an :class:`APIError` carrying that ``code``, the HTTP
``status`` and the rest. Branch on ``code`` (stable), never on ``message``::

    try:
        sb = client.get("0b3ae0d4-...")
    except sprout.NotFoundError as e:
        assert e.code == "vm_not_found" and e.status == 404

Each HTTP status has its subclass (:class:`NotFoundError` for 404,
:class:`ConflictError` for 409, ...), chosen by the status the server
answered or, for an error that arrives inside an event stream (where the
HTTP status was already 200), by the status the code always has.

A server that cannot be reached is :class:`APIConnectionError`; one that does
not answer in time :class:`APITimeoutError`. Both are :class:`SproutError`,
the base of everything here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Type

if TYPE_CHECKING:  # pragma: no cover
    from .models import ExecResult

__all__ = [
    "SproutError",
    "APIError",
    "BadRequestError",
    "AuthenticationError",
    "QuotaExhaustedError",
    "PermissionDeniedError",
    "NotFoundError",
    "MethodNotAllowedError",
    "ConflictError",
    "PayloadTooLargeError",
    "UnsupportedMediaTypeError",
    "RateLimitError",
    "InternalServerError",
    "BadGatewayError",
    "ServiceUnavailableError",
    "APIConnectionError",
    "APITimeoutError",
    "StreamError",
    "CommandError",
    "CODE_STATUS",
]

#: The HTTP status of every error code sproutd answers (docs/api.md's table;
#: the drift test checks it against docs/openapi.json).
CODE_STATUS: Dict[str, int] = {
    "bad_request": 400,
    "invalid_json": 400,
    "invalid_body": 400,
    "invalid_value": 400,
    "unknown_image": 400,
    "exec_failed": 400,
    "not_supported": 400,
    "path_escape": 400,
    "invalid_path": 400,
    "not_text": 400,
    "file_error": 400,
    "unauthorized": 401,
    "quota_exhausted": 402,
    "forbidden": 403,
    "permission_denied": 403,
    "not_found": 404,
    "process_not_found": 404,
    "file_not_found": 404,
    "vm_not_found": 404,
    "snapshot_not_found": 404,
    "checkpoint_not_found": 404,
    "port_not_open": 404,
    "method_not_allowed": 405,
    "invalid_state": 409,
    "paused": 409,
    "too_many_checkpoints": 409,
    "too_many_ports": 409,
    "stdin_closed": 409,
    "file_conflict": 409,
    "payload_too_large": 413,
    "unsupported_media_type": 415,
    "busy": 429,
    "too_many_requests": 429,
    "internal": 500,
    "boot_failed": 502,
    "agent_unavailable": 502,
    "port_not_listening": 502,
    "worker_failed": 502,
    "snapshot_failed": 502,
    "store_failed": 502,
    "host_unsupported": 503,
    "template_building": 503,
    "image_pulling": 503,
    "bad_image_reference": 400,
    "image_not_found": 400,
    "image_platform": 400,
    "image_unsupported": 400,
    "image_too_large": 400,
    "registry_unreachable": 502,
    "registry_auth": 502,
    "registry_error": 502,
    "image_corrupt": 502,
    "image_build_failed": 500,
}


class SproutError(Exception):
    """The base of every exception the SDK raises."""


class APIError(SproutError):
    """An error answer of sproutd.

    Attributes:
        status: the HTTP status (for an ``error`` event inside a stream, the
            status its code has everywhere else).
        code: the server's stable error code, e.g. ``"vm_not_found"``
            (docs/api.md lists them).
        message: the server's message, for people.
        field: the request field to blame, when one is.
        state: the sandbox's current state, when the request is impossible
            in it (``invalid_state``).
        retry_after: the ``Retry-After`` header in seconds (every 429, a 503
            ``template_building`` or ``image_pulling``), else None.
        request_id: the answer's ``X-Request-Id`` (quote it with a bug report).
        body: the parsed error body (or the raw text of a non-JSON answer).
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        field: Optional[str] = None,
        state: Optional[str] = None,
        retry_after: Optional[float] = None,
        request_id: Optional[str] = None,
        body: Any = None,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.state = state
        self.retry_after = retry_after
        self.request_id = request_id
        self.body = body
        super().__init__(f"{message} ({code}, HTTP {status})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status!r}, code={self.code!r}, message={self.message!r})"


class BadRequestError(APIError):
    """400: a malformed request, a bad value, an exec that could not start, ..."""


class AuthenticationError(APIError):
    """401 ``unauthorized``: no API key, or one that is unknown or revoked."""


class QuotaExhaustedError(APIError):
    """402 ``quota_exhausted``: every sandbox slot of the tenant is held."""


class PermissionDeniedError(APIError):
    """403: ``forbidden`` (the key may not do this) or ``permission_denied`` (a file)."""


class NotFoundError(APIError):
    """404: no such sandbox, snapshot, checkpoint, process, file or route."""


class MethodNotAllowedError(APIError):
    """405 ``method_not_allowed``."""


class ConflictError(APIError):
    """409: impossible in the sandbox's state (``state`` says which), paused, ..."""


class PayloadTooLargeError(APIError):
    """413 ``payload_too_large``: a JSON or text body over 1 MiB."""


class UnsupportedMediaTypeError(APIError):
    """415 ``unsupported_media_type``."""


class RateLimitError(APIError):
    """429 ``too_many_requests`` or ``busy``: retry after ``retry_after`` seconds."""


class InternalServerError(APIError):
    """500 ``internal``: a bug or a registry failure in sproutd."""


class BadGatewayError(APIError):
    """502: a worker, guest, agent, snapshot or store failed."""


class ServiceUnavailableError(APIError):
    """503: ``host_unsupported``, or ``template_building`` or ``image_pulling``
    (retry after ``retry_after``)."""


_BY_STATUS: Dict[int, Type[APIError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    402: QuotaExhaustedError,
    403: PermissionDeniedError,
    404: NotFoundError,
    405: MethodNotAllowedError,
    409: ConflictError,
    413: PayloadTooLargeError,
    415: UnsupportedMediaTypeError,
    429: RateLimitError,
    500: InternalServerError,
    502: BadGatewayError,
    503: ServiceUnavailableError,
}


def api_error(
    status: int,
    body: Any,
    *,
    retry_after: Optional[float] = None,
    request_id: Optional[str] = None,
) -> APIError:
    """The exception for an error answer: ``body`` is its parsed JSON (or text)."""
    err: Mapping[str, Any] = {}
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        err = body["error"]
    code = err.get("code")
    message = err.get("message")
    if not isinstance(code, str) or not isinstance(message, str):
        # Not sproutd's envelope (a proxy in between?): say what came.
        text = body if isinstance(body, str) else repr(body)
        code = "http_error"
        message = f"HTTP {status} without an error envelope: {text[:512]}"
    cls = _BY_STATUS.get(status, APIError)
    return cls(
        status,
        code,
        message,
        field=err.get("field"),
        state=err.get("state"),
        retry_after=retry_after,
        request_id=request_id,
        body=body,
    )


def stream_error(envelope: Any) -> APIError:
    """The exception for an ``error`` event of a stream (its data is the envelope)."""
    code = envelope.get("error", {}).get("code") if isinstance(envelope, Mapping) else None
    status = CODE_STATUS.get(code, 500) if isinstance(code, str) else 500
    return api_error(status, envelope)


class APIConnectionError(SproutError):
    """sproutd could not be reached (nothing listens there, DNS, a reset)."""

    def __init__(self, message: str, *, url: str) -> None:
        self.url = url
        super().__init__(message)


class APITimeoutError(APIConnectionError):
    """sproutd did not answer within the client's timeout."""


class StreamError(SproutError):
    """An event stream ended before its ``exit`` event (the connection broke).

    ``last_event_id`` is the id of the last event received: a background
    process's stream can be re-attached after it with
    ``process.events(last_event_id=e.last_event_id)``.
    """

    def __init__(self, message: str, *, last_event_id: Optional[int]) -> None:
        self.last_event_id = last_event_id
        super().__init__(message)


class CommandError(SproutError):
    """A command exited non-zero (or was killed) and ``check=True`` was asked.

    ``result`` is its :class:`~sprout.models.ExecResult`.
    """

    def __init__(self, result: "ExecResult", command: str) -> None:
        self.result = result
        self.command = command
        how = f"exit status {result.exit_code}" if result.exit_code is not None else f"signal {result.signal}"
        if result.timed_out:
            how += " (timed out)"
        tail = result.stderr_text[-500:].strip()
        super().__init__(f"{command!r} failed: {how}" + (f": {tail}" if tail else ""))
