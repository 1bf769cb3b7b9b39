"""The asyncio client: :class:`AsyncClient`, :class:`AsyncSandbox`,
:class:`AsyncFiles`, :class:`AsyncBackgroundProcess` and the event streams.

The same calls as the sync client (``sprout._sync``), awaited.
"""

from __future__ import annotations

import asyncio
import os
import time
import weakref
from typing import (
    IO,
    Any,
    AsyncIterable,
    AsyncIterator,
    Dict,
    Generator,
    Generic,
    Iterable,
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

from . import _base
from ._base import (
    CHUNK_SIZE,
    DEFAULT_CREATE_TIMEOUT,
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    EventReader,
    ForkResult,
    Progress,
    TimeoutTypes,
    log,
)
from ._routes import route
from ._sync import _is_stream, _snap_id
from .errors import CommandError, NotFoundError, ServiceUnavailableError, StreamError
from .events import ExecEvent, ExitEvent, ProcessEvent
from .models import (
    Deleted,
    DirMade,
    ExecExit,
    ExecResult,
    FileDeleted,
    FileList,
    FileWritten,
    Forked,
    Health,
    Info,
    Process,
    ProcessExit,
    ProcessList,
    ProcessStarted,
    Port,
    PortList,
    Signal,
    SignalSent,
    Snapshot,
    SnapshotDeleted,
    SnapshotList,
    SnapshotTaken,
    StdinWritten,
    Template,
    TemplateList,
    Vm,
    VmList,
    WakeResp,
)

__all__ = [
    "AsyncClient",
    "AsyncSandbox",
    "AsyncFiles",
    "AsyncBackgroundProcess",
    "AsyncEventStream",
    "AsyncExecStream",
    "AsyncProcessStream",
]

T = TypeVar("T")
E = TypeVar("E", ExecEvent, ProcessEvent)
Query = Union[Dict[str, Any], List[Tuple[str, Any]], None]


class AsyncClient:
    """A connection to one sproutd, for asyncio (the arguments of :class:`~sprout.Client`)."""

    def __init__(
        self,
        base_url: Optional[str] = None,
        *,
        api_key: Optional[str] = None,
        timeout: TimeoutTypes = DEFAULT_TIMEOUT,
        create_timeout: float = DEFAULT_CREATE_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        headers: Optional[Mapping[str, str]] = None,
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> None:
        self.base_url = _base.resolve_base_url(base_url)
        self.api_key = _base.resolve_api_key(api_key)
        self.timeout = _base.as_timeout(timeout)
        self.create_timeout = create_timeout
        self.max_retries = max_retries
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=_base.default_headers(self.api_key, headers),
            timeout=self.timeout,
            transport=transport,
        )

    def __repr__(self) -> str:
        return f"AsyncClient(base_url={self.base_url!r})"

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def request(
        self,
        op: str,
        path_params: Optional[Mapping[str, Union[str, int]]] = None,
        *,
        json: Any = None,
        query: Query = None,
        headers: Optional[Mapping[str, str]] = None,
        content: Any = None,
        timeout: Optional[httpx.Timeout] = None,
    ) -> httpx.Response:
        """As :meth:`sprout.Client.request`."""
        method, path = route(op, **(path_params or {}))
        attempt = 0
        while True:
            try:
                r = await self._http.request(
                    method,
                    path,
                    json=json,
                    params=query,
                    headers=headers,
                    content=content,
                    timeout=timeout or self.timeout,
                )
            except httpx.TransportError as e:
                raise _base.transport_error(e, self.base_url) from e
            if r.status_code == 429 and attempt < self.max_retries and not _is_stream(content):
                attempt += 1
                wait = _base.retry_after(r) or 1.0
                log.info("%s %s: 429, retrying in %.0f s", method, path, wait)
                await asyncio.sleep(wait)
                continue
            if r.is_error:
                raise _base.error_of(r)
            return r

    async def _call(
        self, op: str, model: Type[T], path_params: Optional[Mapping[str, Union[str, int]]] = None, **kw: Any
    ) -> T:
        r = await self.request(op, path_params, **kw)
        return _base.json_of(r, model)  # type: ignore[no-any-return]

    async def open_stream(
        self,
        op: str,
        path_params: Optional[Mapping[str, Union[str, int]]] = None,
        *,
        json: Any = None,
        query: Query = None,
        headers: Optional[Mapping[str, str]] = None,
    ) -> httpx.Response:
        """As :meth:`sprout.Client.open_stream` (close it with ``aclose()``)."""
        method, path = route(op, **(path_params or {}))
        req = self._http.build_request(method, path, json=json, params=query, headers=headers)
        try:
            r = await self._http.send(req, stream=True)
        except httpx.TransportError as e:
            raise _base.transport_error(e, self.base_url) from e
        if r.is_error:
            try:
                await r.aread()
            except httpx.TransportError as e:
                raise _base.transport_error(e, self.base_url) from e
            finally:
                await r.aclose()
            raise _base.error_of(r)
        return r

    async def health(self) -> Health:
        return await self._call("health", Health)

    async def info(self) -> Info:
        return await self._call("info", Info)

    async def openapi(self) -> Dict[str, Any]:
        return await self._call("openapi", dict)

    async def metrics(self) -> str:
        return (await self.request("metrics")).text

    async def templates(self) -> List[Template]:
        return (await self._call("listTemplates", TemplateList)).templates

    async def create(
        self,
        *,
        image: Optional[str] = None,
        runtime: Optional[str] = None,
        cpus: Optional[int] = None,
        memory_mb: Optional[int] = None,
        env: Optional[Mapping[str, str]] = None,
        metadata: Optional[Mapping[str, str]] = None,
        idle_timeout_secs: Optional[int] = None,
        disable_internet: Optional[bool] = None,
        snapshot: Optional[str] = None,
        create_timeout: Optional[float] = None,
    ) -> "AsyncSandbox":
        """As :meth:`sprout.Client.create`."""
        body = _base.schedule_body(
            image=image,
            runtime=runtime,
            cpus=cpus,
            memory_mb=memory_mb,
            env=env,
            metadata=metadata,
            idle_timeout_secs=idle_timeout_secs,
            disable_internet=disable_internet,
            snapshot=snapshot,
        )
        limit = self.create_timeout if create_timeout is None else create_timeout
        deadline = time.monotonic() + limit
        while True:
            try:
                return AsyncSandbox(self, await self._call("schedule", Vm, json=body))
            except ServiceUnavailableError as e:
                left = deadline - time.monotonic()
                if e.code not in ("template_building", "image_pulling") or left <= 0:
                    raise
                wait = min(e.retry_after or 5.0, 5.0, left)
                log.info("%s; retrying the create in %.0f s", e.message, wait)
                await asyncio.sleep(wait)

    async def get(self, vm_id: str) -> "AsyncSandbox":
        return AsyncSandbox(self, await self._call("getVm", Vm, {"id": vm_id}))

    async def list(self, metadata: Optional[Mapping[str, str]] = None) -> List["AsyncSandbox"]:
        q = [(f"metadata.{k}", v) for k, v in (metadata or {}).items()]
        return [AsyncSandbox(self, v) for v in (await self._call("listVms", VmList, query=q)).vms]

    async def snapshots(self) -> List[Snapshot]:
        return (await self._call("listSnapshots", SnapshotList)).snapshots

    async def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return await self._call("getSnapshot", Snapshot, {"id": snapshot_id})

    async def delete_snapshot(self, snapshot_id: str) -> SnapshotDeleted:
        return await self._call("deleteSnapshot", SnapshotDeleted, {"id": snapshot_id})

    async def restore_checkpoint(self, checkpoint: Union[str, Snapshot]) -> "AsyncSandbox":
        return AsyncSandbox(self, await self._call("restoreCheckpoint", Vm, {"id": _snap_id(checkpoint)}))

    async def spawn_checkpoint(self, checkpoint: Union[str, Snapshot]) -> "AsyncSandbox":
        return AsyncSandbox(self, await self._call("spawnCheckpoint", Vm, {"id": _snap_id(checkpoint)}))

    async def delete_checkpoint(self, checkpoint: Union[str, Snapshot]) -> SnapshotDeleted:
        return await self._call("deleteCheckpoint", SnapshotDeleted, {"id": _snap_id(checkpoint)})


# An httpx.AsyncClient belongs to the event loop it was first used in: the
# default clients are one per (loop, base URL, API key).
_defaults: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Dict[Tuple[str, Optional[str]], AsyncClient]]" = (
    weakref.WeakKeyDictionary()
)


