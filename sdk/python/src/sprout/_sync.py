"""The synchronous client: :class:`Client`, :class:`Sandbox`, :class:`Files`,
:class:`BackgroundProcess` and the event streams."""

from __future__ import annotations

import os
import threading
import time
from typing import (
    IO,
    Any,
    Dict,
    Generic,
    Iterable,
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

__all__ = ["Client", "Sandbox", "Files", "BackgroundProcess", "EventStream", "ExecStream", "ProcessStream"]

T = TypeVar("T")
E = TypeVar("E", ExecEvent, ProcessEvent)
Query = Union[Dict[str, Any], List[Tuple[str, Any]], None]


class Client:
    """A connection to one sproutd.

    Args:
        base_url: ``http://HOST:PORT`` (or ``HOST:PORT``); default
            ``$SPROUT_URL``, else ``http://127.0.0.1:7070``.
        api_key: sent as ``Authorization: Bearer KEY`` (a sproutd run with
            ``--tenants``); default ``$SPROUT_API_KEY``.
        timeout: seconds (or an :class:`httpx.Timeout`) to wait for each
            answer: default 900 s to read (a create waits for a boot, which
            takes minutes in the emulated lab), 10 s to connect. Event
            streams get keep-alives every 15 s, so the read timeout only
            ends one whose server is gone.
        create_timeout: how long :meth:`create` retries a
            ``503 template_building`` (a first create of an image and shape
            builds its template).
        max_retries: how many times a ``429`` (exec limits) is retried after
            its ``Retry-After``; 0 raises it at once.
        headers: extra headers for every request.
        transport: an httpx transport (tests, proxies).

    A client is thread-safe; close it (or use ``with``) when done.
    """

    def __init__(
        self,
        base_url: Optional[str] = None,
        *,
        api_key: Optional[str] = None,
        timeout: TimeoutTypes = DEFAULT_TIMEOUT,
        create_timeout: float = DEFAULT_CREATE_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        headers: Optional[Mapping[str, str]] = None,
        transport: Optional[httpx.BaseTransport] = None,
    ) -> None:
        self.base_url = _base.resolve_base_url(base_url)
        self.api_key = _base.resolve_api_key(api_key)
        self.timeout = _base.as_timeout(timeout)
        self.create_timeout = create_timeout
        self.max_retries = max_retries
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=_base.default_headers(self.api_key, headers),
            timeout=self.timeout,
            transport=transport,
        )

    def __repr__(self) -> str:
        return f"Client(base_url={self.base_url!r})"

    # -- plumbing

    def close(self) -> None:
        """Closes the connections."""
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def request(
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
        """Sends operation ``op`` (an operationId of docs/openapi.json) and
        returns its 2xx answer, read whole; raises :class:`~sprout.APIError`
        for an error answer. A 429 is retried after its ``Retry-After`` up to
        ``max_retries`` times (not for a streamed body)."""
        method, path = route(op, **(path_params or {}))
        attempt = 0
        while True:
            try:
                r = self._http.request(
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
                time.sleep(wait)
                continue
            if r.is_error:
                raise _base.error_of(r)
            return r

    def _call(
        self, op: str, model: Type[T], path_params: Optional[Mapping[str, Union[str, int]]] = None, **kw: Any
    ) -> T:
        r = self.request(op, path_params, **kw)
        return _base.json_of(r, model)  # type: ignore[no-any-return]

    def open_stream(
        self,
        op: str,
        path_params: Optional[Mapping[str, Union[str, int]]] = None,
        *,
        json: Any = None,
        query: Query = None,
        headers: Optional[Mapping[str, str]] = None,
    ) -> httpx.Response:
        """Sends ``op`` and returns its answer once its headers are in, its body
        not read (close it); an error answer is raised."""
        method, path = route(op, **(path_params or {}))
        req = self._http.build_request(method, path, json=json, params=query, headers=headers)
        try:
            r = self._http.send(req, stream=True)
        except httpx.TransportError as e:
            raise _base.transport_error(e, self.base_url) from e
        if r.is_error:
            try:
                r.read()
            except httpx.TransportError as e:
                raise _base.transport_error(e, self.base_url) from e
            finally:
                r.close()
            raise _base.error_of(r)
        return r

    # -- the service

    def health(self) -> Health:
        """``GET /v1/health``."""
        return self._call("health", Health)

    def info(self) -> Info:
        """sproutd's version, host mode, images, exec limits and the caller's tenant."""
        return self._call("info", Info)

    def openapi(self) -> Dict[str, Any]:
        """The server's OpenAPI document."""
        return self._call("openapi", dict)

    def metrics(self) -> str:
        """Prometheus text (an operator tenant's key, with ``--tenants``)."""
        return self.request("metrics").text

    def templates(self) -> List[Template]:
        return self._call("listTemplates", TemplateList).templates

    # -- sandboxes

    def create(
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
    ) -> "Sandbox":
        """Creates a sandbox and returns it once it runs (see :meth:`Sandbox.create`)."""
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
                return Sandbox(self, self._call("schedule", Vm, json=body))
            except ServiceUnavailableError as e:
                left = deadline - time.monotonic()
                if e.code not in ("template_building", "image_pulling") or left <= 0:
                    raise
                wait = min(e.retry_after or 5.0, 5.0, left)
                log.info("%s; retrying the create in %.0f s", e.message, wait)
                time.sleep(wait)

    def get(self, vm_id: str) -> "Sandbox":
        """An existing sandbox (``NotFoundError`` with ``vm_not_found`` if there is none)."""
        return Sandbox(self, self._call("getVm", Vm, {"id": vm_id}))

    def list(self, metadata: Optional[Mapping[str, str]] = None) -> List["Sandbox"]:
        """Every sandbox, oldest first; ``metadata`` keeps those with all these pairs."""
        q = [(f"metadata.{k}", v) for k, v in (metadata or {}).items()]
        return [Sandbox(self, v) for v in self._call("listVms", VmList, query=q).vms]

    # -- snapshots and checkpoints

    def snapshots(self) -> List[Snapshot]:
        """User snapshots and checkpoints."""
        return self._call("listSnapshots", SnapshotList).snapshots

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return self._call("getSnapshot", Snapshot, {"id": snapshot_id})

    def delete_snapshot(self, snapshot_id: str) -> SnapshotDeleted:
        return self._call("deleteSnapshot", SnapshotDeleted, {"id": snapshot_id})

    def restore_checkpoint(self, checkpoint: Union[str, Snapshot]) -> "Sandbox":
        """Makes the checkpoint's sandbox what it was then (same id; everything since is gone)."""
        return Sandbox(self, self._call("restoreCheckpoint", Vm, {"id": _snap_id(checkpoint)}))

    def spawn_checkpoint(self, checkpoint: Union[str, Snapshot]) -> "Sandbox":
        """A new sandbox from a checkpoint."""
        return Sandbox(self, self._call("spawnCheckpoint", Vm, {"id": _snap_id(checkpoint)}))

    def delete_checkpoint(self, checkpoint: Union[str, Snapshot]) -> SnapshotDeleted:
        return self._call("deleteCheckpoint", SnapshotDeleted, {"id": _snap_id(checkpoint)})


def _snap_id(s: Union[str, Snapshot]) -> str:
    return s.snapshot_id if isinstance(s, Snapshot) else s


def _is_stream(content: Any) -> bool:
    return content is not None and not isinstance(content, (bytes, str))


_defaults: Dict[Tuple[str, Optional[str]], Client] = {}
_defaults_lock = threading.Lock()


def default_client(base_url: Optional[str] = None, api_key: Optional[str] = None) -> Client:
    """The client :meth:`Sandbox.create` and friends use when given none: one per
    (base URL, API key), made on first use from the arguments or the environment."""
    key = (_base.resolve_base_url(base_url), _base.resolve_api_key(api_key))
    with _defaults_lock:
        c = _defaults.get(key)
        if c is None:
            c = _defaults[key] = Client(key[0], api_key=key[1] or "")
        return c


class Sandbox:
    """A sandbox: a microVM with its files, processes and rest states.

    Make one with :meth:`Sandbox.create` (or :meth:`Client.create`), find one
    with :meth:`Sandbox.connect` or :meth:`Sandbox.list`. ``info`` is the
    server's record as of the last call that returned it; :meth:`refresh`
    reads it again. Used as a context manager, the sandbox is deleted at the
    end of the block::

        with Sandbox.create(cpus=1, memory_mb=512) as sb:
            print(sb.exec("uname", ["-a"]).stdout)
    """

    def __init__(self, client: Client, info: Vm) -> None:
        self.client = client
        self.info = info
        #: The sandbox's files under /workspace.
        self.files = Files(self)

    # -- making and finding

    @classmethod
    def create(
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
        client: Optional[Client] = None,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
        create_timeout: Optional[float] = None,
    ) -> "Sandbox":
        """Creates a sandbox and returns it once it runs.

        Every field is optional (the server's defaults: image ``default``, 2
        vCPUs, 1024 MiB). ``runtime`` is ``"container"`` (the default: the
        image's entrypoint is its main process) or ``"vm"`` (the image's own
        systemd is PID 1). ``snapshot`` restores a snapshot or checkpoint
        instead (then give no image, runtime, cpus or memory_mb). ``env`` is the base
        environment of every exec; ``metadata`` string pairs to find it by.
        ``idle_timeout_secs`` puts it to sleep after that long without a
        call (the next call wakes it).

        A first create of an (image, cpus, memory) builds its template:
        sproutd answers ``503 template_building`` and this retries, as
        ``Retry-After`` says, for up to ``create_timeout`` seconds (the
        client's, default 900).

        ``client`` is the connection to use; without one, a shared client for
        ``base_url``/``api_key`` (default ``$SPROUT_URL``/``$SPROUT_API_KEY``).
        """
        c = client or default_client(base_url, api_key)
        return c.create(
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
    def connect(
        cls,
        vm_id: str,
        *,
        client: Optional[Client] = None,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
    ) -> "Sandbox":
        """The existing sandbox ``vm_id``."""
        return (client or default_client(base_url, api_key)).get(vm_id)

    @classmethod
    def list(
        cls,
        metadata: Optional[Mapping[str, str]] = None,
        *,
        client: Optional[Client] = None,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
    ) -> List["Sandbox"]:
        """Every sandbox, oldest first (those with all of ``metadata``'s pairs)."""
        return (client or default_client(base_url, api_key)).list(metadata)

    # -- what it is

    @property
    def id(self) -> str:
        return self.info.vm_id

    @property
    def state(self) -> str:
        """Its state as of :attr:`info` (``refresh()`` reads it again)."""
        return self.info.state

    @property
    def parent_id(self) -> Optional[str]:
        """The sandbox it was forked from."""
        return self.info.parent_vm_id

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, state={self.state!r}, image={self.info.image!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sandbox) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def _p(self) -> Dict[str, Union[str, int]]:
        return {"id": self.id}

    def _set(self, vm: Vm) -> "Sandbox":
        self.info = vm
        return self

    def refresh(self) -> "Sandbox":
        """Reads its record again; returns itself."""
        return self._set(self.client._call("getVm", Vm, self._p()))

    # -- the end

    def kill(self) -> Deleted:
        """Deletes it: its worker stops, its disk and checkpoints go."""
        return self.client._call("deleteVm", Deleted, self._p())

    delete = kill

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.kill()
        except NotFoundError:
            pass  # already gone
        except Exception:
            if exc_type is None:
                raise
            log.warning("deleting sandbox %s after an error failed", self.id, exc_info=True)

    # -- exec

    def exec(
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
        """Runs a command to its end and returns its output and exit status.

        execve-style: ``command`` is a path or a name looked up in ``PATH``,
        ``argv`` the arguments after it (a shell line:
        ``exec("/bin/sh", ["-c", LINE])``). ``stdin`` (text, or bytes) is fed
        to it, then end of file. ``timeout_ms`` kills its process group after
        that long (``timed_out``). A non-zero exit is not an error unless
        ``check`` (then :class:`~sprout.CommandError`). Each stream keeps at
        most 1 MiB (``stdout_truncated``); :meth:`exec_stream` streams.
        """
        body = _base.exec_body(command, argv, stdin=stdin, env=env, cwd=cwd, timeout_ms=timeout_ms)
        r = self.client._call(
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
    ) -> "ExecStream":
        """Runs a command and returns an iterator of its events as they happen:
        :class:`~sprout.OutputEvent` per chunk of stdout or stderr, then one
        :class:`~sprout.ExitEvent`. Errors before it starts are raised here.

        Closing the stream before its exit (``close()``, leaving a ``with``
        block, ``break`` and garbage collection) ends the command: use
        :meth:`exec_background` for one that must outlive its reader::

            with sb.exec_stream("/bin/sh", ["-c", "echo a; sleep 1; echo b"]) as s:
                for ev in s:
                    if isinstance(ev, sprout.OutputEvent):
                        print(ev.text, end="")
            print(s.exit.exit_code)
        """
        body = _base.exec_body(command, argv, stdin=stdin, env=env, cwd=cwd, timeout_ms=timeout_ms)
        r = self.client.open_stream("exec", self._p(), json=body, headers={"Accept": "text/event-stream"})
        return ExecStream(r, ExecExit, "the exec's stream", self.client.base_url)

    def exec_background(
        self,
        command: str,
        argv: Optional[Sequence[str]] = None,
        *,
        stdin: Union[str, bytes, None] = None,
        stdin_open: bool = False,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout_ms: Optional[int] = None,
    ) -> "BackgroundProcess":
        """Starts a background process and returns its handle at once.

        It lives in the sandbox's agent whatever happens to any connection:
        attach to its output with :meth:`BackgroundProcess.events` (again and
        again, from where a reader left off), wait for it, write to its stdin
        (``stdin_open=True`` keeps stdin open), signal it.
        """
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
        p = self.client._call("exec", ProcessStarted, self._p(), json=body)
        return BackgroundProcess(self, p.exec_id, p.pid)

    def processes(self) -> List[Process]:
        """Its background processes (running, and the most recently finished)."""
        return self.client._call("listProcesses", ProcessList, self._p()).processes

    def process(self, exec_id: int) -> "BackgroundProcess":
        """The handle of background process ``exec_id`` (to re-attach to it)."""
        return BackgroundProcess(self, exec_id, None)

    # -- rest states

    def _op(self, op: str, **kw: Any) -> "Sandbox":
        return self._set(self.client._call(op, Vm, self._p(), **kw))

    def pause(self) -> "Sandbox":
        """Stops its vCPUs (memory, processes and files stay); exec, file and
        process calls are then ``409 paused`` until :meth:`resume`."""
        return self._op("pauseVm")

    def resume(self) -> "Sandbox":
        return self._op("resumeVm")

    def sleep(self) -> "Sandbox":
        """Snapshots it and stops its worker; the next exec, file or process
        call wakes it transparently."""
        return self._op("sleepVm")

    def hibernate(self) -> "Sandbox":
        """As :meth:`sleep`, but only :meth:`wake` wakes it."""
        return self._op("hibernateVm")

    def wake(self) -> WakeResp:
        """Restores a sleeping or hibernated sandbox (``cold_boot`` if only its
        disk could be)."""
        w = self.client._call("wakeVm", WakeResp, self._p())
        self._set(w.vm)
        return w

    def reboot(self) -> "Sandbox":
        """Reboots its guest: the disk is kept; memory and processes are not."""
        return self._op("rebootVm")

    def archive(self) -> "Sandbox":
        """Moves it to the object store (sproutd's ``--s3-endpoint``)."""
        return self._op("archiveVm")

    def unarchive(self) -> "Sandbox":
        return self._op("unarchiveVm")

    def snapshot(self, *, leave_paused: bool = False) -> SnapshotTaken:
        """Snapshots it (checked before it is recorded); create a new
        sandbox from it with ``Sandbox.create(snapshot=taken.snapshot_id)``."""
        body = {"leavePaused": True} if leave_paused else {}
        t = self.client._call("snapshotVm", SnapshotTaken, self._p(), json=body)
        self.refresh()
        return t

    def fork(self, count: int = 1) -> ForkResult["Sandbox"]:
        """Snapshots it and makes ``count`` (1-100) children that run on from
        its state now, each with its own copy of its memory, files and
        processes. It runs on. Children that failed are in ``failed``."""
        f = self.client._call("forkVm", Forked, self._p(), json={"count": count})
        kids: List[Sandbox] = []
        for child in f.forks:
            try:
                kids.append(self.client.get(child.vm_id))
            except NotFoundError:
                if child.error is None:
                    raise
        return ForkResult(f.source_vm_id, f.snapshot_id, kids, [c for c in f.forks if c.error is not None])

    # -- checkpoints

    def checkpoint(self, name: str) -> Snapshot:
        """Takes a named checkpoint (at most 10 per sandbox: ``too_many_checkpoints``)."""
        return self.client._call("createCheckpoint", Snapshot, self._p(), json={"name": name})

    def checkpoints(self) -> List[Snapshot]:
        return self.client._call("listCheckpoints", SnapshotList, self._p()).snapshots

    def restore(self, checkpoint: Union[str, Snapshot]) -> "Sandbox":
        """Makes it what it was at ``checkpoint`` (everything since is gone)."""
        return self._set(self.client._call("restoreCheckpoint", Vm, {"id": _snap_id(checkpoint)}))

    def spawn(self, checkpoint: Union[str, Snapshot]) -> "Sandbox":
        """A new sandbox from one of its checkpoints."""
        return self.client.spawn_checkpoint(checkpoint)

    def delete_checkpoint(self, checkpoint: Union[str, Snapshot]) -> SnapshotDeleted:
        return self.client.delete_checkpoint(checkpoint)

    # -- ports

    def open_port(self, port: int, *, public: bool = False) -> Port:
        """Serves the guest's TCP ``port`` over HTTP at the answer's ``url``
        (``http://{port}-{id}.localhost:7070/`` for a sproutd on loopback),
        which needs the API key unless ``public`` (docs/api.md, "Ports")."""
        return self.client._call("openPort", Port, self._p(), json={"port": port, "public": public})

    def ports(self) -> List[Port]:
        return self.client._call("listPorts", PortList, self._p()).ports

    def close_port(self, port: int) -> None:
        """Stops serving ``port`` (its URL answers ``404 port_not_open``)."""
        self.client.request("closePort", {**self._p(), "port": port})


class Files:
    """A sandbox's files, confined to ``/workspace``: a path is relative to it
    (or absolute beneath it); one that leaves it is ``400 path_escape``."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def _q(self, path: str, **extra: Any) -> Dict[str, Any]:
        return {"path": path, **extra}

    def list(self, path: str = ".") -> FileList:
        """A directory's entries (at most 10000: ``truncated``); iterable."""
        return self._sb.client._call("listFiles", FileList, self._sb._p(), query=self._q(path))

    def read(self, path: str) -> str:
        """A UTF-8 text file, whole (``400 not_text`` if it is not UTF-8)."""
        r = self._sb.client.request("readFile", self._sb._p(), query=self._q(path))
        if r.headers.get("x-truncated") == "true":
            # Over the text endpoint's 1 MiB: read it raw instead.
            return self.read_bytes(path).decode("utf-8")
        return r.text

    def read_bytes(self, path: str) -> bytes:
        """A file's bytes (kept in memory: :meth:`download` streams to a file)."""
        r = self._sb.client.request("readRaw", self._sb._p(), query=self._q(path))
        return r.content

    def write(self, path: str, data: Union[str, bytes]) -> FileWritten:
        """Writes a file whole (replacing it): text is written as UTF-8."""
        if isinstance(data, str):
            raw = data.encode("utf-8")
            if len(raw) <= 1 << 20:
                return self._sb.client._call(
                    "writeFile",
                    FileWritten,
                    self._sb._p(),
                    query=self._q(path),
                    content=raw,
                    headers={"Content-Type": "text/plain; charset=utf-8"},
                )
            data = raw
        return self.upload(path, bytes(data))

    def mkdir(self, path: str, *, parents: bool = False) -> DirMade:
        body = {"path": path, "parents": True} if parents else {"path": path}
        return self._sb.client._call("mkdir", DirMade, self._sb._p(), json=body)

    def delete(self, path: str, *, recursive: bool = False) -> FileDeleted:
        """Removes a file, an empty directory, or (``recursive``) a tree."""
        q = self._q(path, recursive="true") if recursive else self._q(path)
        return self._sb.client._call("deleteFile", FileDeleted, self._sb._p(), query=q)

    remove = delete

    def exists(self, path: str) -> bool:
        """Whether ``path`` names anything (a listing of its directory)."""
        head, _, name = path.rstrip("/").rpartition("/")
        try:
            return name in self.list(head or ".").names()
        except NotFoundError as e:
            if e.code == "file_not_found":
                return False
            raise

    def upload(
        self,
        path: str,
        source: Union[str, "os.PathLike[str]", bytes, IO[bytes], Iterable[bytes]],
        *,
        progress: Optional[Progress] = None,
        chunk_size: int = CHUNK_SIZE,
    ) -> FileWritten:
        """Writes ``path`` from ``source``, streamed (any size; never held whole).

        ``source`` is a local file's path, an open binary file, bytes, or an
        iterable of bytes chunks. ``progress(sent, total)`` is called after
        each chunk (``total`` None when unknown).
        """
        kind, src = _base.describe(source)
        total = None if kind == "iter" else _base.size_of(source)

        def chunks() -> Iterator[bytes]:
            sent = 0
            it: Iterable[bytes]
            if kind == "bytes":
                it = (src[i : i + chunk_size] for i in range(0, len(src), chunk_size))
            elif kind == "path":
                it = _read_file(src, chunk_size)
            elif kind == "file":
                it = iter(lambda: src.read(chunk_size), b"")
            else:
                it = src
            for c in it:
                c = bytes(c)
                sent += len(c)
                yield c
                if progress:
                    progress(sent, total)

        return self._sb.client._call(
            "writeRaw",
            FileWritten,
            self._sb._p(),
            query=self._q(path),
            content=chunks(),
            headers=_base.upload_headers(total),
        )

    def download(
        self,
        path: str,
        dest: Union[str, "os.PathLike[str]", IO[bytes]],
        *,
        progress: Optional[Progress] = None,
        chunk_size: int = CHUNK_SIZE,
    ) -> int:
        """Copies ``path`` to ``dest`` (a local path, or a binary file open for
        writing) as it arrives; returns the bytes written. A local file left
        incomplete by an error is removed. ``progress(received, total)``."""
        r = self._sb.client.open_stream("readRaw", self._sb._p(), query=self._q(path))
        n = 0
        total = int(r.headers["content-length"]) if "content-length" in r.headers else None
        own = isinstance(dest, (str, os.PathLike))
        f: IO[bytes] = open(dest, "wb") if own else dest  # type: ignore[assignment,arg-type]
        ok = False
        try:
            for chunk in r.iter_bytes(chunk_size):
                f.write(chunk)
                n += len(chunk)
                if progress:
                    progress(n, total)
            ok = True
        except httpx.TransportError as e:
            raise _base.transport_error(e, self._sb.client.base_url) from e
        finally:
            r.close()
            if own:
                f.close()
                if not ok:
                    os.unlink(dest)  # type: ignore[arg-type]
        return n


def _read_file(path: Any, size: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while True:
            c = f.read(size)
            if not c:
                return
            yield c


class EventStream(Generic[E]):
    """An iterator of a stream's events as they arrive (never buffered whole).

    Ends after the ``exit`` event (then :attr:`exit` holds it); raises
    :class:`~sprout.StreamError` if the connection ends before it, and an
    :class:`~sprout.APIError` for the server's ``error`` event.
    :attr:`last_event_id` is the id of the last event received. Close it
    (or use ``with``) to stop reading early.
    """

    def __init__(self, response: httpx.Response, exit_model: Any, what: str, base_url: str) -> None:
        self._r = response
        self._lines = response.iter_lines()
        self._reader = EventReader(exit_model)
        self._what = what
        self._base_url = base_url
        self._done = False

    @property
    def exit(self) -> Optional[Any]:
        """The ``exit`` event's data, once read."""
        return self._reader.exit

    @property
    def last_event_id(self) -> Optional[int]:
        return self._reader.last_event_id

    def __iter__(self) -> "EventStream[E]":
        return self

    def __next__(self) -> E:
        if self._done:
            raise StopIteration
        try:
            for line in self._lines:
                ev = self._reader.feed(line)
                if ev is not None:
                    if isinstance(ev, ExitEvent):
                        self.close()
                    return ev  # type: ignore[return-value]
            ev = self._reader.end()
        except httpx.TransportError as e:
            self.close()
            raise StreamError(
                _base.no_exit_message(self._what, self.last_event_id) + f": {type(e).__name__}: {e}",
                last_event_id=self.last_event_id,
            ) from e
        except BaseException:
            self.close()
            raise
        self.close()
        if ev is not None:
            return ev  # type: ignore[return-value]
        if self._reader.exit is None:
            raise StreamError(_base.no_exit_message(self._what, self.last_event_id), last_event_id=self.last_event_id)
        raise StopIteration

    def wait(self) -> Any:
        """Reads (and drops) the rest of the events; returns the exit."""
        for _ in self:
            pass
        return self._reader.exit

    def close(self) -> None:
        """Stops reading (an exec stream closed before its exit ends the command)."""
        if not self._done:
            self._done = True
            self._r.close()

    def __enter__(self) -> "EventStream[E]":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class ExecStream(EventStream[ExecEvent]):
    """The events of :meth:`Sandbox.exec_stream`; ``exit`` is an :class:`~sprout.models.ExecExit`."""

    @property
    def exit(self) -> Optional[ExecExit]:
        return self._reader.exit  # type: ignore[return-value]

    def wait(self) -> ExecExit:
        return super().wait()  # type: ignore[no-any-return]


class ProcessStream(EventStream[ProcessEvent]):
    """The events of :meth:`BackgroundProcess.events`; ``exit`` is a :class:`~sprout.models.ProcessExit`."""

    @property
    def exit(self) -> Optional[ProcessExit]:
        return self._reader.exit  # type: ignore[return-value]

    def wait(self) -> ProcessExit:
        return super().wait()  # type: ignore[no-any-return]


class BackgroundProcess:
    """A background process of a sandbox (:meth:`Sandbox.exec_background`).

    ``exec_id`` names it in the sandbox; ``pid`` is its pid in the guest
    (None for a handle made by :meth:`Sandbox.process`).
    """

    def __init__(self, sandbox: Sandbox, exec_id: int, pid: Optional[int]) -> None:
        self.sandbox = sandbox
        self.exec_id = exec_id
        self.pid = pid

    def __repr__(self) -> str:
        return f"BackgroundProcess(sandbox={self.sandbox.id!r}, exec_id={self.exec_id}, pid={self.pid})"

    def _p(self) -> Dict[str, Union[str, int]]:
        return {"id": self.sandbox.id, "execId": self.exec_id}

    def events(self, last_event_id: Optional[int] = None) -> ProcessStream:
        """Attaches to its output: the events the agent still keeps after
        ``last_event_id`` (all it keeps without one), then live ones to its
        exit. Each event's ``id`` is the agent's sequence number: re-attach
        with the last one seen (``stream.last_event_id``) to miss nothing
        and repeat nothing. Closing the stream ends the attach only."""
        h = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            h["Last-Event-ID"] = str(last_event_id)
        r = self.sandbox.client.open_stream("processEvents", self._p(), headers=h)
        return ProcessStream(r, ProcessExit, f"process {self.exec_id}'s stream", self.sandbox.client.base_url)

    def wait(self, *, reattach: int = 5) -> ProcessExit:
        """Waits for its exit (re-attaching up to ``reattach`` times after a
        broken connection) and returns it."""
        last: Optional[int] = None
        while True:
            s = self.events(last)
            try:
                return s.wait()
            except StreamError as e:
                if reattach <= 0:
                    raise
                reattach -= 1
                last = e.last_event_id if e.last_event_id is not None else last
                log.info("%s; re-attaching after event %s", e, last)
            finally:
                s.close()

    def info(self) -> Process:
        """Its entry in the sandbox's process list (``process_not_found`` if none)."""
        for p in self.sandbox.processes():
            if p.exec_id == self.exec_id:
                return p
        raise NotFoundError(
            404, "process_not_found", f"No background process {self.exec_id} in sandbox {self.sandbox.id}"
        )

    def write_stdin(self, data: Union[str, bytes], *, close: bool = False) -> StdinWritten:
        """Writes to its stdin (started with ``stdin_open=True``), waiting while
        it does not read; ``close`` closes stdin after."""
        return self.sandbox.client._call("processStdin", StdinWritten, self._p(), json=_base.stdin_body(data, close))

    def close_stdin(self) -> StdinWritten:
        return self.write_stdin("", close=True)

    def signal(self, signal: Signal = "TERM") -> SignalSent:
        """Signals its whole process group (a number 1-64 or a name: TERM, KILL, ...)."""
        return self.sandbox.client._call("processSignal", SignalSent, self._p(), json={"signal": signal})

    def kill(self) -> SignalSent:
        """SIGKILL to its process group."""
        return self.signal("KILL")
