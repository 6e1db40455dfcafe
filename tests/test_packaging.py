"""Packaging as the ecosystem expects: the wheel carries LICENSE and py.typed, one version
number everywhere, and a CHANGELOG in Keep a Changelog form."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import sdpa

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel built from a copy of the sources (no build/ or egg-info in the checkout),
    offline: the installed setuptools, no build isolation."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "checkout"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "-w", str(tmp / "dist")],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (path,) = (tmp / "dist").glob("sdpa-*.whl")
    return zipfile.ZipFile(path)


def _metadata(wheel: zipfile.ZipFile) -> str:
    (name,) = (n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    return wheel.read(name).decode()


def test_wheel_ships_license_and_py_typed(wheel):
    names = wheel.namelist()
    licenses = [n for n in names if re.fullmatch(r"sdpa-[^/]+\.dist-info/(licenses/)?LICENSE", n)]
    assert licenses, names
    assert wheel.read(licenses[0]) == (ROOT / "LICENSE").read_bytes()
    assert "sdpa/py.typed" in names
    meta = _metadata(wheel)
    assert "License-File: LICENSE" in meta
    assert re.search(r"^(License|License-Expression): MIT$", meta, re.M)


def test_license_file_is_the_declared_mit_license():
    declared = PYPROJECT["license"]
    declared = declared["text"] if isinstance(declared, dict) else declared
    assert declared == "MIT"
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n")
    assert "Permission is hereby granted, free of charge" in text


def test_one_version_everywhere(wheel):
    version = PYPROJECT["version"]
    assert re.search(rf"^Version: {re.escape(version)}$", _metadata(wheel), re.M)
    assert sdpa.__version__ == metadata.version("sdpa") == version
    done = subprocess.run([sys.executable, "-m", "sdpa", "--version"], capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    assert done.stdout.strip() == f"sdpa {version}"
    assert f"## [{version}] - " in (ROOT / "CHANGELOG.md").read_text()


def test_version_falls_back_when_the_package_is_not_installed():
    code = (
        "import importlib.metadata as m\n"
        "def missing(name): raise m.PackageNotFoundError(name)\n"
        "m.version = missing\n"
        "import sdpa; print(sdpa.__version__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert done.stdout.strip() == "0+unknown"


def test_changelog_keeps_a_changelog_form():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog\n") and "keepachangelog.com" in text
    releases = re.findall(r"^## \[([^\]]+)\](.*)$", text, re.M)
    assert releases[0] == ("Unreleased", "")
    for name, rest in releases[1:]:
        assert re.fullmatch(r"\d+\.\d+\.\d+", name) and re.fullmatch(r" - \d{4}-\d{2}-\d{2}", rest)
    kinds = set(re.findall(r"^### (.+)$", text, re.M))
    assert kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, kinds
