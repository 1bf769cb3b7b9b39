"""Exec streams (events as they happen: the first arrives before the command
ends) and background processes (stdin, re-attach with Last-Event-ID, signals),
sync and async. Linux guests only."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Dict, List

import pytest

import sprout
from conftest import Clock

pytestmark = pytest.mark.server

# Every process's command line, one a line (the image may have no ps).
PS = "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done"
# Prints, then goes quiet for 3 s, then prints again and fails.
SLOW = "echo first; sleep 3; echo second >&2; exit 5"


def test_exec_stream_events_arrive_as_they_happen(linux_box: sprout.Sandbox) -> None:
    clock = Clock()
    seen: List[Any] = []
    with linux_box.exec_stream("/bin/sh", ["-c", SLOW]) as s:
        for ev in s:
            seen.append((clock(), ev))
    first_t, first = seen[0]
    exit_t, last = seen[-1]
    assert isinstance(first, sprout.OutputEvent) and (first.stream, first.text) == ("stdout", "first\n"), seen
    assert isinstance(last, sprout.ExitEvent) and last.exit_code == 5, seen
    # The first event came while the command still ran (it sleeps 3 s after it).
    assert exit_t - first_t >= 2.5, f"first event at {first_t:.2f} s, exit at {exit_t:.2f} s: buffered"
    out = [ev for _, ev in seen if isinstance(ev, sprout.OutputEvent)]
    assert [(e.stream, e.text) for e in out] == [("stdout", "first\n"), ("stderr", "second\n")]
    ids = [ev.id for _, ev in seen]
    assert ids == sorted(ids) and ids[0] == 1, ids
    assert s.exit is not None and s.exit.exit_code == 5 and not s.exit.timed_out
    assert isinstance(s.exit, sprout.ExecExit)


def test_exec_stream_stdin_binary_output_and_timeout(linux_box: sprout.Sandbox) -> None:
    s = linux_box.exec_stream("/bin/sh", ["-c", "cat; printf '\\377\\376'"], stdin="in\n")
    evs = list(s)
    raw = b"".join(e.raw for e in evs if isinstance(e, sprout.OutputEvent))
    assert raw == b"in\n\xff\xfe", evs
    assert evs[-1].exit_code == 0  # type: ignore[union-attr]
    t = linux_box.exec_stream("sleep", ["30"], timeout_ms=500).wait()
    assert t.timed_out and t.exit_code is None and t.signal == 9, t


def test_exec_stream_errors_before_the_stream_are_raised_at_the_call(
    client: sprout.Client, linux_box: sprout.Sandbox
) -> None:
    with pytest.raises(sprout.BadRequestError) as e:
        linux_box.exec_stream("/no/such/program")
    assert e.value.code == "exec_failed"
    gone = sprout.Sandbox(client, dataclasses.replace(linux_box.info, vm_id=str(uuid.uuid4())))
    with pytest.raises(sprout.NotFoundError) as nf:
        gone.exec_stream("true")
    assert nf.value.code == "vm_not_found"


def test_closing_an_exec_stream_ends_the_command(linux_box: sprout.Sandbox) -> None:
    s = linux_box.exec_stream("/bin/sh", ["-c", "echo started; sleep 60; echo never > /workspace/never"])
    first = next(iter(s))
    assert isinstance(first, sprout.OutputEvent) and first.text == "started\n"
    s.close()
    assert list(s) == [] and s.exit is None
    # Its process group was killed: nothing sleeps on.
    deadline = time.monotonic() + 30
    while True:
        ps = linux_box.exec("/bin/sh", ["-c", PS]).stdout
        assert "/bin/sh" in ps, ps  # the listing works (it sees itself)
        if "sleep 60" not in ps or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "sleep 60" not in ps, ps


def by_stream(events: List[Any]) -> Dict[str, List[str]]:
    """The output events' texts, per stream, each in the order it came."""
    out: Dict[str, List[str]] = {}
    for e in events:
        if isinstance(e, sprout.OutputEvent):
            out.setdefault(e.stream, []).append(e.text)
    return out


