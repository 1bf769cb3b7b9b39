"""Every ``python`` block of sdk/python/README.md and docs/sdk.md, run against
the server under test, each in a fresh interpreter (with ``$SPROUT_URL`` set,
as a reader's would be). A ``text`` block right after one is its expected
output, line by line; ``...`` in it stands for any text. A block that creates
a sandbox needs Linux guests (the examples use the server's default image)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

import sprout
from conftest import require_linux

pytestmark = pytest.mark.server

SDK = Path(__file__).resolve().parents[1]
DOCS = [SDK / "README.md", SDK.parents[1] / "docs" / "sdk.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


def blocks(path: Path) -> List[Tuple[str, str, Optional[str]]]:
    """(id, code, expected output or None) of each python block of ``path``."""
    text = path.read_text()
    found = [(m.group(1), m.group(2), m.start(), m.end()) for m in FENCE.finditer(text)]
    out = []
    for i, (lang, body, start, end) in enumerate(found):
        if lang != "python":
            continue
        expect = None
        if i + 1 < len(found) and found[i + 1][0] == "text" and not text[end : found[i + 1][2]].strip():
            expect = found[i + 1][1]
        line = text[:start].count("\n") + 1
        out.append((f"{path.name}:{line}", body, expect))
    return out


ALL = [b for p in DOCS for b in blocks(p)]


def test_the_docs_have_examples() -> None:
    names = {b[0].split(":")[0] for b in ALL}
    assert names == {"README.md", "sdk.md"} and len(ALL) >= 8, [b[0] for b in ALL]
    readme = next(b for b in ALL if b[0].startswith("README.md"))
    assert len(readme[1].rstrip("\n").split("\n")) <= 10, "the README's example is 10 lines at most"


def matches(expect: str, got: str) -> bool:
    want = expect.rstrip("\n").split("\n")
    have = got.rstrip("\n").split("\n")
    if len(want) != len(have):
        return False
    for w, h in zip(want, have):
        pattern = re.escape(w).replace(re.escape("..."), ".*")
        if not re.fullmatch(pattern, h):
            return False
    return True


@pytest.mark.parametrize("name, code, expect", ALL, ids=[b[0] for b in ALL])
def test_example(name: str, code: str, expect: Optional[str], base_url: str, linux: bool, info: sprout.Info) -> None:
    if "create(" in code:
        require_linux(linux, info)
    env = {**os.environ, "SPROUT_URL": base_url, "PYTHONPATH": str(SDK / "src")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"{name} failed:\n{r.stdout}\n{r.stderr}"
    if expect is not None:
        assert matches(expect, r.stdout), f"{name} printed:\n{r.stdout}\nexpected:\n{expect}"


def test_the_matcher() -> None:
    assert matches("a ...\nb\n", "a xyz\nb\n") and matches("x", "x\n")
    assert not matches("a\nb\n", "a\n") and not matches("a...", "b")
