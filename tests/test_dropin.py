"""sdpa.scaled_dot_product_attention gives torch's result for every call torch accepts."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import sdpa

from conftest import make_inputs, randn


def same_as_torch(*args, atol=1e-5, **kwargs):
    """Equal up to rounding: torch's own backends differ by ~2e-6 in float32."""
    ours = sdpa.scaled_dot_product_attention(*args, **kwargs)
    theirs = F.scaled_dot_product_attention(*args, **kwargs)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)


def test_signature_is_torchs():
    params = list(inspect.signature(sdpa.scaled_dot_product_attention).parameters.values())
    assert [(p.name, p.default) for p in params] == [
        ("query", inspect.Parameter.empty), ("key", inspect.Parameter.empty),
        ("value", inspect.Parameter.empty), ("attn_mask", None), ("dropout_p", 0.0),
        ("is_causal", False), ("scale", None), ("enable_gqa", False),
    ]  # fmt: skip


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "float_inf", "key_padding", "2d"])
@pytest.mark.parametrize("L,S,E,Ev", [(1, 1, 16, 16), (97, 130, 40, 59), (130, 97, 59, 16)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_masks_sizes_scales(gen, mask_kind, L, S, E, Ev, scale):
    q, k, v, mask = make_inputs(gen, L=L, S=S, E=E, Ev=Ev, mask_kind=mask_kind)
    same_as_torch(q, k, v, mask, scale=scale)


@pytest.mark.parametrize("L,S", [(5, 5), (3, 9), (9, 3)])
def test_is_causal_is_top_left_like_torch(gen, L, S):
    q, k, v, _ = make_inputs(gen, L=L, S=S)
    same_as_torch(q, k, v, is_causal=True)


def test_enable_gqa(gen):
    q, k, v, _ = make_inputs(gen, Hq=8, Hkv=2, L=17, S=19)
    same_as_torch(q, k, v, enable_gqa=True)
    with pytest.raises(ValueError, match=r"pass enable_gqa=True"):
        sdpa.scaled_dot_product_attention(q, k, v)
    # one key/value head broadcasts without enable_gqa, as in torch
    same_as_torch(q, k[:, :1], v[:, :1])


@pytest.mark.parametrize("hk,hv", [(4, 2), (2, 4), (8, 2), (1, 4), (4, 8)])
def test_enable_gqa_takes_key_and_value_of_other_head_counts(gen, hk, hv):
    """torch's enable_gqa takes key and value heads that each divide the query heads."""
    q = randn(gen, 2, 8, 5, 16)
    k, v = randn(gen, 2, hk, 7, 16), randn(gen, 2, hv, 7, 12)
    same_as_torch(q, k, v, enable_gqa=True)
    same_as_torch(q, k, v, randn(gen, 1, 8, 5, 7), enable_gqa=True)
    out, w = sdpa.attention(q, k, v)  # attention takes them too, with the weights
    p = torch.softmax(q @ k.repeat_interleave(8 // hk, 1).mT / 4, dim=-1)
    torch.testing.assert_close(w.full(), p, atol=1e-5, rtol=0)
    torch.testing.assert_close(out, p @ v.repeat_interleave(8 // hv, 1), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"each must divide the query heads.* 3 key heads"):
        sdpa.scaled_dot_product_attention(q, randn(gen, 2, 3, 7, 16), v, enable_gqa=True)


def test_dims_2_3_5(gen):
    same_as_torch(randn(gen, 4, 8), randn(gen, 6, 8), randn(gen, 6, 3))
    same_as_torch(randn(gen, 2, 4, 8), randn(gen, 1, 6, 8), randn(gen, 1, 6, 3))
    same_as_torch(randn(gen, 3, 2, 4, 5, 8), randn(gen, 3, 2, 4, 6, 8), randn(gen, 3, 2, 4, 6, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtypes(gen, dtype):
    q, k, v, mask = make_inputs(gen, L=33, S=47, dtype=dtype, mask_kind="bool")
    same_as_torch(q, k, v, mask, atol=1e-2 if dtype != torch.float64 else 1e-12)


def test_fully_masked_rows_are_zero_like_torch(gen):
    q, k, v, _ = make_inputs(gen, L=4, S=5)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1] = False
    same_as_torch(q, k, v, mask)


def test_mask_with_is_causal_raises_as_torch_documents(gen):
    q, k, v, mask = make_inputs(gen, L=5, S=5, mask_kind="bool")
    with pytest.raises(ValueError, match=r"attn_mask and is_causal=True were both given"):
        sdpa.scaled_dot_product_attention(q, k, v, mask, is_causal=True)


def test_gradients_like_torch(gen):
    q, k, v, mask = make_inputs(gen, L=21, S=21, mask_kind="float")
    ours = [t.clone().requires_grad_(True) for t in (q, k, v)]
    theirs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    sdpa.scaled_dot_product_attention(*ours, mask).square().sum().backward()
    F.scaled_dot_product_attention(*theirs, mask).square().sum().backward()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=0)


def test_superset_integer_keep_mask(gen):
    q, k, v, mask = make_inputs(gen, mask_kind="bool")
    ours = sdpa.scaled_dot_product_attention(q, k, v, mask.to(torch.int32))
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, mask))


def test_3d_inputs_with_enable_gqa_read_dim_minus_3_as_heads(gen):
    same_as_torch(randn(gen, 4, 5, 8), randn(gen, 2, 7, 8), randn(gen, 2, 7, 8), enable_gqa=True)


@pytest.mark.parametrize("scale", [True, float("inf"), 0.5])
def test_any_scale_torch_accepts(gen, scale):
    q, k, v, _ = make_inputs(gen)
    ours = sdpa.scaled_dot_product_attention(q, k, v, scale=scale)
    theirs = F.scaled_dot_product_attention(q, k, v, scale=scale)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0, equal_nan=True)
