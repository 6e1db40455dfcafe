"""The edge convention of the tile rule (sdpa.tile), on every engine and every read.

- scale = 0: every visible key gets the same weight;
- a row that sees no key: weights 0, output 0, LSE 0 (with sinks logaddexp(0, z));
- a NaN or +inf score (from q, k, or NaN / +inf in a float mask): that row's weights
  and statistics are NaN exactly where the listing's softmax row is NaN, and finite
  and equal to the listing's elsewhere;
- rows whose |lse| is far past float32's exact range: every statistic is exact, and
  the entropy never negative beyond float32's rounding.

ENGINES: the kept weights (small), the LSE of the fused, chunked and reference
backends read by the rows engine, and the Triton statistics kernels (interpreted).
"""

from __future__ import annotations

import math

import pytest
import torch

from engines import BACKEND_ENGINES, ENGINES, run
from sdpa import masks

from conftest import randn
from oracle import oracle
from tolerances import STAT_FLOOR, within_rule


def _weights(engine, q, k, v, mask=None, **kw):
    """The handle of `engine`'s call, and the settings its reads run under."""
    return run(engine, q, k, v, mask, **kw)[1:]


def _reads(w, engine):
    """Every read of a handle, as {name: value} (the Triton engine: its statistics)."""
    L, S = w.shape[-2], w.shape[-1]
    out = {
        "entropy": w.entropy(),
        "amax": w.amax(-1),
        "sum": w.sum(dim=-2),
        "max_logits": w.max_logits().row,
    }
    if engine != "triton":
        out.update(
            full=w.full(),
            row=w[:, :, L // 2],
            keys=w[..., [0, S - 1]],
            topk=w.topk(min(2, S))[0],
            diagonal=w.diagonal(0, -2, -1),
            lse=w.lse,
        )
    return out


def _listing_reads(p, scores, lse):
    """The same reads of the listing's dense weights p (float64)."""
    L, S = p.shape[-2], p.shape[-1]
    plogp = torch.where(p > 0, p * torch.where(p > 0, p, 1.0).log(), 0.0)
    plogp = torch.where(torch.isnan(p), p, plogp)
    return {
        "entropy": -plogp.sum(-1),
        "amax": p.amax(-1),
        "sum": p.sum(-2),
        "max_logits": scores.amax(-1),
        "full": p,
        "row": p[:, :, L // 2],
        "keys": p[..., [0, S - 1]],
        "topk": p.topk(min(2, S), dim=-1)[0],
        "diagonal": torch.diagonal(p, 0, -2, -1),
        "lse": lse,
    }


def _listing(q, k, mask=None, scale=None):
    """The listing in float64 without the oracle's NaN repair: (p, raw scores, lse),
    rows that see no key 0 (the convention), every other NaN kept."""
    q, k = q.double(), k.double()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.mT * scale
    if mask is not None:
        s = s + mask.double() if mask.is_floating_point() else s.masked_fill(~mask, -math.inf)
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s, dim=-1).masked_fill(dead, 0.0)
    lse = torch.logsumexp(s, dim=-1).masked_fill(dead[..., 0], 0.0)
    lse = lse.masked_fill(torch.isnan(p[..., 0]), math.nan)  # the LSE of a NaN row: NaN
    return p, s, lse


def _compare(got, want, what):
    """NaN exactly where the listing is NaN; equal elsewhere."""
    got = got.double()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (
        f"{what}: NaN at {torch.isnan(got).nonzero().tolist()[:6]}, the listing at "
        f"{torch.isnan(want).nonzero().tolist()[:6]}"
    )
    ok = ~torch.isnan(want)
    torch.testing.assert_close(got[ok], want[ok], atol=2e-5, rtol=1e-5, msg=what)


@pytest.mark.parametrize("engine", ENGINES)
def test_scale_zero_gives_uniform_weights(gen, engine):
    """The probe of issue 24: q of (1, 2, 400, 16), scale=0: sum(dim=-2) was all NaN."""
    L = 40 if engine in ("small", "triton") else 400
    q = randn(gen, 1, 2, L, 16)
    keep = torch.rand(1, 1, L, L, generator=gen) < 0.6
    keep[..., 0] = True
    w, reads = _weights(engine, q, q, q, keep, scale=0.0)
    n = keep.sum(-1).double()  # (1, 1, L)
    with reads, torch.no_grad():
        got = _reads(w, engine)
    uniform = keep.double() / n[..., None]
    want = {"entropy": n.log().expand(1, 2, L), "amax": (1 / n).expand(1, 2, L),
            "sum": uniform.sum(-2).expand(1, 2, L), "full": uniform.expand(1, 2, L, L)}  # fmt: skip
    for name in ("entropy", "amax", "sum", "full"):
        if name in got:
            _compare(got[name], want[name], f"{engine} {name}")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("sinks", [False, True])
def test_rows_that_see_no_key(gen, engine, sinks):
    if engine == "small" and sinks:
        pytest.skip("the small backend takes no sinks (the fused and chunked do)")
    B, H, L, S = 2, 2, 9, 11
    q, k, v = randn(gen, B, H, L, 8), randn(gen, B, H, S, 8), randn(gen, B, H, S, 8)
    keep = torch.rand(B, 1, L, S, generator=gen) < 0.7
    keep[..., ::3, :] = False  # every third row sees no key
    z = randn(gen, H, 1, 1)
    mask = masks.sinks(z, keep) if sinks else keep
    out, w, reads = run(engine, q, k, v, mask)
    dead = (~keep.any(-1)).expand(B, H, L)
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    zeros = torch.zeros(B, H, L)
    lse_dead = torch.logaddexp(zeros, z[..., 0].expand(B, H, L)) if sinks else zeros
    torch.testing.assert_close(w.lse[dead], lse_dead[dead], atol=1e-6, rtol=0)
    with reads, torch.no_grad():
        for name, value in _reads(w, engine).items():
            if name in ("sum", "keys", "lse") or value.shape[:3] != (B, H, L):
                continue
            want = -torch.inf if name == "max_logits" else 0.0
            rows = value[dead]
            assert torch.all(rows == want), f"{engine} {name}: {rows.flatten()[:4]}"
    with reads, torch.no_grad():  # a row that sees no key adds nothing to any key's sum
        _, p_full = oracle(q, k, v, keep, sinks=z[..., 0].expand(B, H, L) if sinks else None)
        torch.testing.assert_close(w.sum(dim=-2).double(), p_full.sum(-2), atol=1e-5, rtol=0)


def _nan_cases(gen):
    """(name, q, k, float mask or None, scale): a +inf key entry (rows with q > 0 there
    get a +inf score, the others -inf), the same at scale 0 (inf * 0: NaN), a NaN key
    entry, NaN / +inf in a float mask."""
    B, H, L, S, E = 1, 2, 7, 9, 8
    q, k = randn(gen, B, H, L, E), randn(gen, B, H, S, E)
    k_inf = k.clone()
    k_inf[0, 0, 2, 0] = math.inf
    k_nan = k.clone()
    k_nan[0, 1, 4, 3] = math.nan
    bias = randn(gen, B, 1, L, S)
    bias_nan, bias_inf = bias.clone(), bias.clone()
    bias_nan[0, 0, 3, 5] = math.nan
    bias_inf[0, 0, 1, 2] = math.inf
    return [("k +inf", q, k_inf, None, None), ("k +inf, scale 0", q, k_inf, None, 0.0),
            ("k NaN", q, k_nan, None, None), ("mask NaN", q, k, bias_nan, None),
            ("mask +inf", q, k, bias_inf, None)]  # fmt: skip


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize(
    "case", range(5), ids=["k +inf", "k +inf, scale 0", "k NaN", "mask NaN", "mask +inf"]
)
def test_a_row_is_nan_exactly_where_the_listings_is(gen, engine, case, sinks):
    name, q, k, bias, scale = _nan_cases(gen)[case]
    if sinks and engine == "small":
        pytest.skip("the small backend takes no sinks (the fused and chunked do)")
    v = randn(gen, *k.shape)
    z = randn(gen, q.shape[1], 1, 1) if sinks else None
    mask = masks.sinks(z, bias) if sinks else bias
    out, w, reads = run(engine, q, k, v, mask, scale=scale)
    p, s, lse = _listing(q, k, bias, scale=scale)
    nan_rows = torch.isnan(p[..., 0])  # (B, H, L): the listing's NaN rows
    assert torch.equal(torch.isnan(out).any(-1), nan_rows), f"{engine} {name}: output"
    assert not torch.isnan(out[~nan_rows]).any()
    if sinks:  # the sink column changes the values, not where they are NaN
        with reads, torch.no_grad():
            for read, value in _reads(w, engine).items():
                if value.shape[:3] == nan_rows.shape and read != "max_logits":
                    rows = torch.isnan(value).any(-1) if value.ndim == 4 else torch.isnan(value)
                    assert torch.equal(rows, nan_rows), f"{engine} {read}"
        return
    want = _listing_reads(p, s, lse)
    with reads, torch.no_grad():
        got = _reads(w, engine)
    for read, value in got.items():
        if read == "max_logits":
            continue  # a score's maximum: +inf is its true value, NaN stays NaN (below)
        _compare(value, want[read], f"{engine} {name} {read}")
    assert torch.equal(torch.isnan(got["max_logits"].double()), torch.isnan(s).any(-1))


@pytest.mark.parametrize("engine", ENGINES)
def test_statistics_stay_exact_past_float32s_lse(gen, engine):
    """Issue 24's probe: at scale 1e6 (400 x 400) the entropy came out between -16 and
    8 nats where the truth is 0. Rows under a -1e9 bias (|lse| ~ 1e9): float32 itself
    rounds such scores to multiples of 64, so there the rule is the listing's own error
    in float32 (twice it), as for every statistic."""
    L = 48 if engine in ("small", "triton") else 400
    q = randn(gen, 1, 2, L, 16)
    bias = torch.zeros(1, 1, L, L)
    bias[..., 1::4, :] = -1e9  # a huge finite bias over whole rows
    for scale, mask in ((1e6, None), (None, bias)):
        w, reads = _weights(engine, q, q, q, mask, scale=scale)
        truth = _listing_reads(*_listing(q, q, mask, scale=scale))
        p32 = oracle(q, q, q, mask, scale=scale, dtype=torch.float32)[1]
        listing32 = {"entropy": -(p32 * p32.clamp_min(1e-38).log()).sum(-1),
                     "amax": p32.amax(-1), "sum": p32.sum(-2)}  # fmt: skip
        with reads, torch.no_grad():
            got = {"entropy": w.entropy(), "amax": w.amax(-1), "sum": w.sum(dim=-2)}
        assert got["entropy"].min() >= -1e-5, f"{engine}: entropy {got['entropy'].min():.3g}"
        for name, value in got.items():
            ok, mine, theirs = within_rule(value, listing32[name], truth[name], STAT_FLOOR)
            assert ok, f"{engine} scale={scale} {name}: {mine:.2e} > 2 x {theirs:.2e}"


def _listing_kl(first, second):
    """KL(first || second) per row of dense float64 weights: 0 log 0 = 0, +inf where only
    the second is 0, NaN where either row is NaN."""
    terms = torch.where(first > 0, first * (first.log() - second.log()), 0.0)
    nan = torch.isnan(first[..., 0]) | torch.isnan(second[..., 0])
    return terms.sum(-1).masked_fill(nan, math.nan)


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
@pytest.mark.parametrize(
    "case", range(5), ids=["k +inf", "k +inf, scale 0", "k NaN", "mask NaN", "mask +inf"]
)
def test_kl_is_nan_exactly_where_either_side_is(gen, engine, case):
    """KL between weights with the NaN rows of the cases above and weights that exclude
    keys (some rows see none; 0 log 0 and the +inf of a key only one side excludes), both
    ways round, and against the dense target of those weights (zeros included)."""
    name, q, k, bias, scale = _nan_cases(gen)[case]
    B, L, S = q.shape[0], q.shape[2], k.shape[2]
    keep = torch.rand(B, 1, L, S, generator=gen) < 0.7
    keep[..., 0, :] = False  # a row that sees no key
    q2, k2 = randn(gen, *q.shape), randn(gen, *k.shape)
    _, w, reads = run(engine, q, k, randn(gen, *k.shape), bias, scale=scale)
    _, t, _ = run(engine, q2, k2, randn(gen, *k.shape), keep)
    p = _listing(q, k, bias, scale=scale)[0]
    pt = _listing(q2, k2, keep)[0]
    with reads, torch.no_grad():
        got = {"kl(t || w)": w.kl(t), "kl(w || t)": w.kl(t, reverse=True),
               "t: kl(w || t)": t.kl(w), "kl(dense t || w)": w.kl(pt.float())}  # fmt: skip
    forward, reverse = _listing_kl(pt, p), _listing_kl(p, pt)
    want = {"kl(t || w)": forward, "kl(w || t)": reverse, "t: kl(w || t)": reverse,
            "kl(dense t || w)": forward}  # fmt: skip
    for read, value in got.items():
        both_inf = torch.isinf(want[read])
        assert torch.equal(torch.isinf(value.double()), both_inf), f"{engine} {name} {read}"
        _compare(value.masked_fill(both_inf, 0.0), want[read].masked_fill(both_inf, 0.0),
                 f"{engine} {name} {read}")  # fmt: skip
