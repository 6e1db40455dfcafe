"""Small shapes: the small backend, one-product weights, the O(1) fast path, the mask cache.

Every result is compared with the float64 oracle; the thresholds are tested on their
edges (one score under, at and over).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import sdpa
from sdpa import listing, masks, tile
from sdpa.backends import select, select_fast, small
from sdpa.inputs import fast_normalize, normalize
from sdpa.settings import override

from conftest import MASK_KINDS, make_inputs, randn
from oracle import oracle

pytestmark = pytest.mark.small_shapes
ATOL = 2e-5


def check_weights(w, ref_p, atol=ATOL):
    """Every way of reading the weights against the oracle's p (B, H, L, S)."""
    torch.testing.assert_close(w.full().double(), ref_p, atol=atol, rtol=0)
    torch.testing.assert_close(w[1, :, -1].double(), ref_p[1, :, -1], atol=atol, rtol=0)
    torch.testing.assert_close(w[..., 1:3, :].double(), ref_p[..., 1:3, :], atol=atol, rtol=0)
    torch.testing.assert_close(w.sum(dim=-2).double(), ref_p.sum(-2), atol=atol * 4, rtol=0)
    entropy = torch.special.entr(ref_p).sum(-1)
    torch.testing.assert_close(w.entropy().double(), entropy, atol=atol * 10, rtol=0)
    torch.testing.assert_close(w.amax(-1).double(), ref_p.amax(-1), atol=atol, rtol=0)
    values, indices = w.topk(2)
    torch.testing.assert_close(values.double(), ref_p.topk(2, dim=-1).values, atol=atol, rtol=0)
    torch.testing.assert_close(
        ref_p.gather(-1, indices), ref_p.topk(2, dim=-1).values, atol=atol, rtol=0
    )


