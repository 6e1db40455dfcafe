"""Each mask's analytic `blocks` held to its `keep`, with diagonals and lengths on block edges.

The contract (Mask.blocks): always sound, i.e. never FULL where a block holds a False and
never EMPTY where it holds a True (PARTIAL is always allowed); exact for causal,
sliding_window and padding, and for documents whose q_ids and k_ids are sorted and hold
the same ids. The truth is `masks.occupancy` of the materialised mask.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdpa import masks

# (bq, bk): 1, odd sizes, squares, bq < bk and bq > bk; the sweep over L, S in 1..13
# makes each divide some lengths and not others
BLOCKS = [(1, 1), (1, 3), (2, 2), (3, 2), (4, 4), (3, 5), (8, 3), (5, 8)]
LENGTHS = range(1, 14)


def truth(mask, L, S, bq, bk):
    """Exact occupancy from keep: (Bm, nQ, nK)."""
    keep = mask.materialize(L, S, max_bytes=None).reshape(mask.batch or 1, L, S)  # (Bm, L, S)
    return masks.occupancy(keep, bq, bk)


def check(mask, L, S, bq, bk, exact):
    got, want = mask.blocks(L, S, bq, bk), truth(mask, L, S, bq, bk)
    if got.dtype != torch.int8 or got.shape != want.shape:
        ok = False
    elif exact:
        ok = torch.equal(got, want)
    else:  # FULL only where FULL, EMPTY only where EMPTY
        ok = not (((got == masks.FULL) | (got == masks.EMPTY)) & (got != want)).any()
    if not ok:  # the message only on failure: printing tensors is slow
        kind = "equal" if exact else "be sound against"
        pytest.fail(f"{mask!r}.blocks({L}, {S}, {bq}, {bk}) must {kind} occupancy(keep)\n"
                    f"got {got.dtype}\n{got}\nwant\n{want}")  # fmt: skip


def band_masks(S, bk):
    """causal and windows of 1, 2, bk - 1, bk, bk + 1, S - 1, S, S + 1, both alignments."""
    sizes = sorted({n for n in (1, 2, bk - 1, bk, bk + 1, S - 1, S, S + 1) if n >= 1})
    for align in masks.ALIGNS:
        yield masks.causal(align)
        for size in sizes:
            yield masks.sliding_window(size, align)


def edge_lengths(S, bk):
    """Padding lengths on and beside every key-block edge, plus 0, S and S + 1."""
    edges = {0, S, S + 1} | {m * bk + d for m in range(S // bk + 2) for d in (-1, 0, 1)}
    return sorted(n for n in edges if 0 <= n <= S + 1)


@pytest.mark.parametrize("bq,bk", BLOCKS)
def test_band_blocks_equal_keep(bq, bk):
    """causal / sliding_window: every L != S both ways, so the diagonal p = i + S - L
    (bottom-right) or i (top-left) and each window's far edge land on block edges."""
    for L, S in itertools.product(LENGTHS, LENGTHS):
        for mask in band_masks(S, bk):
            check(mask, L, S, bq, bk, exact=True)


@pytest.mark.parametrize("bq,bk", BLOCKS)
def test_padding_blocks_equal_keep(bq, bk):
    for L, S in itertools.product((1, bq, bq + 1, 2 * bq + 1), LENGTHS):
        check(masks.padding(edge_lengths(S, bk)), L, S, bq, bk, exact=True)
        # padded queries: lengths on and beside the query blocks' edges too
        lengths = sorted(set(edge_lengths(S, bk)) | set(edge_lengths(L, bq)))
        check(masks.padding(lengths, queries=True), L, S, bq, bk, exact=True)


def sorted_ids(g, n, docs):
    """n sorted ids covering exactly 0..docs-1 (needs n >= docs)."""
    extra = torch.randint(0, docs, (n - docs,), generator=g)
    return torch.sort(torch.cat([torch.arange(docs), extra])).values


