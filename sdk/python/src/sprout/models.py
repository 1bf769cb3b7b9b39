"""Typed models of sproutd's JSON, one dataclass per schema of docs/openapi.json.

Each class is named as its schema (``Vm``, ``ExecResult``, ...) and has one
field per property, in snake_case (``memoryMb`` is ``memory_mb``). A property
the schema requires is a field without a default; an optional one defaults
to None. ``tests/test_drift.py`` checks all of this against
docs/openapi.json, so a server change the SDK does not follow fails there.

* :meth:`Model.from_dict` reads the server's camelCase JSON (properties it
  does not know are ignored, so a newer server's additions do not break an
  older SDK); ``date-time`` strings become aware :class:`datetime.datetime`.
* :meth:`Model.to_dict` writes it back (optional fields that are None are
  left out, which is what request bodies need).

String enums (``VmState``, ``ErrorCode``, ...) are ``Literal`` aliases of
plain ``str``: a value a newer server adds still parses.
"""

from __future__ import annotations

import base64 as _b64
import dataclasses
import datetime as _dt
import re
import sys
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Literal, Mapping, Optional, Tuple, Type, TypeVar, Union

__all__ = [
    # enums
    "VmState",
    "ErrorCode",
    "FileType",
    "SnapshotKind",
    "TemplateState",
    "Runtime",
    "Signal",
    # base
    "Model",
    # schemas
    "CheckpointRequest",
    "Deleted",
    "DirMade",
    "ErrorBody",
    "ErrorEnvelope",
    "ExecChunk",
    "ExecExit",
    "ExecLimits",
    "ExecRequest",
    "ExecResult",
    "FileDeleted",
    "FileEntry",
    "FileList",
    "FileWritten",
    "ForkChild",
    "ForkRequest",
    "Forked",
    "Health",
    "HostMode",
    "Image",
    "Info",
    "MakeDir",
    "Network",
    "Process",
    "ProcessExit",
    "ProcessGap",
    "ProcessList",
    "ProcessStarted",
    "Port",
    "PortList",
    "PortRequest",
    "ScheduleRequest",
    "SignalSend",
    "SignalSent",
    "Snapshot",
    "SnapshotDeleted",
    "SnapshotList",
    "SnapshotRequest",
    "SnapshotTaken",
    "StdinWrite",
    "StdinWritten",
    "Template",
    "TemplateList",
    "Tenant",
    "Vm",
    "VmList",
    "WakeResp",
    "SCHEMA_MODELS",
]

# ---------------------------------------------------------------- enums

#: A sandbox's state (docs/api.md, "The sandbox object").
VmState = Literal["starting", "running", "paused", "sleeping", "archived", "hibernated", "stopping", "failed"]
#: A stable error code (docs/api.md, "Errors").
ErrorCode = Literal[
    "bad_request",
    "invalid_json",
    "invalid_body",
    "invalid_value",
    "unsupported_media_type",
    "payload_too_large",
    "not_found",
    "unauthorized",
    "forbidden",
    "quota_exhausted",
    "method_not_allowed",
    "vm_not_found",
    "unknown_image",
    "invalid_state",
    "paused",
    "snapshot_not_found",
    "checkpoint_not_found",
    "too_many_checkpoints",
    "snapshot_failed",
    "store_failed",
    "template_building",
    "image_pulling",
    "bad_image_reference",
    "image_not_found",
    "image_platform",
    "image_unsupported",
    "image_too_large",
    "registry_unreachable",
    "registry_auth",
    "registry_error",
    "image_corrupt",
    "image_build_failed",
    "host_unsupported",
    "boot_failed",
    "agent_unavailable",
    "exec_failed",
    "worker_failed",
    "not_supported",
    "busy",
    "too_many_requests",
    "process_not_found",
    "stdin_closed",
    "path_escape",
    "invalid_path",
    "file_not_found",
    "file_conflict",
    "permission_denied",
    "not_text",
    "file_error",
    "port_not_open",
    "port_not_listening",
    "too_many_ports",
    "internal",
]
FileType = Literal["file", "dir", "symlink", "other"]
#: What a snapshot is for.
SnapshotKind = Literal["user", "rest", "checkpoint", "template", "dropped"]
#: Where a template's build is.
TemplateState = Literal["building", "ready", "failed"]
#: How a sandbox's guest comes up: Sprout's agent as PID 1, or the image's
#: own systemd.
Runtime = Literal["container", "vm"]
#: A signal: a number 1-64 or a name (HUP, INT, QUIT, KILL, USR1, USR2, TERM,
#: CONT, STOP, with or without ``SIG``).
Signal = Union[int, str]

