"""Tiles that span batch elements (sdpa.rows.tiles): consecutive elements that read the
same rows and keys share one tile, as many as fit in 1 / rows.RUN of the budget, so a
batch of short rows costs a few tiles' ops, not a dozen per element. Every read and
gradient (q, k, a float mask broadcast over the batch, sinks) equals the same read with
one tile per element (the grouping turned off), over runs of alike and unalike
elements, padded or not, causal, GQA, and budgets that cut a run short. A property test
(hypothesis), not examples."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import sdpa
from sdpa import masks, rows
from sdpa import settings as sdpa_settings

KINDS = ["none", "padding bool", "padding() & causal", "float (1,H,L,S)", "sinks"]


@st.composite
def cases(draw):
    B = draw(st.integers(2, 5))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.integers(1, 2))
    S = draw(st.integers(2, 12))
    kind = draw(st.sampled_from(KINDS))
    L = S if "causal" in kind else draw(st.integers(1, 12))
    # few distinct lengths, so that runs of alike elements form and break
    lengths = [draw(st.sampled_from([S, S, max(1, S - 3)])) for _ in range(B)]
    teacher = [draw(st.sampled_from([S, max(1, S - 2)])) for _ in range(B)]
    per_tile = draw(st.integers(1, B))  # whole elements one tile may hold
    seed = draw(st.integers(0, 2**31 - 1))
    return B, Hq, Hkv, L, S, kind, (lengths, teacher), per_tile, seed


def _inputs(case):
    """(q, k, v, the teacher's q, u, the mask, the teacher's, the leaves): the teacher
    padded by lengths of its own (its key spans joined with the student's, `rows.joint`:
    the student's runs of alike elements need not be the teacher's)."""
    B, Hq, Hkv, L, S, kind, (lengths, teacher), _, seed = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, 8, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, S, 8, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, S, 8, generator=g)
    qt = torch.randn(B, Hq, L, 8, generator=g)
    u = torch.randn(B, Hq, 2, L, generator=g)
    leaves = [q, k]
    mask_t = None
    if kind == "padding bool":
        keep = torch.arange(S) < torch.tensor(lengths)[:, None]  # (B, S)
        mask = keep[:, None, None, :]
        mask_t = (torch.arange(S) < torch.tensor(teacher)[:, None])[:, None, None, :]
    elif kind == "padding() & causal":
        mask = masks.padding(lengths) & masks.causal()
        mask_t = masks.padding(teacher) & masks.causal()
    elif kind == "float (1,H,L,S)":  # one bias for every element: its gradient sums them
        mask = torch.randn(1, Hq, L, S, generator=g, requires_grad=True)
        leaves.append(mask)
    elif kind == "sinks":
        logits = torch.randn(Hq, 1, 1, generator=g, requires_grad=True)
        mask = masks.sinks(logits)
        leaves.append(logits)
    else:
        mask = None
    return q, k, v, qt, u, mask, mask if mask_t is None else mask_t, leaves


def _reads(w, t, u, B: int, L: int, S: int) -> dict[str, torch.Tensor]:
    k = min(3, S)
    qi = torch.arange(B * 3).view(B, 3) % L  # (B, P): pairs of their own per element
    kj = (torch.arange(B * 3).view(B, 3) * 5 + 1) % S
    return {
        "full": w.full(),
        "sum over queries": w.sum(dim=-2),
        "entropy": w.entropy(),
        "amax": w.amax(dim=-1),
        f"top-{k}": w.topk(k).values,
        "u @ w": u @ w,
        "kl": w.kl(t),
        "kl reverse": w.kl(t, reverse=True),
        "kl, dense target": w.kl(t.full().detach()),
        "score errors": w.score_errors(t),
        "pairs": w.pairs(qi, kj),
    }


def _run(case, grouped: bool):
    """(values, gradients of every leaf) of every read; tile count, tiles of > 1 element."""
    B, Hq, _, L, S, _, _, per_tile, _ = case
    q, k, v, qt, u, mask, mask_t, leaves = _inputs(case)
    element = Hq * L * S * 4  # bytes of one element's weights, every head
    real_alike = rows._alike
    before = rows.SPAN_MIN_SCORES
    rows.SPAN_MIN_SCORES = 0  # (key spans at these small sizes too)
    if not grouped:
        rows._alike = lambda r, a, b: False
    try:
        with sdpa_settings.override(chunk_bytes=per_tile * element * rows.RUN):
            w = sdpa.attention(q, k, v, mask).weights
            t = sdpa.attention(qt, k.detach(), v, mask_t).weights
            tiles = list(rows.tiles(w._every_row(), sdpa_settings.get().chunk_bytes))
            out = {}
            g = torch.Generator().manual_seed(1)
            for name, value in _reads(w, t, u, B, L, S).items():
                upstream = torch.rand(value.shape, generator=g)  # (differs per element)
                grads = torch.autograd.grad(
                    (value.nan_to_num(posinf=0.0) * upstream).sum(),
                    leaves,
                    allow_unused=True,
                    materialize_grads=True,
                )
                out[name] = (value.detach(), *grads)
    finally:
        rows._alike, rows.SPAN_MIN_SCORES = real_alike, before
    return out, (len(tiles), sum(t.nb > 1 for t in tiles))


@settings(max_examples=60, deadline=None)
@given(cases())
# a run of two alike elements whose teacher is padded only in the second: the teacher's
# mask is applied on the shared tile though its first element's span is full
@example((2, 2, 1, 5, 6, "padding bool", ([6, 6], [6, 4]), 2, 0))
def test_tiles_across_batch_elements_equal_one_tile_per_element(case):
    grouped, (count, _) = _run(case, grouped=True)
    alone, (count_alone, shared_alone) = _run(case, grouped=False)
    assert shared_alone == 0 and count <= count_alone
    for name in alone:
        whats = ("value", "dq", "dk", "d(mask or sinks)")
        for a, b, what in zip(grouped[name], alone[name], whats, strict=False):
            torch.testing.assert_close(
                a, b, atol=1e-6, rtol=1e-5, equal_nan=True, msg=f"{name}: {what}"
            )
        assert len(grouped[name]) == len(alone[name])


@pytest.mark.parametrize("per_tile, want", [(1, [1, 1, 1, 1, 1]), (2, [2, 1, 2]), (5, [3, 2])])
def test_runs_of_alike_elements_share_tiles_within_the_budget(per_tile, want):
    """Lengths [6, 6, 6, 4, 4]: the first three read alike (one key span), the last two;
    a budget of `per_tile` whole elements groups them as far as it holds them."""
    case = (5, 2, 1, 5, 6, "padding bool", ([6, 6, 6, 4, 4], [6] * 5), per_tile, 0)
    _, (count, _) = _run(case, grouped=True)
    q, k, v, _, _, mask, _, _ = _inputs(case)
    element = 2 * 5 * 6 * 4
    before = rows.SPAN_MIN_SCORES
    rows.SPAN_MIN_SCORES = 0
    try:
        with sdpa_settings.override(chunk_bytes=per_tile * element * rows.RUN):
            w = sdpa.attention(q, k, v, mask).weights
            tiles = list(rows.tiles(w._every_row(), sdpa_settings.get().chunk_bytes))
    finally:
        rows.SPAN_MIN_SCORES = before
    assert [t.nb for t in tiles] == want and count == len(want)
    assert [(t.b.start, t.b.stop) for t in tiles] == [(t.at_b.start, t.at_b.stop) for t in tiles]


def test_an_element_with_a_hole_in_its_span_keeps_its_own_tile():
    """Elements whose key span is the same but whose mask is not all True inside it (a
    hole) do not share a tile with open ones: those keep their tile without a mask."""
    keep = torch.ones(3, 6, dtype=torch.bool)
    keep[1, 2] = False  # element 1: span (0, 6), not full
    q, k, v = torch.randn(3, 2, 5, 8), torch.randn(3, 1, 6, 8), torch.randn(3, 1, 6, 8)
    before = rows.SPAN_MIN_SCORES
    rows.SPAN_MIN_SCORES = 0
    try:
        w = sdpa.attention(q, k, v, keep[:, None, None, :]).weights
        r = w._every_row()
        tiles = list(rows.tiles(r, sdpa_settings.get().chunk_bytes))
    finally:
        rows.SPAN_MIN_SCORES = before
    assert [t.nb for t in tiles] == [1, 1, 1]
    assert [rows.is_open(r, t) for t in tiles] == [True, False, True]
