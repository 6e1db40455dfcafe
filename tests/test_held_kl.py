"""The KL read from both sides' kept weights (AttentionWeights._held_kl: the small
backend's weights, or one product where small) equals the tile-by-tile read it replaces,
values and gradients into both sides, forward and reverse, over every mask kind, padded
and declared rows, a mask on one side only; and where the kept weights cannot give the
tiles' value (a weight that underflowed to 0 under a key the other side weighs, a NaN)
the read falls back to the tiles."""

from __future__ import annotations

import pytest
import torch

import sdpa
from sdpa import masks
from sdpa.weights import AttentionWeights

from conftest import MASK_KINDS, make_inputs, make_mask

pytestmark = pytest.mark.small_shapes  # (the small backend and one product at their real sizes)


def _kl_both_ways(monkeypatch, build, reverse, real=None):
    """(value, grads of q, k, teacher q) of ws._kl(wt) through the kept weights, and the
    same through the tiles (the held path turned off), from fresh calls each."""
    out = []
    for held in (True, False):
        if not held:
            monkeypatch.setattr(AttentionWeights, "_held_kl", lambda *a: None)
        q, k, qt, ws, wt = build()
        assert held is False or ws._held() is not None  # (the kept path is the one taken)
        value = ws._kl(wt, reverse=reverse, real=real)
        c = torch.linspace(0.5, 1.5, value.numel()).view(value.shape)
        grads = torch.autograd.grad((c * value).sum(), (q, k, qt), allow_unused=True)
        out.append((value.detach(), *grads))
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_the_kept_weights_kl_is_the_tiles_kl(gen, monkeypatch, kind, reverse):
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))

    def build():
        g = torch.Generator().manual_seed(seed)
        q, k, v, mask = make_inputs(g, B=2, Hq=4, Hkv=2, L=9, S=11, mask_kind=kind)
        qt = torch.randn(q.shape, generator=g).requires_grad_()
        q.requires_grad_(), k.requires_grad_()
        other = make_mask(g, "key_padding", 2, 4, 9, 11)  # (the teacher's own padding)
        ws = sdpa.attention(q, k, v, mask).weights
        wt = sdpa.attention(qt, k.detach(), v, other if kind == "bool" else mask).weights
        return q, k, qt, ws, wt

    held, tiles = _kl_both_ways(monkeypatch, build, reverse)
    for a, b, what in zip(held, tiles, ("value", "dq", "dk", "dq teacher"), strict=True):
        if what != "value" and not tiles[0].isfinite().all():
            break  # (an infinite KL: the tiles' value, no gradient to compare)
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5, equal_nan=True, msg=what)


@pytest.mark.parametrize("reverse", [False, True])
def test_real_rows_and_declared_queries_read_as_the_tiles_do(monkeypatch, reverse):
    """A loss's real rows (sdpa.losses: rows outside the first..last real one read 0) and
    a mask's declared padded queries give the tiles' rows on the kept path."""
    keep = torch.zeros(3, 12, dtype=torch.bool)
    keep[0, :7], keep[1, 3:], keep[2, :] = True, True, True

    def build():
        g = torch.Generator().manual_seed(11)
        q, k, qt = (torch.randn(3, 2, 12, 8, generator=g, requires_grad=True) for _ in range(3))
        mask = masks.padding([7, 12, 0], queries=True)
        ws = sdpa.attention(q, k, k, mask).weights
        wt = sdpa.attention(qt, k.detach(), k.detach(), mask).weights
        return q, k, qt, ws, wt

    for real in (None, keep):
        held, tiles = _kl_both_ways(monkeypatch, build, reverse, real)
        for a, b in zip(held, tiles, strict=True):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_a_weight_that_underflowed_takes_the_tiles(monkeypatch):
    """The student gives a key exp(-200) (0 in float32) where the teacher weighs it: the
    kept weights' log would be -inf, the tiles' log-softmax keeps -200, so the value is
    finite and the read falls back to the tiles for it."""
    q = torch.zeros(1, 1, 2, 4)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 3, 4)
    k[0, 0, 0, 0] = 200.0 * 2  # (scale 1/2: score 200 at key 0 for the student)
    qt = torch.zeros(1, 1, 2, 4)  # (the teacher: uniform)
    ws = sdpa.attention(q, k, k).weights
    wt = sdpa.attention(qt, k, k).weights
    assert ws._held() is not None and (ws._held() == 0).any()
    value = ws.kl(wt)
    assert value.isfinite().all() and (value > 100).all()  # (about 2/3 x 200 per row)
    monkeypatch.setattr(AttentionWeights, "_held_kl", lambda *a: None)
    torch.testing.assert_close(value, ws.kl(wt))


@pytest.mark.parametrize("reverse", [False, True])
def test_a_nan_weight_makes_its_row_nan_as_the_dense_kl(gen, reverse):
    """A NaN in the teacher's q: its row of weights is NaN, and so is that row's KL on
    either side of it (the dense formula's answer; the kept path once read 0 there)."""
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=6, S=7)
    qt = q.clone()
    qt[0, 1, 3, 0] = float("nan")
    ws, wt = sdpa.attention(q, k, v).weights, sdpa.attention(qt, k, v).weights
    assert ws._held() is not None and wt._held() is not None
    value = ws.kl(wt, reverse=reverse)
    ps, pt = ws.full().double(), wt.full().double()
    first, second = (ps, pt) if reverse else (pt, ps)
    want = (first * (first.log() - second.log())).sum(-1)
    assert value[0, 1, 3].isnan() and want[0, 1, 3].isnan()
    torch.testing.assert_close(value.double(), want, atol=1e-6, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("read", ["entropy", "full", "sum over queries", "kl"])
def test_kept_reads_of_a_self_relation_count_its_tensor_once(read):
    """attention(x, x, x) (MiniLM's relations: q, k and v one tensor): a read of the kept
    weights differentiates x once, as the float64 formula does (the kept graph's backward
    gave the whole gradient to q and again to k, which autograd added: twice)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 10, 8, generator=g, requires_grad=True)
    xt = torch.randn(2, 3, 10, 8, generator=g)
    w = sdpa.attention(x, x, x).weights
    assert w._held() is not None
    x64 = x.detach().double().requires_grad_()
    p = torch.softmax(x64 @ x64.mT / 8**0.5, dim=-1)
    pt = torch.softmax(xt.double() @ xt.double().mT / 8**0.5, dim=-1)
    reads = {
        "entropy": (lambda w: w.entropy(), lambda p: -(p * p.log()).sum(-1)),
        "full": (lambda w: w.full(), lambda p: p),
        "sum over queries": (lambda w: w.sum(dim=-2), lambda p: p.sum(-2)),
        "kl": (
            lambda w: w.kl(sdpa.attention(xt, xt, xt).weights),
            lambda p: (pt * (pt.log() - p.log())).sum(-1),
        ),
    }
    ours, formula = reads[read]
    got = ours(w)
    c = torch.randn(got.shape, generator=g, dtype=torch.float64)
    (g_ours,) = torch.autograd.grad((c * got.double()).sum(), x)
    (g_want,) = torch.autograd.grad((c * formula(p)).sum(), x64)
    torch.testing.assert_close(g_ours.double(), g_want, atol=2e-5, rtol=1e-5)
