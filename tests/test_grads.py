"""Gradients through every read of the weights, against the listing's autograd.

Each read's gradient into q, k, a float mask and the sinks must equal the listing's
(the float64 oracle differentiated by torch's autograd): float32 within twice the
listing's own float32 error (tests/tolerances.py), and torch.autograd.gradcheck in
float64 at small awkward sizes. Engines: the kept weights (the small backend, torch's
own autograd), and the LSE with the tile-by-tile backward (sdpa.grads) after the fused,
chunked and reference backends.
"""

from __future__ import annotations

import math

import pytest
import torch

import sdpa
from engines import BACKEND_ENGINES, KEPT, refusal
from sdpa import listing, masks, settings

from conftest import make_mask, randn
from oracle import oracle
from tolerances import EPS32, GRAD_ATOL

# read name -> (sdpa read of a handle, the same of the dense weights p)
READS = {
    "full": (lambda w: w.full(), lambda p: p),
    "row": (lambda w: w[:, :, 3], lambda p: p[:, :, 3]),
    "rows": (lambda w: w[0, :, [0, 4, 4]], lambda p: p[0][:, [0, 4, 4]]),
    "block": (lambda w: w[:, 1:, 2:5, 3:7], lambda p: p[:, 1:, 2:5, 3:7]),
    "keys": (lambda w: w[..., [1, 6, 1]], lambda p: p[..., [1, 6, 1]]),
    "sum": (lambda w: w.sum(dim=-2), lambda p: p.sum(-2)),
    "mean": (lambda w: w.mean(dim=-2), lambda p: p.mean(-2)),
    "entropy": (
        lambda w: w.entropy(),
        lambda p: -torch.where(p > 0, p * torch.where(p > 0, p, 1.0).log(), 0.0).sum(-1),
    ),
    "amax": (lambda w: w.amax(-1), lambda p: p.amax(-1)),
    "topk": (lambda w: w.topk(3)[0], lambda p: p.topk(3, dim=-1)[0]),
    "pairs": (
        lambda w: w.pairs(*_pairs(w.shape)),
        lambda p: p[(..., *_pairs(p.shape))],
    ),
    "diagonal": (lambda w: w.diagonal(-1, -2, -1), lambda p: torch.diagonal(p, -1, -2, -1)),
    "rmatmul": (
        lambda w: torch.linspace(-1, 1, w.shape[-2]) @ w,
        lambda p: torch.linspace(-1, 1, p.shape[-2], dtype=p.dtype) @ p,
    ),
}
ENGINES = BACKEND_ENGINES


def _pairs(shape):
    """Four (query, key) pairs of an L x S view, one of them twice."""
    L, S = shape[-2], shape[-1]
    return torch.tensor([0, 5, 5, 7]) % L, torch.tensor([2, 0, 0, 8]) % S


MASKS = ["none", "bool", "float", "dead_rows", "causal", "window", "padding"]


def _mask(gen, kind, B, H, L, S):
    """(the mask sdpa takes, the tensor the oracle takes)."""
    if kind == "causal":
        return masks.causal(), masks.causal().materialize(L, S)
    if kind == "window":
        m = masks.sliding_window(3, align="top-left")
        return m, m.materialize(L, S)
    if kind == "padding":
        m = masks.padding([S - 3, 2][:B])
        return m, masks.as_4d(m.materialize(L, S))
    t = make_mask(gen, kind, B, H, L, S)
    return t, t


def _grads(read, q, k, v, mask, *, sinks=None, softcap=None, scale=None, backend="auto",
           upstream=None, dtype=torch.float32):  # fmt: skip
    """(value, [dq, dk, dmask, dsinks]) of read(weights) under the upstream gradient."""
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k)]
    m = mask
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        m = mask.detach().to(dtype).clone().requires_grad_()
    z = None if sinks is None else sinks.detach().to(dtype).clone().requires_grad_()
    arg = m
    if z is not None:
        arg = masks.sinks(z, arg)
    if softcap is not None:
        arg = masks.softcap(softcap, arg)
    _, w = sdpa.attention(leaves[0], leaves[1], v.to(dtype), arg, scale=scale, backend=backend)
    value = read(w)
    value.backward(upstream.to(value.dtype))
    out = [leaves[0].grad, leaves[1].grad]
    out.append(m.grad if isinstance(m, torch.Tensor) and m.requires_grad else None)
    out.append(None if z is None else z.grad)
    return value, out


