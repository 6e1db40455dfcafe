"""Nested (jagged) inputs: torch's result for every call torch's SDPA accepts with NJTs,
and a refusal naming the argument for every call it refuses (torch 2.13, CPU).

Every accepted case runs both ways sdpa.nested can run it (one call per sequence, and
all sequences packed into one call) against torch's own F.scaled_dot_product_attention
on the same NJTs: values, offsets and layout of the output, and gradients.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import sdpa
from sdpa import nested

from conftest import randn

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")


def dense(*args):
    return sdpa.scaled_dot_product_attention(*args)


def ours(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return nested.nested_attention(
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dense
    )


@pytest.fixture(params=["per_sequence", "packed"])
def strategy(request, monkeypatch):
    """Force one of the two ways to run the sequences, whatever the sizes."""
    pack = request.param == "packed"
    monkeypatch.setattr(nested, "_pack", lambda lq, lk, is_causal: pack and not is_causal)
    return request.param


def njt(gen, lengths, H=4, E=8, dtype=torch.float32, grad=False):
    """(B, H, j, E) NJT made (B, j, H, E) and transposed, and its values leaf (nnz, H, E)."""
    values = randn(gen, sum(lengths), H, E, dtype=dtype).requires_grad_(grad)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2), values


def assert_same_njt(out, ref, atol=1e-5):
    assert out.is_nested and out.layout == torch.jagged
    assert out.shape == ref.shape and out.dtype == ref.dtype  # same nested int j
    assert out._ragged_idx == ref._ragged_idx
    assert torch.equal(out.offsets(), ref.offsets())
    assert out.transpose(1, 2).is_contiguous() == ref.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out.values(), ref.values(), atol=atol, rtol=0)


CASES = {  # name: (query lengths L_b, key lengths S_b)
    "self": ([3, 5, 2], [3, 5, 2]),
    "cross": ([3, 5, 2], [4, 1, 6]),
    "one sequence": ([7], [7]),
    "empty query": ([3, 0, 2], [2, 4, 1]),
    "empty keys": ([3, 2, 2], [3, 0, 2]),  # a query with no key gives 0, as torch
    "many short": ([1, 4, 2, 9, 3, 1, 6, 2, 5, 3], [2, 1, 7, 3, 3, 5, 1, 8, 2, 4]),
    "long": ([40, 65, 17], [33, 70, 21]),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_torch(gen, strategy, case):
    lq, lk = CASES[case]
    scale = 0.3 if case in ("cross", "many short") else None
    (q, _), (k, _), (v, _) = njt(gen, lq), njt(gen, lk), njt(gen, lk, E=5)  # Ev != E
    ref = F.scaled_dot_product_attention(q, k, v, scale=scale)
    assert_same_njt(ours(q, k, v, scale=scale), ref)


def test_enable_gqa_with_equal_heads_is_accepted(gen):
    (q, _), (k, _), (v, _) = njt(gen, [3, 5]), njt(gen, [2, 6]), njt(gen, [2, 6])
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert_same_njt(ours(q, k, v, enable_gqa=True), ref)


@pytest.mark.parametrize("case", ["cross", "many short", "empty keys"])
def test_gradients_match_torch(gen, strategy, case):
    lq, lk = CASES[case]
    (q, qv), (k, kv), (v, vv) = (njt(gen, n, grad=True) for n in (lq, lk, lk))
    out, ref = ours(q, k, v, scale=0.4), F.scaled_dot_product_attention(q, k, v, scale=0.4)
    grad_out = torch.randn_like(ref.values())
    g_ours = torch.autograd.grad(out.values(), (qv, kv, vv), grad_out)
    g_ref = torch.autograd.grad(ref.values(), (qv, kv, vv), grad_out)
    for a, b in zip(g_ours, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_gradients_reach_leaf_njts(gen):
    """NJTs made with requires_grad=True (leaves) get NJT gradients, as in torch."""
    data = [[randn(gen, n, 4, 8) for n in (3, 5, 2)] for _ in range(3)]
    grads = []
    for fn in (ours, F.scaled_dot_product_attention):
        q, k, v = (torch.nested.as_nested_tensor(d, layout=torch.jagged) for d in data)
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))  # leaves
        fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).values().sum().backward()
        grads.append([t.grad.values() for t in (q, k, v)])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_dtypes(gen, strategy, dtype):
    """float64 to rounding; 16-bit within 2x torch's own error against float64."""
    lq, lk = CASES["many short"]
    (q, _), (k, _), (v, _) = njt(gen, lq), njt(gen, lk), njt(gen, lk)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).values()
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out, ref = ours(q, k, v), F.scaled_dot_product_attention(q, k, v)
    assert out.dtype == dtype
    if dtype == torch.float64:
        assert_same_njt(out, ref, atol=1e-12)
        return
    err_ours = (out.values().double() - exact).abs().max()
    err_torch = (ref.values().double() - exact).abs().max()
    assert err_ours <= 2 * err_torch + 1e-3, (err_ours, err_torch)


