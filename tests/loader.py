"""Files of this repository that are not in a package (examples/, scripts/) loaded as
modules, for the tests that call their functions, or run as scripts."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_file(relative: str) -> ModuleType:
    """The module of ROOT / relative (e.g. "examples/diffusion_maps.py"), run once per
    call, named after its file."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(relative: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """python ROOT / relative *args in a fresh process from its folder, offline
    (HF_HUB_OFFLINE=1), its output captured as text."""
    path = ROOT / relative
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout,
        env=env, cwd=path.parent,
    )  # fmt: skip
