"""Sprout's Python SDK: a client of sproutd's REST API (docs/api.md).

    import sprout

    with sprout.Sandbox.create(cpus=1, memory_mb=512) as sb:
        r = sb.exec("python3", ["-c", "print(2**100)"])
        print(r.stdout, r.exit_code)

Sync (:class:`Client`, :class:`Sandbox`) and asyncio (:class:`AsyncClient`,
:class:`AsyncSandbox`) clients; typed models in :mod:`sprout.models`; errors
in :mod:`sprout.errors`. The server is ``base_url=`` or ``$SPROUT_URL``
(default http://127.0.0.1:7070), its key ``api_key=`` or ``$SPROUT_API_KEY``.
docs/sdk.md is the guide.
"""

from . import models
from ._async import (
    AsyncBackgroundProcess,
    AsyncClient,
    AsyncEventStream,
    AsyncExecStream,
    AsyncFiles,
    AsyncProcessStream,
    AsyncSandbox,
    default_async_client,
)
from ._base import DEFAULT_BASE_URL, DEFAULT_CREATE_TIMEOUT, DEFAULT_TIMEOUT, ForkResult
from ._sync import (
    BackgroundProcess,
    Client,
    EventStream,
    ExecStream,
    Files,
    ProcessStream,
    Sandbox,
    default_client,
)
from ._version import __version__
from .errors import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    AuthenticationError,
    BadGatewayError,
    BadRequestError,
    CommandError,
    ConflictError,
    InternalServerError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    QuotaExhaustedError,
    RateLimitError,
    ServiceUnavailableError,
    SproutError,
    StreamError,
    UnsupportedMediaTypeError,
)
from .events import ExecEvent, ExitEvent, GapEvent, OutputEvent, ProcessEvent
from .models import (
    ExecExit,
    ExecResult,
    FileEntry,
    FileList,
    FileWritten,
    Info,
    Port,
    ProcessExit,
    Snapshot,
    SnapshotTaken,
    Template,
    Vm,
    WakeResp,
)

__all__ = [
    "__version__",
    "models",
    # clients
    "Client",
    "Sandbox",
    "Files",
    "BackgroundProcess",
    "EventStream",
    "ExecStream",
    "ProcessStream",
    "AsyncClient",
    "AsyncSandbox",
    "AsyncFiles",
    "AsyncBackgroundProcess",
    "AsyncEventStream",
    "AsyncExecStream",
    "AsyncProcessStream",
    "ForkResult",
    "default_client",
    "default_async_client",
    "DEFAULT_BASE_URL",
    "DEFAULT_TIMEOUT",
    "DEFAULT_CREATE_TIMEOUT",
    # events
    "OutputEvent",
    "ExitEvent",
    "GapEvent",
    "ExecEvent",
    "ProcessEvent",
    # models
    "Vm",
    "ExecResult",
    "ExecExit",
    "ProcessExit",
    "FileEntry",
    "FileList",
    "FileWritten",
    "Info",
    "Port",
    "Snapshot",
    "SnapshotTaken",
    "Template",
    "WakeResp",
    # errors
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
]