def test_background_process_reattach(linux_box: sprout.Sandbox) -> None:
    p = linux_box.exec_background(
        "/bin/sh", ["-c", "echo one; read l; echo got:$l; echo err >&2; exit 4"], stdin_open=True
    )
    assert p.exec_id >= 0 and p.pid and p.pid > 0
    # Attach, read the first event, detach: the process runs on.
    s = p.events()
    first = next(s)
    assert isinstance(first, sprout.OutputEvent) and first.text == "one\n", first
    seen = s.last_event_id
    assert seen == first.id
    s.close()
    info = p.info()
    assert info.running and info.stdin_open and info.exit is None
    assert p.write_stdin("hello\n", close=True).closed
    # Re-attach after the last event seen: the rest, nothing repeated.
    rest = list(p.events(last_event_id=seen))
    # stdout and stderr are two pipes read apart: each keeps its own order, but
    # which of "got:hello" and "err" is read first is up to the guest's scheduler.
    assert by_stream(rest) == {"stdout": ["got:hello\n"], "stderr": ["err\n"]}, rest
    assert isinstance(rest[-1], sprout.ExitEvent) and rest[-1].exit_code == 4
    assert all(e.id is not None and seen is not None and e.id > seen for e in rest)
    # Without an id: everything the ring kept, from the start.
    again = list(p.events())
    assert by_stream(again) == {"stdout": ["one\n", "got:hello\n"], "stderr": ["err\n"]}, again
    ids = [e.id for e in again]
    assert None not in ids and ids == sorted(ids), again  # type: ignore[type-var]
    assert p.wait().exit_code == 4
    listed = {x.exec_id: x for x in linux_box.processes()}
    assert not listed[p.exec_id].running and listed[p.exec_id].exit.exit_code == 4  # type: ignore[union-attr]
    # A process whose stdin is closed refuses more.
    with pytest.raises(sprout.ConflictError) as e:
        p.write_stdin("more")
    assert e.value.code == "stdin_closed"
    # A handle made from the id alone re-attaches the same way.
    h = linux_box.process(p.exec_id)
    assert h.wait().exit_code == 4
    with pytest.raises(sprout.NotFoundError) as nf:
        list(linux_box.process(10**9).events())
    assert nf.value.code == "process_not_found"


def test_background_process_signal(linux_box: sprout.Sandbox) -> None:
    p = linux_box.exec_background("sleep", ["600"])
    assert p.info().running
    sent = p.kill()
    assert (sent.exec_id, sent.signal) == (p.exec_id, 9)
    x = p.wait()
    assert x.exit_code is None and x.signal == 9, x


@pytest.mark.asyncio
async def test_async_streams(base_url: str, linux_box: sprout.Sandbox) -> None:
    async with sprout.AsyncClient(base_url) as c:
        sb = await c.get(linux_box.id)
        clock = Clock()
        times: List[float] = []
        events: List[Any] = []
        async with sb.exec_stream("/bin/sh", ["-c", SLOW]) as s:
            async for ev in s:
                times.append(clock())
                events.append(ev)
        assert isinstance(events[0], sprout.OutputEvent) and events[0].text == "first\n"
        assert isinstance(events[-1], sprout.ExitEvent) and events[-1].exit_code == 5
        assert times[-1] - times[0] >= 2.5, times
        # Opened by the first step of `async for`, or by `await`.
        assert [e.text async for e in sb.exec_stream("echo", ["x"]) if isinstance(e, sprout.OutputEvent)] == ["x\n"]
        with pytest.raises(sprout.BadRequestError):
            await sb.exec_stream("/no/such/program")

        p = await sb.exec_background("/bin/sh", ["-c", "echo a; read l; echo b:$l"], stdin_open=True)
        st = await p.events()
        first = await st.__anext__()
        assert isinstance(first, sprout.OutputEvent) and first.text == "a\n"
        await st.aclose()
        await p.write_stdin(b"bin\n", close=True)
        rest = [e async for e in p.events(last_event_id=first.id)]
        assert [e.text for e in rest if isinstance(e, sprout.OutputEvent)] == ["b:bin\n"]
        assert (await p.wait()).exit_code == 0
