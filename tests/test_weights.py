"""AttentionWeights: shape, dtype, dense values and the never-stale guarantee."""

from __future__ import annotations

import pytest
import torch

import sdpa

from conftest import make_inputs
from oracle import oracle


def test_shape_dtype_repr(gen):
    q, k, v, _ = make_inputs(gen, Hq=4, Hkv=2, L=5, S=9, dtype=torch.bfloat16)
    w = sdpa.attention(q, k, v).weights
    assert w.shape == torch.Size([2, 4, 5, 9]) and w.dtype == torch.float32
    assert repr(w) == "AttentionWeights(shape=(2, 4, 5, 9), dtype=torch.float32, lazy)"
    assert w.lse.shape == (2, 4, 5)


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_lse_is_the_log_sum_exp_of_the_scores(gen, backend):
    q, k, v, mask = make_inputs(gen, L=13, S=17, mask_kind="float")
    w = sdpa.attention(q, k, v, mask, backend=backend).weights
    scores = q.double() @ k.double().mT / 4 + mask.double()
    torch.testing.assert_close(w.lse.double(), scores.logsumexp(-1), atol=1e-5, rtol=0)


def test_rows_sum_to_one_or_zero(gen):
    q, k, v, mask = make_inputs(gen, L=40, S=50, mask_kind="dead_rows")
    p = sdpa.attention(q, k, v, mask).weights.full()
    sums = p.sum(-1)
    dead = ~mask.any(-1)
    torch.testing.assert_close(sums[~dead], torch.ones_like(sums[~dead]), atol=1e-5, rtol=0)
    assert torch.equal(sums[dead], torch.zeros_like(sums[dead]))


def test_weights_are_detached(gen):
    q, k, v, _ = make_inputs(gen)
    q.requires_grad_(True)
    out, w = sdpa.attention(q, k, v)
    assert out.requires_grad and not w.full().requires_grad


@pytest.mark.parametrize("which", ["query", "key", "mask"])
def test_in_place_change_after_the_call_is_refused(gen, which):
    q, k, v, mask = make_inputs(gen, mask_kind="bool")
    w = sdpa.attention(q, k, v, mask).weights
    w.full()  # fine before the change
    changed = {"query": q, "key": k, "mask": mask}[which]
    changed.copy_(changed.clone())  # same values, but written in place
    with pytest.raises(
        sdpa.StaleWeightsError,
        match=rf"{which} changed in place after the "
        r"attention call",
    ):
        w.full()
    with pytest.raises(sdpa.StaleWeightsError):
        _ = w.lse


def test_value_change_and_copies_do_not_go_stale(gen):
    q, k, v, _ = make_inputs(gen)
    w = sdpa.attention(q, k, v).weights
    v.mul_(2)  # weights do not depend on value
    ref = oracle(q, k, v)[1]
    torch.testing.assert_close(w.full().double(), ref, atol=2e-5, rtol=0)


def test_kv_cache_view_goes_stale(gen):
    """A key that is a view into a cache sees the cache's in-place writes."""
    cache = torch.randn(1, 2, 16, 8, generator=gen)
    q = torch.randn(1, 2, 1, 8, generator=gen)
    w = sdpa.attention(q, cache[:, :, :4], cache[:, :, :4]).weights
    cache[:, :, 4] = 1.0  # append the next token in place
    with pytest.raises(sdpa.StaleWeightsError):
        w.full()


INDICES = [
    (0,),
    (1, 2),
    (0, slice(None), 5),
    (0, 1, slice(10, 20)),
    (slice(None), slice(1, 4, 2), slice(3, 30, 7)),
    (-1, -2, -3),
    (Ellipsis, 4, slice(None)),
    (1, Ellipsis, slice(2, 9)),
    (0, 3, 7, slice(5, 11)),  # a key-dim index applies to the computed rows
    (slice(None), slice(None), slice(0, 0)),
]


@pytest.mark.parametrize("index", INDICES, ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "key_padding", "dead_rows"])
@pytest.mark.parametrize("causal", [False, True])
def test_rows_on_demand_equal_the_dense_weights(gen, index, mask_kind, causal):
    q, k, v, mask = make_inputs(gen, Hq=6, Hkv=2, L=33, S=33, mask_kind=mask_kind)
    w = sdpa.attention(q, k, v, mask, causal=causal).weights
    dense = oracle(q, k, v, mask, causal=causal)[1]
    got = w[index]
    assert got.shape == dense[index].shape
    torch.testing.assert_close(got.double(), dense[index], atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "shapes,index",
    [
        (((5, 8), (7, 8)), (slice(1, 3),)),  # 2-D: (L, S)
        (((3, 5, 8), (1, 7, 8)), (2, 4)),  # 3-D: (N, L, S), key broadcast over N
        (((2, 3, 4, 5, 8), (1, 3, 2, 7, 8)), (1, slice(None), 3, 0)),  # 5-D with GQA
        (((2, 3, 4, 5, 8), (1, 3, 2, 7, 8)), (Ellipsis, 4, slice(None))),
    ],
    ids=str,
)
def test_rows_on_demand_any_rank(gen, shapes, index):
    (qs, ks) = shapes
    q, k = torch.randn(*qs, generator=gen), torch.randn(*ks, generator=gen)
    w = sdpa.attention(q, k, k).weights
    dense = oracle(q, k, k)[1]
    torch.testing.assert_close(w[index].double(), dense[index], atol=2e-5, rtol=0)


def test_one_row_costs_one_row(gen):
    """w[0, :, 5] on a long sequence must not build the L x S matrix."""
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=4096, S=4096, E=8)
    w = sdpa.attention(q, k, v).weights
    row = w[0, :, 5]
    assert row.shape == (2, 4096)
    ref = torch.softmax(q[0, :, 5:6].double() @ k[0].double().mT / 8**0.5, -1)[:, 0]
    torch.testing.assert_close(row.double(), ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "index,exc,pattern",
    [
        ((0, 0, 0, 0, 0), IndexError, r"too many indices for weights of shape \(2, 3, 7, 9\)"),
        ((2,), IndexError, r"index 2 is out of bounds for dim 0 with size 2"),
        ((0, None), TypeError, r"takes ints, slices and '...' .* got NoneType for dim 1"),
        ((torch.tensor([0]),), TypeError, r"got Tensor for dim 0"),
        ((slice(None, None, -1),), ValueError, r"slice step must be positive, got -1"),
        ((Ellipsis, Ellipsis), IndexError, r"single ellipsis"),
    ],
)
def test_bad_indices(gen, index, exc, pattern):
    q, k, v, _ = make_inputs(gen)
    w = sdpa.attention(q, k, v).weights
    with pytest.raises(exc, match=pattern):
        w[index]
