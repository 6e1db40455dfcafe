"""The API reference: mkdocs + mkdocstrings build it offline with --strict (as `make docs`
does), every public name gets its section, and a broken reference fails the build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="needs the docs extra")
pytest.importorskip("mkdocstrings", reason="needs the docs extra")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = {  # page -> anchors its API section must have
    "attention": ["sdpa.attention", "sdpa.scaled_dot_product_attention", "sdpa.AttentionWeights"],
    "masks": ["sdpa.masks.causal", "sdpa.masks.padding", "sdpa.masks.documents",
              "sdpa.masks.sinks"],
    "modules": ["sdpa.MultiHeadAttention", "sdpa.SpatialSelfAttention", "sdpa.PositionalEncoding"],
    "integrations": ["sdpa.integrations.transformers.register",
                     "sdpa.integrations.transformers.capture"],
    "distributed": ["sdpa.distributed.ring_attention", "sdpa.distributed.shard"],
    "errors": ["sdpa.errors.StaleWeightsError", "sdpa.errors.NotSupportedError"],
}  # fmt: skip


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip


def test_make_docs_builds_strictly_with_every_public_name(tmp_path):
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr
    for page, anchors in PUBLIC.items():
        html = (tmp_path / "site" / page / "index.html").read_text()
        for anchor in anchors:
            assert f'id="{anchor}"' in html, f"{page}: no section for {anchor}"
    assert (tmp_path / "site" / "unet_pixels.png").is_file()  # the picture on the home page


def test_a_broken_reference_fails_the_build(tmp_path):
    """The same configuration with one page that names an object that does not exist."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "broken.md").write_text("# Broken\n\nSee [the call][sdpa.no_such_function].\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(docs)
    config["nav"].append({"Broken": "broken.md"})
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            plugin["mkdocstrings"]["handlers"]["python"]["paths"] = [str(ROOT / "src")]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "sdpa.no_such_function" in done.stderr, done.stderr[-3000:]
