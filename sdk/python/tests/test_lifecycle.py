"""The lifecycle through the SDK, sync and async: create -> exec with stdin and
a non-zero exit -> files (text, a directory, a 32 MiB upload and download
whose hashes are equal) -> fork(2) -> the list shows the children with their
parent -> delete.

Against a sproutd without Linux guests (the test guest has no agent) the exec
and files steps check that the server refuses them (``not_supported``)."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

import sprout
from conftest import TAG

pytestmark = pytest.mark.server

BIG = int(os.environ.get("SPROUT_TEST_BIG_MIB", "32")) << 20
SHELL = "read a; echo got:$a; echo oops >&2; exit 3"


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, str]:
    """A file of random bytes and its SHA-256."""
    p = tmp_path_factory.mktemp("big") / "big.bin"
    h = hashlib.sha256()
    with open(p, "wb") as f:
        left = BIG
        while left:
            c = os.urandom(min(left, 1 << 20))
            f.write(c)
            h.update(c)
            left -= len(c)
    return p, h.hexdigest()


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for c in iter(lambda: f.read(1 << 20), b""):
            h.update(c)
    return h.hexdigest()


class Progress:
    def __init__(self) -> None:
        self.calls: List[Tuple[int, Any]] = []

    def __call__(self, done: int, total: Any) -> None:
        self.calls.append((done, total))

    def check(self, total: int) -> None:
        assert self.calls, "progress was never called"
        done = [c[0] for c in self.calls]
        assert done == sorted(done) and done[-1] == total, done[-5:]
        assert len(self.calls) >= total // (1 << 20), "one call per chunk at least"


def test_lifecycle_sync(
    client: sprout.Client, create: Any, linux: bool, big_file: Tuple[Path, str], tmp_path: Path
) -> None:
    parent = create(metadata={"role": "parent"})
    made = [parent]
    try:
        assert parent.state == "running", parent.info
        assert parent.info.metadata["role"] == "parent"
        assert parent.refresh().info.vm_id == parent.id and parent.info.created_at.tzinfo is not None

        # -- exec
        if linux:
            r = parent.exec("/bin/sh", ["-c", SHELL], stdin="hello\n")
            assert (r.exit_code, r.stdout, r.stderr, r.ok) == (3, "got:hello\n", "oops\n", False), r
            assert r.signal is None and not r.timed_out and r.duration_ms >= 0
            with pytest.raises(sprout.CommandError) as ce:
                parent.exec("/bin/sh", ["-c", SHELL], stdin="x\n", check=True)
            assert ce.value.result.exit_code == 3 and "oops" in str(ce.value)
            b = parent.exec("/bin/sh", ["-c", "wc -c; exit 0"], stdin=bytes(range(256)) * 4)
            assert b.stdout.strip() == "1024" and b.ok
            assert parent.exec("printenv", ["X"], env={"X": "y"}, cwd="/tmp").stdout == "y\n"
        else:
            with pytest.raises(sprout.BadRequestError) as e:
                parent.exec("true")
            assert e.value.code == "not_supported"

        # -- files
        if linux:
            f = parent.files
            assert f.mkdir("notes/deep", parents=True).created
            assert f.write("notes/a.txt", "héllo\n").bytes == len("héllo\n".encode())
            assert f.read("notes/a.txt") == "héllo\n"
            assert f.read_bytes("notes/a.txt") == "héllo\n".encode()
            listing = f.list("notes")
            assert sorted(listing.names()) == ["a.txt", "deep"] and not listing.truncated
            assert {e.name: e.type for e in listing} == {"a.txt": "file", "deep": "dir"}
            assert f.exists("notes/a.txt") and not f.exists("notes/b.txt")
            src, digest = big_file
            up = Progress()
            w = f.upload("big.bin", src, progress=up)
            assert (w.path, w.bytes) == ("big.bin", BIG)
            up.check(BIG)
            assert parent.exec("sha256sum", ["/workspace/big.bin"]).stdout.split()[0] == digest
            down = Progress()
            back = tmp_path / "back.bin"
            assert f.download("big.bin", back, progress=down) == BIG
            down.check(BIG)
            assert sha256_file(back) == digest
            with pytest.raises(sprout.NotFoundError) as nf:
                f.read("nope.txt")
            assert nf.value.code == "file_not_found"
            with pytest.raises(sprout.BadRequestError) as esc:
                f.read("../etc/passwd")
            assert esc.value.code == "path_escape"
            assert f.delete("notes", recursive=True).deleted
            assert not f.exists("notes")
        else:
            with pytest.raises(sprout.BadRequestError) as e:
                parent.files.list()
            assert e.value.code == "not_supported"

        # -- fork
        kids = parent.fork(2)
        made += list(kids)
        assert len(kids) == 2 and not kids.failed, kids
        assert kids.source_vm_id == parent.id and kids.snapshot_id
        for k in kids:
            assert k.parent_id == parent.id and k.state == "running", k.info
            assert k.info.snapshot_id == kids.snapshot_id
        if linux:
            k = kids[0]
            assert k.exec("sha256sum", ["/workspace/big.bin"]).stdout.split()[0] == big_file[1]
            k.files.write("who", "child")
            assert not parent.files.exists("who"), "a child's writes are its own"

        # -- the list
        listed = {s.id: s for s in client.list()}
        for k in kids:
            assert listed[k.id].parent_id == parent.id
        assert listed[parent.id].parent_id is None
        tagged = [s.id for s in sprout.Sandbox.list(metadata={**TAG, "role": "parent"}, client=client)]
        assert parent.id in tagged

        # -- delete
        for s in made:
            assert s.kill().deleted
        for s in made:
            with pytest.raises(sprout.NotFoundError) as e:
                s.refresh()
            assert e.value.code == "vm_not_found"
        made.clear()
    finally:
        for s in made:
            try:
                s.kill()
            except sprout.APIError:
                pass


@pytest.mark.asyncio
async def test_lifecycle_async(
    base_url: str, shape: Dict[str, Any], linux: bool, big_file: Tuple[Path, str], tmp_path: Path
) -> None:
    async with sprout.AsyncClient(base_url) as c:
        parent = await c.create(**shape, metadata={**TAG, "role": "async-parent"})
        made: List[sprout.AsyncSandbox] = [parent]
        try:
            assert parent.state == "running"
            assert (await parent.refresh()).id == parent.id

            if linux:
                r = await parent.exec("/bin/sh", ["-c", SHELL], stdin="hello\n")
                assert (r.exit_code, r.stdout, r.stderr) == (3, "got:hello\n", "oops\n"), r
                with pytest.raises(sprout.CommandError):
                    await parent.exec("false", check=True)

                f = parent.files
                await f.mkdir("d")
                await f.write("d/t.txt", "text")
                assert await f.read("d/t.txt") == "text"
                assert (await f.list("d")).names() == ["t.txt"]
                src, digest = big_file
                up = Progress()
                assert (await f.upload("big.bin", src, progress=up)).bytes == BIG
                up.check(BIG)
                back = tmp_path / "back.bin"
                with open(back, "wb") as out:  # an open file as the destination
                    assert await f.download("big.bin", out) == BIG
                assert sha256_file(back) == digest

                async def gen() -> Any:  # an async iterable as the source
                    for i in range(4):
                        yield bytes([i]) * 1000

                assert (await f.upload("gen.bin", gen())).bytes == 4000
                assert await f.read_bytes("gen.bin") == b"".join(bytes([i]) * 1000 for i in range(4))
            else:
                with pytest.raises(sprout.BadRequestError) as e:
                    await parent.exec("true")
                assert e.value.code == "not_supported"

            kids = await parent.fork(2)
            made += list(kids)
            assert len(kids) == 2 and not kids.failed
            ids = {k.id for k in kids}
            listed = await c.list()
            assert {s.id for s in listed if s.parent_id == parent.id} == ids
            if linux:
                assert await kids[1].files.read("d/t.txt") == "text"

            for s in made:
                assert (await s.kill()).deleted
            with pytest.raises(sprout.NotFoundError) as e:
                await c.get(parent.id)
            assert e.value.code == "vm_not_found"
            made.clear()
        finally:
            for s in made:
                try:
                    await s.kill()
                except sprout.APIError:
                    pass


def test_context_manager_deletes(create: Any, client: sprout.Client) -> None:
    with create() as sb:
        vm_id = sb.id
        assert client.get(vm_id).state == "running"
    with pytest.raises(sprout.NotFoundError):
        client.get(vm_id)
    # Also when the block raises (and the block's error is what propagates).
    with pytest.raises(KeyError):
        with create() as sb2:
            vm2 = sb2.id
            raise KeyError("boom")
    with pytest.raises(sprout.NotFoundError):
        client.get(vm2)
    assert uuid.UUID(vm2)