def _listing_p(q, k, mask, *, scale, softcap=None, sinks=None):
    """The listing's weights, differentiable everywhere (the oracle's softmax of a row
    that sees no key has a NaN gradient): such rows' scores are filled before the
    softmax and their weights set to 0, as the convention has it."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.mT * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s + mask if mask.is_floating_point() else s.masked_fill(~mask, -math.inf)
    dead = torch.isneginf(s.detach()).all(dim=-1, keepdim=True)
    s = s.masked_fill(dead, 0.0)
    if sinks is not None:
        column = sinks[..., None].expand(*s.shape[:-1], 1)
        return torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1].masked_fill(dead, 0)
    return torch.softmax(s, dim=-1).masked_fill(dead, 0.0)


def _oracle_grads(read, q, k, v, mask, *, sinks=None, softcap=None, scale=None,
                  upstream=None, dtype=torch.float64):  # fmt: skip
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k)]
    m = mask
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        m = mask.detach().to(dtype).clone().requires_grad_()
    z = None if sinks is None else sinks.detach().to(dtype).clone().requires_grad_()
    B, H, L = q.shape[0], q.shape[1], q.shape[2]
    zz = None if z is None else z[..., 0].expand(B, H, L)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    p = _listing_p(*leaves, m, scale=scale, softcap=softcap, sinks=zz)
    value = read(p)
    value.backward(upstream.to(dtype))
    out = [leaves[0].grad, leaves[1].grad]
    out.append(m.grad if isinstance(m, torch.Tensor) and m.requires_grad else None)
    out.append(None if z is None else z.grad)
    return value, out


def _check(name, read_w, read_p, q, k, v, mask, mask_ref, gen, engine, **mods):
    _skip_unless_runs(engine, q, k, v, mask, mods)
    upstream = None
    with torch.no_grad():
        shape = read_p(oracle(q, k, v, mask_ref, **_oracle_mods(mods, q))[1]).shape
    upstream = randn(gen, *shape)
    engine_settings = KEPT if engine == "small" else {}  # (off in the suite: conftest)
    with settings.override(chunk_bytes=7 * 4 * k.shape[2], **engine_settings):
        value, got = _grads(read_w, q, k, v, mask, backend=engine, upstream=upstream, **mods)
    ref_value, want = _oracle_grads(read_p, q, k, v, mask_ref, upstream=upstream, **mods)
    _, listing = _oracle_grads(
        read_p, q, k, v, mask_ref, upstream=upstream, dtype=torch.float32, **mods
    )
    torch.testing.assert_close(value.double(), ref_value.detach(), atol=2e-5, rtol=0)
    for what, g, g64, g32 in zip(("q", "k", "mask", "sinks"), got, want, listing, strict=True):
        if g64 is None:
            assert g is None, what
            continue
        assert g is not None, f"{name}: no gradient for {what}"
        err = (g.double() - g64).abs().max().item()
        bound = 2 * (g32.double() - g64).abs().max().item()
        floor = max(GRAD_ATOL * 0.1, 64 * EPS32 * g64.abs().max().item())
        assert err <= max(bound, floor), (
            f"{name} ({engine}): d{what} off by {err:.2e}, the listing's float32 by {bound / 2:.2e}"
        )


def _skip_unless_runs(engine, q, k, v, mask, mods):
    """Skip, with the engine's own reason, what it refuses (the fused kernels take no
    softcap and no float mask that needs its gradient): auto then picks another."""
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        mask = mask.clone().requires_grad_()
    if mods.get("sinks") is not None:
        mask = masks.sinks(mods["sinks"], mask)
    if mods.get("softcap") is not None:
        mask = masks.softcap(mods["softcap"], mask)
    why = refusal(engine, q, k, v, mask, scale=mods.get("scale"))
    if why:
        pytest.skip(f"{engine}: {why}")


def _oracle_mods(mods, q):
    B, H, L = q.shape[0], q.shape[1], q.shape[2]
    out = {k: v for k, v in mods.items() if k in ("softcap", "scale")}
    if out.get("scale") is None:
        out.pop("scale", None)
    if mods.get("sinks") is not None:
        out["sinks"] = mods["sinks"][..., 0].expand(B, H, L)
    return out


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(READS))
@pytest.mark.parametrize("mask_kind", MASKS)
def test_every_read_carries_the_listings_gradient(gen, engine, name, mask_kind):
    B, Hq, Hkv, L, S, E = 2, 4, 2, 9, 11, 12
    q, k, v = randn(gen, B, Hq, L, E), randn(gen, B, Hkv, S, E), randn(gen, B, Hkv, S, E)
    if mask_kind == "causal":
        k, v = k[:, :, :L], v[:, :, :L]
    mask, mask_ref = _mask(gen, mask_kind, B, Hq, L, k.shape[2])
    read_w, read_p = READS[name]
    _check(name, read_w, read_p, q, k, v, mask, mask_ref, gen, engine)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", ["full", "keys", "sum", "entropy", "amax", "pairs"])
@pytest.mark.parametrize(
    "mods",
    [
        {"sinks": "per-head"},
        {"softcap": 1.5},
        {"scale": 1.7},
        {"zero scale": 0.0},
        {"softcap": 2.0, "sinks": "per-head", "scale": 0.6},
    ],
    ids=lambda m: "+".join(m),
)
def test_gradients_with_score_mods(gen, engine, name, mods):
    B, Hq, Hkv, L, S, E = 2, 4, 1, 9, 11, 8
    q, k, v = randn(gen, B, Hq, L, E), randn(gen, B, Hkv, S, E), randn(gen, B, Hkv, S, E)
    mask = make_mask(gen, "bool", B, Hq, L, S)
    mods = dict(mods)
    if "zero scale" in mods:
        mods["scale"] = mods.pop("zero scale")
    if mods.get("sinks") == "per-head":
        mods["sinks"] = randn(gen, Hq, 1, 1)
    read_w, read_p = READS[name]
    _check(name, read_w, read_p, q, k, v, mask, mask, gen, engine, **mods)


def test_the_two_silent_cases_of_the_issue(gen):
    """issue 26: q.grad of out.sum() + w.entropy().sum() equals the listing's (it was
    off by 0.25: the entropy's share was dropped)."""
    q, k, v = randn(gen, 1, 2, 8, 16), randn(gen, 1, 2, 8, 16), randn(gen, 1, 2, 8, 16)
    for small in (True, False):
        q1 = q.clone().requires_grad_()
        override = {} if small else {"small_weights": 0, "one_product_weights": 0}
        with settings.override(**override):
            out, w = sdpa.attention(q1, k, v)
            (out.sum() + w.entropy().sum()).backward()
        q2 = q.clone().requires_grad_()
        out2, p = listing.attention(q2, k, v)
        (out2.sum() - (p * p.log()).sum()).backward()
        torch.testing.assert_close(q1.grad, q2.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["full", "keys", "sum", "entropy", "amax", "topk", "pairs"])
