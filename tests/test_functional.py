"""sdpa.attention against the float64 oracle: every backend, mask kind and awkward size."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import sdpa
from engines import BACKEND_ENGINES, run_or_skip
from sdpa import listing

from conftest import MASK_KINDS, make_inputs, randn
from oracle import oracle

ATOL = 2e-5


def check(out, w, ref_out, ref_p, atol=ATOL, reads=None):
    """The output and the dense weights (read under the engine's settings, `reads`)
    against the oracle's."""
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=0)
    with reads or contextlib.nullcontext():
        torch.testing.assert_close(w.full().double(), ref_p, atol=atol, rtol=0)


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("E,Ev", [(16, 16), (40, 59), (59, 16)])
@pytest.mark.parametrize("L,S", [(1, 1), (97, 130), (130, 97), (1, 130)])
def test_matches_oracle(gen, engine, mask_kind, E, Ev, L, S):
    q, k, v, mask = make_inputs(gen, L=L, S=S, E=E, Ev=Ev, mask_kind=mask_kind)
    out, w, reads = run_or_skip(engine, q, k, v, mask)
    assert out.shape == (2, 3, L, Ev) and out.dtype == torch.float32
    assert w.shape == (2, 3, L, S) and w.dtype == torch.float32
    check(out, w, *oracle(q, k, v, mask), reads=reads)


