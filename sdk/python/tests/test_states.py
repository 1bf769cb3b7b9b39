"""Rest states, snapshots and checkpoints through the SDK, sync and async.

With Linux guests each step also checks what the guest keeps (a file written
before a sleep is there after the wake, a checkpoint restore brings back the
file as it was); with the test guest only the states."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

import sprout
from conftest import TAG

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def box(client: sprout.Client, shape: Any) -> Iterator[sprout.Sandbox]:
    sb = client.create(**shape, metadata=TAG)
    yield sb
    try:
        sb.kill()
    except sprout.NotFoundError:
        pass


def test_pause_resume_sleep_wake(box: sprout.Sandbox, linux: bool) -> None:
    if linux:
        box.files.write("mark", "v1")
    assert box.pause().state == "paused"
    assert box.refresh().state == "paused"
    if linux:
        with pytest.raises(sprout.ConflictError) as e:
            box.exec("true")
        assert e.value.code == "paused"
        assert box.refresh().state == "paused", "an exec never wakes a paused sandbox"
    with pytest.raises(sprout.ConflictError) as e2:
        box.pause()
    assert (e2.value.code, e2.value.state) == ("invalid_state", "paused")
    assert box.resume().state == "running"

    assert box.sleep().state == "sleeping"
    assert box.info.worker_pid is None
    if linux:
        # The next call wakes it transparently.
        assert box.files.read("mark") == "v1"
        assert box.refresh().state == "running"
        assert box.sleep().state == "sleeping"
    w = box.wake()
    assert isinstance(w, sprout.WakeResp) and w.vm.state == "running" and not w.cold_boot
    assert box.state == "running" and box.info.worker_pid

    assert box.hibernate().state == "hibernated"
    if linux:
        with pytest.raises(sprout.ConflictError) as e3:
            box.exec("true")
        assert e3.value.state == "hibernated"
    assert box.wake().vm.state == "running"


def test_snapshot_and_a_sandbox_from_it(box: sprout.Sandbox, client: sprout.Client, linux: bool) -> None:
    t = box.snapshot()
    assert isinstance(t, sprout.SnapshotTaken)
    assert (t.vm_id, t.state) == (box.id, "running")
    snap = client.get_snapshot(t.snapshot_id)
    assert (snap.kind, snap.vm_id, snap.cpus) == ("user", box.id, box.info.cpus)
    assert t.snapshot_id in [s.snapshot_id for s in client.snapshots()]
    with client.create(snapshot=t.snapshot_id, metadata=TAG) as child:
        assert child.info.snapshot_id == t.snapshot_id and child.id != box.id
        assert child.info.memory_mb == box.info.memory_mb
        if linux:
            assert child.files.read("mark") == "v1"
    paused = box.snapshot(leave_paused=True)
    assert paused.state == "paused" and box.state == "paused"
    box.resume()


def test_checkpoints(box: sprout.Sandbox, client: sprout.Client, linux: bool) -> None:
    if linux:
        box.files.write("mark", "at-checkpoint")
    cp = box.checkpoint("before")
    assert (cp.kind, cp.name, cp.vm_id) == ("checkpoint", "before", box.id)
    assert [c.snapshot_id for c in box.checkpoints()] == [cp.snapshot_id]
    if linux:
        box.files.write("mark", "after")
    assert box.restore(cp).state == "running"
    assert box.id == cp.vm_id
    if linux:
        assert box.files.read("mark") == "at-checkpoint"
    with box.spawn(cp) as spawned:
        assert spawned.id != box.id and spawned.info.snapshot_id == cp.snapshot_id
        if linux:
            assert spawned.files.read("mark") == "at-checkpoint"
    assert box.delete_checkpoint(cp).deleted
    assert box.checkpoints() == []
    with pytest.raises(sprout.NotFoundError) as e:
        client.restore_checkpoint(cp.snapshot_id)
    assert e.value.code == "checkpoint_not_found"


@pytest.mark.asyncio
async def test_async_states(box: sprout.Sandbox, base_url: str) -> None:
    async with sprout.AsyncClient(base_url) as c:
        sb = await c.get(box.id)
        assert (await sb.pause()).state == "paused"
        assert (await sb.resume()).state == "running"
        assert (await sb.sleep()).state == "sleeping"
        assert (await sb.wake()).vm.state == "running"
        t = await sb.snapshot()
        assert (await c.get_snapshot(t.snapshot_id)).vm_id == sb.id
        cp = await sb.checkpoint("async")
        assert [x.name for x in await sb.checkpoints()] == ["async"]
        assert (await sb.restore(cp)).state == "running"
        assert (await c.delete_checkpoint(cp)).deleted
        with pytest.raises(sprout.NotFoundError) as e:
            await c.delete_checkpoint(cp)
        assert e.value.code == "checkpoint_not_found"
