"""Lazy expressions of the weights (sdpa.lazy): elementwise ops, casts, transposes and
reductions over the leading dims stay lazy and are evaluated by the read that ends them.
Each read of an expression equals the same ops on the dense weights (the float64 oracle),
gradients included, on every engine and mask kind, over one chunk of rows or many
(checkpointed); every index form of a transpose and of a head mean; staleness, no_grad,
refusals, printing and copies."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys

import pytest
import torch

import sdpa
from engines import ENGINES, run_or_skip
from sdpa import budget
from sdpa.errors import NotSupportedError, StaleWeightsError
from sdpa.lazy import LazyExpr

from conftest import MASK_KINDS, make_inputs
from oracle import oracle

B, HQ, HKV, L, S = 2, 4, 2, 9, 11  # L != S: a transpose that reads the wrong dim fails


def _operands(gen):
    keep = (torch.rand(L, S, generator=gen) < 0.6).float()  # a mask of one's own
    x = torch.randn(L, 3, generator=gen)  # values over the queries (w.mT @ x)
    u = torch.randn(3, S, generator=gen)  # weights over the keys (u @ w.mT)
    heads = torch.randn(HQ, 1, 1, generator=gen)  # a factor per head
    y = torch.randn(S, 3, generator=gen)  # values over the keys (expr @ y)
    z = torch.randn(2, L, generator=gen)  # weights over the queries (z @ expr)
    return keep, x, u, heads, y, z


def _rollout_step(a, o):
    """One step of attention rollout: the head mean with the identity, rows normalised."""
    a = 0.5 * a.mean(1) + 0.5 * torch.eye(L, S, dtype=o[4].dtype)
    return a / a.sum(-1, keepdim=True)


# expression -> the same on a tensor, given (keep, x, u); mask-safe (no log of a zero)
EXPRS = {
    "row-sums-of-a-product": lambda w, o: (w * o[0]).sum(-1),
    "count-over": lambda w, o: (w > 0.05).sum(-1),
    "clamped-log-rows": lambda w, o: w.clamp_min(1e-4).log()[..., 3, :],
    "where-max": lambda w, o: torch.where(w > 0.1, w, 0.0).amax(-1),
    "affine-received": lambda w, o: (w * 2 + 1).sum(-2),
    "bfloat16-rows": lambda w, o: w.to(torch.bfloat16).float()[..., 2, :],
    "double-keys": lambda w, o: w.double()[..., 4],
    "transpose-rows": lambda w, o: w.mT[..., 1, :],
    "transpose-received": lambda w, o: w.mT.sum(-1),
    "transpose-product": lambda w, o: w.mT @ o[1],
    "product-with-transpose": lambda w, o: o[2] @ w.mT,
    "transpose-diagonal": lambda w, o: torch.diagonal(w.mT, -1, -2, -1),
    "head-mean-rows": lambda w, o: w.mean(1)[:, 4],
    "head-mean-received": lambda w, o: w.mean(1).sum(-2),
    "head-max-keepdim": lambda w, o: w.amax(1, keepdim=True)[1, 0, 2:5],
    "topk-of-a-product": lambda w, o: (w * o[0]).topk(3).values,
    "argmax-of-a-product": lambda w, o: (w * o[0]).argmax(-1),
    "mean-of-everything": lambda w, o: (w * o[0]).mean(),
    "transposed-product-rows": lambda w, o: (w * o[0]).mT[..., 2, :],
    "diagonal-of-a-product": lambda w, o: torch.diagonal(w * o[0], 1, -2, -1),
    "max-of-a-sum-of-two": lambda w, o: (w + w.mT.mT * o[0]).max(-1).values,
    "any-over": lambda w, o: (w > 0.3).any(-1),
    "row-of-a-product": lambda w, o: (w * o[0])[1, 2, 3],
    "row-of-a-per-head-product": lambda w, o: (w * o[3])[1, 2, 3],
    "product-of-an-expression": lambda w, o: (0.5 * w + 0.5 * o[0]) @ o[4],
    "expression-times-a-vector": lambda w, o: (w * o[0]) @ o[4][:, 0],
    "weighted-rows-of-an-expression": lambda w, o: o[5] @ (w * o[0]),
    "vector-times-an-expression": lambda w, o: o[5][1] @ (w * w),
    "head-mean-product": lambda w, o: w.mean(1) @ o[4],
    "probes-of-a-head-mean": lambda w, o: o[5] @ w.mean(1),
    "vector-of-a-head-sum-keepdim": lambda w, o: o[5][0] @ w.sum(1, keepdim=True),
    "rollout-step-product": lambda w, o: _rollout_step(w, o) @ o[4],
    "rollout-step-cls-row": lambda w, o: o[5][:1] @ _rollout_step(w, o),
    # reshapes of the leading dims: the operands moved (a per-head factor's broadcast
    # view cannot merge B and H as a view: copied, B x H entries)
    "lead-reshaped-product-received": lambda w, o: (w * o[0]).reshape(B * HQ, L, S).sum(-1),
    "flattened-per-head-product-row": lambda w, o: (w * o[3]).flatten(0, 1)[5, 2],
    "unflattened-transpose-rows": lambda w, o: (w * 2).mT.unflatten(1, (2, 2))[1, 0, 1, 3],
    "expanded-expression-received": lambda w, o: (w * o[0])[:1].expand(3, HQ, L, S).sum(-2),
    "unsqueezed-log-head-mean": lambda w, o: w.clamp_min(1e-4).log().unsqueeze(0).mean(2)[0, 1, 4],
    "viewed-count-over": lambda w, o: (w > 0.05).view(B * HQ, L, S).sum(-1),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_an_expressions_reads_and_gradients_are_the_dense_ops(gen, engine, kind):
    q, k, v, mask = make_inputs(gen, B=B, Hq=HQ, Hkv=HKV, L=L, S=S, mask_kind=kind)
    q.requires_grad_()
    k.requires_grad_()
    _, w, reads = run_or_skip(engine, q, k, v, mask)
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    dense = oracle(q64, k64, v.double(), mask)[1]
    ops = _operands(gen)
    ops64 = tuple(t.double() for t in ops)
    for name, f in EXPRS.items():
        with reads:
            got = f(w, ops)
        want = f(dense, ops64)
        assert type(got) is torch.Tensor and got.shape == want.shape, name
        if not want.dtype.is_floating_point:  # counts, indices: the same entries
            if name == "argmax-of-a-product":  # (ties within rounding may pick apart)
                assert (got == want).float().mean() > 0.9, name
            else:  # counts of weights over a threshold (monotone in the weights): the
                # oracle's, but where a weight lies within rounding of the threshold
                # (0.30000003 read one ulp low is 0.3f: not over 0.3)
                lo, hi = (f(dense + d, ops64).long() for d in (-2e-6, 2e-6))
                assert ((lo <= got.long()) & (got.long() <= hi)).all(), name
            assert not got.requires_grad, name
            continue
        # (bfloat16 rounds both sides alike, up to one step of 2^-8 below 1)
        atol = 4e-3 if "bfloat16" in name else 2e-6
        rtol = 2.6e-6  # (float32 sums: twice torch's float32 rtol)
        torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol, msg=name)
        c = torch.randn(want.shape, generator=gen, dtype=torch.float64)
        g_q, g_k = torch.autograd.grad((c * got.double()).sum(), (q, k))
        w_q, w_k = torch.autograd.grad((c * want.double()).sum(), (q64, k64), retain_graph=True)
        torch.testing.assert_close(g_q.double(), w_q, atol=2e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(g_k.double(), w_k, atol=2e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("rows_per_chunk", [1, 2, 4])
def test_reductions_over_many_chunks_equal_one_chunk_gradients_included(gen, rows_per_chunk):
    """Chunks of query rows on tile edges (L = 9 in chunks of 1, 2 and 4 rows, the last
    one short): the same values and gradients as one chunk; the chunks' work is
    recomputed in the backward (checkpointed)."""
    q, k, v, mask = make_inputs(gen, B=B, Hq=HQ, Hkv=HKV, L=L, S=S, mask_kind="float")
    q.requires_grad_()
    ops = _operands(gen)
    reductions = {
        "keys": lambda w: (w * ops[0]).sum(-1),
        "queries": lambda w: (w * ops[0]).sum(-2),
        "everything": lambda w: (w * w).mean(),
        "max": lambda w: (w * 3).max(-1).values,
        "transposed": lambda w: w.mT.amax(-2),
        "counts": lambda w: (w > 0.1).sum((-2, -1)),
        "product": lambda w: (w * ops[0]) @ ops[4],
        "weighted-rows": lambda w: ops[5] @ (w * ops[0]),
        # (the default budget takes the per-head products, small budgets the row chunks)
        "head-mean-product": lambda w: w.mean(1) @ ops[4],
        "probes-of-a-head-mean": lambda w: ops[5] @ w.mean(1),
    }
    w = sdpa.attention(q, k, v, mask).weights
    # the rows of a (B, HQ, L, S) float32 product per chunk: budget for `rows_per_chunk`
    budget = B * HQ * S * 4 * 4 * rows_per_chunk  # (w * x: two nodes, and two copies)
    for name, f in reductions.items():
        whole = f(w)
        with sdpa.settings.override(lazy_chunk_bytes=budget):
            chunked = f(w)
        torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6, msg=name)
        if whole.requires_grad:
            (a,) = torch.autograd.grad(whole.double().square().sum(), q)
            with sdpa.settings.override(lazy_chunk_bytes=budget):
                (b,) = torch.autograd.grad(f(w).double().square().sum(), q)
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)


TRANSPOSED_INDICES = [
    (1,), (0, 2), (0, 2, 3), (0, 2, 3, 1), (-1, -2, -3, -4), (Ellipsis, 3),
    (Ellipsis, 3, slice(1, 4)), (0, slice(None), [1, 4], slice(None)),
    (0, 1, [1, 4], slice(2, 5)), (0, 1, slice(None), [1, 4]),
    (slice(None), slice(None), slice(None), [2, 3]), (slice(None), slice(1, 3), [1, 2], [3, 4]),
    (Ellipsis, [1, 2], [3, 4]), (Ellipsis, [1, 2], 5), ([0, 1], Ellipsis, 2, slice(None)),
    ([1, 0], slice(None), [1, 2], slice(None)), (None, 0),
    (Ellipsis, slice(None, None, 2), slice(1, None, 3)),
    (torch.tensor(1), Ellipsis, torch.tensor([0, 3])), (Ellipsis, slice(None)),
]  # fmt: skip


def test_every_index_of_a_transpose_is_the_dense_transposes(gen):
    """Rows of w.mT are key columns of w: ints, slices, lists and integer tensors on
    either of the last two dims, with ints, slices or lists before them (lists on both
    sides, and None, take the dense value)."""
    q, k, v, mask = make_inputs(gen, B=B, Hq=HQ, L=L, S=S, mask_kind="bool")
    w = sdpa.attention(q, k, v, mask).weights
    p = w.full()
    for index in TRANSPOSED_INDICES:
        got = w.mT[index]
        got = got.full() if isinstance(got, LazyExpr) else got
        torch.testing.assert_close(got, p.mT[index], atol=1e-6, rtol=0, msg=repr(index))


@pytest.mark.parametrize(
    "reduce",
    [
        lambda t: t.mean(1),
        lambda t: t.sum(1, keepdim=True),
        lambda t: t.amax(0),
        lambda t: t.mean((0, 1)),
        lambda t: t.amin((0,), keepdim=True),
    ],
)
def test_every_index_of_a_head_mean_is_the_dense_ones(gen, reduce):
    """A reduction over leading dims alone (the head mean) is lazy: its indices read the
    operand's entries over the reduced dims, with and without keepdim."""
    q, k, v, mask = make_inputs(gen, B=B, Hq=HQ, L=L, S=S, mask_kind="float_inf")
    q.requires_grad_()
    w = sdpa.attention(q, k, v, mask).weights
    lazy = reduce(w)
    assert isinstance(lazy, LazyExpr)
    dense = reduce(w.full())
    nd = dense.ndim
    indices = [(0,), (Ellipsis, 2, slice(None)), (Ellipsis, [1, 3]), (Ellipsis, slice(1, 4), 2)]
    indices += [(0,) * (nd - 2) + (slice(None),), (-1,) * (nd - 1), (Ellipsis, [0, 2], [1, 5])]
    for index in indices:
        got = lazy[index]
        got = got.full() if isinstance(got, LazyExpr) else got
        torch.testing.assert_close(got, dense[index], atol=1e-6, rtol=0, msg=repr(index))
        (a,) = torch.autograd.grad(got.sum(), q)
        (b,) = torch.autograd.grad(reduce(w.full())[index].sum(), q)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=repr(index))


