"""Every oracle file takes its engines from tests/engines.py, and engines.py from the registry.

A backend added to sdpa.backends.PRIORITY must run in every oracle matrix without an edit
to any test. So no test file lists backends by name (a list of them leaves the new one
out, silently), and engines.py's engines hold every backend of the registry. A test that
checks one backend's own behaviour (backend="fused") names it; that is no list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import engines
import sdpa.backends
from engines import refusal
from sdpa.backends import Backend

from conftest import make_inputs

TESTS = Path(__file__).parent
# (file, function) -> why it lists backends by name; engines.py is the one place that may
ALLOWED = {
    ("test_backends.py", "test_auto_prefers_fused_and_falls_to_reference_for_dropout"): (
        "auto's order is a decision made where a backend is added (CONTRIBUTING, Adding a "
        "backend: put it in PRIORITY where auto should try it): the test pins it"
    ),
}


def registry() -> list[str]:
    """The backends' names, read from the registry now (BACKENDS and PRIORITY)."""
    names = [*sdpa.backends.BACKENDS, *(b.name for b in sdpa.backends.PRIORITY)]
    return list(dict.fromkeys(names))


def _named(node: ast.AST, names: set[str], aliases: dict[str, ast.AST]) -> str | None:
    """The backend a literal's element names: a string constant, pytest.param's value, or
    a module-level name bound to either (SMALL = pytest.param("small", ...))."""
    if isinstance(node, ast.Name) and node.id in aliases:
        node = aliases[node.id]
    if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "param" and node.args:
        node = node.args[0]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
        return node.value
    return None


