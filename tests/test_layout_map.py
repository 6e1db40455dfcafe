"""CONTRIBUTING.md's maps say where everything is: every module and package under
src/sdpa is in the package's map, the map around it (tests/, benchmarks/, scripts/,
examples/) names what exists and, for each folder whose contents it lists, all of them;
the layer list holds src/sdpa's imports; and nothing in scripts/ imports from tests/."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "sdpa"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"


def tree_entries(lines: list[str], start: int, top: int) -> dict[str, str]:
    """{path: description} of a map's lines (numbered from `start`): two spaces of indent
    per level, `top` levels of indent at the top; a name, a trailing / for a folder."""
    entries, parents = {}, []
    for n, line in enumerate(lines, start=start):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        assert indent % 2 == 0 and indent >= 2 * top, f"map line {n}: indent {indent}: {line!r}"
        depth = indent // 2 - top
        assert depth <= len(parents), f"map line {n} is indented under no folder: {line!r}"
        name, _, description = line.strip().partition(" ")
        parents[depth:] = [name] if name.endswith("/") else []
        path = "".join(parents[:depth]) + name
        assert description.strip(), f"map line {n}: {name} has no description"
        assert path not in entries, f"map line {n}: {path} is listed twice"
        entries[path] = description.strip()
    return entries


def parse_map(text: str) -> dict[str, str]:
    """{path under src/sdpa ("backends/", "backends/fused.py"): its description} from the
    fenced block that starts with `src/sdpa/`: two spaces of indent per level, a name
    (a trailing / for a folder), then the description."""
    blocks = re.findall(r"^```[^\n]*\n(src/sdpa/\n.*?)^```", text, re.M | re.S)
    assert len(blocks) == 1, (
        f"expected one layout block starting with src/sdpa/, found {len(blocks)}"
    )
    return tree_entries(blocks[0].splitlines()[1:], start=2, top=1)


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


# ---- the map around the package: tests/, benchmarks/, scripts/, examples/ ...


def parse_around(text: str) -> dict[str, str]:
    """{path from the root ("scripts/", "scripts/gpu_check/gpu_bench.py", "tests/test_*.py"):
    its description} from the fenced block that starts with `tests/`: top-level entries
    unindented, two spaces of indent per level below; a name may be a glob."""
    blocks = re.findall(r"^```[^\n]*\n(tests/ .*?)^```", text, re.M | re.S)
    assert len(blocks) == 1, f"expected one map starting with tests/, found {len(blocks)}"
    return tree_entries(blocks[0].splitlines(), start=1, top=0)


def _contents(folder: Path) -> set[str]:
    """What a folder holds, as the map writes it (a trailing / for a folder), less
    caches and dot files."""
    return {
        p.name + "/" if p.is_dir() else p.name
        for p in folder.iterdir()
        if not p.name.startswith(".") and p.name != "__pycache__"
    }


def check_around(entries: dict[str, str], root: Path = ROOT) -> list[str]:
    """What is wrong with the map: an entry that names nothing, and, in each folder whose
    contents the map lists, anything it holds that no entry names."""
    problems = []
    for path in entries:
        found = list(root.glob(path.rstrip("/")))
        if not found or (path.endswith("/") and not all(p.is_dir() for p in found)):
            problems.append(f"{path} names nothing")
    for folder in {p for p in entries if p.endswith("/")}:
        children = [p[len(folder) :] for p in entries if p.startswith(folder) and p != folder]
        children = [c for c in children if c.count("/") <= int(c.endswith("/"))]
        if not children or not (root / folder).is_dir():
            continue  # a folder described, not listed
        for item in sorted(_contents(root / folder)):
            if not any(fnmatch.fnmatchcase(item, c) for c in children):
                problems.append(f"{folder}{item} is in no line of the map")
    return problems


def test_the_map_around_the_package_names_what_exists_and_lists_folders_in_full():
    problems = check_around(parse_around(CONTRIBUTING.read_text()))
    assert not problems, f"CONTRIBUTING.md's map of the repository: {problems}"


def test_the_map_around_the_package_catches_a_ghost_and_a_stray_file(tmp_path):
    text = (
        "```\ntests/  the suite\n  test_*.py  tests\n  zoo.py  the zoo\n"
        "scripts/  tools\n  gpu/  glue\n    a.py  one\nexamples/  described only\n```\n"
    )
    entries = parse_around(text)
    assert entries["scripts/gpu/a.py"] == "one" and entries["tests/test_*.py"] == "tests"
    for path in ("tests/test_a.py", "tests/zoo.py", "scripts/gpu/a.py", "examples/x.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert check_around(entries, tmp_path) == []
    (tmp_path / "scripts" / "stray.py").write_text("")
    (tmp_path / "tests" / "zoo.py").unlink()
    assert sorted(check_around(entries, tmp_path)) == [
        "scripts/stray.py is in no line of the map",
        "tests/zoo.py names nothing",
    ]


# ---- nothing in scripts/ imports from tests/


PATH_CALLS = {"join", "joinpath", "Path", "PurePath", "insert", "append", "chdir"}


def imports_from_tests(path: Path, tests: Path = ROOT / "tests") -> list[str]:
    """Where a Python file takes code from tests/: an import of `tests` or of a module
    that tests/ holds (zoo, oracle, conftest, ...), or a path into tests/ (the string
    "tests" or "tests/...") that it could put on sys.path or load."""
    local = {p.stem for p in tests.glob("*.py")} | {"tests"}
    tree = ast.parse(path.read_text(), str(path))
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [f"{path.name}:{node.lineno}: import {n}" for n in names
                  if n.split(".")[0] in local]  # fmt: skip
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            up = parent.get(node)
            func = up.func if isinstance(up, ast.Call) else None
            called = getattr(func, "attr", getattr(func, "id", None))
            as_path = re.fullmatch(r"(\./)?tests/[\w./-]*", node.value) or (
                node.value == "tests"  # a path's part: root / "tests", join(root, "tests")
                and ((isinstance(up, ast.BinOp) and isinstance(up.op, ast.Div))
                     or called in PATH_CALLS)
            )  # fmt: skip
            if as_path:
                found.append(f"{path.name}:{node.lineno}: the path {node.value!r}")
    return found


def test_nothing_in_scripts_imports_from_tests():
    """Runners that share code with the tests live beside them (tests/model_zoo.py,
    tests/tl_zoo.py): a tool in scripts/ that imports tests/ breaks when a test helper
    changes, and nothing runs it to notice."""
    found = [f for p in sorted((ROOT / "scripts").rglob("*.py")) for f in imports_from_tests(p)]
    assert not found, f"scripts/ imports from tests/: {found}"


def test_the_import_check_finds_each_way_in(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "zoo.py").write_text("")
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import sys\nfrom pathlib import Path\n"
        "sys.path.insert(0, str(Path(__file__).parents[1] / 'tests'))\n"
        "import zoo\nfrom tests.oracle import oracle\nload('tests/zoo.py')\n"
        "sys.path.append(os.path.join(ROOT, 'tests'))\n"
        "def f():\n    import zoo.sub as z\n"
    )
    found = sorted(f.split(": ", 1)[1] for f in imports_from_tests(bad, tests))
    assert found == [
        "import tests.oracle", "import zoo", "import zoo.sub", "the path 'tests'",
        "the path 'tests'", "the path 'tests/zoo.py'",
    ]  # fmt: skip
    good = tmp_path / "good.py"
    good.write_text(
        '"""Run it after tests/test_docs.py fails."""\nimport json\nimport sdpa\n'
        'count = {"tests": 2}\nprint(count["tests"], count.get("tests"))\n'
    )
    assert imports_from_tests(good, tests) == []


# ---- the layers: src/sdpa's imports against CONTRIBUTING.md's list


def parse_layers(text: str) -> dict[str, int]:
    """{name as the list writes it ("masks", "backends/", "__init__"): its layer} from
    the numbered list after "The layers, lowest first": `N. `name`, `name`: what`."""
    section = text[text.index("The layers, lowest first") :]
    section = section[: section.index("\n## ")]
    layers = {}
    for number, names in re.findall(r"^(\d+)\. ([^:\n]+):", section, re.M):
        for name in re.findall(r"`([^`]+)`", names):
            assert name not in layers, f"{name} is in layers {layers[name]} and {number}"
            layers[name] = int(number)
    assert layers, "no layer list found after 'The layers, lowest first'"
    return layers


def layer_of(module: str, layers: dict[str, int]) -> int | None:
    """The layer of a module path under src/sdpa ("backends/fused.py"): its own name's,
    else its top folder's."""
    top, _, rest = module.partition("/")
    return layers.get(f"{top}/") if rest else layers.get(module.removesuffix(".py"))


