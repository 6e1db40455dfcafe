"""The documentation site and its generated tables.

The site: mkdocs + mkdocstrings build the guides and the API reference offline with
--strict (as `make docs` does), every guide is in it, every public name gets its
section, and a broken reference, link or anchor fails the build.

The benchmark tables (README.md and docs/guide/benchmarks.md): what
scripts/bench_tables.py generates from benchmarks/results/*.json, so a table edited by
hand, or left stale after a results file changed, fails here."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loader import load_file

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ROOT / "docs" / "guide"


def _needs_mkdocs():
    pytest.importorskip("mkdocs", reason="needs the docs extra")
    pytest.importorskip("mkdocstrings", reason="needs the docs extra")
    return pytest.importorskip("yaml")


def _tables():
    """scripts/bench_tables.py as a module (scripts/ is not a package)."""
    return load_file("scripts/bench_tables.py")


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


def test_make_docs_builds_strictly_with_every_guide_and_public_name(tmp_path):
    _needs_mkdocs()
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr
    for page, anchors in PUBLIC.items():
        html = (tmp_path / "site" / page / "index.html").read_text()
        for anchor in anchors:
            assert f'id="{anchor}"' in html, f"{page}: no section for {anchor}"
    assert (tmp_path / "site" / "unet_pixels.png").is_file()  # the picture on the home page
    guides = sorted(p.stem for p in GUIDES.glob("*.md"))
    assert len(guides) >= 10, guides
    home = (tmp_path / "site" / "index.html").read_text()
    for guide in guides:  # built, and linked from the home page's nav and guide list
        assert (tmp_path / "site" / "guide" / guide / "index.html").is_file(), guide
        assert home.count(f'href="guide/{guide}/"') >= 2, f"{guide}: not in the nav and the list"
    benchmarks = (tmp_path / "site" / "guide" / "benchmarks" / "index.html").read_text()
    assert benchmarks.count("<table>") >= 12  # the generated tables render as tables


def _copy_site(tmp_path: Path) -> tuple[Path, dict]:
    """The docs and the configuration, copied where a test may break them."""
    yaml = _needs_mkdocs()
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(docs)
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            plugin["mkdocstrings"]["handlers"]["python"]["paths"] = [str(ROOT / "src")]
    return docs, config


def _build_copy(tmp_path: Path, config: dict) -> subprocess.CompletedProcess:
    import yaml

    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    return build(tmp_path / "mkdocs.yml", tmp_path / "site")


def test_a_broken_reference_link_anchor_or_a_page_out_of_the_nav_fails_the_build(tmp_path):
    """One build of a copy with four faults, each named in the errors: a reference to an
    object that does not exist, a link to no page, a link to no heading, a guide in no
    nav."""
    docs, config = _copy_site(tmp_path)
    (docs / "broken.md").write_text("# Broken\n\nSee [the call][sdpa.no_such_function].\n")
    config["nav"].append({"Broken": "broken.md"})
    contract = docs / "guide" / "contract.md"
    contract.write_text(
        contract.read_text()
        + "\nSee [a page](no-such-page.md) and [a heading](masks.md#no-such-heading).\n"
    )
    (docs / "guide" / "orphan.md").write_text("# Orphan\n\nIn no nav.\n")
    done = _build_copy(tmp_path, config)
    assert done.returncode != 0
    records = re.split(r"^(?=(?:DEBUG|INFO|WARNING|ERROR)\b)", done.stderr, flags=re.M)
    for said in ("sdpa.no_such_function", "no-such-page.md", "no-such-heading", "orphan.md"):
        levels = {r.split()[0] for r in records if said in r}
        assert levels & {"WARNING", "ERROR"}, f"{said}: not a warning ({levels}):\n{done.stderr}"


def test_the_benchmark_tables_are_what_the_results_give():
    """Regenerate every table from benchmarks/results and compare: a hand edit or a
    results file changed since fails here (fix: python scripts/bench_tables.py)."""
    tables = _tables()
    stale = tables.stale(tables.pages())
    assert not stale, f"stale benchmark tables {stale}: run python scripts/bench_tables.py"
    readme = (ROOT / "README.md").read_text()
    assert [n for n, _, _ in tables.regions(readme)] == ["headline"]
    headline = readme[slice(*tables.regions(readme)[0][1:])]
    rows = [line for line in headline.splitlines() if line.startswith("| ")]
    assert 2 <= len(rows) - 1 <= 8, f"the headline table has {len(rows) - 1} rows (at most 8)"
    bench = (GUIDES / "benchmarks.md").read_text()
    assert len(tables.regions(bench)) >= 12


def test_no_table_on_the_benchmarks_page_is_typed_by_hand():
    """Every table row of docs/guide/benchmarks.md lies between generated markers."""
    tables = _tables()
    text = (GUIDES / "benchmarks.md").read_text()
    inside = [range(s, e) for _, s, e in tables.regions(text)]
    offset = 0
    for n, line in enumerate(text.splitlines(keepends=True), start=1):
        if line.startswith("|"):
            assert any(offset in r for r in inside), (
                f"benchmarks.md line {n} is a table typed by hand"
            )
        offset += len(line)


def _copy_pages(tmp_path: Path) -> list[Path]:
    out = []
    for page in _tables().pages():
        copy = tmp_path / page.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(page.read_text())
        out.append(copy)
    return out


def test_a_hand_edited_table_is_caught(tmp_path):
    tables = _tables()
    pages = _copy_pages(tmp_path)
    bench = next(p for p in pages if p.name == "benchmarks.md")
    text = bench.read_text()
    edited = re.sub(r"\| 0\.186 \|", "| 0.150 |", text, count=1)  # a better ratio, by hand
    assert edited != text, "the masks table's sliding-window ratio was not found"
    bench.write_text(edited)
    assert tables.stale(pages) == [f"{bench}: table masks"]


def test_a_stale_table_is_caught_after_the_results_change(tmp_path):
    """A new results file (one median changed) makes the committed tables stale, and
    regenerating them writes the new figure."""
    tables = _tables()
    results = tmp_path / "results"
    shutil.copytree(tables.RESULTS, results)
    data = json.loads((results / "core.json").read_text())
    ours = next(r for r in data["results"] if r["case"] == "unet float32 weights" and r["peer"])
    ours["ratio"] = 0.4321
    (results / "core.json").write_text(json.dumps(data))
    pages = [tables.ROOT / "README.md", GUIDES / "benchmarks.md"]
    stale = tables.stale(pages, results)
    assert sorted(stale) == ["README.md: table headline", "docs/guide/benchmarks.md: table core"]
    assert "| 0.432 |" in tables.render(pages[1].read_text(), results)
    assert "| 0.43x |" in tables.render(pages[0].read_text(), results)


def test_a_table_refuses_an_unknown_name_or_case(tmp_path):
    tables = _tables()
    with pytest.raises(KeyError, match="no table named 'nope'"):
        tables.render("<!-- bench:nope -->\n<!-- /bench:nope -->\n")
    with pytest.raises(ValueError, match="no closing"):
        tables.render("<!-- bench:core -->\n")
    with pytest.raises(KeyError, match="no case"):
        tables.comparisons("core.json", ["no such case"])(tables.RESULTS)
