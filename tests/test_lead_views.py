"""Views over the weights' leading dims (sdpa.leads): w[1], w[:, 2], select, narrow,
unbind, split, chunk, flatten, unsqueeze... are lazy handles of those (batch, head) rows.
Each view's weights, reads and gradients equal the same op on the dense weights (the
float64 oracle) on every engine, every mask kind (tensor masks with and without head and
batch dims, padding and documents with a batch dim, causal, sinks), grouped heads whose
groups a view cuts, and both layouts a view takes (its rows as ranges: views of q and k;
else gathered copies); a view goes stale with the call's inputs."""

from __future__ import annotations

import pytest
import torch

import sdpa
from engines import ENGINES, run_or_skip
from sdpa import masks
from sdpa.errors import StaleWeightsError
from sdpa.lazy import LazyExpr

from conftest import MASK_KINDS, make_inputs
from oracle import oracle

# view -> the same op on a tensor; B = 3, Hq = 4 (grouped: Hkv = 2)
VIEWS = {
    "batch": lambda w: w[1],
    "head": lambda w: w[:, 3],
    "one": lambda w: w[2, 1],
    "heads-cut-a-group": lambda w: w[:, 1:3],
    "heads-stepped": lambda w: w[:, ::3],
    "batch-list": lambda w: w[[2, 0, 2]],
    "bool-over-lead": lambda w: w[torch.tensor([[True, False, True, True]] * 3)],
    "select": lambda w: w.select(0, -1),
    "narrow": lambda w: w.narrow(1, 2, 2),
    "unbind": lambda w: w.unbind(1)[2],
    "split": lambda w: torch.split(w, [1, 2], dim=0)[1],
    "chunk": lambda w: w.chunk(2, 1)[1],
    "flatten": lambda w: w.flatten(0, 1)[6:9],
    "unsqueeze-squeeze": lambda w: w.unsqueeze(1)[:, 0].squeeze(0),
    "reshape": lambda w: w.reshape(3, 2, 2, *w.shape[-2:])[1],
    "view-of-a-view": lambda w: w[1:][:, 2][1],
    "expand": lambda w: w[:1].expand(3, -1, -1, -1),
    "expand-new-dims": lambda w: w[0, 1:3].expand(2, 2, -1, -1),
}


MIXES_BATCH = {"expand-new-dims"}


