"""Every refusal: a clear error naming the argument, what was seen and what would work."""

from __future__ import annotations

import pytest
import torch

import sdpa

from conftest import make_inputs, randn


@pytest.fixture
def qkv(gen):
    return make_inputs(gen, L=5, S=7, E=8)[:3]


def refuses(exc, pattern, *args, **kwargs):
    with pytest.raises(exc, match=pattern):
        sdpa.attention(*args, **kwargs)


def test_not_a_tensor(qkv):
    q, k, v = qkv
    refuses(TypeError, r"key must be a torch.Tensor, got list", q, [1.0], v)
    refuses(
        TypeError,
        r"mask must be None, a torch.Tensor .* or an sdpa.masks object, got str",
        q,
        k,
        v,
        "causal",
    )


def test_too_few_dims(qkv):
    q, k, v = qkv
    refuses(ValueError, r"query must have at least 2 dims .* got shape \(8,\)", q[0, 0, 0], k, v)


def test_non_floating_inputs(qkv):
    q, k, v = qkv
    refuses(
        TypeError,
        r"query is a non-floating tensor \(torch.int64\).*cast q, k and v first",
        q.long(),
        k.long(),
        v.long(),
    )


def test_mixed_dtypes(qkv):
    q, k, v = qkv
    refuses(
        TypeError,
        r"same dtype, got query torch.float32, key torch.float64, value "
        r"torch.float32",
        q,
        k.double(),
        v,
    )


def test_mixed_devices(qkv):
    q, k, v = qkv
    refuses(ValueError, r"one device, got query cpu, key meta", q, k.to("meta"), v)


def test_head_dim_mismatch(qkv):
    q, k, v = qkv
    refuses(
        ValueError,
        r"same feature size E, got query \(2, 3, 5, 8\) \(E=8\) and key "
        r"\(2, 3, 7, 6\) \(E=6\)",
        q,
        k[..., :6],
        v,
    )


def test_key_value_length_mismatch(qkv):
    q, k, v = qkv
    refuses(
        ValueError,
        r"key and value must have the same length S, got key \(2, 3, 7, 8\) "
        r"\(S=7\) and value \(2, 3, 6, 8\) \(S=6\)",
        q,
        k,
        v[..., :6, :],
    )


def test_mask_does_not_broadcast(qkv):
    q, k, v = qkv
    refuses(
        ValueError,
        r"mask of shape \(5, 6\) does not broadcast to the weights' shape "
        r"\(2, 3, 5, 7\)",
        q,
        k,
        v,
        torch.ones(5, 6, dtype=torch.bool),
    )
    refuses(ValueError, r"does not broadcast", q, k, v, torch.ones(1, 2, 3, 5, 7))


def test_key_padding_hint_fits_the_inputs(gen):
    q, k, v = (randn(gen, 2, n, 8) for n in (5, 7, 7))  # 3-D: (N, L, E)
    refuses(
        ValueError,
        r"key padding is \(N, 1, S\) for 3-D inputs",
        q,
        k,
        v,
        torch.ones(2, 1, 1, 7, dtype=torch.bool),
    )


def test_mask_type_is_checked_before_autocast(qkv):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        refuses(TypeError, r"mask must be None, a torch.Tensor .* got list", *qkv, [[True]])


def test_complex_mask(qkv):
    q, k, v = qkv
    refuses(
        TypeError,
        r"mask must be bool, integer or real floating, got torch.complex64",
        q,
        k,
        v,
        torch.ones(5, 7, dtype=torch.complex64),
    )


def test_mask_on_other_device(qkv):
    q, k, v = qkv
    refuses(
        ValueError,
        r"mask is on meta but query is on cpu",
        q,
        k,
        v,
        torch.ones(5, 7, dtype=torch.bool, device="meta"),
    )


def test_heads_not_divisible(gen):
    q, k, v, _ = make_inputs(gen, Hq=6, Hkv=4)
    refuses(
        ValueError,
        r"key/value heads must divide query heads .* got 6 query heads "
        r"\(query \(2, 6, 7, 16\)\) and 4 key/value heads",
        q,
        k,
        v,
    )


def test_key_value_heads_differ(gen):
    """Key and value heads may differ where each divides the query heads (torch's
    enable_gqa takes them: tests/test_dropin.py); where one does not, refused naming it."""
    q, k, v, _ = make_inputs(gen, Hq=4, Hkv=4)
    refuses(
        ValueError,
        r"key and value have different numbers of heads \(key \(2, 4, 9, 16\): 4, value "
        r"\(2, 3, 9, 16\): 3\), so each must divide the query heads, got 4 query heads .* "
        r"and 3 value heads",
        q,
        k,
        torch.cat([v, v[:, :2]], dim=1)[:, :3],
    )


def test_batch_dims_do_not_broadcast(gen):
    q, k, v = randn(gen, 2, 3, 4, 5, 8), randn(gen, 3, 3, 4, 6, 8), randn(gen, 3, 3, 4, 6, 8)
    refuses(ValueError, r"batch dims .* must broadcast .* query \(2, 3\), key \(3, 3\)", q, k, v)
    refuses(
        ValueError,
        r"batch dim \(dim -3 of 3-D inputs\) .* query \(4,\), key \(3,\)",
        q[0, 0],
        k[0, 0, :3],
        v[0, 0, :3],
    )


def test_causal_needs_square(qkv):
    q, k, v = qkv
    refuses(
        ValueError,
        r"causal=True needs as many queries as keys, got L=5 and S=7.*"
        r"mask=sdpa.masks.causal\(align='bottom-right'\) .* or align='top-left'",
        q,
        k,
        v,
        causal=True,
    )


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.1", True, torch.ones(2)])
def test_bad_scale(qkv, scale):
    refuses(ValueError, r"scale must be a finite number or None", *qkv, scale=scale)


def test_scale_may_be_a_numpy_scalar_or_0d_tensor(qkv):
    import numpy as np

    ref = sdpa.attention(*qkv, scale=0.5).output
    for scale in (np.float32(0.5), torch.tensor(0.5)):
        torch.testing.assert_close(sdpa.attention(*qkv, scale=scale).output, ref)


@pytest.mark.parametrize("p", [-0.1, 1.5, "0.1"])
def test_bad_dropout(qkv, p):
    refuses(ValueError, r"dropout_p must be a probability in \[0, 1\]", *qkv, dropout_p=p)


def test_unknown_backend(qkv):
    refuses(
        ValueError,
        r"backend must be 'auto' or one of "
        r"\['chunked', 'fused', 'reference', 'small'\], got 'flash'",
        *qkv,
        backend="flash",
    )
