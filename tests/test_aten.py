"""sdpa.backends.aten: the probe that asks torch's CPU flash op whether it takes grouped
key/value heads, and the wrappers that serve a torch whose op does not (torch 2.5's read
past k and v, and its backward wrote past dk and dv and aborted the process). The
wrappers call the op with one key/value head per query head only, so they run, and are
checked here, on every torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sdpa.backends import aten

from conftest import randn

pytestmark = pytest.mark.skipif(
    aten._CPU_FLASH is None or aten._CPU_FLASH_BACKWARD is None,
    reason="this torch has no CPU flash ops",
)


def _listing(q, k, v, mask, causal, scale):
    """torch's math path with every key/value head repeated for its query heads, float64:
    (out, lse)."""
    g = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q @ k.mT * scale  # (B, Hq, L, S)
    if mask is not None:
        s = s + mask.double()
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -torch.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _old_op(q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    """A stand-in for torch 2.5's op: query head h reads key/value head h through k's and
    v's own strides, whatever their head count (in bounds only for the probe's buffers)."""
    B, H = q.shape[:2]
    k = k.as_strided((B, H, *k.shape[2:]), k.stride(), k.storage_offset())
    v = v.as_strided((B, H, *v.shape[2:]), v.stride(), v.storage_offset())
    return aten._CPU_FLASH(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def test_the_probe_tells_an_op_that_ignores_the_grouping():
    assert aten.takes_gqa(_old_op) is False
    assert aten.takes_gqa(lambda *a, **kw: 1 / 0) is False  # an error: the wrappers serve
    if aten.CPU_GQA:  # torch's own op takes the grouping: the calls go to it directly
        assert aten.CPU_FLASH is aten._CPU_FLASH
        assert aten.CPU_FLASH_BACKWARD is aten._CPU_FLASH_BACKWARD
    else:
        assert aten.CPU_FLASH is aten._cpu_flash_grouped


# (mask kind, causal): folded rows (no mask, one bias row for all, a bias per query head)
# or k and v expanded (a bias shared by the heads over every row, the op's causal path)
CASES = [
    ("none", False),
    ("key_padding", False),
    ("per_head", False),
    ("shared", False),
    ("none", True),
    ("shared", True),
]


def _mask(gen, kind, B, Hq, L, S):
    if kind == "none":
        return None
    shape = {"key_padding": (B, 1, 1, S), "per_head": (B, Hq, L, S), "shared": (B, 1, L, S)}
    return randn(gen, *shape[kind])


@pytest.mark.parametrize("kind,causal", CASES)
@pytest.mark.parametrize("Hq,Hkv,L", [(6, 2, 13), (4, 1, 1), (3, 3, 7)])
def test_the_wrappers_give_grouped_heads_the_listings_result(gen, kind, causal, Hq, Hkv, L):
    B, S, E = 2, L if causal else 11, 16
    q, k, v = randn(gen, B, Hq, L, E), randn(gen, B, Hkv, S, E), randn(gen, B, Hkv, S, E)
    mask = _mask(gen, kind, B, Hq, L, S)
    scale = 0.3
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = aten._cpu_flash_grouped(*leaves, 0.0, causal, attn_mask=mask, scale=scale)[:2]
    ref_out, ref_lse = _listing(q, k, v, mask, causal, scale)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)
    assert out.shape == (B, Hq, L, E) and lse.shape == (B, Hq, L)

    dout = randn(gen, B, Hq, L, E)
    out.backward(dout)  # autograd through the fold or the expansion
    refs = [t.double().requires_grad_(True) for t in (q, k, v)]
    _listing(*refs, mask, causal, scale)[0].backward(dout.double())
    for name, a, b in zip("qkv", leaves, refs, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=0, msg=name)

    # the backward op itself, as the sinks' correction and ring attention call it
    grads = aten._cpu_flash_backward_grouped(
        dout, q, k, v, out.detach(), lse, 0.0, causal, attn_mask=mask, scale=scale
    )
    for name, a, b in zip("qkv", grads, refs, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b.grad, atol=1e-4, rtol=0, msg=name)


def test_folding_rows_copies_neither_k_nor_v(gen):
    """The fold is a view of q: k and v reach the op as they are (one head each)."""
    q, k, v = randn(gen, 1, 4, 5, 8), randn(gen, 1, 2, 9, 8), randn(gen, 1, 2, 9, 8)
    seen = []

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.data_ptr(), k.data_ptr(), v.data_ptr(), q.shape))
        return F.scaled_dot_product_attention(q, k, v), torch.zeros(q.shape[:-1])

    real = aten._CPU_FLASH
    aten._CPU_FLASH = spy
    try:
        aten._cpu_flash_grouped(q, k, v, 0.0, False, scale=None)
    finally:
        aten._CPU_FLASH = real
    assert seen == [(q.data_ptr(), k.data_ptr(), v.data_ptr(), (1, 2, 10, 8))]