def default_async_client(base_url: Optional[str] = None, api_key: Optional[str] = None) -> AsyncClient:
    """The client :meth:`AsyncSandbox.create` and friends use when given none
    (one per event loop, base URL and API key)."""
    key = (_base.resolve_base_url(base_url), _base.resolve_api_key(api_key))
    per_loop = _defaults.setdefault(asyncio.get_running_loop(), {})
    c = per_loop.get(key)
    if c is None:
        c = per_loop[key] = AsyncClient(key[0], api_key=key[1] or "")
    return c


class AsyncSandbox:
    """A sandbox, for asyncio: the methods of :class:`~sprout.Sandbox`, awaited.

    ``async with await AsyncSandbox.create(...) as sb:`` deletes it at the end.
    """

    def __init__(self, client: AsyncClient, info: Vm) -> None:
        self.client = client
        self.info = info
        self.files = AsyncFiles(self)

    @classmethod
    async def create(
        cls,
        *,
        image: Optional[str] = None,
        runtime: Optional[str] = None,
        cpus: Optional[int] = None,
        memory_mb: Optional[int] = None,
        env: Optional[Mapping[str, str]] = None,
        metadata: Optional[Mapping[str, str]] = None,
        idle_timeout_secs: Optional[int] = None,
        disable_internet: Optional[bool] = None,
        snapshot: Optional[str] = None,
        client: Optional[AsyncClient] = None,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
        create_timeout: Optional[float] = None,
    ) -> "AsyncSandbox":
        """As :meth:`sprout.Sandbox.create`."""
        c = client or default_async_client(base_url, api_key)
        return await c.create(
            image=image,
            runtime=runtime,
            cpus=cpus,
            memory_mb=memory_mb,
            env=env,
            metadata=metadata,
            idle_timeout_secs=idle_timeout_secs,
            disable_internet=disable_internet,
            snapshot=snapshot,
            create_timeout=create_timeout,
        )

    @classmethod
    async def connect(
        cls,
        vm_id: str,
        *,
        client: Optional[AsyncClient] = None,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
    ) -> "AsyncSandbox":
        return await (client or default_async_client(base_url, api_key)).get(vm_id)

    @classmethod
    async def list(
        cls,
        metadata: Optional[Mapping[str, str]] = None,
        *,
        client: Optional[AsyncClient] = None,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
    ) -> List["AsyncSandbox"]:
        return await (client or default_async_client(base_url, api_key)).list(metadata)

    @property
    def id(self) -> str:
        return self.info.vm_id

    @property
    def state(self) -> str:
        return self.info.state

    @property
    def parent_id(self) -> Optional[str]:
        return self.info.parent_vm_id

    def __repr__(self) -> str:
        return f"AsyncSandbox(id={self.id!r}, state={self.state!r}, image={self.info.image!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AsyncSandbox) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def _p(self) -> Dict[str, Union[str, int]]:
        return {"id": self.id}

    def _set(self, vm: Vm) -> "AsyncSandbox":
        self.info = vm
        return self

    async def refresh(self) -> "AsyncSandbox":
        return self._set(await self.client._call("getVm", Vm, self._p()))

    async def kill(self) -> Deleted:
        return await self.client._call("deleteVm", Deleted, self._p())

    delete = kill

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            await self.kill()
        except NotFoundError:
            pass
        except Exception:
            if exc_type is None:
                raise
            log.warning("deleting sandbox %s after an error failed", self.id, exc_info=True)

    async def exec(
        self,
        command: str,
        argv: Optional[Sequence[str]] = None,
        *,
        stdin: Union[str, bytes, None] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout_ms: Optional[int] = None,
        check: bool = False,
    ) -> ExecResult:
        """As :meth:`sprout.Sandbox.exec`."""
        body = _base.exec_body(command, argv, stdin=stdin, env=env, cwd=cwd, timeout_ms=timeout_ms)
        r = await self.client._call(
            "exec",
            ExecResult,
            self._p(),
            json=body,
            timeout=_base.exec_read_timeout(self.client.timeout, timeout_ms),
        )
        if check and r.exit_code != 0:
            raise CommandError(r, " ".join([command, *(argv or [])]))
        return r

    def exec_stream(
        self,
        command: str,
        argv: Optional[Sequence[str]] = None,
        *,
        stdin: Union[str, bytes, None] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout_ms: Optional[int] = None,
    ) -> "AsyncExecStream":
        """As :meth:`sprout.Sandbox.exec_stream`; the stream is opened by
        ``await``, ``async with`` or the first ``async for`` step::

            async with sb.exec_stream("/bin/sh", ["-c", "echo a; sleep 1"]) as s:
                async for ev in s:
                    ...
        """
        body = _base.exec_body(command, argv, stdin=stdin, env=env, cwd=cwd, timeout_ms=timeout_ms)

        async def open_() -> httpx.Response:
            return await self.client.open_stream("exec", self._p(), json=body, headers={"Accept": "text/event-stream"})

        return AsyncExecStream(open_, ExecExit, "the exec's stream", self.client.base_url)

    async def exec_background(
        self,
        command: str,
        argv: Optional[Sequence[str]] = None,
        *,
        stdin: Union[str, bytes, None] = None,
        stdin_open: bool = False,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout_ms: Optional[int] = None,
    ) -> "AsyncBackgroundProcess":
        body = _base.exec_body(
            command,
            argv,
            stdin=stdin,
            env=env,
            cwd=cwd,
            timeout_ms=timeout_ms,
            background=True,
            stdin_open=stdin_open,
        )
        p = await self.client._call("exec", ProcessStarted, self._p(), json=body)
        return AsyncBackgroundProcess(self, p.exec_id, p.pid)

    async def processes(self) -> List[Process]:
        return (await self.client._call("listProcesses", ProcessList, self._p())).processes

    def process(self, exec_id: int) -> "AsyncBackgroundProcess":
        return AsyncBackgroundProcess(self, exec_id, None)

    async def _op(self, op: str) -> "AsyncSandbox":
        return self._set(await self.client._call(op, Vm, self._p()))

    async def pause(self) -> "AsyncSandbox":
        return await self._op("pauseVm")

    async def resume(self) -> "AsyncSandbox":
        return await self._op("resumeVm")

    async def sleep(self) -> "AsyncSandbox":
        return await self._op("sleepVm")

    async def hibernate(self) -> "AsyncSandbox":
        return await self._op("hibernateVm")

    async def wake(self) -> WakeResp:
        w = await self.client._call("wakeVm", WakeResp, self._p())
        self._set(w.vm)
        return w

    async def reboot(self) -> "AsyncSandbox":
        return await self._op("rebootVm")

    async def archive(self) -> "AsyncSandbox":
        return await self._op("archiveVm")

    async def unarchive(self) -> "AsyncSandbox":
        return await self._op("unarchiveVm")

    async def snapshot(self, *, leave_paused: bool = False) -> SnapshotTaken:
        body = {"leavePaused": True} if leave_paused else {}
        t = await self.client._call("snapshotVm", SnapshotTaken, self._p(), json=body)
        await self.refresh()
        return t

    async def fork(self, count: int = 1) -> ForkResult["AsyncSandbox"]:
        f = await self.client._call("forkVm", Forked, self._p(), json={"count": count})
        kids: List[AsyncSandbox] = []
        for child in f.forks:
            try:
                kids.append(await self.client.get(child.vm_id))
            except NotFoundError:
                if child.error is None:
                    raise
        return ForkResult(f.source_vm_id, f.snapshot_id, kids, [c for c in f.forks if c.error is not None])

    async def checkpoint(self, name: str) -> Snapshot:
        return await self.client._call("createCheckpoint", Snapshot, self._p(), json={"name": name})

    async def checkpoints(self) -> List[Snapshot]:
        return (await self.client._call("listCheckpoints", SnapshotList, self._p())).snapshots

    async def restore(self, checkpoint: Union[str, Snapshot]) -> "AsyncSandbox":
        return self._set(await self.client._call("restoreCheckpoint", Vm, {"id": _snap_id(checkpoint)}))

    async def spawn(self, checkpoint: Union[str, Snapshot]) -> "AsyncSandbox":
        return await self.client.spawn_checkpoint(checkpoint)

    async def delete_checkpoint(self, checkpoint: Union[str, Snapshot]) -> SnapshotDeleted:
        return await self.client.delete_checkpoint(checkpoint)

    # -- ports

    async def open_port(self, port: int, *, public: bool = False) -> Port:
        """As :meth:`sprout.Sandbox.open_port`."""
        return await self.client._call("openPort", Port, self._p(), json={"port": port, "public": public})

    async def ports(self) -> List[Port]:
        return (await self.client._call("listPorts", PortList, self._p())).ports

    async def close_port(self, port: int) -> None:
        await self.client.request("closePort", {**self._p(), "port": port})