def _target(name: str, package: Path) -> str | None:
    """The file under package (as "a/b.py") that `import name` runs for an sdpa module."""
    parts = name.split(".")[1:]
    base = package.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if parts and path.is_file():
            return path.relative_to(package).as_posix()
    return "__init__.py" if not parts else None


def imports(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the sdpa modules it imports}, as paths under package, from every import
    statement that runs (at the top or in a function; not under `if TYPE_CHECKING`).
    `from sdpa.x import y` imports sdpa/x/y.py when there is one, else sdpa/x."""
    graph = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        skip = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        found = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert node.level == 0, f"{rel}: a relative import (write sdpa.{node.module})"
                names = [f"{node.module}.{a.name}" for a in node.names]
                names = [n if _target(n, package) else node.module for n in names]
            else:
                continue
            found |= {_target(n, package) for n in names if n.split(".")[0] == "sdpa"}
        graph[rel] = found - {None, rel}
    return graph


def check_layers(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    problems = [f"{m} is in no layer" for m in graph if layer_of(m, layers) is None]
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            here, there = layer_of(module, layers), layer_of(target, layers)
            if here is not None and there is not None and there > here:
                problems.append(f"{module} (layer {here}) imports {target} (layer {there})")
            if module in graph.get(target, ()) and module < target:
                problems.append(f"{module} and {target} import each other")
    return problems


def test_src_imports_follow_the_layers_of_contributing():
    """A file imports only from its own layer or those below, and no two import each
    other: where this fails, fix the import, or the list if the design changed."""
    problems = check_layers(imports(), parse_layers(CONTRIBUTING.read_text()))
    assert not problems, f"src/sdpa against CONTRIBUTING.md's layers: {problems}"


def test_the_layer_check_finds_an_upward_import_and_a_pair(tmp_path):
    pkg = tmp_path / "sdpa"
    (pkg / "backends").mkdir(parents=True)
    files = {
        "__init__.py": "from sdpa.functional import attention\n",
        "masks.py": "def f():\n    from sdpa import weights\n",  # upward, in a function
        "weights.py": "from sdpa import masks\nfrom sdpa.backends import fused\n",
        "functional.py": "import sdpa.weights\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from sdpa import view\n",  # not an import that runs
        "backends/__init__.py": "",
        "backends/fused.py": "from sdpa.backends import run\n",  # the registry: a pair
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    (pkg / "backends" / "__init__.py").write_text("from sdpa.backends.fused import F\n")
    layers = parse_layers(
        "The layers, lowest first:\n\n1. `masks`: m\n4. `backends/`: b\n5. `weights`: w\n"
        "6. `functional`: f\n8. `__init__`: i\n\n## Next\n"
    )
    graph = imports(pkg)
    assert graph["functional.py"] == {"weights.py"}
    assert graph["backends/fused.py"] == {"backends/__init__.py"}
    assert check_layers(graph, layers) == [
        "backends/__init__.py and backends/fused.py import each other",
        "masks.py (layer 1) imports weights.py (layer 5)",
        "masks.py and weights.py import each other",
    ]
