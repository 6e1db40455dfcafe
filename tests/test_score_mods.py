"""Softcap and attention sinks (sdpa.masks.softcap / sinks) against the float64 oracle:
outputs, weights, every statistic and gradients, in every backend that runs them."""

from __future__ import annotations

import pytest
import torch

import sdpa
from engines import BACKEND_ENGINES, run, run_or_skip

from oracle import oracle

MASKS = ["none", "bool", "float", "causal", "padding", "window", "dead"]


def make_mask(kind, B, L, S):
    """(mask for sdpa, the same mask as a tensor for the oracle)"""
    if kind == "none":
        return None, None
    if kind == "bool":
        m = torch.rand(B, 1, L, S) > 0.4
        return m, m
    if kind == "float":
        m = torch.randn(B, 1, L, S)
        return m, m
    if kind == "dead":  # some rows see no key at all
        m = torch.rand(B, 1, L, S) > 0.4
        m[:, :, ::3] = False
        return m, m
    mask = {
        "causal": sdpa.masks.causal(),
        "padding": sdpa.masks.padding([max(S - 3, 1), 0][:B] + [S] * max(0, B - 2)),
        "window": sdpa.masks.sliding_window(5),
    }[kind]
    return mask, mask.materialize(L, S).reshape(-1, 1, L, S)


def entropy(p):
    return -(p * torch.log(p)).nan_to_num(nan=0.0).sum(-1)


def run_case(engine, mask_kind, softcap, sinks_kind, L, S, *, B=2, H=4, Hkv=2, E=16,
             skip_refused=False):  # fmt: skip
    """The case on `engine`, against the oracle; where the engine refuses it, an error
    (or a skip naming the engine's reason, with skip_refused: a test over every engine)."""
    q = torch.randn(B, H, L, E, requires_grad=True)
    k = torch.randn(B, Hkv, S, E, requires_grad=True)
    v = torch.randn(B, Hkv, S, E + 3, requires_grad=True)
    mask, dense_mask = make_mask(mask_kind, B, L, S)
    z = None
    if sinks_kind == "head":
        z = (torch.randn(H, 1, 1) * 2).requires_grad_()
    elif sinks_kind == "row":
        z = (torch.randn(B, H, L, 1) * 2).requires_grad_()
    arg = mask
    if softcap is not None:
        arg = sdpa.masks.softcap(softcap, arg)
    if z is not None:
        arg = sdpa.masks.sinks(z, arg)
    out, w, reads = (run_or_skip if skip_refused else run)(engine, q, k, v, arg, scale=0.37)
    ref_out, ref_p = oracle(
        q, k, v, dense_mask, scale=0.37, softcap=softcap, sinks=None if z is None else z[..., 0]
    )
    tol = dict(atol=2e-5, rtol=0)
    torch.testing.assert_close(out.double(), ref_out, **tol)
    with reads:
        p, row, block = w.full(), w[B - 1, H - 1, L // 2], w[:, 1:3, 1:]
        sums, means, ent, amax = w.sum(dim=-2), w.mean(dim=-2), w.entropy(), w.amax(-1)
        k_top = min(3, S)
        values, indices = w.topk(k_top)
    torch.testing.assert_close(p.double(), ref_p, **tol)
    torch.testing.assert_close(row.double(), ref_p[B - 1, H - 1, L // 2], **tol)
    torch.testing.assert_close(block.double(), ref_p[:, 1:3, 1:], **tol)
    torch.testing.assert_close(sums.double(), ref_p.sum(-2), atol=1e-4, rtol=0)
    torch.testing.assert_close(means.double(), ref_p.mean(-2), **tol)
    torch.testing.assert_close(ent.double(), entropy(ref_p), atol=1e-4, rtol=0)
    torch.testing.assert_close(amax.double(), ref_p.amax(-1), **tol)
    torch.testing.assert_close(values.double(), ref_p.topk(k_top, dim=-1).values, **tol)
    picked = ref_p.gather(-1, indices)
    torch.testing.assert_close(picked, ref_p.topk(k_top, dim=-1).values, **tol)
    grad = torch.randn_like(ref_out)
    wrt = [q, k, v] + ([z] if z is not None else [])
    ours = torch.autograd.grad((out.double() * grad).sum(), wrt)
    theirs = torch.autograd.grad((ref_out * grad).sum(), wrt)
    for a, b, name in zip(ours, theirs, ["dq", "dk", "dv", "dsinks"], strict=False):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("sinks_kind", ["head", "row"])
@pytest.mark.parametrize("engine", ["auto", *BACKEND_ENGINES])
def test_sinks_match_the_oracle(engine, mask_kind, sinks_kind):
    torch.manual_seed(hash((engine, mask_kind, sinks_kind)) % 2**31)
    run_case(engine, mask_kind, None, sinks_kind, L=37, S=53, skip_refused=True)


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("sinks_kind", [None, "head"])
@pytest.mark.parametrize("engine", ["auto", *BACKEND_ENGINES])
def test_softcap_matches_the_oracle(engine, mask_kind, sinks_kind):
    torch.manual_seed(hash((engine, mask_kind, sinks_kind, "cap")) % 2**31)
    run_case(engine, mask_kind, 2.5, sinks_kind, L=37, S=53, skip_refused=True)


@pytest.mark.parametrize("L, S", [(1, 1), (1, 300), (256, 256), (257, 300), (300, 257)])
def test_block_edges_and_one_query(L, S):
    """Sizes on the fused kernel's block edges (256) and one-token decoding; the block
    plan (sliding window) runs one kernel call per piece, each with its rows' sinks."""
    torch.manual_seed(L * 1000 + S)
    run_case("fused", "window", None, "row", L=L, S=S, B=1, H=2, Hkv=1, E=8)
    run_case("auto", "padding", 3.0, "head", L=L, S=S, B=2, H=2, Hkv=2, E=8)


@pytest.mark.parametrize("rows_per_chunk", [1, 7, 16])
def test_chunked_backend_on_chunk_edges(rows_per_chunk):
    """Several chunks of rows, the last one short; causality continues across chunks."""
    B, H, S = 2, 4, 53
    torch.manual_seed(rows_per_chunk)
    with sdpa.settings.override(chunk_bytes=rows_per_chunk * B * H * S * 4 * 3):
        for mask_kind in ["causal", "float", "dead"]:
            run_case("chunked", mask_kind, 4.0, "row", L=37, S=S, B=B, H=H)
        q, k, v = torch.randn(B, H, 37, 8), torch.randn(B, H, 37, 8), torch.randn(B, H, 37, 8)
        out = sdpa.attention(q, k, v, sdpa.masks.softcap(3.0), causal=True, backend="chunked")[0]
    ref = oracle(q, k, v, causal=True, softcap=3.0)[0]
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)


def test_softcap_needs_the_chunked_path():
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(sdpa.NotSupportedError, match=r"softcap=30\.0.*chunked"):
        sdpa.attention(q, k, v, sdpa.masks.softcap(30.0), backend="fused")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_within_twice_the_reference_error(dtype):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 70, 32) for _ in range(3))
    z = torch.randn(4, 1, 1)
    for arg in [sdpa.masks.sinks(z, sdpa.masks.causal()), sdpa.masks.softcap(5.0)]:
        exact = sdpa.attention(q.double(), k.double(), v.double(), arg)[0]
        ref = sdpa.attention(q.to(dtype), k.to(dtype), v.to(dtype), arg, backend="reference")
        ours = sdpa.attention(q.to(dtype), k.to(dtype), v.to(dtype), arg)
        assert ours.output.dtype == dtype and ours.weights.full().dtype == torch.float32
        ref_err = (ref.output.double() - exact).abs().max()
        assert (ours.output.double() - exact).abs().max() <= 2 * ref_err + 1e-6


