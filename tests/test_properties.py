"""Property tests: random shapes, dtypes and masks; the backends agree with the oracle."""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engines import BACKEND_ENGINES, refusal, run
from sdpa import masks

from oracle import oracle


@st.composite
def cases(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 3))
    Hq = Hkv * draw(st.integers(1, 3))
    L, S = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    E, Ev = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    causal = draw(st.booleans()) and L == S
    scale = draw(st.one_of(st.none(), st.floats(0.01, 1.0)))
    seed = draw(st.integers(0, 2**31 - 1))
    return B, Hq, Hkv, L, S, E, Ev, mask_kind, causal, scale, seed


@settings(max_examples=60, deadline=None)
@given(cases())
def test_backends_agree_with_oracle(case):
    B, Hq, Hkv, L, S, E, Ev, mask_kind, causal, scale, seed = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, E, generator=g)
    k, v = torch.randn(B, Hkv, S, E, generator=g), torch.randn(B, Hkv, S, Ev, generator=g)
    mask = {
        "none": None,
        "bool": torch.rand(B, 1, L, S, generator=g) < 0.6,
        "float": torch.randn(L, S, generator=g),
    }[mask_kind]
    ref_out, ref_p = oracle(q, k, v, mask, causal=causal, scale=scale)
    ran = []
    for engine in BACKEND_ENGINES:
        if refusal(engine, q, k, v, mask, causal=causal, scale=scale):
            continue
        ran.append(engine)
        out, w, reads = run(engine, q, k, v, mask, causal=causal, scale=scale)
        with reads:
            p = w.full()
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
        torch.testing.assert_close(p.double(), ref_p, atol=2e-5, rtol=0)
        # output is the weights times value; each row sums to 1, or 0 if it sees no key
        vv = v.repeat_interleave(Hq // Hkv, dim=1)
        torch.testing.assert_close(out, p @ vv, atol=2e-5, rtol=0)
        sums = p.sum(-1)
        assert torch.all(((sums - 1).abs() < 1e-5) | (sums == 0))
    assert len(ran) >= 2, f"only {ran} took these inputs: nothing to agree with"


# Sizes on and beside the engine's block edges (BLOCK_Q = 256 queries, BLOCK_K = 64 keys),
# so block skipping runs with diagonals, windows, lengths and documents on the edges.
EDGES = [1, 63, 64, 65, 127, 128, 255, 256, 257, 320, 511, 512, 513]
N = 600  # the largest L or S drawn


def near_edges(lo, hi):
    """An int in [lo, hi], often on or beside a block edge."""
    edges = [n for n in EDGES if lo <= n <= hi]
    return st.sampled_from(edges) | st.integers(lo, hi) if edges else st.integers(lo, hi)


@st.composite
def lengths(draw):
    """(L, S) with L < S, L > S and L == S; S - L = 1, 65 or -63 puts the bottom-right
    diagonal exactly on a key-block edge at the end of every query block."""
    L = draw(near_edges(1, N))
    beside = st.sampled_from([-65, -64, -63, -1, 0, 1, 63, 64, 65])  # S - L
    S = draw(near_edges(1, N) | beside.map(lambda d: min(N, max(1, L + d))))
    return L, S


def doc_ids(draw, n):
    """Sorted ids of packed documents over n positions, cut often on block edges."""
    cuts = draw(st.lists(near_edges(1, max(1, n - 1)), max_size=4))
    cuts = sorted({c for c in cuts if 0 < c < n})
    sizes = torch.diff(torch.tensor([0, *cuts, n]))
    return torch.repeat_interleave(torch.arange(len(sizes)), sizes)  # (n,)


@st.composite
def mask_trees(draw, L, S, depth=2):
    """A random structured mask over L queries and S keys."""
    kinds = ["causal", "window", "padding", "docs"] + ["and", "or"] * (depth > 0)
    kind = draw(st.sampled_from(kinds))
    align = draw(st.sampled_from(masks.ALIGNS))
    if kind == "causal":
        return masks.causal(align)
    if kind == "window":
        size = draw(near_edges(1, N) | st.sampled_from([S, S + 1]))
        return masks.sliding_window(size, align)
    if kind == "padding":
        edges = near_edges(0, S) | st.sampled_from([0, S])
        return masks.padding(draw(st.lists(edges, min_size=2, max_size=2)))
    if kind == "docs":  # packed documents of random lengths
        q_ids = doc_ids(draw, L)
        return masks.documents(q_ids, None if L == S and draw(st.booleans()) else doc_ids(draw, S))
    a, b = draw(mask_trees(L, S, depth=depth - 1)), draw(mask_trees(L, S, depth=depth - 1))
    return (a & b) if kind == "and" else (a | b)


@st.composite
def tree_cases(draw):
    L, S = draw(lengths())
    return L, S, draw(mask_trees(L, S)), draw(st.integers(0, 2**31 - 1))


def packed(*sizes):
    """ids of packed documents of these sizes: packed(2, 3) = [0, 0, 1, 1, 1]."""
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))


