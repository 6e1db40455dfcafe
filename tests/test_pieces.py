"""The entropy in pieces (sdpa.rows.pieces): a row tile of complete rows read in blocks
of keys shifted by the LSE (every |lse| within exact_lse_limit), or in chunks of whole
rows shifted by their max (an LSE past it), gives the float64 oracle's entropy within
the precision rule (tests/tolerances.py) and its gradients, at chunk sizes that cut key
blocks on every edge (one key, a row's last block short, several blocks a row), under
no mask, causal, bool and float masks, key padding, declared padded queries, sinks, a
softcap, GQA and non-default scales; the attention received in the same pieces (a
block's rows exp(s - lse), not divided by their totals) and top-k (whole rows, their
exponentials through tile.exp) beside it. A property test (hypothesis), not examples."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa
from sdpa import masks, rows
from sdpa import settings as sdpa_settings

from oracle import oracle
from tolerances import STAT_FLOOR, WEIGHTS_FLOOR, selection_atol, within_rule

MASKS = ["none", "causal", "bool", "float", "padding", "padding(queries=True)"]
# the engine, not the held weights (small shapes hold their dense weights)
ENGINE = {"small_weights": 0, "one_product_weights": 0}


@st.composite
def cases(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.integers(1, 2))
    S = draw(st.integers(1, 40))
    L = S if draw(st.booleans()) else draw(st.integers(1, 40))
    kind = draw(st.sampled_from(MASKS))
    if kind == "causal":
        L = S
    chunk = draw(st.integers(4, 4 * Hq * L * S + 8))  # bytes: 1 key a block and up
    scale = draw(st.sampled_from([None, 0.3, 2.5]))
    softcap = draw(st.sampled_from([None, None, 4.0]))
    sinks = draw(st.booleans()) and kind != "causal"
    inexact = draw(st.booleans())  # every LSE "lost digits": whole rows by their max
    k = draw(st.integers(1, max(1, min(4, S))))
    seed = draw(st.integers(0, 2**31 - 1))
    return B, Hq, Hkv, L, S, kind, chunk, scale, softcap, sinks, inexact, k, seed


def _mask(kind, B, Hq, L, S, g):
    lengths = torch.randint(0, S + 1, (B,), generator=g).tolist()
    if kind == "bool":
        return torch.rand(B, 1, L, S, generator=g) > 0.3
    if kind == "float":
        return torch.randn(B, Hq, L, S, generator=g)
    if kind == "padding":
        return masks.padding(lengths)
    if kind == "padding(queries=True)":
        return masks.padding(lengths, queries=True)
    return None


def _truths(p: torch.Tensor, k: int):
    """(received, entropy, top-k values) of dense weights p."""
    logp = torch.where(p > 0, p, torch.ones_like(p)).log()  # (0 log 0 = 0, gradient too)
    return p.sum(dim=-2), -(p * logp).sum(dim=-1), p.topk(k, dim=-1).values


@settings(max_examples=80, deadline=None)
@given(cases())
def test_statistics_in_pieces_are_the_oracles(case):
    B, Hq, Hkv, L, S, kind, chunk, scale, softcap, sinks, inexact, k, seed = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, 8, generator=g, requires_grad=True)
    key = torch.randn(B, Hkv, S, 8, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, S, 8, generator=g)
    mask = _mask(kind, B, Hq, L, S, g)
    z = torch.randn(Hq, 1, 1, generator=g) if sinks else None
    call_mask = mask if softcap is None else masks.softcap(softcap, mask)
    call_mask = call_mask if z is None else masks.sinks(z, call_mask)
    limit = 1e-3 if inexact else 32.0  # (an LSE near 0 stays exact: whole rows then too)
    with sdpa_settings.override(chunk_bytes=chunk, exact_lse_limit=limit, **ENGINE):
        w = sdpa.attention(q, key, v, call_mask, causal=kind == "causal", scale=scale).weights
        got = (w.sum(dim=-2), w.entropy(), w.topk(k))
        grads = torch.autograd.grad(
            got[0].sum() + got[1].sum() + got[2].values.sum(), [q, key], allow_unused=True
        )
    m = mask.materialize(L, S) if isinstance(mask, masks.Mask) else mask
    ref = {"causal": kind == "causal", "scale": scale, "softcap": softcap}
    ref["sinks"] = None if z is None else z[..., 0].expand(B, Hq, L)
    qd, kd = q.detach().double().requires_grad_(), key.detach().double().requires_grad_()
    p = oracle(qd, kd, v, m, **ref)[1]
    truth = _truths(p, k)
    listing = _truths(oracle(q.detach(), key.detach(), v, m, **ref, dtype=torch.float32)[1], k)
    # Where scores are large (scale 2.5: |s| past 20) a weight's error is the rounding of
    # its score, eps |s|, in ours and in the listing alike but landing otherwise by the
    # order of the product's sums: the rule's floor then takes that class (the sum over
    # rows of received's weights, the entropy's 1 + ln p factor), tests/tolerances.py.
    score = selection_atol(w.lse.detach())
    floors = (
        max(STAT_FLOOR, score * max(1.0, truth[0].abs().max().item())),
        max(STAT_FLOOR, score * (1.0 + truth[1].abs().max().item())),
        max(WEIGHTS_FLOOR, score),
    )
    for name, ours, t, lst, floor in zip(
        ("received", "entropy", "top-k"),
        (got[0], got[1], got[2].values),
        truth,
        listing,
        floors,
        strict=True,
    ):
        ok, mine, theirs = within_rule(ours.detach(), lst, t.detach(), floor)
        assert ok, f"{name}: error {mine:.3g}, the listing's {theirs:.3g} ({case})"
    # the indices name keys of those weights (a tie may name another key of that value)
    named = p.detach().gather(-1, got[2].indices)
    assert (named - truth[2].detach()).abs().max() <= 1e-5, f"top-k indices ({case})"
    want = torch.autograd.grad(
        sum(x.sum() for x in truth), [qd, kd], allow_unused=True, materialize_grads=True
    )
    for name, a, b in zip(("q", "k"), grads, want, strict=True):
        a = torch.zeros_like(b) if a is None else a
        assert torch.allclose(a.double(), b, atol=2e-4, rtol=1e-3), f"grad {name} ({case})"


@pytest.mark.parametrize("exact", [True, False], ids=["key blocks", "row chunks"])
def test_a_long_row_is_read_in_the_pieces_it_means_to_be(exact):
    """The shapes the pieces are for: 2 heads of 64 rows of 300 keys, in one tile (the
    heads folded), chunk_bytes of 10 rows' worth: key blocks of 23 keys where the LSE is
    exact (the last one short), else chunks of 20 whole rows (stat_budget, 4 x
    chunk_bytes)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (64, 300, 300))
    chunk = 4 * 300 * 10
    with sdpa_settings.override(chunk_bytes=chunk, exact_lse_limit=32.0 if exact else 1e-3):
        w = sdpa.attention(q, k, v).weights
        r = rows.Rows.every(w._inputs, w._log_sum_exp())
        (t,) = rows.tiles(r, rows.block_budget(r))
        parts = rows.pieces(r, t)
    assert t.heads == range(2) and t.at_r == slice(0, 64) and t.keys == rows.ALL
    if exact:
        widths = [p.keys.stop - p.keys.start for p in parts]
        assert widths == [chunk // (2 * 64 * 4)] * 13 + [300 - 13 * 23]
        assert all(p.at_r == t.at_r for p in parts)
    else:
        assert [p.at_r for p in parts] == [slice(i, min(64, i + 20)) for i in range(0, 64, 20)]
        assert all(p.keys == t.keys for p in parts)