def test_gradcheck_in_float64(name):
    """torch.autograd.gradcheck (finite differences) through the tile backward, L != S,
    GQA, a float mask with -inf entries (rows that see no key) and sinks."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 7, 3, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, 7, 3, generator=g, dtype=torch.float64)
    bias = torch.randn(1, 1, 5, 7, generator=g, dtype=torch.float64)
    bias[..., 2, :] = -torch.inf  # a row that sees no key
    z = torch.randn(2, 1, 1, generator=g, dtype=torch.float64)
    read = READS[name][0]

    def f(q, k, bias, z):
        with settings.override(small_weights=0, one_product_weights=0, chunk_bytes=3 * 8 * 7):
            _, w = sdpa.attention(q, k, v, masks.sinks(z, bias))  # chunked: the mask's grad
            return read(w)

    args = [t.clone().requires_grad_() for t in (q, k, bias, z)]
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6, nondet_tol=1e-12)


def test_kl_gradients_into_both_sides_with_a_head_map(gen):
    """w.kl(t) = KL(t || w): into the student g (w - t), into the teacher (with fewer,
    mapped heads) g t (ln t - ln w - KL), both against the oracle."""
    B, L, S = 2, 9, 11
    qs, ks = randn(gen, B, 4, L, 16), randn(gen, B, 2, S, 16)
    qt, kt = randn(gen, B, 2, L, 8), randn(gen, B, 1, S, 8)
    mask = make_mask(gen, "bool", B, 1, L, S)
    mask[..., 0] = True
    head_map = [1, 0, 0, 1]
    for reverse in (False, True):
        leaves = [t.clone().requires_grad_() for t in (qs, ks, qt, kt)]
        with settings.override(small_weights=0, one_product_weights=0):
            w_s = sdpa.attention(leaves[0], leaves[1], leaves[1], mask).weights
            w_t = sdpa.attention(leaves[2], leaves[3], leaves[3], mask).weights
            kl = w_s.kl(w_t, reverse=reverse, head_map=head_map)
        up = randn(gen, *kl.shape)
        kl.backward(up)
        ref = [t.double().requires_grad_() for t in (qs, ks, qt, kt)]
        p_s = oracle(ref[0], ref[1], ref[1], mask)[1]
        p_t = oracle(ref[2], ref[3], ref[3], mask)[1][:, head_map]
        first, second = (p_s, p_t) if reverse else (p_t, p_s)
        on = first > 0  # (keys the first gives 0 add 0: no NaN gradient through log 0)
        log_ratio = torch.where(on, first, 1.0).log() - torch.where(on, second, 1.0).log()
        want = torch.where(on, first * log_ratio, 0.0).sum(-1)
        torch.testing.assert_close(kl.double(), want.detach(), atol=2e-5, rtol=0)
        want.backward(up.double())
        for got, r in zip(leaves, ref, strict=True):
            torch.testing.assert_close(got.grad.double(), r.grad, atol=5e-6, rtol=1e-4)


@pytest.mark.parametrize("groups", [(8, 8, 8, 2), (8, 2, 8, 8), (8, 4, 8, 2), (8, 2, 8, 4)])
@pytest.mark.parametrize("chunk", [None, 4 * 11 * 4 * 3])
def test_kl_without_a_head_map_between_other_key_head_groups(gen, groups, chunk):
    """Without a head map head h meets head h, each side with its own key heads (no
    copy of the other side's inputs): the tiles cut by the student's grouping also fit
    the teacher's, whole heads at once or (a tiny chunk) one head at a time."""
    hs, ks, ht, kt = groups
    B, L, S = 1, 9, 11
    leaves = [
        randn(gen, B, n, m, 8).requires_grad_() for n, m in ((hs, L), (ks, S), (ht, L), (kt, S))
    ]
    tuning = {"small_weights": 0, "one_product_weights": 0} | (
        {} if chunk is None else {"chunk_bytes": chunk}
    )
    with settings.override(**tuning):
        w_s = sdpa.attention(leaves[0], leaves[1], leaves[1]).weights
        w_t = sdpa.attention(leaves[2], leaves[3], leaves[3]).weights
        kl = w_s.kl(w_t)
    kl.sum().backward()
    ref = [t.detach().double().requires_grad_() for t in leaves]
    p_s, p_t = oracle(ref[0], ref[1], ref[1])[1], oracle(ref[2], ref[3], ref[3])[1]
    want = (p_t * (p_t.log() - p_s.log())).sum(-1)
    torch.testing.assert_close(kl.double(), want.detach(), atol=2e-5, rtol=0)
    want.sum().backward()
    for got, r in zip(leaves, ref, strict=True):
        torch.testing.assert_close(got.grad.double(), r.grad, atol=5e-6, rtol=1e-4)


def test_kl_gradients_with_sinks_on_either_side(gen):
    """With sinks a side's weights sum to less than 1: the KL's gradient then has terms
    that vanish without them (into the side that weighs the sum: Q (1 - sum Q))."""
    B, H, L, S = 1, 2, 7, 9
    qs, ks, qt, kt = (randn(gen, B, H, n, 8) for n in (L, S, L, S))
    zs, zt = randn(gen, H, 1, 1), randn(gen, H, 1, 1)
    for reverse in (False, True):
        leaves = [t.clone().requires_grad_() for t in (qs, ks, qt, kt, zs, zt)]
        with settings.override(small_weights=0, one_product_weights=0):
            w_s = sdpa.attention(leaves[0], leaves[1], leaves[1], masks.sinks(leaves[4])).weights
            w_t = sdpa.attention(leaves[2], leaves[3], leaves[3], masks.sinks(leaves[5])).weights
            kl = w_s.kl(w_t, reverse=reverse)
        up = randn(gen, *kl.shape)
        kl.backward(up)
        ref = [t.double().requires_grad_() for t in (qs, ks, qt, kt, zs, zt)]
        scale = 1 / math.sqrt(8)
        p_s = _listing_p(ref[0], ref[1], None, scale=scale, sinks=ref[4][..., 0].expand(B, H, L))
        p_t = _listing_p(ref[2], ref[3], None, scale=scale, sinks=ref[5][..., 0].expand(B, H, L))
        first, second = (p_s, p_t) if reverse else (p_t, p_s)
        want = (first * (first.log() - second.log())).sum(-1)
        torch.testing.assert_close(kl.double(), want.detach(), atol=2e-5, rtol=0)
        want.backward(up.double())
        for got, r in zip(leaves, ref, strict=True):
            torch.testing.assert_close(got.grad.double(), r.grad, atol=5e-6, rtol=1e-4)


@pytest.mark.parametrize("engine", ENGINES)
def test_amax_splits_ties_as_torch_does(gen, engine):
    """Two equal keys give each row tied largest weights: torch.amax's backward splits
    the gradient evenly between them, and so must the read's."""
    q = randn(gen, 1, 2, 6, 8)
    k = randn(gen, 1, 2, 5, 8)
    k = torch.cat([k, k[:, :, :1]], dim=2)  # key 5 repeats key 0
    keep = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    keep[..., 2] = False
    _check("amax", READS["amax"][0], READS["amax"][1], q, k, k, keep, keep, gen, engine)
    q_big = q * 6.0  # peaked rows: the tied pair is each row's largest (or not at all)
    _check("amax", READS["amax"][0], READS["amax"][1], q_big, k, k, keep, keep, gen, engine)


def test_matmul_carries_gradients_to_q_k_and_x(gen):
    q, k = randn(gen, 2, 4, 9, 16).requires_grad_(), randn(gen, 2, 2, 11, 16).requires_grad_()
    x = randn(gen, 2, 1, 11, 5).requires_grad_()
    with settings.override(small_weights=0, one_product_weights=0):
        w = sdpa.attention(q, k, k).weights
        y = w @ x
    up = randn(gen, *y.shape)
    y.backward(up)
    ref = [t.detach().double().requires_grad_() for t in (q, k, x)]
    (oracle(ref[0], ref[1], ref[1])[1] @ ref[2]).backward(up.double())
    for got, r in zip((q, k, x), ref, strict=True):
        torch.testing.assert_close(got.grad.double(), r.grad, atol=5e-6, rtol=1e-4)


def test_a_double_backward_is_refused(gen):
    q = randn(gen, 1, 2, 9, 8).requires_grad_()
    with settings.override(small_weights=0, one_product_weights=0):
        h = sdpa.attention(q, q, q).weights.entropy().sum()
    with pytest.raises(sdpa.NotSupportedError, match="double backward"):
        torch.autograd.grad(h, q, create_graph=True)
    (g,) = torch.autograd.grad(h, q)  # first order: fine
    assert torch.isfinite(g).all()


def test_the_backward_uses_the_forwards_settings(gen):
    """autograd's threads do not see the caller's ContextVar: the backward runs under the
    settings captured at the forward (a tiny chunk budget: many tiles, same gradient)."""
    q = randn(gen, 2, 3, 40, 8).requires_grad_()
    calls = []
    from sdpa import rows

    real = rows.tiles

    def counting(r, budget):
        calls.append(budget)
        return real(r, budget)

    with settings.override(small_weights=0, one_product_weights=0, chunk_bytes=4 * 40 * 4):
        h = sdpa.attention(q, q, q).weights.entropy()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rows, "tiles", counting)
        h.sum().backward()
    assert calls and set(calls) == {4 * 40 * 4}