def test_an_operand_read_at_two_places_reads_each(gen):
    """w * w.mT (L == S) reads w's rows and its key columns for the same chunk: two
    reads of one operand in one evaluation, each at its own index."""
    q, k, v, mask = make_inputs(gen, B=B, Hq=HQ, L=L, S=L, mask_kind="float")
    q.requires_grad_()
    w = sdpa.attention(q, k, v, mask).weights
    p = w.full()
    for f in (lambda t: (t * t.mT).sum(-1), lambda t: (t * t.mT)[0, 1, 2], lambda t: t - t.mT):
        got, want = f(w), f(p)
        got = got.full() if isinstance(got, LazyExpr) else got
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        (a,) = torch.autograd.grad(got.square().sum(), q)
        (b,) = torch.autograd.grad(f(w.full()).square().sum(), q)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_an_expression_is_made_in_o1_and_answers_as_a_tensor(gen):
    q, k, v, _ = make_inputs(gen, B=B, Hq=HQ, L=L, S=S)
    q.requires_grad_()
    w = sdpa.attention(q, k, v).weights
    x = (w > 0.1).to(torch.float16)
    assert isinstance(x, torch.Tensor) and isinstance(x, LazyExpr)
    assert x.shape == (B, HQ, L, S) and x.dtype == torch.float16 and not x.requires_grad
    y = w.mT * 2
    assert y.shape == (B, HQ, S, L) and y.dtype == torch.float32 and y.requires_grad
    assert y.mT.mT is y and w.mT.mT is w and w.transpose(-1, -2).transpose(-2, -1) is w
    assert (w * 2).contiguous().shape == w.shape and (w * 2).float().dtype == torch.float32
    with torch.no_grad():
        z = w * 2
    assert not z.requires_grad and not z[0, 1, 2].requires_grad  # made under no_grad
    assert not (w * 2).detach()[0, 1, 2].requires_grad