class AsyncFiles:
    """A sandbox's files (as :class:`sprout.Files`), awaited. Local file I/O
    of uploads and downloads runs in a worker thread."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    def _q(self, path: str, **extra: Any) -> Dict[str, Any]:
        return {"path": path, **extra}

    async def list(self, path: str = ".") -> FileList:
        return await self._sb.client._call("listFiles", FileList, self._sb._p(), query=self._q(path))

    async def read(self, path: str) -> str:
        r = await self._sb.client.request("readFile", self._sb._p(), query=self._q(path))
        if r.headers.get("x-truncated") == "true":
            return (await self.read_bytes(path)).decode("utf-8")
        return r.text

    async def read_bytes(self, path: str) -> bytes:
        return (await self._sb.client.request("readRaw", self._sb._p(), query=self._q(path))).content

    async def write(self, path: str, data: Union[str, bytes]) -> FileWritten:
        if isinstance(data, str):
            raw = data.encode("utf-8")
            if len(raw) <= 1 << 20:
                return await self._sb.client._call(
                    "writeFile",
                    FileWritten,
                    self._sb._p(),
                    query=self._q(path),
                    content=raw,
                    headers={"Content-Type": "text/plain; charset=utf-8"},
                )
            data = raw
        return await self.upload(path, bytes(data))

    async def mkdir(self, path: str, *, parents: bool = False) -> DirMade:
        body = {"path": path, "parents": True} if parents else {"path": path}
        return await self._sb.client._call("mkdir", DirMade, self._sb._p(), json=body)

    async def delete(self, path: str, *, recursive: bool = False) -> FileDeleted:
        q = self._q(path, recursive="true") if recursive else self._q(path)
        return await self._sb.client._call("deleteFile", FileDeleted, self._sb._p(), query=q)

    remove = delete

    async def exists(self, path: str) -> bool:
        head, _, name = path.rstrip("/").rpartition("/")
        try:
            return name in (await self.list(head or ".")).names()
        except NotFoundError as e:
            if e.code == "file_not_found":
                return False
            raise

    async def upload(
        self,
        path: str,
        source: Union[str, "os.PathLike[str]", bytes, IO[bytes], Iterable[bytes], AsyncIterable[bytes]],
        *,
        progress: Optional[Progress] = None,
        chunk_size: int = CHUNK_SIZE,
    ) -> FileWritten:
        """As :meth:`sprout.Files.upload`; ``source`` may also be an async iterable."""
        kind, src = _base.describe(source)
        if kind == "iter" and hasattr(src, "__aiter__"):
            kind = "aiter"
        total = None if kind in ("iter", "aiter") else await asyncio.to_thread(_base.size_of, source)

        async def chunks() -> AsyncIterator[bytes]:
            sent = 0

            async def pieces() -> AsyncIterator[bytes]:
                if kind == "bytes":
                    for i in range(0, len(src), chunk_size):
                        yield src[i : i + chunk_size]
                elif kind == "path":
                    f = await asyncio.to_thread(open, src, "rb")
                    try:
                        while True:
                            c = await asyncio.to_thread(f.read, chunk_size)
                            if not c:
                                break
                            yield c
                    finally:
                        await asyncio.to_thread(f.close)
                elif kind == "file":
                    while True:
                        c = await asyncio.to_thread(src.read, chunk_size)
                        if not c:
                            break
                        yield c
                elif kind == "aiter":
                    async for c in src:
                        yield c
                else:
                    for c in src:
                        yield c

            async for c in pieces():
                c = bytes(c)
                sent += len(c)
                yield c
                if progress:
                    progress(sent, total)

        return await self._sb.client._call(
            "writeRaw",
            FileWritten,
            self._sb._p(),
            query=self._q(path),
            content=chunks(),
            headers=_base.upload_headers(total),
        )

    async def download(
        self,
        path: str,
        dest: Union[str, "os.PathLike[str]", IO[bytes]],
        *,
        progress: Optional[Progress] = None,
        chunk_size: int = CHUNK_SIZE,
    ) -> int:
        """As :meth:`sprout.Files.download`."""
        r = await self._sb.client.open_stream("readRaw", self._sb._p(), query=self._q(path))
        n = 0
        total = int(r.headers["content-length"]) if "content-length" in r.headers else None
        own = isinstance(dest, (str, os.PathLike))
        f: IO[bytes] = await asyncio.to_thread(open, dest, "wb") if own else dest  # type: ignore[assignment,arg-type]
        ok = False
        try:
            async for chunk in r.aiter_bytes(chunk_size):
                await asyncio.to_thread(f.write, chunk)
                n += len(chunk)
                if progress:
                    progress(n, total)
            ok = True
        except httpx.TransportError as e:
            raise _base.transport_error(e, self._sb.client.base_url) from e
        finally:
            await r.aclose()
            if own:
                await asyncio.to_thread(f.close)
                if not ok:
                    os.unlink(dest)  # type: ignore[arg-type]
        return n


class AsyncEventStream(Generic[E]):
    """An async iterator of a stream's events as they arrive (as
    :class:`sprout.EventStream`). The request is sent by ``await stream``,
    ``async with stream`` or the first ``async for`` step; use ``async with``
    (or :meth:`aclose`) to stop reading early."""

    def __init__(self, opener: Any, exit_model: Any, what: str, base_url: str) -> None:
        self._opener = opener
        self._r: Optional[httpx.Response] = None
        self._lines: Optional[AsyncIterator[str]] = None
        self._reader = EventReader(exit_model)
        self._what = what
        self._base_url = base_url
        self._done = False

    @property
    def exit(self) -> Optional[Any]:
        return self._reader.exit

    @property
    def last_event_id(self) -> Optional[int]:
        return self._reader.last_event_id

    async def open(self) -> "AsyncEventStream[E]":
        """Sends the request (once); errors before the stream starts are raised here."""
        if self._r is None and not self._done:
            self._r = await self._opener()
            self._lines = self._r.aiter_lines()
        return self

    def __await__(self) -> Generator[Any, None, "AsyncEventStream[E]"]:
        return self.open().__await__()

    def __aiter__(self) -> "AsyncEventStream[E]":
        return self

    async def __anext__(self) -> E:
        if self._done:
            raise StopAsyncIteration
        await self.open()
        assert self._lines is not None
        try:
            async for line in self._lines:
                ev = self._reader.feed(line)
                if ev is not None:
                    if isinstance(ev, ExitEvent):
                        await self.aclose()
                    return ev  # type: ignore[return-value]
            ev = self._reader.end()
        except httpx.TransportError as e:
            await self.aclose()
            raise StreamError(
                _base.no_exit_message(self._what, self.last_event_id) + f": {type(e).__name__}: {e}",
                last_event_id=self.last_event_id,
            ) from e
        except BaseException:
            await self.aclose()
            raise
        await self.aclose()
        if ev is not None:
            return ev  # type: ignore[return-value]
        if self._reader.exit is None:
            raise StreamError(_base.no_exit_message(self._what, self.last_event_id), last_event_id=self.last_event_id)
        raise StopAsyncIteration

    async def wait(self) -> Any:
        """Reads (and drops) the rest of the events; returns the exit."""
        async for _ in self:
            pass
        return self._reader.exit

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            if self._r is not None:
                await self._r.aclose()

    async def __aenter__(self) -> "AsyncEventStream[E]":
        return await self.open()

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class AsyncExecStream(AsyncEventStream[ExecEvent]):
    """The events of :meth:`AsyncSandbox.exec_stream`; ``exit`` is an :class:`~sprout.models.ExecExit`."""

    @property
    def exit(self) -> Optional[ExecExit]:
        return self._reader.exit  # type: ignore[return-value]

    async def wait(self) -> ExecExit:
        return await super().wait()  # type: ignore[no-any-return]


class AsyncProcessStream(AsyncEventStream[ProcessEvent]):
    """The events of :meth:`AsyncBackgroundProcess.events`; ``exit`` is a :class:`~sprout.models.ProcessExit`."""

    @property
    def exit(self) -> Optional[ProcessExit]:
        return self._reader.exit  # type: ignore[return-value]

    async def wait(self) -> ProcessExit:
        return await super().wait()  # type: ignore[no-any-return]


class AsyncBackgroundProcess:
    """A background process of a sandbox (as :class:`sprout.BackgroundProcess`)."""

    def __init__(self, sandbox: AsyncSandbox, exec_id: int, pid: Optional[int]) -> None:
        self.sandbox = sandbox
        self.exec_id = exec_id
        self.pid = pid

    def __repr__(self) -> str:
        return f"AsyncBackgroundProcess(sandbox={self.sandbox.id!r}, exec_id={self.exec_id}, pid={self.pid})"

    def _p(self) -> Dict[str, Union[str, int]]:
        return {"id": self.sandbox.id, "execId": self.exec_id}

    def events(self, last_event_id: Optional[int] = None) -> AsyncProcessStream:
        """As :meth:`sprout.BackgroundProcess.events` (opened as an :class:`AsyncEventStream`)."""
        h = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            h["Last-Event-ID"] = str(last_event_id)

        async def open_() -> httpx.Response:
            return await self.sandbox.client.open_stream("processEvents", self._p(), headers=h)

        return AsyncProcessStream(open_, ProcessExit, f"process {self.exec_id}'s stream", self.sandbox.client.base_url)

    async def wait(self, *, reattach: int = 5) -> ProcessExit:
        last: Optional[int] = None
        while True:
            s = self.events(last)
            try:
                return await s.wait()
            except StreamError as e:
                if reattach <= 0:
                    raise
                reattach -= 1
                last = e.last_event_id if e.last_event_id is not None else last
                log.info("%s; re-attaching after event %s", e, last)
            finally:
                await s.aclose()

    async def info(self) -> Process:
        for p in await self.sandbox.processes():
            if p.exec_id == self.exec_id:
                return p
        raise NotFoundError(
            404, "process_not_found", f"No background process {self.exec_id} in sandbox {self.sandbox.id}"
        )

    async def write_stdin(self, data: Union[str, bytes], *, close: bool = False) -> StdinWritten:
        return await self.sandbox.client._call(
            "processStdin", StdinWritten, self._p(), json=_base.stdin_body(data, close)
        )

    async def close_stdin(self) -> StdinWritten:
        return await self.write_stdin("", close=True)

    async def signal(self, signal: Signal = "TERM") -> SignalSent:
        return await self.sandbox.client._call("processSignal", SignalSent, self._p(), json={"signal": signal})

    async def kill(self) -> SignalSent:
        return await self.signal("KILL")
