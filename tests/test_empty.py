"""Empty and degenerate shapes behave as torch's SDPA does, in every call and statistic.

One dim at a time is 0 (B, Hq and Hkv, L, S, E, Ev): the drop-in gives torch's
output; `attention` gives the same output on every backend, and the weights object
answers every question with the shape a dense (*lead, L, S) tensor would give.
E = 0 means every score is 0 (an empty dot product): softmax is uniform over the keys
a query sees, and torch returns the mean of those values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sdpa
from engines import BACKEND_ENGINES, run_or_skip

from conftest import randn

# (B, Hq, Hkv, L, S, E, Ev)
SHAPES = {
    "B=0": (0, 2, 2, 3, 5, 4, 6),
    "H=0": (2, 0, 0, 3, 5, 4, 6),
    "L=0": (2, 2, 2, 0, 5, 4, 6),
    "S=0": (2, 2, 2, 3, 0, 4, 6),
    "E=0": (2, 2, 2, 3, 5, 0, 6),
    "Ev=0": (2, 2, 2, 3, 5, 4, 0),
    "E=0 GQA": (2, 4, 2, 3, 5, 0, 6),
}
MASKS = ["none", "bool", "float", "causal"]


def inputs(gen, shape, mask_kind):
    B, Hq, Hkv, L, S, E, Ev = shape
    q, k, v = randn(gen, B, Hq, L, E), randn(gen, B, Hkv, S, E), randn(gen, B, Hkv, S, Ev)
    mask = {
        "none": None,
        "causal": None,
        "bool": torch.rand(B, 1, L, S, generator=gen) < 0.6,
        "float": randn(gen, L, S),
    }[mask_kind]
    return q, k, v, mask


def expected_weights(q, k, mask, causal):
    """The dense weights in float64 with torch's semantics for empty dims."""
    _, Hq, L, E = q.shape
    S = k.shape[2]
    group = Hq // k.shape[1] if k.shape[1] else 1
    kk = k.double().repeat_interleave(group, dim=1)
    s = q.double() @ kk.mT * (1.0 / E**0.5 if E else 1.0)  # (B, Hq, L, S): 0 when E == 0
    if causal:
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -torch.inf)
    if mask is not None:
        s = s + mask.double() if mask.is_floating_point() else s.masked_fill(~mask, -torch.inf)
    return torch.softmax(s, dim=-1).nan_to_num(0.0) if S else s


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_drop_in_is_torch_on_empty_shapes(gen, name, mask_kind):
    q, k, v, mask = inputs(gen, SHAPES[name], mask_kind)
    causal = mask_kind == "causal"
    gqa = q.shape[1] != k.shape[1]
    theirs = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa)
    ours = sdpa.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("engine", ["auto", *BACKEND_ENGINES])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_attention_and_every_statistic_on_empty_shapes(gen, name, mask_kind, engine):
    q, k, v, mask = inputs(gen, SHAPES[name], mask_kind)
    B, Hq, _, L, S, _, Ev = SHAPES[name]
    causal = mask_kind == "causal" and L == S
    p = expected_weights(q, k, mask, causal)  # (B, Hq, L, S)
    out, w, reads = run_or_skip(engine, q, k, v, mask, causal=causal)
    group = Hq // k.shape[1] if k.shape[1] else 1
    want = p @ v.double().repeat_interleave(group, dim=1)  # (B, Hq, L, Ev)
    assert out.shape == (B, Hq, L, Ev)
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=0)

    with reads:  # the settings the engine's reads run under
        assert w.shape == (B, Hq, L, S)
        torch.testing.assert_close(w.full().double(), p, atol=1e-6, rtol=0)
        torch.testing.assert_close(w[...].double(), p, atol=1e-6, rtol=0)
        if B:
            torch.testing.assert_close(w[0].double(), p[0], atol=1e-6, rtol=0)
        assert w.lse.shape == (B, Hq, L)
        # (sums of up to L weights, from one fused call: float32 relative error)
        torch.testing.assert_close(w.sum(dim=-2).double(), p.sum(-2), atol=1e-6, rtol=2e-6)
        torch.testing.assert_close(
            w.mean(dim=-2).double(), p.sum(-2) / max(L, 1), atol=1e-6, rtol=2e-6
        )
        logp = p.log().nan_to_num(0.0, neginf=0.0)
        # (the entropy is lse - scale * q . PK in float32: a difference of two O(1) terms;
        # seed 1487052650 gives 1.27e-6 on Ev=0)
        torch.testing.assert_close(w.entropy().double(), -(p * logp).sum(-1), atol=4e-6, rtol=2e-6)
        amax = p.amax(-1) if S else torch.zeros(B, Hq, L, dtype=torch.float64)
        torch.testing.assert_close(w.amax(-1).double(), amax, atol=1e-6, rtol=0)
        for kk in {0, min(1, S), S}:
            values, indices = w.topk(kk)
            assert values.shape == indices.shape == (B, Hq, L, kk)
            torch.testing.assert_close(
                values.double(), p.topk(kk, dim=-1).values, atol=1e-6, rtol=0
            )