def _aliases(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level NAME = value assignments (a single target)."""
    return {
        node.targets[0].id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
    }


class _Lists(ast.NodeVisitor):
    """Collects (line, enclosing function, sorted names) of each listing of backends."""

    def __init__(self, names: set[str], aliases: dict[str, ast.AST]):
        self.names, self.aliases = names, aliases
        self.where, self.found = ["<module>"], {}

    def _name(self, node: ast.AST) -> str | None:
        return _named(node, self.names, self.aliases)

    def _add(self, node: ast.AST, hits: set[str]) -> None:
        if len(hits) >= 2:
            self.found.setdefault(node.lineno, (node.lineno, self.where[-1], sorted(hits)))

    def visit_FunctionDef(self, node):  # (decorators count as the function's)
        self.where.append(node.name)
        self.generic_visit(node)
        self.where.pop()

    visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

    def _literal(self, node, elements):
        self._add(node, {n for e in elements if (n := self._name(e))})
        self.generic_visit(node)

    def visit_List(self, node):
        self._literal(node, node.elts)

    def visit_Tuple(self, node):
        self._literal(node, node.elts)

    def visit_Set(self, node):
        self._literal(node, node.elts)

    def visit_Dict(self, node):
        self._literal(node, [key for key in node.keys if key is not None])

    def visit_Call(self, node):
        if getattr(node.func, "attr", None) == "parametrize":  # argvalues at any depth, ids
            values = [*node.args[1:], *(kw.value for kw in node.keywords)]
            self._add(
                node,
                {n for value in values for sub in ast.walk(value) if (n := self._name(sub))},
            )
        self.generic_visit(node)


def listed(source: str, names) -> list[tuple[int, str, list[str]]]:
    """(line, enclosing function, names) of each list, tuple, set or dict literal, and
    each pytest.mark.parametrize argument list, in `source` holding two or more of
    `names` as string constants (or pytest.param values)."""
    tree = ast.parse(source)
    visitor = _Lists(set(names), _aliases(tree))
    visitor.visit(tree)
    return sorted(visitor.found.values())


def listings(names) -> dict[tuple[str, str], list[str]]:
    """Every listing of `names` in tests/*.py but engines.py: {(file, function): lines}."""
    out: dict[tuple[str, str], list[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        if path == TESTS / "engines.py":
            continue
        where = str(path.relative_to(TESTS))
        for line, function, hits in listed(path.read_text(), names):
            out.setdefault((where, function), []).append(f"{where}:{line} ({function}): {hits}")
    return out


def unlisted(names, listed_engines=None) -> list[str]:
    """The backends of `names` that tests/engines.py's ENGINES lacks."""
    listed_engines = engines.ENGINES if listed_engines is None else listed_engines
    return [name for name in names if name not in listed_engines]


def test_no_test_file_lists_backends_by_name():
    found = listings(registry())
    wrong = [line for key, lines in found.items() if key not in ALLOWED for line in lines]
    assert not wrong, (
        "these list backends by name, so a backend added to the registry would not run "
        "there: take the engines from tests/engines.py (ENGINES, BACKEND_ENGINES) and skip "
        "what one refuses with engines.skip_refused / refusal:\n" + "\n".join(wrong)
    )
    stale = [f"{file}::{function}" for file, function in ALLOWED if (file, function) not in found]
    assert not stale, f"ALLOWED names a listing that is gone: {stale}"


def test_engines_hold_every_backend_of_the_registry():
    assert not unlisted(registry()), (
        f"tests/engines.py's ENGINES {engines.ENGINES} lack {unlisted(registry())}: "
        f"derive them from sdpa.backends.PRIORITY"
    )
    assert engines.BACKEND_ENGINES == tuple(b.name for b in sdpa.backends.PRIORITY)
    for engine in engines.KERNEL_ENGINES:  # not backends, each runs one's forward
        assert engine not in registry() and engines.backend_of(engine) in registry()


def test_every_engine_takes_plain_inputs_here(gen):
    """The oracle files skip what an engine refuses, in its words: an engine refusing
    plain inputs here would be skipped everywhere. float32 on CPU, a bool mask, sizes
    within the small backend's thresholds: every engine runs them, on its own backend
    (the small one too, which the suite turns off: conftest; engines.run turns it on)."""
    q, k, v, mask = make_inputs(gen, L=7, S=9, mask_kind="bool")
    refused = {e: why for e in ("auto", *engines.ENGINES) if (why := refusal(e, q, k, v, mask))}
    assert not refused
    for engine in engines.ENGINES:
        _, w, _ = engines.run(engine, q, k, v, mask)
        assert w.served_by.split(":")[0] == engines.backend_of(engine), w.served_by


class _Toaster(Backend):
    name = "toaster"

    def not_supported_reasons(self, inputs):
        return ["inputs on a toaster"]


def test_a_backend_added_to_the_registry_is_seen_by_both_checks(monkeypatch):
    """A new registry entry: engines.py, imported before it, lacks it, and a file that
    lists it beside another backend is found."""
    toaster, before = _Toaster(), registry()
    monkeypatch.setitem(sdpa.backends.BACKENDS, toaster.name, toaster)
    monkeypatch.setattr(sdpa.backends, "PRIORITY", (*sdpa.backends.PRIORITY, toaster))
    assert unlisted(registry()) == ["toaster"]
    assert unlisted(registry(), (*engines.ENGINES, "toaster")) == []
    source = (
        "import pytest\n\n\n"
        '@pytest.mark.parametrize("backend", ["fused", "toaster"])\n'
        "def test_new(backend):\n"
        "    pass\n"
    )
    assert listed(source, registry()) == [(4, "test_new", ["fused", "toaster"])]
    assert listed(source, before) == []  # the registry before it: one backend


# sources over the made-up backends alpha, beta, gamma: (source, lines found)
CASES = [
    ('B = ["alpha", "beta"]', [1]),
    ('B = ("alpha", "gamma", "other")', [1]),
    ('B = {"beta", "gamma"}', [1]),
    ('B = {"alpha": 1, "beta": 2}', [1]),
    ('B = [pytest.param("alpha", marks=m), "beta"]', [1]),
    ('A = pytest.param("alpha", marks=m)\nB = [A, "beta"]', [2]),
    ('@pytest.mark.parametrize("b,x", [("alpha", 1), ("beta", 2)])\ndef t(b, x): ...', [1]),
    ('@pytest.mark.parametrize("b", X, ids=["alpha", "beta"])\ndef t(b): ...', [1]),
    ('def t(b):\n    for b in ("alpha", "beta"):\n        f(b)', [2]),
    ('if engine in ("alpha", "beta"): pass', [1]),
    # a single backend's behaviour, the engines of engines.py, a list of one backend
    ('f(backend="alpha"); g(backend="beta")', []),
    ('B = ("auto", *BACKEND_ENGINES)', []),
    ('B = ["alpha", "triton"]', []),
    ('B = ["alpha", "alpha"]', []),
    ('@pytest.mark.parametrize("b", ["auto", "alpha"])\ndef t(b): ...', []),
]


@pytest.mark.parametrize("source, lines", CASES)
def test_the_scan_finds_each_kind_of_listing(source, lines):
    found = listed(source, ["alpha", "beta", "gamma"])
    assert [line for line, _, _ in found] == lines, found


def test_a_list_spelled_from_the_registry_is_found():
    """Every test file parses, and the list a file would once have kept (every backend
    of the registry, spelled out) is found at module level."""
    for path in TESTS.rglob("*.py"):
        ast.parse(path.read_text())
    spelled = f"BACKENDS = {list(registry())!r}"
    assert listed(spelled, registry()) == [(1, "<module>", sorted(registry()))]
