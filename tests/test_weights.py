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


def test_index_edge_cases(gen):
    import numpy as np

    q, k, v, _ = make_inputs(gen, Hq=4, Hkv=2, L=6, S=6)
    w = sdpa.attention(q, k, v).weights
    dense = w.full()
    assert w[:, 0:0].shape == (2, 0, 6, 6) and w[0, 2:2].shape == (0, 6, 6)
    torch.testing.assert_close(w[np.int64(1), torch.tensor(2)], dense[1, 2])
    torch.testing.assert_close(w[0, 1:3, 4], dense[0, 1:3, 4])  # heads across a group edge
    torch.testing.assert_close(w[0, 2:4, 4], dense[0, 2:4, 4])  # one whole group


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


def dense_stats(p: torch.Tensor, k: int):
    """The oracle's statistics of dense float64 weights p (..., L, S)."""
    plogp = torch.where(p > 0, p * p.log(), torch.zeros_like(p))
    values, _ = p.topk(k, dim=-1)
    return p.sum(-2), p.sum(-2) / p.shape[-2], -plogp.sum(-1), values


STAT_CASES = [
    dict(mask_kind="none"),
    dict(mask_kind="bool"),
    dict(mask_kind="float"),
    dict(mask_kind="float_inf"),
    dict(mask_kind="key_padding"),
    dict(mask_kind="dead_rows"),
    dict(mask_kind="none", causal=True),
    dict(mask_kind="bool", causal=True),
    dict(mask_kind="none", Hq=6, Hkv=2),
    dict(mask_kind="bool", Hq=6, Hkv=3, scale=0.7),
    dict(mask_kind="none", dtype=torch.bfloat16),
    dict(mask_kind="float", dtype=torch.float16),
    dict(mask_kind="none", scale=2.0),  # peaked rows: entropy cancels
]


@pytest.mark.parametrize("case", STAT_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("L,S", [(1, 1), (37, 53), (64, 64)])
def test_statistics_match_the_oracle(gen, case, L, S):
    case = dict(case)
    causal, scale = case.pop("causal", False), case.pop("scale", None)
    if causal and L != S:
        pytest.skip("causal needs L == S")
    q, k, v, mask = make_inputs(gen, L=L, S=S, E=40, **case)
    w = sdpa.attention(q, k, v, mask, causal=causal, scale=scale).weights
    ref_p = oracle(q, k, v, mask, causal=causal, scale=scale)[1]
    kk = min(5, S)
    ref_sum, ref_mean, ref_entropy, ref_top = dense_stats(ref_p, kk)
    tol = 2e-5 if q.dtype == torch.float32 else 1e-2  # 16-bit inputs carry their rounding
    torch.testing.assert_close(w.sum(dim=-2).double(), ref_sum, atol=tol * L, rtol=0)
    torch.testing.assert_close(w.mean(dim=-2).double(), ref_mean, atol=tol, rtol=0)
    # entropy: within 1e-4 * max(1, |lse|) of the oracle (the fused path may cancel)
    ref_lse = torch.where(ref_p.sum(-1) > 0, w.lse.double(), torch.zeros_like(ref_entropy))
    bound = 1e-4 * ref_lse.abs().clamp(min=1) if q.dtype == torch.float32 else tol * 10
    assert ((w.entropy().double() - ref_entropy).abs() <= bound).all()
    values, indices = w.topk(kk)
    assert values.shape == indices.shape == (*ref_p.shape[:-1], kk)
    torch.testing.assert_close(values.double(), ref_top, atol=tol, rtol=0)
    # the indices point at those values
    torch.testing.assert_close(ref_p.gather(-1, indices), ref_top, atol=tol, rtol=0)
    for stat in (w.sum(), w.entropy(), values):
        assert stat.dtype == torch.float32


def test_fully_masked_rows_have_zero_entropy_and_zero_topk(gen):
    q, k, v, _ = make_inputs(gen, L=6, S=5)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[2] = False
    w = sdpa.attention(q, k, v, mask).weights
    assert torch.equal(w.entropy()[:, :, 2], torch.zeros(2, 3))
    assert torch.equal(w.topk(3)[0][:, :, 2], torch.zeros(2, 3, 3))


def test_statistics_take_the_chunked_path_in_tiles(gen):
    """A small budget cuts the work into row chunks of one head: same answers."""
    from sdpa import rows

    q, k, v, mask = make_inputs(gen, Hq=4, Hkv=2, L=50, S=70, mask_kind="float")
    r = sdpa.attention(q, k, v, mask).weights._rows()
    budget = 7 * 70 * 4  # 7 rows of one head
    assert len(list(r.tiles(budget))) == 2 * 4 * 8
    ref_p = oracle(q, k, v, mask)[1]
    ref_sum, _, ref_entropy, ref_top = dense_stats(ref_p, 4)
    torch.testing.assert_close(rows.key_sums(r, budget).double(), ref_sum, atol=1e-4, rtol=0)
    torch.testing.assert_close(rows.entropy(r, budget).double(), ref_entropy, atol=1e-4, rtol=0)
    torch.testing.assert_close(rows.topk(r, 4, budget)[0].double(), ref_top, atol=2e-5, rtol=0)
    torch.testing.assert_close(rows.dense(r, budget).double(), ref_p, atol=2e-5, rtol=0)


def test_full_refuses_over_budget_before_allocating(gen):
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=300, S=400)
    w = sdpa.attention(q, k, v).weights
    with pytest.raises(
        sdpa.WeightsTooLargeError,
        match=r"need 960,000 bytes .* over "
        r"max_bytes=100,000. Ask for less: rows .* w.entropy\(\)",
    ):
        w.full(max_bytes=100_000)
    assert isinstance(sdpa.WeightsTooLargeError("x"), MemoryError)
    assert w.full(max_bytes=None).shape == (1, 2, 300, 400)