@pytest.mark.small_shapes
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("E,Ev", [(16, 16), (59, 16)])
@pytest.mark.parametrize("L,S", [(1, 1), (7, 9), (97, 130), (1, 130), (64, 64)])
def test_matches_oracle_at_the_real_small_shape_thresholds(gen, mask_kind, E, Ev, L, S):
    """The core matrix once more as users run it: the small backend and the one-product
    weights at their real thresholds (the suite turns them off elsewhere)."""
    q, k, v, mask = make_inputs(gen, L=L, S=S, E=E, Ev=Ev, mask_kind=mask_kind)
    out, w = sdpa.attention(q, k, v, mask)
    check(out, w, *oracle(q, k, v, mask))


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "dead_rows"])
@pytest.mark.parametrize("L", [1, 97])
def test_causal_is_anded_with_mask(gen, engine, mask_kind, L):
    q, k, v, mask = make_inputs(gen, L=L, S=L, E=40, mask_kind=mask_kind)
    out, w, reads = run_or_skip(engine, q, k, v, mask, causal=True)
    check(out, w, *oracle(q, k, v, mask, causal=True), reads=reads)


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
@pytest.mark.parametrize("scale", [0.05, 0.5, 2.5])
def test_custom_scale(gen, engine, scale):
    q, k, v, mask = make_inputs(gen, L=33, S=65, E=59, mask_kind="bool")
    out, w, reads = run_or_skip(engine, q, k, v, mask, scale=scale)
    # float32 rounding of a score grows with its size: scores here have std scale*sqrt(E)
    score_std = scale * 59**0.5
    atol = ATOL * max(1.0, score_std / 4)
    check(out, w, *oracle(q, k, v, mask, scale=scale), atol=atol, reads=reads)


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
@pytest.mark.parametrize("Hq,Hkv", [(6, 2), (6, 1), (4, 4), (1, 3)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float_inf"])
def test_grouped_query_attention(gen, engine, Hq, Hkv, mask_kind):
    q, k, v, mask = make_inputs(gen, Hq=Hq, Hkv=Hkv, L=31, S=45, E=40, Ev=16, mask_kind=mask_kind)
    if Hq < Hkv:  # one query head broadcasts over every key/value head
        mask = None if mask is None else mask[:, :1]
    out, w, reads = run_or_skip(engine, q, k, v, mask)
    H = max(Hq, Hkv)
    assert out.shape == (2, H, 31, 16) and w.shape == (2, H, 31, 45)
    if Hq < Hkv:
        q = q.expand(2, H, 31, 40)
    check(out, w, *oracle(q, k, v, mask), reads=reads)


def test_gqa_head_mapping_is_h_over_group(gen):
    """Query head h must use key/value head h // group, not h % Hkv."""
    q, k, v, _ = make_inputs(gen, Hq=4, Hkv=2, L=5, S=6)
    out = sdpa.attention(q, k, v).output
    for h in range(4):
        ref, _ = oracle(q[:, h], k[:, h // 2], v[:, h // 2])
        torch.testing.assert_close(out[:, h].double(), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
def test_leading_dims_broadcast(gen, engine):
    q = randn(gen, 2, 3, 4, 11, 16)
    k = randn(gen, 1, 3, 4, 13, 16)
    v = randn(gen, 2, 1, 4, 13, 8)
    mask = torch.rand(3, 1, 11, 13, generator=gen) < 0.8
    out, w, reads = run_or_skip(engine, q, k, v, mask)
    assert out.shape == (2, 3, 4, 11, 8) and w.shape == (2, 3, 4, 11, 13)
    check(out, w, *oracle(q, k, v, mask), reads=reads)


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
def test_seed_phrase_shapes_2d_and_3d(gen, engine):
    x = randn(gen, 4, 256)  # the seed's "How are you?" as (4, 256)
    out, w, reads = run_or_skip(engine, x, x, x)
    assert out.shape == (4, 256) and w.shape == (4, 4)
    check(out, w, *oracle(x, x, x), reads=reads)
    # 3-D: dim -3 is batch, never heads; k broadcasts over it
    q, k, v = randn(gen, 5, 4, 32), randn(gen, 1, 6, 32), randn(gen, 1, 6, 7)
    mask = torch.rand(5, 4, 6, generator=gen) < 0.8
    out, w, reads = run_or_skip(engine, q, k, v, mask)
    assert out.shape == (5, 4, 7) and w.shape == (5, 4, 6)
    check(out, w, *oracle(q, k, v, mask), reads=reads)


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
def test_fully_masked_rows_give_zero_output_weights_and_finite_grads(gen, engine):
    q, k, v, _ = make_inputs(gen, L=6, S=5)
    for t in (q, k, v):
        t.requires_grad_(True)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[2] = False
    out, w, reads = run_or_skip(engine, q, k, v, mask)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    with reads:
        assert torch.equal(w.full()[:, :, 2], torch.zeros(2, 3, 5))
        assert torch.equal(w.lse[:, :, 2], torch.zeros(2, 3))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "dead_rows"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("E,Ev", [(16, 16), (40, 59), (59, 16)])
def test_gradients_match_oracle(gen, engine, mask_kind, causal, E, Ev):
    q, k, v, mask = make_inputs(gen, Hq=4, Hkv=2, L=37, S=37, E=E, Ev=Ev, mask_kind=mask_kind)
    mask = None if mask is None else mask[:, :1]  # one mask for all heads (B, 1, L, S)
    grad_out = randn(gen, 2, 4, 37, Ev)
    ours = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = [t.double().requires_grad_(True) for t in (q, k, v)]
    run_or_skip(engine, *ours, mask, causal=causal)[0].backward(grad_out)
    oracle(*ref, mask, causal=causal)[0].backward(grad_out.double())
    for name, a, b in zip("qkv", ours, ref, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_half_precision_within_twice_the_listings_error(gen, engine, dtype, mask_kind):
    """The flash-attention rule: err(ours) <= 2 * err(the listing run in that dtype)."""
    q, k, v, mask = make_inputs(gen, L=97, S=130, E=64, dtype=dtype, mask_kind=mask_kind)
    out, w, reads = run_or_skip(engine, q, k, v, mask)
    with reads:
        p = w.full()
    assert out.dtype == dtype and w.dtype == torch.float32 and p.dtype == torch.float32
    ref_out, ref_p = oracle(q, k, v, mask)
    low_out, low_p = oracle(q, k, v, mask, dtype=dtype)  # the listing's math in `dtype`
    err = (out.double() - ref_out).abs().max()
    assert err <= 2 * (low_out.double() - ref_out).abs().max() + 1e-6
    # float32 weights beat the listing's 16-bit weights outright
    assert (p.double() - ref_p).abs().max() <= (low_p.double() - ref_p).abs().max()
    torch.testing.assert_close(p.double(), ref_p, atol=1e-2, rtol=0)


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
def test_half_precision_gradients_within_three_times_the_listings_error(gen, engine):
    q, k, v, mask = make_inputs(gen, L=64, S=80, E=32, dtype=torch.bfloat16, mask_kind="bool")
    grad_out = randn(gen, 2, 3, 64, 32, dtype=torch.bfloat16)

    def grads(fn, dtype):
        ts = [t.detach().to(dtype).clone().requires_grad_(True) for t in (q, k, v)]
        fn(*ts).backward(grad_out.to(dtype))
        return [t.grad.double() for t in ts]

    ours = grads(lambda *t: run_or_skip(engine, *t, mask)[0], torch.bfloat16)
    low = grads(lambda *t: oracle(*t, mask, dtype=torch.bfloat16)[0], torch.bfloat16)
    ref = grads(lambda *t: oracle(*t, mask)[0], torch.float64)
    for a, b, r in zip(ours, low, ref, strict=True):
        assert (a - r).abs().max() <= 3 * (b - r).abs().max() + 1e-6


def test_dropout_drops_weights_before_value_and_returns_undropped_weights(gen):
    q, k, v, mask = make_inputs(gen, B=1, Hq=2, L=8, S=10, E=16, mask_kind="bool")
    ref_out, ref_p = oracle(q, k, v, mask)
    outs = []
    for _ in range(400):
        out, w = sdpa.attention(q, k, v, mask, dropout_p=0.5)
        outs.append(out.double())
    torch.testing.assert_close(w.full().double(), ref_p, atol=ATOL, rtol=0)
    # dropout is unbiased: the mean output converges to the undropped one (z-score < 6)
    samples = torch.stack(outs)
    stderr = samples.std(0) / len(outs) ** 0.5
    assert torch.all((samples.mean(0) - ref_out).abs() <= 6 * stderr + 1e-6)
    assert not torch.allclose(outs[0], outs[1])  # and it really drops
    out, _ = sdpa.attention(q, k, v, mask, dropout_p=1.0)
    assert torch.equal(out, torch.zeros_like(out))


def test_dropout_is_served_by_reference_on_cpu(gen):
    q, k, v, _ = make_inputs(gen)
    with pytest.raises(sdpa.NotSupportedError, match=r"dropout_p=0.1 > 0 on CPU"):
        sdpa.attention(q, k, v, dropout_p=0.1, backend="fused")
    assert sdpa.attention(q, k, v, dropout_p=0.1).output.shape == (2, 3, 7, 16)


def test_autocast_follows_torch(gen):
    q, k, v, mask = make_inputs(gen, L=33, S=40, mask_kind="float")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, w = sdpa.attention(q, k, v, mask)
        theirs = F.scaled_dot_product_attention(q, k, v, mask)
        f64 = sdpa.attention(q.double(), k.double(), v.double()).output
    assert ours.dtype == theirs.dtype == torch.bfloat16 and f64.dtype == torch.float64
    assert w.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, atol=1e-2, rtol=0)


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
def test_non_contiguous_inputs(gen, engine):
    q = randn(gen, 2, 11, 3, 16).transpose(1, 2)  # (B, H, L, E) from (B, L, H, E)
    k = randn(gen, 2, 13, 3, 16).transpose(1, 2)
    v = randn(gen, 2, 3, 16, 13).transpose(-1, -2)
    out, w, reads = run_or_skip(engine, q, k, v)
    check(out, w, *oracle(q, k, v), reads=reads)


@pytest.mark.parametrize("L,S", [(0, 5), (4, 0)])
def test_empty_lengths(gen, L, S):
    q, k, v, _ = make_inputs(gen, L=L, S=S)
    out, w = sdpa.attention(q, k, v)
    assert out.shape == (2, 3, L, 16) and w.full().shape == (2, 3, L, S)
    assert torch.equal(out, torch.zeros_like(out))  # no key: output 0


def test_inference_mode(gen):
    q, k, v, _ = make_inputs(gen)
    with torch.inference_mode():
        out, w = sdpa.attention(q * 1, k * 1, v)
        check(out, w, *oracle(q, k, v))


def test_listing_agrees_with_oracle_away_from_edges(gen):
    """The oracle is the listing: same numbers wherever no row is fully masked."""
    q, k, v, mask = make_inputs(gen, mask_kind="bool")
    mask[..., 0] = True
    torch.testing.assert_close(
        listing.attention(q.double(), k.double(), v.double(), mask)[1], oracle(q, k, v, mask)[1]
    )


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
@pytest.mark.parametrize(
    "shapes",
    [
        ((1, 2, 2, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8)),  # 5-D query, 4-D key/value
        ((2, 2, 4, 5, 8), (2, 4, 6, 8), (2, 4, 6, 8)),
        ((3, 1, 2, 4, 8), (2, 2, 6, 8), (1, 2, 2, 6, 8)),
        ((2, 4, 8), (3, 2, 1, 6, 8), (2, 1, 6, 8)),  # 3-D query among 4-D+: dim -3 is heads
    ],
)
def test_mixed_ranks_broadcast_like_torch(gen, engine, shapes):
    q, k, v = (randn(gen, *s) for s in shapes)
    out, w, reads = run_or_skip(engine, q, k, v)
    ref_out, ref_p = oracle(q, k, v)
    assert out.shape == ref_out.shape and w.shape == ref_p.shape
    check(out, w, ref_out, ref_p, reads=reads)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=0)


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
@pytest.mark.parametrize("big", [-1e4, -1e9, torch.finfo(torch.float32).min])
def test_rows_masked_with_a_large_finite_bias(gen, engine, big):
    """The -1e9 / finfo.min convention (the listing, Hugging Face). In float32 a row
    masked everywhere has s + big rounded to big: torch's kernel and the listing both
    give it uniform weights, and our weights must say what our output did."""
    q, k, v, _ = make_inputs(gen, L=6, S=9)
    mask = torch.zeros(6, 9)
    mask[1] = big  # every key
    mask[2, 4:] = big  # some keys
    out, w, reads = run_or_skip(engine, q, k, v, mask)
    with reads:
        p = w.full()
    f32_out, f32_p = oracle(q, k, v, mask, dtype=torch.float32)  # the float32 rounding
    torch.testing.assert_close(p, f32_p, atol=2e-5, rtol=0)
    torch.testing.assert_close(out, f32_out, atol=2e-5, rtol=0)
    assert torch.all(p[:, :, 2, 4:] == 0)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 3, 6))
    if big <= -1e9:
        torch.testing.assert_close(p[:, :, 1], torch.full((2, 3, 9), 1 / 9))


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
@pytest.mark.parametrize("scale", [3.0, 10.0])
def test_weights_of_large_scores_are_as_exact_as_the_listings(gen, engine, scale):
    """Scores in the hundreds: a float32 LSE has lost digits, weights must not."""
    q, k, v, _ = make_inputs(gen, L=64, S=64, E=64)
    _, w, reads = run_or_skip(engine, q, k, v, scale=scale)
    with reads:
        p = w.full()
    ref_p = oracle(q, k, v, scale=scale)[1]
    scores = q @ k.mT * scale
    listing_err = (torch.softmax(scores, -1).double() - ref_p).abs().max()
    # rows under the exact-LSE limit keep the usual float32 bound, 2e-5. With scores in
    # the hundreds each weight's error is that of its float32 score (p * eps * |s|), whose
    # rounding differs from the listing's with the order of the product's sums: 2x the
    # listing's error fails for about one seed in thirty, 2 eps max|s| never
    rounding = 2 * torch.finfo(torch.float32).eps * scores.abs().max().item()
    assert (p.double() - ref_p).abs().max() <= max(2 * listing_err, 2e-5, rounding)


def test_float_mask_with_grad_is_served_and_differentiated(gen):
    """Learned biases (ALiBi, relative positions): the fused kernel has no mask gradient."""
    q, k, v, _ = make_inputs(gen, L=6, S=7)
    bias = torch.randn(3, 6, 7, generator=gen, requires_grad=True)
    ref_bias = bias.detach().double().requires_grad_(True)
    with pytest.raises(sdpa.NotSupportedError, match=r"float mask that requires grad"):
        sdpa.attention(q, k, v, bias, backend="fused")
    sdpa.attention(q, k, v, bias).output.square().sum().backward()
    oracle(q, k, v, ref_bias)[0].square().sum().backward()
    torch.testing.assert_close(bias.grad.double(), ref_bias.grad, atol=1e-5, rtol=0)
    with torch.no_grad():  # no gradient wanted: the fused kernel serves it
        assert sdpa.attention(q, k, v, bias, backend="fused").output.shape == (2, 3, 6, 16)