def test_dropout(gen, strategy):
    lq, lk = CASES["cross"]
    (q, qv), (k, _), (v, _) = njt(gen, lq, grad=True), njt(gen, lk), njt(gen, lk)
    assert ours(q, k, v, dropout_p=1.0).values().abs().max() == 0  # as torch
    assert F.scaled_dot_product_attention(q, k, v, dropout_p=1.0).values().abs().max() == 0
    out, ref = ours(q, k, v, dropout_p=0.5), F.scaled_dot_product_attention(q, k, v)
    assert out.shape == ref.shape and torch.equal(out.offsets(), ref.offsets())
    assert not torch.allclose(out.values(), ref.values())
    (grad,) = torch.autograd.grad(out.values().sum(), qv)
    assert grad.shape == qv.shape and torch.isfinite(grad).all()


def test_autocast_casts_before_the_checks(gen):
    """Under autocast torch casts float32 and bf16 inputs alike, so a mix is accepted."""
    (q, _), (k, _), (v, _) = njt(gen, [3, 5]), njt(gen, [4, 2]), njt(gen, [4, 2])
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = ours(q, k, v), F.scaled_dot_product_attention(q, k, v)
    assert_same_njt(out, ref, atol=3e-2)  # bf16: a few ulps of values of size ~1


def test_output_feeds_another_call(gen):
    """The output has query's offsets and layout, so it chains like torch's."""
    (q, _), (k, _), (v, _) = njt(gen, [3, 5, 2]), njt(gen, [3, 5, 2]), njt(gen, [3, 5, 2])
    out = ours(ours(q, k, v), k, v)
    ref = F.scaled_dot_product_attention(F.scaled_dot_product_attention(q, k, v), k, v)
    assert_same_njt(out, ref)


def ragged_batch(gen, lengths, *inner):
    """An NJT ragged in dim 1, (B, j, *inner): torch attends within each token."""
    return torch.nested.nested_tensor_from_jagged(
        randn(gen, sum(lengths), *inner), torch.tensor([0, *lengths]).cumsum(0)
    )


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("inner_q,inner_kv", [((4, 8), (6, 8)), ((2, 4, 8), (2, 3, 8))])
def test_ragged_batch_dim_like_torch(gen, is_causal, inner_q, inner_kv):
    """(B, j, ..., H, E) NJTs: torch's dense path on the values; is_causal works there
    and enable_gqa is ignored (H differs between query and key: cross-attention)."""
    q = ragged_batch(gen, [3, 5, 2], *inner_q)
    k = ragged_batch(gen, [3, 5, 2], *inner_kv)
    v = ragged_batch(gen, [3, 5, 2], *inner_kv)
    kw = {"is_causal": is_causal, "enable_gqa": True}
    assert_same_njt(ours(q, k, v, **kw), F.scaled_dot_product_attention(q, k, v, **kw))


def test_pack_rule_reads_sizes_only():
    assert nested._pack([8] * 32, [8] * 32, is_causal=False)
    assert not nested._pack([8] * 32, [8] * 32, is_causal=True)
    assert not nested._pack([8] * 4, [8] * 4, is_causal=False)  # few sequences
    assert not nested._pack([8] * 32, [200] * 32, is_causal=False)  # long keys