# ---------------------------------------------------------------- machinery

M = TypeVar("M", bound="Model")


def camel(name: str) -> str:
    """``memory_mb`` -> ``memoryMb`` (the server's spelling of a field)."""
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def json_name(f: "dataclasses.Field[Any]") -> str:
    """The JSON property a dataclass field maps to."""
    return str(f.metadata.get("json", camel(f.name)))


_FRACTION = re.compile(r"\.(\d+)")


def parse_datetime(s: str) -> _dt.datetime:
    """RFC 3339 (``2026-12-01T13:48:21.555Z``) as an aware datetime (Python 3.9's
    ``fromisoformat`` takes neither ``Z`` nor every fraction length)."""
    t = s.strip()
    if t.endswith(("Z", "z")):
        t = t[:-1] + "+00:00"
    t = _FRACTION.sub(lambda m: "." + (m.group(1) + "000000")[:6], t, count=1)
    d = _dt.datetime.fromisoformat(t)
    return d if d.tzinfo else d.replace(tzinfo=_dt.timezone.utc)


def format_datetime(d: _dt.datetime) -> str:
    """An aware datetime as RFC 3339 UTC with milliseconds."""
    d = d.astimezone(_dt.timezone.utc)
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond // 1000:03d}Z"


_HINTS: Dict[type, Dict[str, Any]] = {}


def type_hints(cls: type) -> Dict[str, Any]:
    """``typing.get_type_hints`` of a model, cached."""
    h = _HINTS.get(cls)
    if h is None:
        g = vars(sys.modules[__name__])
        h = typing.get_type_hints(cls, globalns=g, localns=g)
        _HINTS[cls] = h
    return h


def _decode(tp: Any, v: Any) -> Any:
    if v is None:
        return None
    origin = typing.get_origin(tp)
    if origin is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _decode(args[0], v)
        return v  # Signal: an int or a str, as it came
    if origin in (list, List):
        (item,) = typing.get_args(tp)
        return [_decode(item, x) for x in v]
    if origin in (dict, Dict):
        _, val = typing.get_args(tp)
        return {k: _decode(val, x) for k, x in v.items()}
    if isinstance(tp, type) and issubclass(tp, Model):
        return tp.from_dict(v)
    if tp is _dt.datetime:
        return parse_datetime(v)
    return v


def _encode(v: Any) -> Any:
    if isinstance(v, Model):
        return v.to_dict()
    if isinstance(v, _dt.datetime):
        return format_datetime(v)
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    if isinstance(v, Mapping):
        return {k: _encode(x) for k, x in v.items()}
    return v


class Model:
    """The base of every model: JSON in (:meth:`from_dict`) and out (:meth:`to_dict`)."""

    #: The docs/openapi.json schema this class is (None: an inline object).
    __schema__: ClassVar[Optional[str]] = None

    @classmethod
    def from_dict(cls: Type[M], data: Mapping[str, Any]) -> M:
        """Reads the server's JSON object (camelCase); unknown properties are ignored."""
        if not isinstance(data, Mapping):
            raise TypeError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
        hints = type_hints(cls)
        kw: Dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            key = json_name(f)
            if key in data:
                kw[f.name] = _decode(hints[f.name], data[key])
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{cls.__name__}: the server's JSON has no {key!r}: {dict(data)!r}")
        return cls(**kw)

    def to_dict(self) -> Dict[str, Any]:
        """The JSON object (camelCase); optional fields that are None are left out."""
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if v is None and not required:
                continue
            out[json_name(f)] = _encode(v)
        return out


def _bytes_of(text: str, is_base64: bool) -> bytes:
    return _b64.b64decode(text) if is_base64 else text.encode("utf-8")


# ---------------------------------------------------------------- health, info


@dataclass(frozen=True)
class Health(Model):
    """``GET /v1/health``."""

    __schema__ = "Health"
    status: str


@dataclass(frozen=True)
class HostMode(Model):
    """Whether this host runs Linux guests, and whether from the emulated lab."""

    __schema__ = "HostMode"
    linux_guests: bool
    lab: bool
    note: Optional[str] = None
    reason: Optional[str] = None


@dataclass(frozen=True)
class Image(Model):
    """An image a sandbox can be made from."""

    __schema__ = "Image"
    name: str
    path: str
    size_bytes: int
    runtimes: List[str]  # Runtime values