def test_an_expression_goes_stale_with_its_operands(gen):
    """A tensor of one's own in the expression, or q, changed in place after the op:
    every read refuses (the dense op would have used the old values)."""
    q, k, v, _ = make_inputs(gen, B=B, Hq=HQ, L=L, S=S)
    w = sdpa.attention(q, k, v).weights
    keep = torch.ones(S)
    x = w * keep
    x.sum(-1)  # fresh
    keep[0] = 0.0
    with pytest.raises(StaleWeightsError, match=r"shape \(11,\) used in `(__)?mul"):
        x.sum(-1)
    y = w.mT * 2
    q.mul_(2)
    with pytest.raises(StaleWeightsError, match="query changed in place"):
        y[..., 0, :]


@pytest.mark.parametrize(
    "op, pattern",
    [
        (lambda x: x.mul_(2), "`mul_` writes into LazyExpr"),
        (lambda x: x.__setitem__((0, 0), 1.0), "`__setitem__` writes into"),
        (lambda x: x.data_ptr(), "`data_ptr` reads the storage of LazyExpr"),
        (lambda x: torch.add(x.full(), 1, out=x), "out= a LazyExpr"),
        (lambda x: x.retain_grad(), r"w.retain_grad: gradients with respect to the weights"),
        (lambda x: torch.func.vmap(lambda t: t.sum())(x), "torch.func transforms"),
    ],
)
def test_what_an_expression_cannot_do_refuses_by_name(gen, op, pattern):
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=5, S=6)
    x = sdpa.attention(q, k, v).weights * 2
    with pytest.raises(NotSupportedError, match=pattern):
        op(x)