def test_frozen_patterns_send_gradients_only_through_the_values(gen):
    q, k, v = (randn(gen, 1, 2, 9, 8).requires_grad_() for _ in range(3))
    with sdpa.frozen():
        out, w = sdpa.attention(q, k, v)
    out.sum().backward()
    assert q.grad is None and k.grad is None
    ref = v.detach().clone().requires_grad_()
    out2, _ = listing.attention(q.detach(), k.detach(), ref)
    out2.sum().backward()
    torch.testing.assert_close(v.grad, ref.grad, atol=1e-6, rtol=0)
    with pytest.raises(sdpa.NotSupportedError, match=r"sdpa\.frozen"):
        w.entropy()
    with torch.no_grad():
        torch.testing.assert_close(w.full(), oracle(q, k, v)[1].float(), atol=2e-6, rtol=0)


@pytest.mark.small_shapes
def test_kept_weights_made_without_grad_carry_the_gradient_when_read_with_it(gen):
    """The small backend keeps p; made under no_grad it is outside the graph, and full()
    read later with grad on carries the listing's gradient (not a copy of a detached p);
    kept weights of a frozen call refuse full() under grad."""
    q, k, v = (randn(gen, 1, 2, 9, 8).requires_grad_() for _ in range(3))
    with torch.no_grad():
        w = sdpa.attention(q, k, v).weights
    assert w.served_by.startswith("small")
    g = randn(gen, 1, 2, 9, 9)
    (w.full() * g).sum().backward()
    want = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    (listing.attention(*want)[1] * g).sum().backward()
    torch.testing.assert_close(q.grad, want[0].grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(k.grad, want[1].grad, atol=1e-6, rtol=1e-5)
    with sdpa.frozen():
        frozen = sdpa.attention(q, k, v).weights
    assert frozen.served_by.startswith("small")
    with pytest.raises(sdpa.NotSupportedError, match=r"sdpa\.frozen"):
        frozen.full()


def test_reads_without_grad_stay_plain(gen):
    q = randn(gen, 1, 2, 9, 8).requires_grad_()
    with settings.override(small_weights=0, one_product_weights=0):
        w = sdpa.attention(q, q, q).weights
        with torch.no_grad():
            for read, _ in READS.values():
                assert not read(w).requires_grad
        w2 = sdpa.attention(q.detach(), q.detach(), q.detach()).weights
        for read, _ in READS.values():
            assert not read(w2).requires_grad


def test_max_logits_refuses_gradients(gen):
    q = randn(gen, 1, 2, 9, 8).requires_grad_()
    w = sdpa.attention(q, q, q).weights
    with pytest.raises(sdpa.NotSupportedError, match="forward only"):
        w.max_logits()
    with torch.no_grad():
        top = w.max_logits()
    s = (q @ q.mT) / math.sqrt(8)
    torch.testing.assert_close(top.row, s.amax(-1).detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(top.head, s.amax(-1).amax(-1).detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mask_kind", ["none", "float"])
def test_kept_weights_give_each_read_its_own_graph(gen, mask_kind):
    """The small backend keeps its weights; a read of them under grad hands them out as
    a graph of their own (no product again in the forward): two reads, two backwards,
    each equal to the oracle's gradient; the output's backward after them; and a second
    order through the read (create_graph) as torch's own product gives."""
    q, k, v = (randn(gen, 1, 2, 6, 8).requires_grad_() for _ in range(3))
    mask = (0.5 * randn(gen, 1, 1, 6, 6)).requires_grad_() if mask_kind == "float" else None
    with settings.override(**KEPT):
        out, w = sdpa.attention(q, k, v, mask)
    assert w.served_by.startswith("small")  # (the weights kept: the path under test)
    ins = [t for t in (q, k, mask) if t is not None]
    ref = [t.detach().double().requires_grad_() for t in ins]

    def p_ref():
        return oracle(ref[0], ref[1], v.detach().double(), None if mask is None else ref[2])[1]

    want = torch.autograd.grad((p_ref() ** 2).sum(), ref)
    for _ in range(2):
        got = torch.autograd.grad((w.full() ** 2).sum(), ins)
        for g, r in zip(got, want, strict=True):
            torch.testing.assert_close(g.double(), r, atol=GRAD_ATOL, rtol=1e-4)
    out.sum().backward()  # the output's graph is its own too
    (dq,) = torch.autograd.grad((w.full() ** 2).sum(), q, create_graph=True)
    (dq_ref,) = torch.autograd.grad((p_ref() ** 2).sum(), ref[0], create_graph=True)
    (ddq,) = torch.autograd.grad(dq.square().sum(), q)
    (ddq_ref,) = torch.autograd.grad(dq_ref.square().sum(), ref[0])
    torch.testing.assert_close(ddq.double(), ddq_ref, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("chunk", [None, 4 * 11 * 4 * 3])
def test_kl_against_a_dense_target_leaves_it_as_it_was(gen, chunk):
    """w.kl(t) with t a dense tensor (B, H, L, S): the backward reads t's tiles and never
    writes them (the rule works in place on the tiles it computes, not on a caller's);
    the gradient into q and k equals the oracle's, and t's own gradient too."""
    B, H, L, S = 2, 3, 9, 11
    q, k = randn(gen, B, H, L, 8).requires_grad_(), randn(gen, B, H, S, 8).requires_grad_()
    target = torch.softmax(randn(gen, B, H, L, S), dim=-1).requires_grad_()
    kept = target.detach().clone()
    tuning = {"small_weights": 0, "one_product_weights": 0} | (
        {} if chunk is None else {"chunk_bytes": chunk}
    )
    with settings.override(**tuning):
        kl = sdpa.attention(q, k, k).weights.kl(target)
    up = randn(gen, *kl.shape)
    kl.backward(up)
    assert torch.equal(target.detach(), kept), "the backward wrote into the dense target"
    ref = [t.detach().double().requires_grad_() for t in (q, k, target)]
    p = oracle(ref[0], ref[1], ref[1])[1]
    want = (ref[2] * (ref[2].log() - p.log())).sum(-1)
    torch.testing.assert_close(kl.double(), want.detach(), atol=2e-5, rtol=0)
    want.backward(up.double())
    for got, r in zip((q, k, target), ref, strict=True):
        torch.testing.assert_close(got.grad.double(), r.grad, atol=5e-6, rtol=1e-4)


def test_a_tile_backward_makes_one_product_per_input_not_one_per_head():
    """Under key padding a tile's dK lands in a strided slice of dK (its key span):
    one batched product, then one add, not torch's strided baddbmm_ (one small GEMM per
    head, each a parallel region, which a busy machine stretches 40x)."""
    from torch.profiler import ProfilerActivity, profile

    B, H, L, E = 2, 12, 300, 16
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, H, L, E, generator=g).requires_grad_() for _ in range(2))
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
    keep[1, ..., 200:] = False  # (element 1: keys [0, 200), a strided slice of dK)
    with settings.override(small_weights=0, one_product_weights=0):
        w = sdpa.attention(q, k, k, keep.expand(B, 1, L, L)).weights
        value = w.entropy().sum()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        value.backward()
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::addmm_", 0) == 0, counts
    ref = [t.detach().double().requires_grad_() for t in (q, k)]
    p = oracle(ref[0], ref[1], ref[1], keep)[1]
    want = -(p * p.clamp_min(1e-300).log()).sum()  # (0 log 0 = 0, gradient finite)
    want.backward()
    for got, r in zip((q, k), ref, strict=True):
        torch.testing.assert_close(got.grad.double(), r.grad, atol=5e-6, rtol=1e-4)
