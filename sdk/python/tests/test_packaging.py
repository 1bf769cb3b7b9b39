"""``pip install ./sdk/python`` works: the wheel builds (offline, from a copy of
the source so the tree stays clean), holds the package with its ``py.typed``,
and the installed package imports and names its version."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

SDK = Path(__file__).resolve().parents[1]


def test_the_wheel_builds_and_installs(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(SDK, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("sprout_sdk-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for f in ("sprout/__init__.py", "sprout/_sync.py", "sprout/_async.py", "sprout/models.py", "sprout/py.typed"):
        assert f in names, names
    meta = next(n for n in names if n.endswith("/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "Name: sprout-sdk" in text and "Requires-Dist: httpx" in text and "Requires-Python: >=3.9" in text
    site = tmp_path / "site"
    subprocess.run(pip + ["install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    out = subprocess.run(
        [sys.executable, "-c", "import sprout, sys; print(sprout.__version__, sprout.__file__)"],
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[1].startswith(str(site)), out
    from sprout import __version__

    assert out[0] == __version__