def test_sinks_take_weight_from_every_row():
    """A row's weights sum to sigmoid(lse - sink); a very negative sink changes nothing."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    z = torch.tensor([0.5, -1e4]).reshape(2, 1, 1)
    out, w = sdpa.attention(q, k, v, sdpa.masks.sinks(z))
    plain_out, plain_w = sdpa.attention(q, k, v)
    share = torch.sigmoid(plain_w.lse[0, 0] - 0.5)
    torch.testing.assert_close(w.full()[0, 0].sum(-1), share)
    torch.testing.assert_close(w.lse[0, 0], torch.logaddexp(plain_w.lse[0, 0], torch.tensor(0.5)))
    torch.testing.assert_close(out[0, 1], plain_out[0, 1])
    torch.testing.assert_close(out[0, 0], plain_out[0, 0] * share[:, None])


def test_drop_in_and_modules_take_score_mods():
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    arg = sdpa.masks.softcap(2.0, sdpa.masks.sinks(torch.randn(4, 1, 1)))
    out = sdpa.scaled_dot_product_attention(q, k, v, attn_mask=arg)
    torch.testing.assert_close(out, sdpa.attention(q, k, v, arg).output)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: sdpa.masks.softcap(0.0), sdpa.SdpaValueError, "positive finite"),
        (lambda: sdpa.masks.softcap(float("inf")), sdpa.SdpaValueError, "positive finite"),
        (lambda: sdpa.masks.softcap(True), sdpa.SdpaValueError, "positive finite"),
        (lambda: sdpa.masks.softcap(2.0, sdpa.masks.softcap(3.0)), sdpa.SdpaValueError, "one"),
        (lambda: sdpa.masks.sinks([1.0, 2.0]), sdpa.SdpaTypeError, "floating tensor"),
        (lambda: sdpa.masks.sinks(torch.tensor([1, 2])), sdpa.SdpaTypeError, "floating"),
        (
            lambda: sdpa.masks.sinks(torch.ones(1), sdpa.masks.sinks(torch.ones(1))),
            sdpa.SdpaValueError,
            "one sinks",
        ),
        (
            lambda: sdpa.masks.softcap(2.0) & sdpa.masks.causal(),
            sdpa.SdpaTypeError,
            "wraps a mask",
        ),
    ],
)
def test_bad_score_mods_are_refused(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_sinks_of_the_wrong_shape_are_refused_by_shape():
    q = k = v = torch.randn(2, 4, 6, 8)
    with pytest.raises(sdpa.SdpaValueError, match=r"sinks of shape \(4,\).*\(Hq, 1, 1\)"):
        sdpa.attention(q, k, v, sdpa.masks.sinks(torch.randn(4)))  # (4,) would be L
    with pytest.raises(sdpa.SdpaValueError, match=r"sinks of shape \(3, 1, 1\)"):
        sdpa.attention(q, k, v, sdpa.masks.sinks(torch.randn(3, 1, 1)))


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
def test_sinks_with_scores_in_the_hundreds(engine):
    """|lse| > 32: the weights recompute such rows by a log-softmax that must hold the
    sink's column too."""
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    z = torch.tensor([150.0, -3.0]).reshape(2, 1, 1)
    out, w, reads = run_or_skip(engine, q, k, v, sdpa.masks.sinks(z), scale=10.0)
    ref_out, ref_p = oracle(q, k, v, scale=10.0, sinks=z[..., 0])
    with reads:
        assert w.lse.abs().max() > 32
        torch.testing.assert_close(w.full().double(), ref_p, atol=2e-5, rtol=0)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=0)