def _reads(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """A row, a column, the sum over queries and the top 2 of a view (or dense tensor)."""
    return {
        "row": x[..., 4, :],
        "column": x[..., 3],
        "received": x.sum(-2),
        "top": x.topk(2).values,
    }


def _masked(gen, kind: str, B: int, Hq: int, L: int, S: int):
    """The mask of `kind`: conftest's tensor kinds, or a structured one with a batch dim."""
    if kind == "padding":
        return masks.padding([S, 3, 1][:B])
    if kind == "documents":
        ids = torch.stack([torch.arange(S) // 3, torch.arange(S) // 4, torch.zeros(S)]).long()
        return masks.documents(ids[:B, :L], ids[:B, :S])
    if kind == "sinks":
        return masks.sinks(torch.randn(Hq, 1, 1, generator=gen))  # one logit per head
    if kind == "causal":
        return None
    return make_inputs(gen, B=B, Hq=Hq, L=L, S=S, mask_kind=kind)[3]


KINDS = [*MASK_KINDS, "padding", "documents", "sinks", "causal"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_views_weights_reads_and_gradients_are_the_dense_ops(gen, engine, kind):
    B, Hq, Hkv, L, S = 3, 4, 2, 9, 9 if kind == "causal" else 11
    q, k, v, _ = make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S)
    mask = _masked(gen, kind, B, Hq, L, S)
    q.requires_grad_()
    k.requires_grad_()
    causal = kind == "causal"
    _, w, reads = run_or_skip(engine, q, k, v, mask, causal=causal)
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    sinks = mask.sinks[..., 0] if kind == "sinks" else None  # (Hq, 1): the oracle's (.., L)
    plain = None if kind == "sinks" else mask
    if isinstance(plain, masks.Mask):  # (the oracle takes the dense keep-mask)
        plain = plain.materialize(L, S).reshape(-1, 1, L, S)
    dense = oracle(q64, k64, v.double(), plain, causal=causal, sinks=sinks)[1]
    for name, view in VIEWS.items():
        with reads:
            got = view(w)
            # a batched structured mask (padding, documents) follows a view only where
            # each new batch element's rows share one of the view's: expanding heads laid
            # out as batch mixes them, and takes the dense weights
            dense_ok = name in MIXES_BATCH and kind in ("padding", "documents")
            assert isinstance(got, sdpa.AttentionWeights) or dense_ok, name
            got_full = got.full() if isinstance(got, sdpa.AttentionWeights) else got
            torch.testing.assert_close(got_full.double(), view(dense), atol=2e-6, rtol=0)
            mine = _reads(got)
        want = _reads(view(dense))
        c = {n: torch.randn(t.shape, generator=gen, dtype=torch.float64) for n, t in want.items()}
        loss = sum((c[n] * mine[n].double()).sum() for n in mine)
        g_q, g_k = torch.autograd.grad(loss, (q, k))
        w_q, w_k = torch.autograd.grad(
            sum((c[n] * want[n]).sum() for n in want), (q64, k64), retain_graph=True
        )  # (the oracle's graph serves every view)
        for n in want:
            torch.testing.assert_close(mine[n].double(), want[n], atol=2e-6, rtol=0, msg=name)
        torch.testing.assert_close(g_q.double(), w_q, atol=2e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(g_k.double(), w_k, atol=2e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("view", ["batch", "heads-cut-a-group", "batch-list", "flatten"])
def test_a_view_goes_stale_with_the_calls_inputs(gen, view):
    """A view of ranges holds views of q and k, a gathered one copies: both refuse once
    the call's q or k changed in place."""
    q, k, v, _ = make_inputs(gen, B=3, Hq=4, Hkv=2, L=9, S=11)
    w = sdpa.attention(q, k, v).weights
    x = VIEWS[view](w)
    x[..., 0, :]  # fresh: reads
    k.add_(1.0)
    with pytest.raises(StaleWeightsError, match="key changed in place"):
        x[..., 0, :]
    with pytest.raises(StaleWeightsError):
        VIEWS[view](w)


def test_a_view_makes_nothing_l_by_s_and_views_q_where_its_rows_are_ranges(gen):
    q, k, v, mask = make_inputs(gen, B=3, Hq=4, L=9, S=11, mask_kind="float")
    w = sdpa.attention(q, k, v, mask).weights
    x = w[1, 1:3]  # ranges: q, k and the mask are views of the call's
    i = x._inputs
    assert i.query.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
    assert i.key.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert i.mask.untyped_storage().data_ptr() == mask.untyped_storage().data_ptr()
    assert x.shape == (2, 9, 11) and i.query.shape == (2, 1, 9, 16)  # (heads as batch)
    y = w[[2, 0]]  # a list: rows gathered (copies of q and k rows, O(rows x E))
    assert y._inputs.query.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()


PERMUTATIONS = {
    "transpose-0-1": lambda w: w.transpose(0, 1),
    "cycle": lambda w: w.permute(2, 0, 1, 3, 4),
    "cycle-back": lambda w: w.permute(1, 2, 0, 3, 4),
    "cycle-keys-first": lambda w: w.permute(1, 2, 0, 4, 3),
    "swapaxes-0-2": lambda w: w.swapaxes(0, -3),
}


@pytest.mark.parametrize("perm", list(PERMUTATIONS))
def test_a_permutation_of_the_lead_dims_is_a_lazy_view_of_the_dense_permutation(gen, perm):
    """Lead dims permuted (the query and key dims last, swapped or not): the rows in
    their new order, a lazy view (a transpose of one where the last two swap), with the
    dense tensor's values and gradients; three lead dims, so a permutation is not its
    own inverse. (q (2, 3, 4, L, E): batch dims 2 x 3, 4 heads.)"""
    q, k, v = (torch.randn(2, 3, 4, 5, 6, generator=gen) for _ in range(3))
    q.requires_grad_()
    w = sdpa.attention(q, k, v).weights
    op = PERMUTATIONS[perm]
    got, want = op(w), op(w.full())
    assert isinstance(got, (sdpa.AttentionWeights, LazyExpr)) and got.shape == want.shape
    torch.testing.assert_close(got.full(), want)
    torch.testing.assert_close(got[1, 1], want[1, 1])
    (g_got,) = torch.autograd.grad(got[..., 3, :].square().sum(), q)
    (g_want,) = torch.autograd.grad(want[..., 3, :].square().sum(), q)
    torch.testing.assert_close(g_got, g_want, atol=1e-6, rtol=1e-5)


def test_a_permutation_mixing_batch_elements_of_a_structured_mask_takes_the_dense_weights(gen):
    """w.transpose(0, 1) puts rows of several batch elements under one new one: a
    structured mask with a batch dim cannot follow (one mask per row), so the dense
    weights answer, as torch would; a tensor mask follows (its rows are copied)."""
    q, k, v, _ = make_inputs(gen, B=3, Hq=4, L=9, S=11)
    w = sdpa.attention(q, k, v, masks.padding([11, 3, 1])).weights
    t = w.transpose(0, 1)
    assert type(t) is torch.Tensor
    torch.testing.assert_close(t, w.full().transpose(0, 1))
    keep = torch.rand(3, 1, 9, 11, generator=gen) > 0.3
    w = sdpa.attention(q, k, v, keep).weights
    t = w.transpose(0, 1)
    assert isinstance(t, sdpa.AttentionWeights)
    torch.testing.assert_close(t.full(), w.full().transpose(0, 1))


# -- torch.stack / torch.cat of handles (the layers of a capture as one tensor) ----------

JOINS = {
    "stack": lambda ws: torch.stack(ws),
    "stack-dim-1": lambda ws: torch.stack(ws, dim=1),
    "cat": lambda ws: torch.cat(ws),
    "stack-then-view": lambda ws: torch.stack(ws)[1:, 0],
    "cat-heads": lambda ws: torch.cat(ws, dim=1),
}


def _layers(gen, kind: str, n: int = 3, requires_grad: bool = True):
    """n calls of one kind (B 2, Hq 4, Hkv 2, L 6, S 6 or 7), each its own q, k, v."""
    S = 6 if kind == "causal" else 7
    shared = make_inputs(gen, B=2, Hq=4, L=6, S=S, mask_kind="float")[3]
    calls = []
    for _ in range(n):
        q, k, v, mask = make_inputs(gen, B=2, Hq=4, Hkv=2, L=6, S=S, mask_kind="float")
        own_2d = make_inputs(gen, B=2, Hq=4, L=6, S=S, mask_kind="2d")[3]  # (L, S) its own
        q.requires_grad_(requires_grad)
        mask = {"none": None, "causal": None, "shared": shared, "own-2d": own_2d}.get(kind, mask)
        if kind == "sinks":
            mask = masks.sinks(torch.randn(4, 1, 1, generator=gen))
        calls.append((q, k, v, mask))
    ws = [sdpa.attention(q, k, v, m, causal=kind == "causal").weights for q, k, v, m in calls]
    return calls, ws


@pytest.mark.parametrize("join", list(JOINS))
@pytest.mark.parametrize("kind", ["none", "causal", "float", "shared", "own-2d", "sinks"])
def test_stacked_handles_are_a_lazy_view_equal_to_the_dense_stack(gen, join, kind):
    calls, ws = _layers(gen, kind)
    got = JOINS[join](ws)
    assert isinstance(got, sdpa.AttentionWeights)
    dense = [w.full() for w in ws]
    torch.testing.assert_close(got.full(), JOINS[join](dense))
    mine, want = got[..., 2, :].sum(), JOINS[join](dense)[..., 2, :].sum()
    queries = [c[0] for c in calls]
    got_grads, want_grads = torch.autograd.grad(mine, queries), torch.autograd.grad(want, queries)
    for g, h in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-5)


def test_a_stack_goes_stale_with_any_of_its_handles(gen):
    """The stack, and its detached twin (whose inputs are the joined copies)."""
    calls, ws = _layers(gen, "float", requires_grad=False)
    s = torch.stack(ws)
    twin = s.detach()
    s[0, 0, 0, 1], twin[0, 0, 0, 1]
    calls[2][1].mul_(2.0)  # the third call's k
    for t in (s, twin):
        with pytest.raises(StaleWeightsError, match="key changed in place"):
            t[0, 0, 0, 1]


def test_handles_of_other_kinds_stack_by_their_rows_and_over_keys_densely(gen):
    """Calls with other scales over a leading dim: a lazy tensor of each call's rows
    (sdpa.lazy_rows.join); over the query or key dims: the dense weights, as torch
    stacks them."""
    from sdpa.lazy_rows import LazyRows

    q, k, v, _ = make_inputs(gen, B=2, Hq=4, L=6, S=7)
    a = sdpa.attention(q, k, v).weights
    b = sdpa.attention(q, k, v, scale=0.3).weights
    both = torch.stack([a, b])
    assert isinstance(both, LazyRows)
    want = torch.stack([a.full(), b.full()])
    torch.testing.assert_close(both.full(), want)
    torch.testing.assert_close(both[1, 0, 2, 3], want[1, 0, 2, 3])
    torch.testing.assert_close(both.sum(-2), want.sum(-2))
    torch.testing.assert_close(
        torch.cat([a, b], 1)[:, 5].full(), torch.cat([want[0], want[1]], 1)[:, 5]
    )
    for got, want in [
        (torch.cat([a, a], dim=-1), torch.cat([a.full(), a.full()], dim=-1)),
        (torch.stack([a, a], dim=3), torch.stack([a.full(), a.full()], dim=3)),
    ]:
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, want)
