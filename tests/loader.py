"""Files of this repository that are not in a package (examples/, scripts/) loaded as
modules, for the tests that call their functions."""

from __future__ import annotations

import importlib.util
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
