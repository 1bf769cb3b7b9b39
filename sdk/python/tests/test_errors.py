"""Error paths: the server's code and status in the exception, sync and async;
a server that is not there, or does not answer."""

from __future__ import annotations

import socket
import uuid
from typing import Any, Iterator

import pytest

import sprout

pytestmark = pytest.mark.server


def test_an_unknown_sandbox_is_vm_not_found(client: sprout.Client) -> None:
    missing = str(uuid.uuid4())
    with pytest.raises(sprout.NotFoundError) as e:
        client.get(missing)
    assert e.value.code == "vm_not_found"
    assert e.value.status == 404
    assert isinstance(e.value, sprout.APIError)
    assert e.value.request_id, "the answer's X-Request-Id is kept"
    assert "vm_not_found" in str(e.value) and "404" in str(e.value)
    # Every call on a gone sandbox says the same, a rest-state one too.
    with pytest.raises(sprout.NotFoundError) as e2:
        client.request("pauseVm", {"id": missing})
    assert e2.value.code == "vm_not_found"
    # Not a UUID at all: the same code (and the id cannot become another path).
    with pytest.raises(sprout.NotFoundError) as e3:
        client.get("../../health")
    assert e3.value.code == "vm_not_found"


def test_a_bad_shape_is_the_servers_validation_code(client: sprout.Client) -> None:
    with pytest.raises(sprout.BadRequestError) as e:
        client.create(cpus=9, memory_mb=128)
    assert (e.value.status, e.value.code, e.value.field) == (400, "invalid_value", "cpus")
    with pytest.raises(sprout.BadRequestError) as e2:
        client.create(memory_mb=64)
    assert (e2.value.code, e2.value.field) == ("invalid_value", "memoryMb")
    # JSON of the wrong shape (what the typed API cannot send): invalid_body.
    with pytest.raises(sprout.BadRequestError) as e3:
        client.request("schedule", json={"cpus": "two"})
    assert e3.value.code == "invalid_body"
    with pytest.raises(sprout.BadRequestError) as e4:
        client.request("schedule", json={"colour": "green"})
    assert e4.value.code == "invalid_body"
    with pytest.raises(sprout.BadRequestError) as e5:
        client.create(image="no-such-image")
    assert e5.value.code == "unknown_image"


def test_an_impossible_transition_carries_the_state(create: Any) -> None:
    with create() as sb:
        with pytest.raises(sprout.ConflictError) as e:
            sb.resume()
        assert (e.value.status, e.value.code, e.value.state) == (409, "invalid_state", "running")


@pytest.fixture
def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A TCP listener that accepts and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield f"127.0.0.1:{s.getsockname()[1]}"
    s.close()


def test_a_server_that_is_down_is_a_connection_error(closed_port: int) -> None:
    url = f"http://127.0.0.1:{closed_port}"
    with sprout.Client(url) as c:
        with pytest.raises(sprout.APIConnectionError) as e:
            c.get(str(uuid.uuid4()))
    assert e.value.url == url
    assert f"cannot reach sproutd at {url}" in str(e.value)
    assert not isinstance(e.value, sprout.APIError)
    # Sandbox.create with no client: the same, from base_url.
    with pytest.raises(sprout.APIConnectionError):
        sprout.Sandbox.create(base_url=url)


def test_a_server_that_does_not_answer_is_a_timeout(silent_server: str) -> None:
    with sprout.Client(silent_server, timeout=0.5) as c:
        with pytest.raises(sprout.APITimeoutError) as e:
            c.health()
    assert "did not answer in time" in str(e.value)


@pytest.mark.asyncio
async def test_async_errors(base_url: str, closed_port: int) -> None:
    async with sprout.AsyncClient(base_url) as c:
        with pytest.raises(sprout.NotFoundError) as e:
            await c.get(str(uuid.uuid4()))
        assert (e.value.status, e.value.code) == (404, "vm_not_found")
        with pytest.raises(sprout.BadRequestError) as e2:
            await c.create(cpus=9)
        assert (e2.value.code, e2.value.field) == ("invalid_value", "cpus")
    async with sprout.AsyncClient(f"127.0.0.1:{closed_port}") as down:
        with pytest.raises(sprout.APIConnectionError) as e3:
            await down.health()
        assert "cannot reach sproutd" in str(e3.value)


def test_config_from_arguments_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPROUT_URL", "sprout.example:7000")
    monkeypatch.setenv("SPROUT_API_KEY", "sk-sprout-env")
    c = sprout.Client()
    assert c.base_url == "http://sprout.example:7000"
    assert c._http.headers["authorization"] == "Bearer sk-sprout-env"
    c2 = sprout.Client("http://h:1/", api_key="sk-arg")
    assert c2.base_url == "http://h:1" and c2._http.headers["authorization"] == "Bearer sk-arg"
    monkeypatch.delenv("SPROUT_URL")
    monkeypatch.setenv("SPROUT_API_KEY", "")
    c3 = sprout.Client()
    assert c3.base_url == sprout.DEFAULT_BASE_URL and "authorization" not in c3._http.headers
    for x in (c, c2, c3):
        x.close()
