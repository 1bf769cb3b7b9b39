"""What the sync and the async clients share: configuration, request bodies,
answers to errors, and the Server-Sent Events reader."""

from __future__ import annotations

import base64
import json
import logging
import os
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    Generic,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Type,
    TypeVar,
    Union,
)

import httpx

from ._version import __version__
from .errors import APIConnectionError, APIError, APITimeoutError, SproutError, api_error, stream_error
from .events import ExitEvent, GapEvent, OutputEvent
from .models import (
    ExecChunk,
    ExecExit,
    ExecRequest,
    ForkChild,
    Model,
    ProcessExit,
    ProcessGap,
    ScheduleRequest,
    StdinWrite,
)

log = logging.getLogger("sprout")

DEFAULT_BASE_URL = "http://127.0.0.1:7070"
#: Requests wait up to 15 minutes for an answer (a create waits for a boot,
#: which takes minutes in the emulated lab), 10 s to connect.
DEFAULT_TIMEOUT = httpx.Timeout(900.0, connect=10.0)
#: A create answered ``503 template_building`` or ``image_pulling`` is
#: retried for this long.
DEFAULT_CREATE_TIMEOUT = 900.0
#: 429s (exec limits) are retried this many times after their Retry-After.
DEFAULT_MAX_RETRIES = 3
#: Upload and download chunks.
CHUNK_SIZE = 1 << 20

#: A progress callback: (bytes so far, total bytes or None when unknown).
Progress = Callable[[int, Optional[int]], None]
TimeoutTypes = Union[None, float, httpx.Timeout]


def resolve_base_url(base_url: Optional[str]) -> str:
    """``base_url``, else ``$SPROUT_URL``, else http://127.0.0.1:7070; ``HOST:PORT`` gets ``http://``."""
    url = base_url or os.environ.get("SPROUT_URL") or DEFAULT_BASE_URL
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def resolve_api_key(api_key: Optional[str]) -> Optional[str]:
    """``api_key``, else ``$SPROUT_API_KEY``; empty means none."""
    key = api_key if api_key is not None else os.environ.get("SPROUT_API_KEY")
    return key or None


