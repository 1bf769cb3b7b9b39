"""The events of an exec stream and of a background process's stream.

``Sandbox.exec_stream(...)`` yields :data:`ExecEvent` (``OutputEvent`` for each
chunk of stdout or stderr as the command prints it, then one ``ExitEvent``);
``BackgroundProcess.events(...)`` yields :data:`ProcessEvent` (the same, and
``GapEvent`` for output the agent's ring dropped before this reader got it).
An ``error`` event of the server is raised as an :class:`~sprout.APIError`.
Every event has the server's ``id``: a process's stream can be re-attached
after the last one seen (``Last-Event-ID``) without missing or repeating any.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from .models import ExecChunk, ExecExit, ProcessExit, ProcessGap

__all__ = ["OutputEvent", "ExitEvent", "GapEvent", "ExecEvent", "ProcessEvent"]


@dataclass(frozen=True)
class OutputEvent:
    """A chunk of the command's stdout or stderr."""

    stream: Literal["stdout", "stderr"]
    chunk: ExecChunk
    id: Optional[int]

    @property
    def text(self) -> str:
        """The chunk as text."""
        return self.chunk.text

    @property
    def raw(self) -> bytes:
        """The chunk's bytes (base64 decoded when it came so)."""
        return self.chunk.raw


@dataclass(frozen=True)
class ExitEvent:
    """The command's end: the last event of a stream.

    ``exit`` is an :class:`~sprout.models.ExecExit` for an exec stream, a
    :class:`~sprout.models.ProcessExit` for a background process.
    """

    exit: Union[ExecExit, ProcessExit]
    id: Optional[int]

    @property
    def exit_code(self) -> Optional[int]:
        """The exit status, or None when a signal ended it."""
        return self.exit.exit_code

    @property
    def signal(self) -> Optional[int]:
        return self.exit.signal


@dataclass(frozen=True)
class GapEvent:
    """Events the agent's ring dropped before this reader got them."""

    gap: ProcessGap
    id: Optional[int]


ExecEvent = Union[OutputEvent, ExitEvent]
ProcessEvent = Union[OutputEvent, GapEvent, ExitEvent]