@settings(max_examples=40, deadline=None)
@given(tree_cases())
# every query block's last query sees exactly the first key of a key block (S - L = 65)
@example((256, 321, masks.sliding_window(100), 0))
# the window's far edge falls exactly on the first key of a key block, in a span
# otherwise FULL (a partial block elsewhere in the span would mask the whole span)
@example((512, 64, masks.sliding_window(511, "top-left"), 1))
# lengths beside and on key-block edges, alone (nothing else in the span to mask them)
@example((300, 321, masks.padding([127, 129]), 2))
@example((400, 321, masks.padding([128, 321]) | masks.causal("top-left"), 3))
# documents cut on query- and key-block edges, L != S
@example((513, 320, masks.documents(packed(256, 257), packed(64, 256)) & masks.causal(), 4))
def test_any_mask_tree_equals_its_materialised_twin(case):
    """Every backend that takes the mask (the fused one by block skipping) and the
    weights agree with the float64 oracle given the dense twin, for L != S and sizes on
    block edges."""
    L, S, mask, seed = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, L, 8, generator=g)
    k, v = (torch.randn(2, 2, S, 8, generator=g) for _ in range(2))
    twin = mask.materialize(L, S)
    ref_out, ref_p = oracle(q, k, v, twin)
    ran = []
    for engine in BACKEND_ENGINES:
        if refusal(engine, q, k, v, mask):
            continue
        ran.append(engine)
        out, w, reads = run(engine, q, k, v, mask)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0, msg=repr(mask))
        with reads:
            rows = w[:, :, ::37]
        torch.testing.assert_close(rows.double(), ref_p[:, :, ::37], atol=2e-5, rtol=0,
                                   msg=repr(mask))  # fmt: skip
    assert len(ran) >= 2, f"only {ran} took {mask!r}: nothing to agree with"


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 12),  # k
    st.sampled_from([1, 2, 3, 8, 64]),  # block
    st.integers(0, 3),  # blocks past 2k (the two-stage path starts there)
    st.sampled_from([0, 1, 5]),  # tail keys past the last block
    st.booleans(),  # a NaN row
    st.integers(0, 2**31 - 1),
)
@example(8, 64, 1, 0, False, 0)  # the default block, 16384-like rows on a block edge
@example(3, 2, 0, 1, True, 1)
def test_two_stage_top_keys_equal_torch_topk(k, block, extra, tail, nan_row, seed):
    """tile.top_keys is torch.topk over the keys (values and indices, largest first) on
    scores without ties, at the edge where it switches to two stages, with and without a
    tail block, a NaN row included (NaN first, as torch orders it)."""
    from sdpa import tile

    m = (2 * k + extra) * block + tail
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(2, 3, 5, m, generator=g)
    if nan_row:
        s[1, 2, 4, m // 2] = torch.nan
    values, indices = tile.top_keys(s, k, block)
    want_v, want_i = s.topk(k, dim=-1)
    torch.testing.assert_close(values, want_v, equal_nan=True, atol=0, rtol=0)
    assert torch.equal(indices, want_i)
