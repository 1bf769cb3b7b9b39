"""Fixtures of the SDK's tests: a real sproutd at ``$SPROUT_URL`` (tests/run.sh URL).

* Tests that need the server take the ``client`` fixture (or ``aclient``); with
  no ``SPROUT_URL`` they fail, saying so (they never pass without a server).
* ``linux`` says whether the server runs Linux guests (``/v1/info``). Tests of
  exec, files and streams need one (``needs_linux``): against a host sproutd
  that runs only the test guest they are skipped, unless
  ``SPROUT_TEST_REQUIRE_LINUX=1``, which fails them instead.
* ``shape`` is what every test creates: the server's default image with one
  vCPU and ``$SPROUT_TEST_MEMORY_MB`` (256) MiB where Linux guests run (one
  template for the whole suite), else the test guest with 128 MiB.
  ``$SPROUT_TEST_IMAGE`` names another image.
* Every sandbox a test makes carries the metadata ``sdk-test=<run id>``; the
  session's end deletes any still there (a test that failed half-way).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, Dict, Iterator

import pytest

import sprout

RUN = uuid.uuid4().hex[:12]
TAG = {"sdk-test": RUN}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "server: needs a real sproutd at $SPROUT_URL")


@pytest.fixture(scope="session")
def base_url() -> str:
    url = os.environ.get("SPROUT_URL")
    if not url:
        pytest.fail("this test needs a sproutd: set SPROUT_URL (sdk/python/tests/run.sh URL does)", pytrace=False)
    return url


@pytest.fixture(scope="session")
def client(base_url: str) -> Iterator[sprout.Client]:
    c = sprout.Client(base_url)
    try:
        c.health()
    except sprout.APIConnectionError as e:
        pytest.fail(f"no sproutd at {base_url}: {e}", pytrace=False)
    yield c
    # Whatever a failed test left behind.
    for sb in c.list(metadata=TAG):
        try:
            sb.kill()
        except sprout.APIError as e:
            print(f"cleanup: {sb.id}: {e}")
    c.close()


@pytest.fixture(scope="session")
def info(client: sprout.Client) -> sprout.Info:
    return client.info()


@pytest.fixture(scope="session")
def linux(info: sprout.Info) -> bool:
    return info.host_mode.linux_guests


def require_linux(linux: bool, info: sprout.Info) -> None:
    if not linux:
        why = "this sproutd runs no Linux guests (/v1/info: hostMode.linuxGuests is false)"
        if os.environ.get("SPROUT_TEST_REQUIRE_LINUX") == "1":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture
def needs_linux(linux: bool, info: sprout.Info) -> None:
    require_linux(linux, info)


@pytest.fixture(scope="session")
def shape(linux: bool, info: sprout.Info) -> Dict[str, Any]:
    if linux:
        s: Dict[str, Any] = {"cpus": 1, "memory_mb": int(os.environ.get("SPROUT_TEST_MEMORY_MB", "256"))}
        if os.environ.get("SPROUT_TEST_IMAGE"):
            s["image"] = os.environ["SPROUT_TEST_IMAGE"]
        return s
    names = [i.name for i in info.images]
    assert "testguest" in names, f"a host sproutd without Linux guests needs the test guest: images {names}"
    return {"image": "testguest", "cpus": 1, "memory_mb": 128}


@pytest.fixture(scope="session")
def create(client: sprout.Client, shape: Dict[str, Any]) -> Any:
    """``create(**extra)``: a sandbox of the suite's shape, tagged for cleanup."""

    def make(**extra: Any) -> sprout.Sandbox:
        meta = {**TAG, **extra.pop("metadata", {})}
        return client.create(**{**shape, **extra}, metadata=meta)

    return make


@pytest.fixture(scope="module")
def linux_box(client: sprout.Client, linux: bool, info: sprout.Info, shape: Dict[str, Any]) -> Iterator[sprout.Sandbox]:
    """One Linux sandbox shared by a module's exec and stream tests."""
    require_linux(linux, info)
    sb = client.create(**shape, metadata=TAG)
    yield sb
    sb.kill()


class Clock:
    """Seconds since it was made."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.t0