@dataclass(frozen=True)
class ExecLimits(Model):
    """sproutd's exec limits and the execs in flight."""

    __schema__ = "ExecLimits"
    max_execs_per_vm: int
    max_execs: int
    in_flight: Optional[int] = None


@dataclass(frozen=True)
class Tenant(Model):
    """The caller's tenant and its quota (None: no limit)."""

    __schema__ = "Tenant"
    name: str
    slots: Optional[int]
    slots_in_use: int
    max_execs: Optional[int]
    execs_in_flight: int


@dataclass(frozen=True)
class Network(Model):
    """What network sandboxes get: ``egress`` (unless ``disable_internet``),
    guest ``ports`` served by sproutd, and what is missing (``reason``)."""

    __schema__ = "Network"
    egress: bool
    ports: bool
    reason: Optional[str]


@dataclass(frozen=True)
class Info(Model):
    """``GET /v1/info``."""

    __schema__ = "Info"
    version: str
    host_mode: HostMode
    images: List[Image]
    exec_limits: ExecLimits
    tenant: Tenant
    network: Network
    data_dir: Optional[str] = None


# ---------------------------------------------------------------- errors


@dataclass(frozen=True)
class ErrorBody(Model):
    """The ``error`` object of an :class:`ErrorEnvelope` (inline in the schema)."""

    code: str  # an ErrorCode
    message: str
    field: Optional[str] = None
    state: Optional[str] = None  # a VmState


@dataclass(frozen=True)
class ErrorEnvelope(Model):
    """Every error answer's body."""

    __schema__ = "ErrorEnvelope"
    error: ErrorBody


# ---------------------------------------------------------------- sandboxes


@dataclass(frozen=True)
class ScheduleRequest(Model):
    """``POST /v1/runtime/schedule``: a sandbox to create; every field is optional."""

    __schema__ = "ScheduleRequest"
    image: Optional[str] = None
    runtime: Optional[str] = None  # a Runtime: "container" or "vm"
    cpus: Optional[int] = None
    memory_mb: Optional[int] = None
    disable_internet: Optional[bool] = None
    idle_timeout_secs: Optional[int] = None
    snapshot: Optional[str] = None
    env: Optional[Dict[str, str]] = None
    metadata: Optional[Dict[str, str]] = None


@dataclass(frozen=True)
class Vm(Model):
    """A sandbox as the API shows it."""

    __schema__ = "Vm"
    vm_id: str
    state: str  # a VmState
    image: str
    runtime: str  # a Runtime
    cpus: int
    memory_mb: int
    disable_internet: bool
    idle_timeout_secs: Optional[int]
    metadata: Dict[str, str]
    created_at: _dt.datetime
    snapshot_id: Optional[str]
    parent_vm_id: Optional[str]
    hostname: Optional[str]
    worker_pid: Optional[int]
    failure_reason: Optional[str] = None


@dataclass(frozen=True)
class VmList(Model):
    __schema__ = "VmList"
    vms: List[Vm]


@dataclass(frozen=True)
class Deleted(Model):
    __schema__ = "Deleted"
    vm_id: str
    deleted: bool


@dataclass(frozen=True)
class WakeResp(Model):
    """A wake's answer: the sandbox, and whether its memory came back."""

    __schema__ = "WakeResp"
    vm: Vm
    cold_boot: bool
    cold_boot_reason: Optional[str] = None


@dataclass(frozen=True)
class ForkRequest(Model):
    __schema__ = "ForkRequest"
    count: Optional[int] = None


@dataclass(frozen=True)
class ForkChild(Model):
    """One child of a fork; ``error`` says why it failed, when it did."""

    __schema__ = "ForkChild"
    vm_id: str
    state: str  # a VmState
    error: Optional[str] = None


@dataclass(frozen=True)
class Forked(Model):
    """``POST /vms/{id}/fork``."""

    __schema__ = "Forked"
    source_vm_id: str
    snapshot_id: str
    forks: List[ForkChild]


# ---------------------------------------------------------------- snapshots, checkpoints, templates


@dataclass(frozen=True)
class SnapshotRequest(Model):
    __schema__ = "SnapshotRequest"
    leave_paused: Optional[bool] = None


@dataclass(frozen=True)
class SnapshotTaken(Model):
    """``POST /vms/{id}/snapshot``."""

    __schema__ = "SnapshotTaken"
    vm_id: str
    snapshot_id: str
    state: str  # a VmState