def lse_of(q, k, mask=None, causal=False, scale=None):
    """log-sum-exp of the scores in float64, 0 for rows that see no key."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.mT * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -torch.inf)
    if mask is not None:
        s = s + mask.double() if mask.is_floating_point() else s.masked_fill(mask == 0, -torch.inf)
    lse = torch.logsumexp(s, dim=-1)
    return lse.masked_fill(torch.isneginf(lse), 0.0)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("Hq,Hkv", [(3, 3), (6, 2), (4, 1)])
@pytest.mark.parametrize("E,Ev", [(16, 16), (40, 59)])
def test_small_backend_matches_the_oracle(gen, mask_kind, Hq, Hkv, E, Ev):
    q, k, v, mask = make_inputs(gen, Hq=Hq, Hkv=Hkv, L=7, S=13, E=E, Ev=Ev, mask_kind=mask_kind)
    out, w = sdpa.attention(q, k, v, mask, backend="small")
    ref_out, ref_p = oracle(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref_out, atol=ATOL, rtol=0)
    check_weights(w, ref_p)
    torch.testing.assert_close(w.lse.double(), lse_of(q, k, mask), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["auto", "small"])
@pytest.mark.parametrize(
    "name",
    ["causal", "causal_dead_rows", "bottom_right", "top_left", "window_and_padding", "documents"],
)
def test_small_backend_causal_and_structured_masks(gen, backend, name):
    L, S = (9, 9) if name.startswith("causal") or name == "documents" else (6, 11)
    q, k, v, _ = make_inputs(gen, Hq=4, Hkv=2, L=L, S=S)
    causal, mask, ref_mask, ref_causal = False, None, None, False
    if name.startswith("causal"):
        causal = ref_causal = True
        if name == "causal_dead_rows":  # rows 3 and 6 see no key once causality is ANDed
            mask = torch.ones(L, S, dtype=torch.bool)
            mask[3, :4] = mask[6, :7] = False
            ref_mask = mask
    else:
        mask = {
            "bottom_right": masks.causal(),
            "top_left": masks.causal("top-left"),
            "window_and_padding": masks.sliding_window(3) & masks.padding([11, 5]),
            "documents": masks.documents(torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])),
        }[name]
        ref_mask = mask.materialize(L, S, torch.device("cpu"))
    out, w = sdpa.attention(q, k, v, mask, causal=causal, backend=backend)
    ref_out, ref_p = oracle(q, k, v, ref_mask, causal=ref_causal)
    torch.testing.assert_close(out.double(), ref_out, atol=ATOL, rtol=0)
    check_weights(w, ref_p)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("scale", [None, 0.05, 2.5])
def test_small_backend_dtypes_and_scales(gen, dtype, scale):
    q, k, v, mask = make_inputs(gen, L=5, S=8, E=24, dtype=dtype, mask_kind="float")
    out, w = sdpa.attention(q, k, v, mask.to(dtype), scale=scale, backend="small")
    assert out.dtype == dtype and w.dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    ref_out, _ = oracle(q, k, v, mask.to(dtype), scale=scale)
    low = dtype in (torch.bfloat16, torch.float16)
    atol = (3e-2 if dtype == torch.bfloat16 else 4e-3) if low else 1e-12
    torch.testing.assert_close(
        out.double(), ref_out, atol=atol * (2 if scale == 2.5 else 1), rtol=0
    )
    # the weights are float32 from the 16-bit inputs: as exact as float32 allows
    ref_p32 = oracle(q.double(), k.double(), v.double(), mask.to(dtype).double(), scale=scale)[1]
    torch.testing.assert_close(w.full().double(), ref_p32, atol=1e-5 if low else 1e-12, rtol=0)


@pytest.mark.parametrize("mask_kind", ["none", "float", "dead_rows"])
def test_small_backend_gradients_match_the_oracle(gen, mask_kind):
    q, k, v, mask = make_inputs(gen, Hq=4, Hkv=2, L=6, S=10, E=12, mask_kind=mask_kind)
    grad = randn(gen, 2, 4, 6, 12)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask_leaf = mask.clone().requires_grad_() if mask_kind == "float" else mask
    out, w = sdpa.attention(*leaves, mask_leaf, backend="small")
    assert w.full().requires_grad  # the kept weights are in the graph, as the listing's
    out.backward(grad)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_mask = mask.double().requires_grad_() if mask_kind == "float" else mask
    oracle(*ref, ref_mask)[0].backward(grad.double())
    for ours, theirs in zip(leaves, ref, strict=True):
        assert torch.isfinite(ours.grad).all()
        torch.testing.assert_close(ours.grad.double(), theirs.grad, atol=1e-4, rtol=0)
    if mask_kind == "float":  # the mask's gradient too (the fused kernel has none)
        torch.testing.assert_close(mask_leaf.grad.double(), ref_mask.grad, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mask_kind", ["none", "key_padding", "float_inf"])
def test_decode_weights_come_from_one_product_after_the_fused_kernel(gen, mask_kind):
    q, k, v, mask = make_inputs(gen, Hq=4, Hkv=2, L=1, S=37, mask_kind=mask_kind)
    inputs = normalize(q, k, v, mask)
    assert select(inputs).name == "fused" and small.one_product(inputs)
    out, w = sdpa.attention(q, k, v, mask)
    ref_out, ref_p = oracle(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref_out, atol=ATOL, rtol=0)
    check_weights(w, ref_p)
    torch.testing.assert_close(w.lse.double(), lse_of(q, k, mask), atol=ATOL, rtol=0)


def test_the_thresholds_are_decided_on_their_edges(gen):
    """B * Hq * L * S at, under and over small_weights; L * S at small_head; L == 1 goes
    to the fused kernel;
    causal beyond small_causal; the one-product weights at one_product_weights."""
    q, k, v, _ = make_inputs(gen, B=2, Hq=3, L=8, S=8)
    scores = 2 * 3 * 8 * 8
    for limit, name in ((scores, "small"), (scores - 1, "fused"), (scores + 1, "small")):
        with override(small_weights=limit):
            assert select(normalize(q, k, v)).name == name
            assert select_fast(fast_normalize(q, k, v)).name == name
    for limit, name in ((64, "small"), (63, "fused")):  # L * S of one head
        with override(small_head=limit):
            assert select(normalize(q, k, v)).name == name
    assert select(normalize(q[:, :, :1], k, v)).name == "fused"  # one query row
    with override(small_causal=64):
        assert select(normalize(q, k, v, causal=True)).name == "small"
    with override(small_causal=63):
        assert select(normalize(q, k, v, causal=True)).name == "fused"
        assert select(normalize(q, k, v, masks.causal())).name == "fused"
        assert select(normalize(q, k, v, torch.ones(8, 8, dtype=torch.bool))).name == "small"
    for limit, kept in ((scores, True), (scores - 1, False)):
        with override(one_product_weights=limit):
            assert small.one_product(normalize(q, k, v)) is kept


def test_kept_weights_are_handed_out_as_the_callers_own_tensors(gen):
    """full() and every index give fresh tensors: editing one changes nothing here, and
    never the autograd graph that saved the weights (issue 25: out.backward() after
    w.full().mul_(0.5) failed on an AsStrided tensor the user never made)."""
    q, k, v, _ = make_inputs(gen, L=5, S=6)
    q.requires_grad_()
    out, w = sdpa.attention(q, k, v)
    full = w.full()
    assert w.full().data_ptr() != full.data_ptr()  # a copy each time
    ref_p = oracle(q.detach(), k, v)[1]
    full.mul_(3.0)  # the caller's change must not leak into later answers
    torch.testing.assert_close(w.full().double(), ref_p, atol=ATOL, rtol=0)
    torch.testing.assert_close(w.sum(-2).double(), ref_p.sum(-2), atol=1e-4, rtol=0)
    row = w[0, 0, 1]
    row.zero_()
    torch.testing.assert_close(w[0, 0].double(), ref_p[0, 0], atol=ATOL, rtol=0)
    out.sum().backward()  # the graph's saved weights are untouched
    q2 = q.detach().clone().requires_grad_()
    oracle(q2, k, v, dtype=torch.float32)[0].sum().backward()
    torch.testing.assert_close(q.grad, q2.grad, atol=1e-5, rtol=0)


def test_under_inference_mode_the_weights_are_copies(gen):
    q, k, v, _ = make_inputs(gen, L=5, S=6)
    with torch.inference_mode():
        _, w = sdpa.attention(q, k, v)
        full = w.full()
        full.zero_()  # no version counter to notice this: full() must have been a copy
        torch.testing.assert_close(w.full().double(), oracle(q, k, v)[1], atol=ATOL, rtol=0)


def test_small_weights_go_stale_with_their_inputs(gen):
    q, k, v, _ = make_inputs(gen, L=5, S=6)
    _, w = sdpa.attention(q, k, v)
    k.add_(1.0)
    with pytest.raises(sdpa.StaleWeightsError, match="key changed in place"):
        w.full()


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
        )  # fmt: skip
    return a == b and type(a) is type(b)


FAST_CASES = {
    "plain": dict(),
    "gqa": dict(Hq=6, Hkv=2),
    "key_padding": dict(mask_kind="key_padding"),
    "bool": dict(mask_kind="bool"),
    "float": dict(mask_kind="float"),
    "causal": dict(L=9, S=9, causal=True),
    "scale": dict(scale=0.3),
    "bf16": dict(dtype=torch.bfloat16),
    "bf16 float32 mask": dict(dtype=torch.bfloat16, mask_kind="float"),
    "decode": dict(L=1, S=40, Hq=4, Hkv=2, mask_kind="key_padding"),
}


@pytest.mark.parametrize("case", list(FAST_CASES))
def test_fast_normalize_gives_what_normalize_gives(gen, case):
    kw = dict(FAST_CASES[case])
    causal, scale = kw.pop("causal", False), kw.pop("scale", None)
    q, k, v, mask = make_inputs(gen, **kw)
    fast = fast_normalize(q, k, v, mask, causal, scale)
    assert fast is not None
    slow = normalize(q, k, v, mask, causal=causal, scale=scale)
    assert all(_same(a, b) for a, b in zip(fast, slow, strict=True)), (fast, slow)


def test_fast_normalize_leaves_everything_else_to_normalize(gen):
    """Each input outside the fast path's domain returns None (normalize then decides,
    and names what is wrong)."""
    q, k, v, _ = make_inputs(gen, Hq=4, Hkv=2, L=5, S=6)
    ok = dict(mask=None, causal=False, scale=None, dropout_p=0.0)
    assert fast_normalize(q, k, v, **ok) is not None
    int_mask = torch.ones(2, 1, 5, 6, dtype=torch.int64)
    f16_mask = torch.zeros(2, 1, 5, 6, dtype=torch.float16)
    grad_mask = torch.zeros(2, 1, 5, 6, requires_grad=True)
    outside = {
        "3-D": dict(query=q[0]),
        "parameter": dict(query=torch.nn.Parameter(q)),
        "dtype": dict(key=k.double()),
        "int query": dict(query=q.int(), key=k.int(), value=v.int()),
        "batch": dict(key=k[:1]),
        "E": dict(key=k[..., :8]),
        "S": dict(value=v[:, :, :5]),
        "heads": dict(query=q[:, :3]),
        "no gqa": dict(gqa=False),
        "empty": dict(query=q[:, :, :0]),
        "causal L != S": dict(causal=True),
        "causal not bool": dict(causal=1),
        "int scale": dict(scale=1),
        "inf scale": dict(scale=float("inf")),
        "dropout": dict(dropout_p=0.1),
        "int dropout": dict(dropout_p=0),
        "int mask": dict(mask=int_mask),
        "float16 mask": dict(mask=f16_mask),
        "mask needs grad": dict(mask=grad_mask),
        "2-D mask": dict(mask=torch.ones(5, 6, dtype=torch.bool)),
        "mask S": dict(mask=torch.ones(2, 1, 5, 1, dtype=torch.bool)),
        "structured": dict(mask=masks.causal()),
    }
    with warnings.catch_warnings():  # torch's note that strided nested is a prototype
        warnings.simplefilter("ignore", UserWarning)
        outside["nested"] = dict(query=torch.nested.nested_tensor([q[0], q[1]]))
    for name, change in outside.items():
        args = {"query": q, "key": k, "value": v, **ok, **change}
        assert fast_normalize(**args) is None, name
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fast_normalize(q, k, v) is None


def test_a_key_padding_mask_is_converted_once_and_never_stale(gen):
    """Two query rows: the fused kernel's call (one row is torch's own F.sdpa, which
    converts the mask itself)."""
    with override(small_weights=0):
        q, k, v, mask = make_inputs(gen, Hq=4, Hkv=2, L=2, S=40, mask_kind="key_padding")
        tile._additive_cache.clear()
        out1 = sdpa.attention(q, k, v, mask).output
        assert len(tile._additive_cache) == 1
        (bias,) = [entry[2] for entry in tile._additive_cache.values()]
        sdpa.attention(q, k, v, mask)
        assert [entry[2] for entry in tile._additive_cache.values()] == [bias]  # reused
        torch.testing.assert_close(out1.double(), oracle(q, k, v, mask)[0], atol=ATOL, rtol=0)
        mask[0, ..., : mask.shape[-1] // 2] = False  # changed in place: must not be reused
        mask[0, ..., -1] = True
        out2 = sdpa.attention(q, k, v, mask).output
        torch.testing.assert_close(out2.double(), oracle(q, k, v, mask)[0], atol=ATOL, rtol=0)
        for _ in range(2 * tile.ADDITIVE_CACHE_ENTRIES):  # bounded
            fresh = torch.rand(2, 1, 1, 40, generator=gen) < 0.8
            out = sdpa.attention(q, k, v, fresh).output
            torch.testing.assert_close(out.double(), oracle(q, k, v, fresh)[0], atol=ATOL, rtol=0)
        assert len(tile._additive_cache) == tile.ADDITIVE_CACHE_ENTRIES


def test_seed_phrase_weights_are_the_listings(gen):
    """(1, 8, 4, 32), the seed's phrase: the small backend's weights and output are the
    listing's, up to rounding."""
    q, k, v = (randn(gen, 1, 8, 4, 32) for _ in range(3))
    out, w = sdpa.attention(q, k, v)
    listing_out, listing_p = listing.attention(q, k, v)
    torch.testing.assert_close(out, listing_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(w.full(), listing_p, atol=1e-6, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_rows_without_keys_under_a_float_mask_are_zero(gen, causal):
    """Dead rows read from the mask (float: a row all -inf), and from the scores when
    causality may take a row's last keys."""
    q, k, v, _ = make_inputs(gen, L=6, S=6)
    mask = torch.randn(2, 1, 6, 6, generator=gen)
    mask[0, :, 2] = -torch.inf  # query 2 of batch 0 sees nothing
    mask[1, :, 4, :5] = -torch.inf  # query 4 of batch 1 sees key 5 only: dead if causal
    out, w = sdpa.attention(q, k, v, mask, causal=causal, backend="small")
    ref_out, ref_p = oracle(q, k, v, mask, causal=causal)
    torch.testing.assert_close(out.double(), ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(w.full().double(), ref_p, atol=ATOL, rtol=0)
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
    assert causal == bool((w.full()[1, :, 4] == 0).all())
