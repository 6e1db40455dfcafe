"""Files of this repository that are not in a package (examples/, scripts/) loaded as
modules, for the tests that call their functions, or run as scripts."""

from __future__ import annotations

import importlib.util
import json
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


def quick_rows(relative: str, tmp_path: Path) -> list[dict]:
    """The comparison rows (each `ours` row, with its peer) of a sdpa.benchmark script's
    --quick run (no peak memory, one repetition), which must succeed."""
    out = tmp_path / "quick.json"
    done = run_script(relative, "--quick", "--no-memory", "--reps", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return [r for r in json.loads(out.read_text())["results"] if r["peer"] is not None]
