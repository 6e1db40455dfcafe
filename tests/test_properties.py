"""Property tests: random shapes, dtypes and masks; the backends agree with the oracle."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa
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
    for backend in ("fused", "reference"):
        out, w = sdpa.attention(q, k, v, mask, causal=causal, scale=scale, backend=backend)
        p = w.full()
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
        torch.testing.assert_close(p.double(), ref_p, atol=2e-5, rtol=0)
        # output is the weights times value; each row sums to 1, or 0 if it sees no key
        vv = v.repeat_interleave(Hq // Hkv, dim=1)
        torch.testing.assert_close(out, p @ vv, atol=2e-5, rtol=0)
        sums = p.sum(-1)
        assert torch.all(((sums - 1).abs() < 1e-5) | (sums == 0))


N = 600  # positions: enough for several 256 x 64 blocks, so block skipping really runs


@st.composite
def mask_trees(draw, depth=2):
    """A random structured mask over N queries and N keys."""
    kinds = ["causal", "window", "padding", "docs"] + ["and", "or"] * (depth > 0)
    kind = draw(st.sampled_from(kinds))
    if kind == "causal":
        return masks.causal(draw(st.sampled_from(masks.ALIGNS)))
    if kind == "window":
        return masks.sliding_window(draw(st.integers(1, 400)), draw(st.sampled_from(masks.ALIGNS)))
    if kind == "padding":
        return masks.padding(draw(st.lists(st.integers(0, N), min_size=2, max_size=2)))
    if kind == "docs":  # packed documents of random lengths
        cuts = sorted(draw(st.lists(st.integers(1, N - 1), max_size=4)))
        lengths = torch.diff(torch.tensor([0, *cuts, N]))
        return masks.documents(torch.repeat_interleave(torch.arange(len(lengths)), lengths))
    a, b = draw(mask_trees(depth=depth - 1)), draw(mask_trees(depth=depth - 1))
    return (a & b) if kind == "and" else (a | b)


@settings(max_examples=25, deadline=None)
@given(mask_trees(), st.integers(0, 2**31 - 1))
def test_any_mask_tree_equals_its_materialised_twin(mask, seed):
    """Block skipping, the reference backend and the weights agree with the dense twin."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, N, 8, generator=g) for _ in range(3))
    twin = mask.materialize(N, N)
    ref_out, ref_p = oracle(q, k, v, twin)
    for backend in ("fused", "reference"):
        out, w = sdpa.attention(q, k, v, mask, backend=backend)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
        torch.testing.assert_close(w[:, :, ::37].double(), ref_p[:, :, ::37], atol=2e-5, rtol=0)