def test_a_reshape_of_the_leading_dims_is_an_expression_of_moved_operands(gen):
    """view / reshape / flatten / unflatten / unsqueeze / squeeze / expand that keep the
    query and key dims: an expression again (its operands moved), made in O(1) of L x S;
    a reshape that moves the query or key dims takes the dense value."""
    q, k, v, _ = make_inputs(gen, B=B, Hq=HQ, L=L, S=S)
    w = sdpa.attention(q, k, v).weights
    keep, _, _, heads, _, _ = _operands(gen)
    dense = w.full()
    cases = [
        ((w * keep).reshape(B * HQ, L, S), (dense * keep).reshape(B * HQ, L, S)),
        ((w * heads).view(-1, L, S), (dense * heads).view(-1, L, S)),
        ((w + 1).unsqueeze(1).squeeze(1), dense + 1),
        ((w.mT * 2).flatten(0, 1), (dense.mT * 2).flatten(0, 1)),
        ((w * keep)[:1].expand(3, HQ, L, S), (dense * keep)[:1].expand(3, HQ, L, S)),
    ]
    for got, want in cases:
        assert isinstance(got, LazyExpr) and got.shape == want.shape
        torch.testing.assert_close(got.full(), want, atol=1e-6, rtol=1e-6)
    # an L x S operand per head, broadcast over B: its view cannot merge B and H, and a
    # copy would be the dense value's size, so the reshape takes the dense value
    per_head = torch.rand(1, HQ, L, S, generator=gen)
    merged = (w * per_head).flatten(0, 1)
    assert type(merged) is torch.Tensor
    torch.testing.assert_close(merged, (dense * per_head).flatten(0, 1))
    moved_keys = (w * 2).reshape(B, HQ, L * S)
    assert type(moved_keys) is torch.Tensor  # (the key dim merged: the dense value)
    torch.testing.assert_close(moved_keys, (dense * 2).reshape(B, HQ, L * S))