# --- refusals: torch refuses each of these, and so do we, naming the argument ---------


def _refusals(gen):
    L = [3, 5, 2]
    (q, _), (k, _), (v, _) = njt(gen, L), njt(gen, L), njt(gen, L)
    (k2, _), (v2, _) = njt(gen, L, H=2), njt(gen, L, H=2)
    (k1, _), (v1, _) = njt(gen, L, H=1), njt(gen, L, H=1)
    dq, dk = randn(gen, 3, 4, 5, 8), randn(gen, 3, 4, 5, 8)
    untransposed = q.transpose(1, 2)
    base = randn(gen, 3, 7, 4, 8)
    starts, lengths = torch.tensor([0, 1, 2]), torch.tensor(L)
    holes = torch.nested.narrow(base, 1, starts, lengths, layout=torch.jagged)  # (B, j, H, E)
    offset2 = torch.nested.nested_tensor_from_jagged(
        randn(gen, 12, 4, 8), torch.tensor([2, 5, 10, 12])
    ).transpose(1, 2)  # values 0 and 1 belong to no sequence
    three_d = torch.nested.nested_tensor([randn(gen, n, 8) for n in L], layout=torch.jagged)
    return {  # name: ((q, k, v), kwargs, what our message matches)
        "attn_mask": (
            (q, k, v),
            {"attn_mask": torch.ones(3, 1, 1, 5, dtype=torch.bool)},
            r"attn_mask is not supported with nested",
        ),
        "is_causal": ((q, k, v), {"is_causal": True}, r"is_causal=True is not supported"),
        "gqa": ((q, k2, v2), {"enable_gqa": True}, r"heads must equal query heads.*H=4, key 2"),
        "gqa without flag": ((q, k2, v2), {}, r"heads must equal query heads"),
        "one kv head": ((q, k1, v1), {}, r"heads must equal query heads"),
        "dense key/value": (
            (q, dk, dk),
            {},
            r"all nested or all dense.*query nested, key and value",
        ),
        "dense query": ((dq, k, v), {}, r"all nested or all dense.*key and value nested"),
        "dtypes": ((q, k.double(), v), {}, r"one floating dtype, got torch.float32, torch.float64"),
        "integer": ((q.long(), k.long(), v.long()), {}, r"one floating dtype"),
        "ragged dims": (
            (q, untransposed, untransposed),
            {},
            r"ragged in the same dim, got dims 2, 1",
        ),
        "3-D": ((three_d, three_d, three_d), {}, r"\(B, H, j, E\) jagged NJTs ragged in dim 2"),
        "contiguous after transpose": (
            (q.contiguous(), k, v),
            {},
            r"query .* transpose of a contiguous",
        ),
        "holes": ((holes.transpose(1, 2),) * 3, {}, r"transpose of a contiguous"),
        "batch": (
            (q, njt(gen, [3, 5])[0], njt(gen, [3, 5])[0]),
            {},
            r"number of sequences, got B=3, 2",
        ),
        "E": ((q, njt(gen, L, E=6)[0], v), {}, r"same last dim E"),
        "offsets from 2": (
            (offset2, offset2, offset2),
            {},
            r"offsets must run from 0 to its number of tokens 12",
        ),
        "key/value lengths": ((q, k, njt(gen, [1, 2, 3])[0]), {}, r"same sequence lengths"),
    }