@dataclass(frozen=True)
class Snapshot(Model):
    """A snapshot (or a checkpoint: ``kind == "checkpoint"``, with its ``name``)."""

    __schema__ = "Snapshot"
    snapshot_id: str
    kind: str  # a SnapshotKind
    vm_id: Optional[str]
    image: str
    runtime: str  # a Runtime
    cpus: int
    memory_mb: int
    parent_snapshot_id: Optional[str]
    size_bytes: int
    durable: bool
    created_at: _dt.datetime
    name: Optional[str] = None


@dataclass(frozen=True)
class SnapshotList(Model):
    __schema__ = "SnapshotList"
    snapshots: List[Snapshot]


@dataclass(frozen=True)
class SnapshotDeleted(Model):
    __schema__ = "SnapshotDeleted"
    snapshot_id: str
    deleted: bool


@dataclass(frozen=True)
class CheckpointRequest(Model):
    __schema__ = "CheckpointRequest"
    name: str


@dataclass(frozen=True)
class PortRequest(Model):
    __schema__ = "PortRequest"
    port: int
    public: Optional[bool] = None


@dataclass(frozen=True)
class Port(Model):
    """An open port of a sandbox: sproutd serves the guest's TCP ``port`` at
    ``url`` (docs/api.md, "Ports")."""

    __schema__ = "Port"
    port: int
    public: bool
    url: str
    created_at: _dt.datetime


@dataclass(frozen=True)
class PortList(Model):
    __schema__ = "PortList"
    ports: List[Port]


@dataclass(frozen=True)
class Template(Model):
    """A template: a snapshot of a booted (image, runtime, cpus, memory) that creates restore."""

    __schema__ = "Template"
    image: str
    runtime: str  # a Runtime
    cpus: int
    memory_mb: int
    state: str  # a TemplateState
    snapshot_id: Optional[str]
    build_ms: Optional[int]
    updated_at: _dt.datetime
    failure_reason: Optional[str] = None


@dataclass(frozen=True)
class TemplateList(Model):
    __schema__ = "TemplateList"
    templates: List[Template]


# ---------------------------------------------------------------- exec


@dataclass(frozen=True)
class ExecRequest(Model):
    """``POST /vms/{id}/exec``: a command to run (execve-style)."""

    __schema__ = "ExecRequest"
    command: str
    argv: Optional[List[str]] = None
    env: Optional[Dict[str, str]] = None
    cwd: Optional[str] = None
    stdin: Optional[str] = None
    stdin_base64: Optional[bool] = None
    timeout_ms: Optional[int] = None
    background: Optional[bool] = None
    stdin_open: Optional[bool] = None


@dataclass(frozen=True)
class ExecResult(Model):
    """A buffered exec's answer.

    ``stdout``/``stderr`` are as the server sent them (base64 when
    ``stdout_base64``/``stderr_base64``); :attr:`stdout_bytes` and
    :attr:`stdout_text` decode them.
    """

    __schema__ = "ExecResult"
    stdout: str
    stderr: str
    stdout_base64: bool
    stderr_base64: bool
    exit_code: Optional[int]
    signal: Optional[int]
    duration_ms: int
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool

    @property
    def stdout_bytes(self) -> bytes:
        return _bytes_of(self.stdout, self.stdout_base64)

    @property
    def stderr_bytes(self) -> bytes:
        return _bytes_of(self.stderr, self.stderr_base64)

    @property
    def stdout_text(self) -> str:
        """stdout as text (bytes that are not UTF-8 replaced)."""
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        """The command exited 0."""
        return self.exit_code == 0

    @property
    def returncode(self) -> int:
        """As :mod:`subprocess`: the exit status, or ``-signal`` when a signal ended it."""
        if self.exit_code is not None:
            return self.exit_code
        return -(self.signal or 0)


@dataclass(frozen=True)
class ExecChunk(Model):
    """A ``stdout``/``stderr`` event's data: text, or base64 when ``base64``."""

    __schema__ = "ExecChunk"
    data: str
    base64: bool

    @property
    def raw(self) -> bytes:
        """The chunk's bytes."""
        return _bytes_of(self.data, self.base64)

    @property
    def text(self) -> str:
        """The chunk as text (a chunk that is not UTF-8 is decoded with replacements)."""
        return self.data if not self.base64 else self.raw.decode("utf-8", "replace")


@dataclass(frozen=True)
class ExecExit(Model):
    """A streamed exec's ``exit`` event."""

    __schema__ = "ExecExit"
    exit_code: Optional[int]
    signal: Optional[int]
    duration_ms: int
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool


# ---------------------------------------------------------------- background processes


