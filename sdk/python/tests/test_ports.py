"""Ports: a guest HTTP server served by sproutd at the port's URL, through the
SDK, sync and async. Linux guests only."""

from __future__ import annotations

import hashlib
import time
from urllib.parse import urlsplit

import httpx
import pytest

import sprout

pytestmark = pytest.mark.server

# A 1 MiB file of known bytes, served from /workspace/www.
SERVE = (
    "mkdir -p /workspace/www && cd /workspace/www && "
    "python3 -c 'import sys; sys.stdout.buffer.write(bytes(range(256)) * 4096)' > blob && "
    "exec python3 -m http.server 8000 --bind 127.0.0.1"
)


def fetch(base_url: str, url: str, path: str) -> httpx.Response:
    """GET ``path`` of a port's ``url`` at sproutd's own address, with the
    URL's host as ``Host`` (httpx does not resolve ``*.localhost``)."""
    host = urlsplit(url).netloc
    return httpx.get(base_url + path, headers={"host": host}, timeout=60)


def test_a_port_serves_a_guest_http_server(linux_box: sprout.Sandbox, base_url: str) -> None:
    p = linux_box.open_port(8000)
    assert (p.port, p.public) == (8000, False)
    try:
        serve_through(linux_box, base_url, p)
    finally:
        linux_box.close_port(8000)
    r = fetch(base_url, p.url, "/blob")
    assert r.status_code == 404 and r.json()["error"]["code"] == "port_not_open", r.text
    with pytest.raises(sprout.NotFoundError) as e:
        linux_box.close_port(8000)
    assert e.value.code == "port_not_open"


def serve_through(linux_box: sprout.Sandbox, base_url: str, p: sprout.Port) -> None:
    assert urlsplit(p.url).hostname == f"8000-{linux_box.id}.localhost", p.url
    # Before anything listens: the port's own error, then the server comes up.
    r = fetch(base_url, p.url, "/")
    assert r.status_code == 502 and r.json()["error"]["code"] == "port_not_listening", r.text
    server = linux_box.exec_background("/bin/sh", ["-c", SERVE])
    deadline = time.monotonic() + 120
    while True:
        r = fetch(base_url, p.url, "/blob")
        if r.status_code == 200:
            break
        assert r.status_code == 502, r.text
        assert time.monotonic() < deadline, "the guest's server never answered"
        time.sleep(0.5)
    assert hashlib.sha256(r.content).hexdigest() == hashlib.sha256(bytes(range(256)) * 4096).hexdigest()
    # The guest's own 404 page passes untouched (not sproutd's envelope).
    r = fetch(base_url, p.url, "/no-such-file")
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html"), r.headers
    assert [x.port for x in linux_box.ports()] == [8000]
    server.kill()


@pytest.mark.asyncio
async def test_async_ports(base_url: str, linux_box: sprout.Sandbox) -> None:
    async with sprout.AsyncClient(base_url) as c:
        sb = await c.get(linux_box.id)
        p = await sb.open_port(8123, public=True)
        assert p.public and 8123 in [x.port for x in await sb.ports()]
        await sb.close_port(8123)
        assert 8123 not in [x.port for x in await sb.ports()]