REFUSALS = list(_refusals(torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("name", REFUSALS)
def test_refuses_what_torch_refuses(gen, name):
    (q, k, v), kwargs, match = _refusals(gen)[name]
    with pytest.raises((RuntimeError, ValueError)):
        F.scaled_dot_product_attention(q, k, v, **kwargs)
    with pytest.raises(RuntimeError, match=match):
        ours(q, k, v, **kwargs)


def test_refuses_softcap_and_sinks_by_name(gen):
    """sdpa's own score modifications are not run on nested inputs: refused, named."""
    (q, k, v), _, _ = _refusals(gen)["is_causal"]
    with pytest.raises(sdpa.NotSupportedError, match=r"got attn_mask ScoreMod\(mask=None, "):
        ours(q, k, v, attn_mask=sdpa.masks.softcap(5.0))


def strided(gen, shapes, grad=False):
    """torch's strided-layout nested tensor (a prototype; it warns once)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parts = [randn(gen, *shape).requires_grad_(grad) for shape in shapes]
        return torch.nested.as_nested_tensor(parts), parts


STRIDED = {  # name: (query, key, value component shapes)
    "(H, L, E) cross": ([(4, 3, 8), (4, 5, 8)], [(4, 2, 8), (4, 6, 8)], [(4, 2, 5), (4, 6, 5)]),
    "(L, E), no keys": ([(3, 8), (2, 8)], [(0, 8), (4, 8)], [(0, 8), (4, 8)]),
    "(H, L, E), empty": ([(2, 3, 8), (2, 0, 8)], [(2, 2, 8), (2, 4, 8)], [(2, 2, 8), (2, 4, 8)]),
    "ragged heads, Ev": ([(1, 3, 8), (3, 2, 8)], [(1, 4, 8), (3, 2, 8)], [(1, 4, 6), (3, 2, 7)]),
    "(A, H, L, E)": ([(2, 3, 4, 8)], [(2, 3, 5, 8)], [(2, 3, 5, 8)]),
}


@pytest.mark.parametrize("case", STRIDED)
def test_strided_layout_matches_torch(gen, case):
    (q, qs), (k, ks), (v, vs) = (strided(gen, shapes, grad=True) for shapes in STRIDED[case])
    gqa = case != "ragged heads, Ev"  # accepted with the same heads in every component
    kw = {"dropout_p": 0.0, "scale": 0.4, "enable_gqa": gqa}
    out, ref = ours(q, k, v, **kw), F.scaled_dot_product_attention(q, k, v, **kw)
    assert out.is_nested and out.layout == torch.strided
    grads = []
    for o, r in zip(out.unbind(), ref.unbind(), strict=True):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=0)
    for result in (out, ref):
        loss = sum((t * t).sum() for t in result.unbind())
        grads.append(torch.autograd.grad(loss, [*qs, *ks, *vs], retain_graph=True))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_strided_empty_queries_and_keys_per_component(gen):
    """torch 2.13 fails inside (setStorage) when one component has no keys and another no
    queries; each component is still ordinary attention, so we answer per component."""
    (q, qs), (k, ks), (v, vs) = (
        strided(gen, shapes) for shapes in ([(3, 8), (0, 8)], [(0, 8), (4, 8)], [(0, 8), (4, 8)])
    )
    for o, parts in zip(ours(q, k, v).unbind(), zip(qs, ks, vs, strict=True), strict=True):
        torch.testing.assert_close(o, F.scaled_dot_product_attention(*parts), atol=1e-6, rtol=0)


def test_strided_ragged_e_needs_a_scale(gen):
    shapes = [(4, 3, 8), (4, 2, 6)]
    (q, _), (k, _), (v, _) = (strided(gen, shapes) for _ in range(3))
    with pytest.raises(RuntimeError, match="irregular"):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError, match=r"last dim E differs .*pass scale"):
        ours(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    for o, r in zip(ours(q, k, v, scale=0.3).unbind(), ref.unbind(), strict=True):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=0)


def _strided_refusals(gen):
    def nt(*shapes):
        return strided(gen, shapes)[0]

    q, kv = nt((4, 3, 8), (4, 5, 8)), nt((4, 2, 8), (4, 6, 8))
    jag = njt(gen, [3, 5])[0]
    rh = nt((1, 3, 8), (3, 2, 8))  # ragged heads
    return {  # name: ((q, k, v), kwargs, what our message matches)
        "attn_mask": ((q, kv, kv), {"attn_mask": torch.ones(1, 2, dtype=torch.bool)}, "attn_mask"),
        "is_causal": ((q, q, q), {"is_causal": True}, r"is_causal=True is not supported"),
        "broadcast heads": (
            (q, nt((1, 2, 8), (1, 6, 8)), nt((1, 2, 8), (1, 6, 8))),
            {},
            "leading dims",
        ),
        "gqa": (
            (q, nt((2, 2, 8), (2, 6, 8)), nt((2, 2, 8), (2, 6, 8))),
            {"enable_gqa": True},
            "leading dims",
        ),
        "gqa, ragged heads": ((rh, rh, rh), {"enable_gqa": True}, r"enable_gqa=True needs"),
        "E": ((q, nt((4, 2, 7), (4, 6, 7)), kv), {}, r"the same E"),
        "S": ((q, kv, nt((4, 3, 8), (4, 6, 8))), {}, r"the same S"),
        "ranks": ((q, nt((2, 8), (6, 8)), nt((2, 8), (6, 8))), {}, "leading dims"),
        "1-D": ((nt((8,)), nt((8,)), nt((8,))), {}, "2\\+ dims"),
        "count": ((q, nt((4, 2, 8)), nt((4, 2, 8))), {}, r"number of components, got 2, 1"),
        "dtype": ((q, kv.double(), kv), {}, r"one floating dtype"),
        "non-contiguous": ((q.transpose(1, 2), kv, kv), {}, r"query must be contiguous"),
        "with jagged": ((q, jag, jag), {}, r"one layout"),
    }


@pytest.mark.parametrize("name", list(_strided_refusals(torch.Generator().manual_seed(0))))
def test_strided_refuses_what_torch_refuses(gen, name):
    (q, k, v), kwargs, match = _strided_refusals(gen)[name]
    with pytest.raises((RuntimeError, ValueError)):
        F.scaled_dot_product_attention(q, k, v, **kwargs)
    with pytest.raises(RuntimeError, match=match):
        ours(q, k, v, **kwargs)


def test_5d_ragged_in_dim_2_is_refused(gen):
    """torch returns a malformed NJT here (values of 4x the rows its offsets say)."""
    q = ragged_batch(gen, [3, 5, 2], 2, 4, 8).transpose(1, 2)  # (B, 2, j, 4, 8)
    with pytest.raises(RuntimeError, match="split_sizes"):
        F.scaled_dot_product_attention(q, q, q).unbind()
    with pytest.raises(RuntimeError, match=r"ragged in dim 2 .*got query \(3, 2, j"):
        ours(q, q, q)


def test_gqa_message_recipe_works(gen):
    """The repeat the GQA refusal suggests gives a call both accept."""
    (q, _), (k, _), (v, _) = njt(gen, [3, 5]), njt(gen, [2, 4], H=2), njt(gen, [2, 4], H=2)

    def repeat(t):
        return torch.nested.nested_tensor_from_jagged(
            t.transpose(1, 2).values().repeat_interleave(4 // 2, dim=1), t.offsets()
        ).transpose(1, 2)

    k, v = repeat(k), repeat(v)
    assert_same_njt(ours(q, k, v), F.scaled_dot_product_attention(q, k, v))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_is_causal_per_sequence(gen, dtype):
    """On CUDA torch's fused kernels run is_causal on NJTs; where every L_b == S_b their
    alignments agree, and so do we."""
    lengths = [3, 17, 40]
    q, k, v = (njt(gen, lengths, E=16)[0].to("cuda", dtype) for _ in range(3))
    out = ours(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_same_njt(out, ref, atol=1e-5 if dtype == torch.float32 else 2e-2)


# --- the public drop-in (sdpa.scaled_dot_product_attention routes nested inputs here) --


def test_public_dropin_matches_torch(gen):
    lq, lk = CASES["cross"]
    (q, _), (k, _), (v, _) = njt(gen, lq), njt(gen, lk), njt(gen, lk)
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert_same_njt(sdpa.scaled_dot_product_attention(q, k, v, scale=0.3), ref)


def test_public_dropin_refuses_like_torch(gen):
    (q, _), (k, _), (v, _) = njt(gen, [3, 5]), njt(gen, [3, 5]), njt(gen, [3, 5])
    with pytest.raises(RuntimeError, match=r"is_causal=True is not supported"):
        sdpa.scaled_dot_product_attention(q, k, v, is_causal=True)
    with pytest.raises(RuntimeError, match=r"all nested or all dense"):
        sdpa.scaled_dot_product_attention(randn(gen, 2, 4, 5, 8), k, v)