@dataclass(frozen=True)
class ProcessStarted(Model):
    """A background exec's ``201`` answer."""

    __schema__ = "ProcessStarted"
    exec_id: int
    pid: int


@dataclass(frozen=True)
class ProcessExit(Model):
    """How a background process ended (its ``exit`` event, its listing's ``exit``)."""

    __schema__ = "ProcessExit"
    exit_code: Optional[int]
    signal: Optional[int]
    duration_ms: int
    timed_out: bool


@dataclass(frozen=True)
class Process(Model):
    """A background process as ``GET /vms/{id}/processes`` lists it."""

    __schema__ = "Process"
    exec_id: int
    pid: int
    command: str
    running: bool
    exit: Optional[ProcessExit]
    started_at: _dt.datetime
    stdin_open: bool
    first_event_id: int
    next_event_id: int
    dropped_events: int
    dropped_bytes: int


@dataclass(frozen=True)
class ProcessList(Model):
    __schema__ = "ProcessList"
    processes: List[Process]


@dataclass(frozen=True)
class ProcessGap(Model):
    """A ``gap`` event: events the agent's ring dropped before this reader got them."""

    __schema__ = "ProcessGap"
    first_event_id: int
    last_event_id: int
    bytes: Optional[int]


@dataclass(frozen=True)
class StdinWrite(Model):
    __schema__ = "StdinWrite"
    data: Optional[str] = None
    base64: Optional[bool] = None
    close: Optional[bool] = None


@dataclass(frozen=True)
class StdinWritten(Model):
    __schema__ = "StdinWritten"
    bytes: int
    closed: bool


@dataclass(frozen=True)
class SignalSend(Model):
    __schema__ = "SignalSend"
    signal: Optional[Signal] = None


@dataclass(frozen=True)
class SignalSent(Model):
    __schema__ = "SignalSent"
    exec_id: int
    signal: int


# ---------------------------------------------------------------- files


@dataclass(frozen=True)
class FileEntry(Model):
    """One entry of a directory listing."""

    __schema__ = "FileEntry"
    name: str
    type: str  # a FileType
    size: int


@dataclass(frozen=True)
class FileList(Model):
    """A directory listing (iterable over its entries)."""

    __schema__ = "FileList"
    path: str
    entries: List[FileEntry]
    truncated: bool

    def __iter__(self) -> typing.Iterator[FileEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def names(self) -> List[str]:
        return [e.name for e in self.entries]


@dataclass(frozen=True)
class FileWritten(Model):
    __schema__ = "FileWritten"
    path: str
    bytes: int


@dataclass(frozen=True)
class FileDeleted(Model):
    __schema__ = "FileDeleted"
    path: str
    deleted: bool


@dataclass(frozen=True)
class MakeDir(Model):
    __schema__ = "MakeDir"
    path: str
    parents: Optional[bool] = None


@dataclass(frozen=True)
class DirMade(Model):
    __schema__ = "DirMade"
    path: str
    created: bool


def _models() -> Dict[str, Type[Model]]:
    out: Dict[str, Type[Model]] = {}
    for v in list(globals().values()):
        if isinstance(v, type) and issubclass(v, Model) and v.__schema__:
            out[v.__schema__] = v
    return out


#: Every model by the name of its docs/openapi.json schema.
SCHEMA_MODELS: Dict[str, Type[Model]] = _models()

#: The string enums by schema name (``Literal`` aliases).
SCHEMA_ENUMS: Dict[str, Any] = {
    "VmState": VmState,
    "ErrorCode": ErrorCode,
    "FileType": FileType,
    "SnapshotKind": SnapshotKind,
    "TemplateState": TemplateState,
    "Runtime": Runtime,
}

#: Fields whose JSON type is one of the enums above (they are typed ``str``
#: so that a value a newer server adds still parses): (model, field) -> enum.
ENUM_FIELDS: Dict[Tuple[str, str], str] = {
    ("Vm", "state"): "VmState",
    ("ForkChild", "state"): "VmState",
    ("SnapshotTaken", "state"): "VmState",
    ("Snapshot", "kind"): "SnapshotKind",
    ("Template", "state"): "TemplateState",
    ("FileEntry", "type"): "FileType",
    ("ErrorBody", "code"): "ErrorCode",
    ("ErrorBody", "state"): "VmState",
    ("Vm", "runtime"): "Runtime",
    ("ScheduleRequest", "runtime"): "Runtime",
    ("Snapshot", "runtime"): "Runtime",
    ("Template", "runtime"): "Runtime",
    ("Image", "runtimes"): "Runtime",
}
