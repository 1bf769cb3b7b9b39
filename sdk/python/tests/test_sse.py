"""The Server-Sent Events reader, fed the server's format line by line (the
streams themselves are tested against a real sproutd in test_streams.py)."""

from __future__ import annotations

from typing import Any, List

import pytest

import sprout
from sprout._base import EventReader
from sprout.models import ExecExit, ProcessExit

STREAM = (
    ": keep-alive\n"
    'event: stdout\ndata: {"data":"a\\n","base64":false}\nid: 1\n\n'
    'event: stderr\r\ndata: {"data":"/w==","base64":true}\r\nid: 2\r\n\r\n'
    'event: future\ndata: {"x":1}\nid: 3\n\n'
    'event: exit\ndata: {"exitCode":3,"signal":null,"durationMs":7,"timedOut":false,'
    '"stdoutTruncated":false,"stderrTruncated":false}\nid: 4\n\n'
)


def feed(reader: EventReader, text: str) -> List[Any]:
    out = [reader.feed(line) for line in text.split("\n")[:-1]]
    return [e for e in out if e is not None]


def test_events_in_order_with_ids() -> None:
    r = EventReader(ExecExit)
    evs = feed(r, STREAM)
    assert [type(e).__name__ for e in evs] == ["OutputEvent", "OutputEvent", "ExitEvent"]
    assert (evs[0].stream, evs[0].text, evs[0].id) == ("stdout", "a\n", 1)
    assert (evs[1].stream, evs[1].raw, evs[1].id) == ("stderr", b"\xff", 2)
    assert evs[2].exit_code == 3 and isinstance(r.exit, ExecExit)
    assert r.last_event_id == 4, "an unknown event's id still counts"


def test_multi_line_data_and_an_unterminated_last_event() -> None:
    r = EventReader(ProcessExit)
    assert feed(r, 'event: gap\ndata: {"firstEventId":2,\n') == []
    assert feed(r, 'data: "lastEventId":5,"bytes":null}\nid: 5\n') == []
    ev = r.end()
    assert isinstance(ev, sprout.GapEvent) and (ev.gap.first_event_id, ev.gap.last_event_id, ev.id) == (2, 5, 5)


def test_an_error_event_raises_the_servers_code() -> None:
    r = EventReader(ExecExit)
    with pytest.raises(sprout.BadGatewayError) as e:
        feed(r, 'event: error\ndata: {"error":{"code":"agent_unavailable","message":"gone"}}\n\n')
    assert (e.value.code, e.value.status, e.value.message) == ("agent_unavailable", 502, "gone")