def test_an_expression_past_the_budget_refuses_a_dense_op_naming_the_lazy_reads():
    q, k, v = (torch.randn(2, 3, 16385, 4) for _ in range(3))
    x = sdpa.attention(q, k, v).weights * 2
    y = x.flatten(0, 1)  # (a reshape of the leading dims: lazy, no L x S)
    torch.testing.assert_close(y[4, 7], x[1, 1, 7], atol=0, rtol=0)
    with pytest.raises(sdpa.WeightsTooLargeError, match=r"diagonal.*pairs.*elementwise"):
        torch.softmax(x, -1)
    with pytest.raises(sdpa.WeightsTooLargeError, match="`max` of a lazy expression"):
        x.max(1)  # (over the heads: values and indices of B x L x S, 4 GiB)
    assert x.mean(1)[0, 7].shape == (16385,)  # (the head mean itself: lazy)


def test_an_expression_prints_saves_and_copies_as_its_dense_value(gen):
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=5, S=6)
    w = sdpa.attention(q, k, v).weights
    x = (w * 3).mT
    dense = x.full()
    assert repr(x) == repr(dense) and str(x) == str(dense)
    twin = copy.deepcopy(x)
    assert isinstance(twin, LazyExpr) and torch.equal(twin.full(), dense)
    k.mul_(2.0)  # the copy holds its own recipe: never stale through the originals
    fresh = sdpa.attention(q, k, v).weights.full() * 3  # (adding to k would not do:
    assert not torch.allclose(fresh.mT, dense, atol=1e-2)  # softmax forgets row shifts)
    # a row read and the dense compute round apart (values up to 3: float32 tolerances)
    torch.testing.assert_close(twin[..., 2, :], dense[..., 2, :], atol=1e-5, rtol=1e-5)
    w2 = sdpa.attention(q, k, v).weights  # (w is stale now: a fresh call for saving)
    x2 = w2 * 3
    buffer = io.BytesIO()
    torch.save(x2, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded) is torch.Tensor and torch.equal(loaded, x2.full())
    assert torch.equal(pickle.loads(pickle.dumps(x2)), x2.full())


# A fresh process: lazy reductions and products of the weights at L = S = 8192 (the dense
# weights 1 GiB, a chunk of rows 4 MiB) with their backward; it prints the peak's rise
# over the baseline taken after the call
CHUNKS_PEAK_CHILD = """
import torch, sdpa
from sdpa.measure import peak_rss_kib
torch.manual_seed(0)
L, H = 8192, 4
q, k, v = (torch.randn(1, H, L, 16) for _ in range(3))
q.requires_grad_()
w = sdpa.attention(q, k, v).weights
x, u, keep = torch.randn(L, 8), torch.randn(8, L), torch.rand(L)
base = peak_rss_kib()
(w * 2).sum(-1).square().sum().backward()
((w * keep) @ x).sum().backward()
(u @ (w.mean(1) * keep)).sum().backward()
print((peak_rss_kib() - base) / 1024)
"""


@pytest.mark.skipif(budget._TRIM is None, reason="glibc's malloc_trim (release_freed)")
def test_chunked_reads_and_their_backward_at_8192_keys_stay_under_64_mib():
    """Each chunk of rows computed under autograd (checkpointed) and each read's backward
    give their freed pages back first (budget.release_freed): without it glibc's heap
    kept every chunk's, 1.5 GiB here."""
    done = subprocess.run([sys.executable, "-c", CHUNKS_PEAK_CHILD], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 64