@pytest.mark.parametrize("bq,bk", BLOCKS)
def test_documents_blocks_exact_for_sorted_shared_ids(bq, bk):
    """Packed documents: each id's queries and keys contiguous, the same ids on both
    sides (self-attention, or a packed cross-attention) -> exact, batched or not."""
    g = torch.Generator().manual_seed(bq * 100 + bk)
    for L, S in itertools.product(LENGTHS, (1, 2, 5, 8, 9, 13)):
        for docs in sorted({1, min(2, L, S), min(L, S)}):
            q, k = sorted_ids(g, L, docs), sorted_ids(g, S, docs)
            check(masks.documents(q, k), L, S, bq, bk, exact=True)
            if L == S:
                check(masks.documents(q), L, S, bq, bk, exact=True)
            qb = torch.stack([q, sorted_ids(g, L, docs)])  # (2, L)
            kb = torch.stack([k, sorted_ids(g, S, docs)])  # (2, S)
            check(masks.documents(qb, kb), L, S, bq, bk, exact=True)


@pytest.mark.parametrize("bq,bk", BLOCKS)
def test_documents_blocks_sound_for_any_ids(bq, bk):
    """Unsorted ids, ids on one side only, batched: never wrong, PARTIAL when unsure."""
    g = torch.Generator().manual_seed(bq * 100 + bk + 1)
    for L, S in itertools.product(LENGTHS, (1, 3, 8, 13)):
        for _ in range(3):
            q = torch.randint(0, 4, (2, L), generator=g)
            k = torch.randint(0, 4, (2, S), generator=g)
            check(masks.documents(q, k), L, S, bq, bk, exact=False)
            check(masks.documents(q[0], k[0] + 2), L, S, bq, bk, exact=False)


def test_empty_sizes():
    """L or S of 0: no blocks, nothing to answer, no error."""
    for mask in (masks.causal(), masks.sliding_window(3), masks.padding([0, 2])):
        for L, S in ((0, 5), (5, 0), (0, 0)):
            check(mask, L, S, 2, 3, exact=True)
            base = masks.Mask.blocks(mask, L, S, 2, 3)  # the generic answer, from keep
            assert torch.equal(base, truth(mask, L, S, 2, 3)), (mask, L, S)
    docs = masks.documents(torch.zeros(0, dtype=torch.long), torch.zeros(5, dtype=torch.long))
    check(docs, 0, 5, 2, 3, exact=True)


@st.composite
def leaves(draw, L, S, B):
    kind = draw(st.sampled_from(["causal", "window", "padding", "docs", "docs_batched"]))
    align = draw(st.sampled_from(masks.ALIGNS))
    if kind == "causal":
        return masks.causal(align)
    if kind == "window":
        return masks.sliding_window(draw(st.integers(1, S + 2)), align)
    if kind == "padding":
        lengths = draw(st.lists(st.integers(0, max(L, S) + 1), min_size=B, max_size=B))
        return masks.padding(lengths, queries=draw(st.booleans()))
    ids = st.integers(0, 3)
    if kind == "docs":
        q = draw(st.lists(ids, min_size=L, max_size=L))
        k = draw(st.lists(ids, min_size=S, max_size=S))
        return masks.documents(sorted(q) if draw(st.booleans()) else q, sorted(k))
    q = draw(st.lists(st.lists(ids, min_size=L, max_size=L), min_size=B, max_size=B))
    k = draw(st.lists(st.lists(ids, min_size=S, max_size=S), min_size=B, max_size=B))
    return masks.documents(q, k)


@st.composite
def trees(draw, L, S, B, depth=3):
    if depth == 0 or draw(st.booleans()):
        return draw(leaves(L, S, B))
    a, b = draw(trees(L, S, B, depth - 1)), draw(trees(L, S, B, depth - 1))
    return (a & b) if draw(st.booleans()) else (a | b)


@st.composite
def tree_cases(draw):
    L, S = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    bq, bk = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    return draw(trees(L, S, B=2)), L, S, bq, bk


@settings(max_examples=300, deadline=None)
@given(tree_cases())
def test_mask_trees_blocks_are_sound(case):
    """& and | of any masks, batched or not: the analytic blocks are never wrong."""
    mask, L, S, bq, bk = case
    check(mask, L, S, bq, bk, exact=False)


@pytest.mark.parametrize("op", ["and", "or"])
def test_combined_blocks_equal_keep_where_one_side_decides(op):
    """A & everything and A | nothing are A, block for block: the combination passes
    its children's answers through rather than only never being wrong."""
    for L, S, (bq, bk) in itertools.product((5, 9), (4, 11), BLOCKS):
        for mask in band_masks(S, bk):
            other = masks.padding([S, S]) if op == "and" else masks.padding([0, 0])
            combined = (mask & other) if op == "and" else (mask | other)
            check(combined, L, S, bq, bk, exact=True)
