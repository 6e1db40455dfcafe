"""CONTRIBUTING.md's layout map says where everything is: every module and package under
src/sdpa is in it, and it names nothing that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "sdpa"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"


def parse_map(text: str) -> dict[str, str]:
    """{path under src/sdpa ("backends/", "backends/fused.py"): its description} from the
    fenced block that starts with `src/sdpa/`: two spaces of indent per level, a name
    (a trailing / for a folder), then the description."""
    blocks = re.findall(r"^```[^\n]*\n(src/sdpa/\n.*?)^```", text, re.M | re.S)
    assert len(blocks) == 1, (
        f"expected one layout block starting with src/sdpa/, found {len(blocks)}"
    )
    entries, parents = {}, []
    for n, line in enumerate(blocks[0].splitlines()[1:], start=2):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        assert indent % 2 == 0 and indent >= 2, f"map line {n}: indent {indent}: {line!r}"
        depth = indent // 2 - 1
        assert depth <= len(parents), f"map line {n} is indented under no folder: {line!r}"
        name, _, description = line.strip().partition(" ")
        parents[depth:] = [name] if name.endswith("/") else []
        path = "".join(parents[:depth]) + name
        assert description.strip(), f"map line {n}: {name} has no description"
        assert path not in entries, f"map line {n}: {path} is listed twice"
        entries[path] = description.strip()
    return entries


def modules(root: Path = PACKAGE) -> set[str]:
    """Every .py file and every package folder under root, as the map writes them."""
    found = set()
    for path in root.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(root)
        found.add(rel.as_posix())
        found.update(f"{parent.as_posix()}/" for parent in rel.parents if parent != Path("."))
    return found


def test_every_module_is_in_the_map_and_the_map_names_only_what_exists():
    entries = parse_map(CONTRIBUTING.read_text())
    missing = sorted(modules() - set(entries))
    assert not missing, f"CONTRIBUTING.md's layout map misses {missing}: add a line for each"
    ghosts = sorted(p for p in entries if not (PACKAGE / p).exists())
    assert not ghosts, f"CONTRIBUTING.md's layout map names {ghosts}, which do not exist"


def test_the_parser_reads_folders_and_refuses_a_bad_map(tmp_path):
    good = (
        "```\nsrc/sdpa/\n  a.py      one\n  pkg/      two\n    b.py    three\n  c.py  four\n```\n"
    )
    assert parse_map(good) == {"a.py": "one", "pkg/": "two", "pkg/b.py": "three", "c.py": "four"}
    for bad, why in [
        ("```\nsrc/sdpa/\n  a.py\n```\n", "no description"),
        ("```\nsrc/sdpa/\n  a.py  x\n  a.py  y\n```\n", "twice"),
        ("```\nsrc/sdpa/\n  a.py  x\n    b.py  y\n```\n", "under no folder"),
    ]:
        try:
            parse_map(bad)
        except AssertionError as e:
            assert why in str(e), (bad, e)
        else:
            raise AssertionError(f"parse_map accepted {bad!r}")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "b.py").write_text("")
    (tmp_path / "a.py").write_text("")
    assert modules(tmp_path) == {"a.py", "pkg/", "pkg/b.py"}