def test_statistics_work_where_the_dense_weights_exceed_the_budget(gen):
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=2048, S=2048, E=8)
    w = sdpa.attention(q, k, v).weights
    with pytest.raises(sdpa.WeightsTooLargeError):
        w.full(max_bytes=2**24)  # 32 MiB of weights
    sums, h, (top, _) = w.sum(), w.entropy(), w.topk(4)
    assert sums.shape == (1, 2, 2048) and h.shape == (1, 2, 2048) and top.shape == (1, 2, 2048, 4)
    torch.testing.assert_close(sums.sum(-1), torch.full((1, 2), 2048.0), rtol=1e-5, atol=0)
    assert ((h > 0) & (h <= torch.log(torch.tensor(2048.0)))).all()


@pytest.mark.parametrize("dim", [-1, 0, 3])
def test_sum_over_other_dims_is_refused(gen, dim):
    q, k, v, _ = make_inputs(gen)
    w = sdpa.attention(q, k, v).weights
    with pytest.raises(ValueError, match=rf"over the queries, dim=-2 .* got dim={dim}"):
        w.sum(dim=dim)


@pytest.mark.parametrize("k", [0, 10, 2.0])
def test_bad_topk(gen, k):
    q, k_, v, _ = make_inputs(gen)
    with pytest.raises(ValueError, match=r"k must be an int in \[1, S=9\]"):
        sdpa.attention(q, k_, v).weights.topk(k)


@pytest.mark.parametrize("mask_kind", ["none", "float_inf", "dead_rows"])
def test_amax_is_each_rows_largest_weight(gen, mask_kind):
    q, k, v, mask = make_inputs(gen, Hq=4, Hkv=2, L=13, S=21, mask_kind=mask_kind)
    w = sdpa.attention(q, k, v, mask).weights
    top = w.amax()
    assert top.shape == (2, 4, 13) and w.amax(dim=3).shape == top.shape
    torch.testing.assert_close(top.double(), oracle(q, k, v, mask)[1].amax(-1), atol=2e-6, rtol=0)


def test_amax_refuses_the_query_dim(gen):
    q, k, v, _ = make_inputs(gen)
    with pytest.raises(ValueError, match=r"amax works over the keys, dim=-1 .* got dim=-2"):
        sdpa.attention(q, k, v).weights.amax(dim=-2)