def default_headers(api_key: Optional[str], extra: Optional[Mapping[str, str]]) -> Dict[str, str]:
    h = {"User-Agent": f"sprout-python/{__version__}", "Accept": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    if extra:
        h.update(extra)
    return h


def as_timeout(t: TimeoutTypes) -> httpx.Timeout:
    return t if isinstance(t, httpx.Timeout) else httpx.Timeout(t, connect=None if t is None else min(t, 10.0))


def retry_after(r: httpx.Response) -> Optional[float]:
    v = r.headers.get("retry-after")
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


def error_of(r: httpx.Response) -> APIError:
    """The exception for an error answer whose body has been read."""
    try:
        body: Any = r.json()
    except ValueError:
        body = r.text
    return api_error(r.status_code, body, retry_after=retry_after(r), request_id=r.headers.get("x-request-id"))


def transport_error(e: Exception, base_url: str) -> SproutError:
    """An httpx transport exception as the SDK's."""
    if isinstance(e, httpx.TimeoutException):
        return APITimeoutError(
            f"sproutd at {base_url} did not answer in time ({type(e).__name__}: {e}); "
            "a longer Client(timeout=...) waits more",
            url=base_url,
        )
    if isinstance(e, httpx.ConnectError):
        return APIConnectionError(
            f"cannot reach sproutd at {base_url}: {e} (is it running? `./serve` starts one; "
            "base_url= or SPROUT_URL says where it is)",
            url=base_url,
        )
    return APIConnectionError(f"talking to sproutd at {base_url}: {type(e).__name__}: {e}", url=base_url)


def json_of(r: httpx.Response, model: Type[Any]) -> Any:
    data = r.json()
    return model.from_dict(data) if isinstance(model, type) and issubclass(model, Model) else data


# ---------------------------------------------------------------- request bodies


def schedule_body(
    *,
    image: Optional[str],
    runtime: Optional[str],
    cpus: Optional[int],
    memory_mb: Optional[int],
    env: Optional[Mapping[str, str]],
    metadata: Optional[Mapping[str, str]],
    idle_timeout_secs: Optional[int],
    disable_internet: Optional[bool],
    snapshot: Optional[str],
) -> Dict[str, Any]:
    return ScheduleRequest(
        image=image,
        runtime=runtime,
        cpus=cpus,
        memory_mb=memory_mb,
        disable_internet=disable_internet,
        idle_timeout_secs=idle_timeout_secs,
        snapshot=snapshot,
        env=dict(env) if env is not None else None,
        metadata=dict(metadata) if metadata is not None else None,
    ).to_dict()


def exec_body(
    command: str,
    argv: Optional[Sequence[str]],
    *,
    stdin: Union[str, bytes, None],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    timeout_ms: Optional[int],
    background: bool = False,
    stdin_open: bool = False,
) -> Dict[str, Any]:
    if isinstance(argv, str):
        raise TypeError(
            "argv is a sequence of arguments, not a string (for a shell line: exec('/bin/sh', ['-c', LINE]))"
        )
    text: Optional[str] = None
    is_b64: Optional[bool] = None
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        text, is_b64 = base64.b64encode(bytes(stdin)).decode("ascii"), True
    elif stdin is not None:
        text = stdin
    return ExecRequest(
        command=command,
        argv=list(argv) if argv else None,
        env=dict(env) if env else None,
        cwd=cwd,
        stdin=text,
        stdin_base64=is_b64,
        timeout_ms=timeout_ms,
        background=True if background else None,
        stdin_open=True if stdin_open else None,
    ).to_dict()


def stdin_body(data: Union[str, bytes], close: bool) -> Dict[str, Any]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return StdinWrite(data=base64.b64encode(bytes(data)).decode("ascii"), base64=True, close=close).to_dict()
    return StdinWrite(data=data, close=close).to_dict()


def exec_read_timeout(base: httpx.Timeout, timeout_ms: Optional[int]) -> httpx.Timeout:
    """A buffered exec answers when the command ends: wait at least its own timeout."""
    if timeout_ms is None or base.read is None:
        return base
    read = max(base.read, timeout_ms / 1000.0 + 60.0)
    return httpx.Timeout(connect=base.connect, read=read, write=base.write, pool=base.pool)


# ---------------------------------------------------------------- Server-Sent Events


@dataclass
class _Pending:
    event: str = ""
    data: List[str] = field(default_factory=list)
    id: Optional[str] = None


class EventReader:
    """Turns the lines of a ``text/event-stream`` into the SDK's events.

    Fed one line at a time (without its end of line), as they arrive;
    :meth:`feed` returns an event when a blank line completes one. ``exit``
    is the stream's exit once seen; ``last_event_id`` the id of the last
    event (the value for ``Last-Event-ID`` on a re-attach).
    """

    def __init__(self, exit_model: Union[Type[ExecExit], Type[ProcessExit]]) -> None:
        self._exit_model = exit_model
        self._p = _Pending()
        self.exit: Optional[Union[ExecExit, ProcessExit]] = None
        self.last_event_id: Optional[int] = None

    def feed(self, line: str) -> Union[OutputEvent, ExitEvent, GapEvent, None]:
        if line.endswith("\r"):
            line = line[:-1]
        if not line:
            p, self._p = self._p, _Pending()
            if not p.data and not p.event:
                return None
            return self._dispatch(p.event or "message", "\n".join(p.data), p.id)
        if line.startswith(":"):
            return None  # a comment: the server's keep-alive
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._p.event = value
        elif name == "data":
            self._p.data.append(value)
        elif name == "id" and "\0" not in value:
            self._p.id = value
        return None

    def end(self) -> Union[OutputEvent, ExitEvent, GapEvent, None]:
        """The end of the stream: an event not closed by a blank line yet."""
        return self.feed("")

    def _dispatch(self, name: str, data: str, raw_id: Optional[str]) -> Union[OutputEvent, ExitEvent, GapEvent, None]:
        ev_id: Optional[int] = None
        if raw_id is not None:
            try:
                ev_id = int(raw_id)
            except ValueError:
                ev_id = None
        try:
            payload = json.loads(data) if data else {}
        except ValueError:
            log.warning("an %r event whose data is not JSON: %.200r", name, data)
            return None
        if name == "error":
            raise stream_error(payload)
        if ev_id is not None:
            self.last_event_id = ev_id
        if name in ("stdout", "stderr"):
            return OutputEvent(name, ExecChunk.from_dict(payload), ev_id)  # type: ignore[arg-type]
        if name == "exit":
            self.exit = self._exit_model.from_dict(payload)
            return ExitEvent(self.exit, ev_id)
        if name == "gap":
            return GapEvent(ProcessGap.from_dict(payload), ev_id)
        log.debug("an event this SDK does not know: %r", name)
        return None


def no_exit_message(what: str, last: Optional[int]) -> str:
    return (
        f"{what} ended without its exit event (the connection broke"
        + (f"; the last event seen was {last}" if last is not None else "")
        + ")"
    )


def size_of(source: Any) -> Optional[int]:
    """The byte size of an upload's source, when it can be known up front."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return len(source)
    if isinstance(source, (str, os.PathLike)):
        return os.path.getsize(source)
    try:
        pos = source.tell()
        end = source.seek(0, os.SEEK_END)
        source.seek(pos)
        return int(end - pos)
    except Exception:
        return None


def upload_headers(total: Optional[int]) -> Dict[str, str]:
    h = {"Content-Type": "application/octet-stream"}
    if total is not None:
        # A known size goes as Content-Length (else: chunked).
        h["Content-Length"] = str(total)
    return h


def describe(source: Any) -> Tuple[str, Any]:
    """What an upload's source is: ('bytes'|'path'|'file'|'iter', the thing)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return "bytes", bytes(source)
    if isinstance(source, (str, os.PathLike)):
        return "path", source
    if hasattr(source, "read"):
        return "file", source
    return "iter", source


S = TypeVar("S")


@dataclass
class ForkResult(Generic[S]):
    """A fork's children: iterable (and indexable) over :attr:`sandboxes`.

    ``sandboxes`` holds every child that sproutd recorded, in the fork's
    order, the failed ones too (``state == "failed"``: delete them as any
    other); ``failed`` the children that failed, with the server's reason
    (``error``). ``snapshot_id`` is the snapshot they were restored from.
    """

    source_vm_id: str
    snapshot_id: str
    sandboxes: List[S]
    failed: List[ForkChild]

    def __iter__(self) -> Iterator[S]:
        return iter(self.sandboxes)

    def __len__(self) -> int:
        return len(self.sandboxes)

    def __getitem__(self, i: int) -> S:
        return self.sandboxes[i]
