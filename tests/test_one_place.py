"""Each decision in one place (issue 34), held by reading the source.

- The softmax backward (dS = P (G - D)) and the dead-row rule (a row that sees no key:
  output 0, LSE 0; -inf to merge) are written in sdpa/tile.py alone: no other module
  multiplies the weights by a difference, or finds rows by -inf, or writes -inf into an
  LSE.
- Causality is a mask: the inputs record keeps no causal flag, and no backend or
  integration passes `causal=` / `is_causal=` by keyword (the fused kernels take the flag
  that masks.causal_flag derives from the mask, positionally).
- A tile size is chosen in tile.chunk_rows alone: no other module divides the settings'
  chunk_bytes.
deferred.py recognises eager attention code, whose ops it must name (isneginf among
them); it is the one module left out of the first rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sdpa.inputs import Inputs

SRC = Path(__file__).resolve().parents[1] / "src" / "sdpa"
HOME = SRC / "tile.py"
EAGER = {SRC / "integrations" / "deferred.py"}  # models eager code: names its ops


def _modules(*parts: str) -> list[Path]:
    root = SRC.joinpath(*parts)
    return sorted(root.rglob("*.py")) if root.is_dir() else [root]


def _name(node: ast.AST) -> str:
    """The last name of a Name or Attribute ('t.p' -> 'p'), else ''."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _weights(node: ast.AST) -> bool:
    """Whether node names the weights: p, or a call on them (p.mul_(d))."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return _weights(node.func.value)
    return _name(node) == "p"


def softmax_backwards(tree: ast.AST) -> list[int]:
    """Lines that compute P (G - D): p * (a - b), x.sub_(p.mul_(d)), or an addcmul of p
    (x - p d in one pass)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            sides = (node.left, node.right)
            if any(_weights(s) for s in sides) and any(
                isinstance(s, ast.BinOp) and isinstance(s.op, ast.Sub) for s in sides
            ):
                found.append(node.lineno)
        if (
            isinstance(node, ast.Call)
            and _name(node.func) == "sub_"
            and node.args
            and _weights(node.args[0])
        ):
            found.append(node.lineno)
        if (
            isinstance(node, ast.Call)
            and _name(node.func) in ("addcmul", "addcmul_")
            and any(_weights(a) for a in node.args)
        ):
            found.append(node.lineno)
    return found


def _is_minus_inf(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and (_name(node.operand) == "inf")
    )


def dead_row_rules(tree: ast.AST) -> list[int]:
    """Lines that find rows by -inf (isneginf) or write -inf into an LSE."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if _name(node.func) == "isneginf":
            found.append(node.lineno)
        if (
            _name(node.func) in ("masked_fill", "masked_fill_")
            and isinstance(node.func, ast.Attribute)
            and "lse" in _name(node.func.value)
            and any(_is_minus_inf(a) for a in node.args)
        ):
            found.append(node.lineno)
    return found


def causal_keywords(tree: ast.AST) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for kw in node.keywords
        if kw.arg in ("causal", "is_causal")
    ]


def budget_divisions(tree: ast.AST) -> list[int]:
    """Lines that divide a byte budget (chunk_bytes, or a name holding one) into rows."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.FloorDiv)
        and any(word in ast.unparse(node.left).lower() for word in ("chunk_bytes", "budget"))
    ]


def _hits(check, paths) -> dict[str, list[int]]:
    out = {}
    for path in paths:
        lines = check(ast.parse(path.read_text(), str(path)))
        if lines:
            out[str(path.relative_to(SRC))] = lines
    return out


def test_the_softmax_backward_and_the_dead_row_rule_live_in_tile():
    others = [p for p in _modules() if p != HOME and p not in EAGER]
    assert _hits(softmax_backwards, others) == {}
    assert _hits(dead_row_rules, others) == {}
    assert _hits(softmax_backwards, [HOME]), "the rule's home must hold it (the scan reads it)"
    assert _hits(dead_row_rules, [HOME])


def test_causality_is_a_mask():
    assert "causal" not in Inputs._fields
    paths = [*_modules("backends"), *_modules("integrations")]
    assert _hits(causal_keywords, [p for p in paths if p not in EAGER]) == {}


def test_a_tile_size_is_chosen_in_one_place():
    others = [p for p in _modules() if p != HOME]
    assert _hits(budget_divisions, others) == {}
    assert _hits(budget_divisions, [HOME])


@pytest.mark.parametrize(
    "source, check",
    [
        ("ds = p * (dp - delta)", softmax_backwards),
        ("ds = pg.sub_(t.p.mul_(d))", softmax_backwards),
        ("dead = torch.isneginf(s.amax(-1))", dead_row_rules),
        ("lse = lse.masked_fill(~alive, -torch.inf)", dead_row_rules),
        ("out = kernel(q, k, v, causal=True)", causal_keywords),
        ("step = settings.get().chunk_bytes // (B * S * 4)", budget_divisions),
        ("size = min(n, max(1, budget // (m * item))) * m", budget_divisions),
    ],
)
def test_the_scans_see_what_they_look_for(source, check):
    """Each scan finds the form it forbids (so the tests above can fail)."""
    assert check(ast.parse(source)) == [1]
