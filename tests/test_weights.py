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
