"""AttentionWeights: shape, dtype, dense values and the never-stale guarantee."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import sdpa
from engines import BACKEND_ENGINES, run_or_skip
from sdpa import masks, rows

from conftest import make_inputs
from oracle import oracle


def test_shape_dtype_repr(gen):
    q, k, v, _ = make_inputs(gen, Hq=4, Hkv=2, L=5, S=9, dtype=torch.bfloat16)
    w = sdpa.attention(q, k, v).weights
    assert w.shape == torch.Size([2, 4, 5, 9]) and w.dtype == torch.float32
    assert repr(w) == repr(w.full())  # what torch prints for the dense weights
    assert w.lse.shape == (2, 4, 5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("engine", BACKEND_ENGINES)
def test_lse_is_the_log_sum_exp_of_the_scores(gen, engine, causal):
    L, S = (17, 17) if causal else (13, 17)  # causal=True needs L == S
    q, k, v, mask = make_inputs(gen, L=L, S=S, mask_kind="float")
    _, w, reads = run_or_skip(engine, q, k, v, mask, causal=causal)
    with reads:
        lse, p = w.lse, w.full()
    scores = q.double() @ k.double().mT / 4 + mask.double()
    if causal:  # query i sees keys j <= i
        scores = scores.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), -torch.inf)
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(p.double(), oracle(q, k, v, mask, causal=causal)[1],
                               atol=2e-5, rtol=0)  # fmt: skip


def test_rows_sum_to_one_or_zero(gen):
    q, k, v, mask = make_inputs(gen, L=40, S=50, mask_kind="dead_rows")
    p = sdpa.attention(q, k, v, mask).weights.full()
    sums = p.sum(-1)
    dead = ~mask.any(-1)
    torch.testing.assert_close(sums[~dead], torch.ones_like(sums[~dead]), atol=1e-5, rtol=0)
    assert torch.equal(sums[dead], torch.zeros_like(sums[dead]))


def test_weights_carry_their_gradient_only_where_asked(gen):
    """As the listing's p_attn: inside the graph when q requires grad, plain tensors
    under no_grad or when nothing requires grad (tests/test_grads.py checks the values)."""
    q, k, v, _ = make_inputs(gen)
    out, w = sdpa.attention(q, k, v)
    assert not out.requires_grad and not w.full().requires_grad
    q.requires_grad_(True)
    out, w = sdpa.attention(q, k, v)
    assert out.requires_grad and w.full().requires_grad and w.entropy().requires_grad
    with torch.no_grad():
        assert not w.full().requires_grad and not w.sum().requires_grad


@pytest.mark.parametrize("causal", [False, True], ids=["mask", "mask_and_causal"])
@pytest.mark.parametrize("which", ["query", "key", "mask"])
def test_in_place_change_after_the_call_is_refused(gen, which, causal):
    """Also with causal=True, where the mask is held beside the causality (TensorAnd)."""
    q, k, v, mask = make_inputs(gen, mask_kind="bool", L=9, S=9)  # (causal: L == S)
    w = sdpa.attention(q, k, v, mask, causal=causal).weights
    w.full()  # fine before the change
    changed = {"query": q, "key": k, "mask": mask}[which]
    changed.copy_(changed.clone())  # same values, but written in place
    with pytest.raises(
        sdpa.StaleWeightsError,
        match=rf"{which} changed in place after the "
        r"attention call",
    ):
        w.full()
    with pytest.raises(sdpa.StaleWeightsError):
        _ = w.lse


def test_value_change_and_copies_do_not_go_stale(gen):
    q, k, v, _ = make_inputs(gen)
    w = sdpa.attention(q, k, v).weights
    v.mul_(2)  # weights do not depend on value
    ref = oracle(q, k, v)[1]
    torch.testing.assert_close(w.full().double(), ref, atol=2e-5, rtol=0)


def test_kv_cache_view_goes_stale(gen):
    """A key that is a view into a cache sees the cache's in-place writes."""
    cache = torch.randn(1, 2, 16, 8, generator=gen)
    q = torch.randn(1, 2, 1, 8, generator=gen)
    w = sdpa.attention(q, cache[:, :, :4], cache[:, :, :4]).weights
    cache[:, :, 4] = 1.0  # append the next token in place
    with pytest.raises(sdpa.StaleWeightsError):
        w.full()


INDICES = [
    (0,),
    (1, 2),
    (0, slice(None), 5),
    (0, 1, slice(10, 20)),
    (slice(None), slice(1, 4, 2), slice(3, 30, 7)),
    (-1, -2, -3),
    (-2, -6, -33),  # each dim's -size: its first entry
    (Ellipsis, 4, slice(None)),
    (1, Ellipsis, slice(2, 9)),
    (0, 3, 7, slice(5, 11)),  # a key-dim index applies to the computed rows
    (slice(None), slice(None), slice(0, 0)),
]


@pytest.mark.parametrize("index", INDICES, ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "key_padding", "dead_rows"])
@pytest.mark.parametrize("causal", [False, True])
def test_rows_on_demand_equal_the_dense_weights(gen, index, mask_kind, causal):
    q, k, v, mask = make_inputs(gen, Hq=6, Hkv=2, L=33, S=33, mask_kind=mask_kind)
    w = sdpa.attention(q, k, v, mask, causal=causal).weights
    dense = oracle(q, k, v, mask, causal=causal)[1]
    got = w[index]
    assert got.shape == dense[index].shape
    torch.testing.assert_close(got.double(), dense[index], atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "shapes,index",
    [
        (((5, 8), (7, 8)), (slice(1, 3),)),  # 2-D: (L, S)
        (((3, 5, 8), (1, 7, 8)), (2, 4)),  # 3-D: (N, L, S), key broadcast over N
        (((2, 3, 4, 5, 8), (1, 3, 2, 7, 8)), (1, slice(None), 3, 0)),  # 5-D with GQA
        (((2, 3, 4, 5, 8), (1, 3, 2, 7, 8)), (Ellipsis, 4, slice(None))),
    ],
    ids=str,
)
def test_rows_on_demand_any_rank(gen, shapes, index):
    (qs, ks) = shapes
    q, k = torch.randn(*qs, generator=gen), torch.randn(*ks, generator=gen)
    w = sdpa.attention(q, k, k).weights
    dense = oracle(q, k, k)[1]
    torch.testing.assert_close(w[index].double(), dense[index], atol=2e-5, rtol=0)


def test_index_edge_cases(gen):
    import numpy as np

    q, k, v, _ = make_inputs(gen, Hq=4, Hkv=2, L=6, S=6)
    w = sdpa.attention(q, k, v).weights
    dense = w.full()
    assert w[:, 0:0].shape == (2, 0, 6, 6) and w[0, 2:2].shape == (0, 6, 6)
    torch.testing.assert_close(w[np.int64(1), torch.tensor(2)], dense[1, 2])
    torch.testing.assert_close(w[0, 1:3, 4], dense[0, 1:3, 4])  # heads across a group edge
    torch.testing.assert_close(w[0, 2:4, 4], dense[0, 2:4, 4])  # one whole group


class Allocations(TorchDispatchMode):
    """Records the bytes of every new storage an aten op returns while active (views and
    writes into out= or in-place arguments allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[int, str]] = []  # (bytes, op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append((t.untyped_storage().nbytes(), str(func)))
        return out

    @property
    def total(self) -> int:
        return sum(n for n, _ in self.sizes)

    @property
    def largest(self) -> tuple[int, str]:
        return max(self.sizes, default=(0, "nothing"))


ROW_MASKS = {
    "none": None,
    "causal": masks.causal(),
    "window_and_padding": masks.sliding_window(100) & masks.padding([3000]),
    "float": "float",
}


@pytest.mark.parametrize("mask_kind", ROW_MASKS)
def test_one_row_costs_one_row(gen, mask_kind):
    """w[0, :, 5] on a long sequence must not build the L x S matrix (nor an L x S mask):
    its values, and the bytes every aten op allocates on the way, O(H x S x E)."""
    B, H, L, E = 1, 4, 4096, 32
    q, k = (torch.randn(B, H, L, E, generator=gen) for _ in range(2))
    mask = ROW_MASKS[mask_kind]
    if mask_kind == "float":
        mask = torch.randn(L, L, generator=gen).masked_fill(torch.rand(L, L, generator=gen) < 0.3,
                                                            -torch.inf)  # fmt: skip
    w = sdpa.attention(q, k, k, mask).weights
    with Allocations() as allocated:
        row = w[0, :, 5]
    assert row.shape == (H, L)
    dense_bytes = B * H * L * L * 4
    # measured: 2.3 MB in all (mostly k with a column of ones, H x S x (E+1) floats)
    assert allocated.total < dense_bytes / 50, allocated.largest
    keep = torch.ones(L, dtype=torch.bool)
    bias = torch.zeros(L, dtype=torch.float64)
    if mask_kind == "causal":
        keep = torch.arange(L) <= 5
    elif mask_kind == "window_and_padding":
        keep = (torch.arange(L) <= 5) & (torch.arange(L) < 3000)
    elif mask_kind == "float":
        bias = mask[5].double()
    s = q[0, :, 5:6].double() @ k[0].double().mT / E**0.5 + bias  # (H, 1, S)
    ref = torch.softmax(s.masked_fill(~keep, -torch.inf), -1)[:, 0]
    torch.testing.assert_close(row.double(), ref, atol=2e-5, rtol=0)


STAT_BUDGET = 2**18  # a small chunk budget: 64 rows of 1024 keys in float32


@pytest.mark.parametrize("mask_kind", ["none", "float", "causal", "documents"])
def test_statistics_never_allocate_the_weights(gen, mask_kind):
    """Where the dense weights exceed the chunk budget, no aten op that entropy, sum,
    topk or amax runs allocates more than a statistic's tile (rows.stat_budget: at most
    STRETCH x the budget) or than the forward call did: not (L, S) of one head, not its
    mask, not the dense weights."""
    with sdpa.settings.override(chunk_bytes=STAT_BUDGET):  # the engine, on a small budget
        _statistics_never_allocate_the_weights(gen, mask_kind)


def _statistics_never_allocate_the_weights(gen, mask_kind):
    B, Hq, Hkv, L, E = 1, 4, 2, 1024, 8
    q = torch.randn(B, Hq, L, E, generator=gen)
    k = torch.randn(B, Hkv, L, E, generator=gen)
    mask = {
        "none": None,
        "float": torch.randn(L, L, generator=gen),
        "causal": masks.causal(),
        "documents": masks.documents(torch.arange(L) // 300),
    }[mask_kind]
    with Allocations() as forward:
        w = sdpa.attention(q, k, k, mask).weights
    # the entropy may take one more fused call, which allocates what the forward does
    # (the bias of a block of rows under a structured mask: 0.7 MB for documents)
    bound = max(rows.STRETCH * STAT_BUDGET, forward.largest[0])
    one_head = L * L * 4
    assert bound < one_head  # one head's weights don't fit
    got = {}
    for stat, ask in {
        "entropy": w.entropy,
        "sum": lambda: w.sum(dim=-2),
        "topk": lambda: w.topk(8)[0],
        "amax": lambda: w.amax(-1),
        "max": lambda: w.max(-1).values,
        "global max": lambda: w.max()[None, None, None].expand(1, 1, L),
    }.items():
        with Allocations() as allocated:
            got[stat] = ask()
        assert allocated.largest[0] <= bound, (stat, allocated.largest)
    # the answers are still right: against rows of the weights, one per head
    p = w[0, :, 700].double()  # (Hq, S)
    plogp = torch.where(p > 0, p * p.log(), torch.zeros_like(p))
    torch.testing.assert_close(got["entropy"][0, :, 700].double(), -plogp.sum(-1),
                               atol=1e-4, rtol=0)  # fmt: skip
    torch.testing.assert_close(got["amax"][0, :, 700].double(), p.amax(-1), atol=2e-5, rtol=0)
    torch.testing.assert_close(got["topk"][0, :, 700].double(), p.topk(8).values,
                               atol=2e-5, rtol=0)  # fmt: skip
    torch.testing.assert_close(got["sum"].sum(-1), torch.full((B, Hq), float(L)), atol=1e-2,
                               rtol=0)  # fmt: skip


@pytest.mark.parametrize(
    "index,exc,pattern",
    [
        ((0, 0, 0, 0, 0), IndexError, r"too many indices for weights of shape \(2, 3, 7, 9\)"),
        ((2,), IndexError, r"index 2 is out of bounds for dim(ension)? 0 with size 2"),
        ((slice(None, None, -1),), ValueError, r"step must be (positive|greater than zero)"),
        ((Ellipsis, Ellipsis), IndexError, r"single ellipsis"),
    ],
)
def test_bad_indices(gen, index, exc, pattern):
    q, k, v, _ = make_inputs(gen)
    w = sdpa.attention(q, k, v).weights
    with pytest.raises(exc, match=pattern):
        w[index]


@pytest.mark.parametrize(
    "index",
    [
        (0, None),
        (torch.tensor([1, 0]),),
        (torch.tensor([True, False]), 2),
        (..., None, 3),
        (1, 2, torch.tensor([True, False] * 3 + [True])),
        (0, None, 1, [4, 2], None),
    ],
    ids=["none", "tensor-lead", "bool-lead", "ellipsis-none", "bool-rows", "none-list"],
)
def test_indices_the_rows_engine_does_not_take_answer_as_the_dense_weights(gen, index):
    """None, tensors and boolean masks over the lead dims: the dense tensor's answer
    (lazily: a view, a read of the index without None then unsqueezed, a mask's
    positions; a None among lists densely, within the budget), gradients included."""
    q, k, v, _ = make_inputs(gen)
    q.requires_grad_()
    w = sdpa.attention(q, k, v).weights
    got, want = w[index], w.full()[index]
    got = got.full() if isinstance(got, sdpa.AttentionWeights) else got
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # (a column read: fp32)
    (g_got,) = torch.autograd.grad(got.square().sum(), q)
    (g_want,) = torch.autograd.grad(w.full()[index].square().sum(), q)
    torch.testing.assert_close(g_got, g_want, atol=1e-6, rtol=0)


def dense_stats(p: torch.Tensor, k: int):
    """The oracle's statistics of dense float64 weights p (..., L, S)."""
    plogp = torch.where(p > 0, p * p.log(), torch.zeros_like(p))
    values, _ = p.topk(k, dim=-1)
    return p.sum(-2), p.sum(-2) / p.shape[-2], -plogp.sum(-1), values


HALF_WEIGHTS_TOL = 2e-4  # 16-bit inputs, statistics in float32: see the test below
HALF_ENTROPY_TOL = 3e-4

STAT_CASES = [
    dict(mask_kind="none"),
    dict(mask_kind="bool"),
    dict(mask_kind="float"),
    dict(mask_kind="float_inf"),
    dict(mask_kind="key_padding"),
    dict(mask_kind="dead_rows"),
    dict(mask_kind="none", causal=True),
    dict(mask_kind="bool", causal=True),
    dict(mask_kind="none", Hq=6, Hkv=2),
    dict(mask_kind="bool", Hq=6, Hkv=3, scale=0.7),
    dict(mask_kind="none", scale=2.0),  # peaked rows: entropy cancels
    *(
        dict(mask_kind=kind, dtype=dtype, **extra)
        for dtype in (torch.bfloat16, torch.float16)
        for kind, extra in [
            ("none", {}),
            ("float", {}),
            ("float_inf", {}),
            ("dead_rows", {}),
            ("bool", dict(causal=True)),
            ("none", dict(Hq=6, Hkv=2)),
            ("none", dict(scale=2.0)),
        ]
    ),
]


@pytest.mark.parametrize("case", STAT_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("L,S", [(1, 1), (37, 53), (64, 64)])
def test_statistics_match_the_oracle(gen, case, L, S):
    case = dict(case)
    causal, scale = case.pop("causal", False), case.pop("scale", None)
    if causal and L != S:
        pytest.skip("causal needs L == S")
    q, k, v, mask = make_inputs(gen, L=L, S=S, E=40, **case)
    w = sdpa.attention(q, k, v, mask, causal=causal, scale=scale).weights
    ref_p = oracle(q, k, v, mask, causal=causal, scale=scale)[1]
    kk = min(5, S)
    ref_sum, ref_mean, ref_entropy, ref_top = dense_stats(ref_p, kk)
    # The oracle sees the same rounded 16-bit inputs and the statistics are computed in
    # float32, so float32-level bounds hold; what 16-bit inputs add is torch's 16-bit CPU
    # kernel's LSE (off by up to 6.5e-5, its fast exp). Worst over 200 seeds x every case
    # and size here, bf16 and fp16 alike: weights (sum/L, mean, topk, amax, rows, full)
    # 6.5e-5, entropy 9.8e-5; the bounds are 3x that. Rows, statistics or the fused
    # entropy computed in the 16-bit dtype instead fail them (checked by mutation).
    tol = 2e-5 if q.dtype == torch.float32 else HALF_WEIGHTS_TOL
    torch.testing.assert_close(w.sum(dim=-2).double(), ref_sum, atol=tol * L, rtol=0)
    torch.testing.assert_close(w.mean(dim=-2).double(), ref_mean, atol=tol, rtol=0)
    # entropy: within 1e-4 * max(1, |lse|) of the oracle (the fused path may cancel)
    ref_lse = torch.where(ref_p.sum(-1) > 0, w.lse.double(), torch.zeros_like(ref_entropy))
    bound = 1e-4 * ref_lse.abs().clamp(min=1) if q.dtype == torch.float32 else HALF_ENTROPY_TOL
    assert ((w.entropy().double() - ref_entropy).abs() <= bound).all()
    torch.testing.assert_close(w.amax(-1).double(), ref_p.amax(-1), atol=tol, rtol=0)
    torch.testing.assert_close(w.full().double(), ref_p, atol=tol, rtol=0)
    torch.testing.assert_close(w[1, :, L // 2].double(), ref_p[1, :, L // 2], atol=tol, rtol=0)
    values, indices = w.topk(kk)
    assert values.shape == indices.shape == (*ref_p.shape[:-1], kk)
    torch.testing.assert_close(values.double(), ref_top, atol=tol, rtol=0)
    # the indices point at those values
    torch.testing.assert_close(ref_p.gather(-1, indices), ref_top, atol=tol, rtol=0)
    for stat in (w.sum(-2), w.entropy(), values):
        assert stat.dtype == torch.float32


def test_fully_masked_rows_have_zero_entropy_and_zero_topk(gen):
    q, k, v, _ = make_inputs(gen, L=6, S=5)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[2] = False
    w = sdpa.attention(q, k, v, mask).weights
    assert torch.equal(w.entropy()[:, :, 2], torch.zeros(2, 3))
    assert torch.equal(w.topk(3)[0][:, :, 2], torch.zeros(2, 3, 3))


def test_statistics_take_the_chunked_path_in_tiles(gen):
    """A small budget cuts the work into row chunks of one head: same answers."""
    q, k, v, mask = make_inputs(gen, Hq=4, Hkv=2, L=50, S=70, mask_kind="float")
    r = sdpa.attention(q, k, v, mask).weights._every_row()
    budget = 7 * 70 * 4  # 7 rows of one head
    assert len(list(rows.tiles(r, budget))) == 2 * 4 * 8
    ref_p = oracle(q, k, v, mask)[1]
    ref_sum, _, ref_entropy, ref_top = dense_stats(ref_p, 4)
    with sdpa.settings.override(chunk_bytes=budget):
        torch.testing.assert_close(rows.key_sums(r).double(), ref_sum, atol=1e-4, rtol=0)
        torch.testing.assert_close(rows.entropy(r).double(), ref_entropy, atol=1e-4, rtol=0)
        torch.testing.assert_close(rows.topk(r, 4)[0].double(), ref_top, atol=2e-5, rtol=0)
        torch.testing.assert_close(rows.dense(r).double(), ref_p, atol=2e-5, rtol=0)


def test_a_batch_elements_heads_fold_into_one_tile_within_fold_times_the_budget(gen):
    """Tiles are planned for few, large operations: every head of a batch element in one
    tile where their complete rows fit in rows.FOLD x the budget (a dozen ops per tile,
    each a parallel region), else row chunks of one head within the budget; same
    answers. A selection of keys folds only within the budget itself."""
    q, k, v, _ = make_inputs(gen, B=2, Hq=4, Hkv=2, L=50, S=70)
    r = sdpa.attention(q, k, v).weights._every_row()
    element = 4 * 50 * 70 * 4  # bytes of one batch element's weights, every head
    keys = r._replace(keys=slice(0, 35))  # half the keys: 28,000 bytes, every head
    assert len(list(rows.tiles(keys, element // rows.FOLD))) == 2 * 4
    ref_p = oracle(q, k, v, None)[1]
    ref_entropy = dense_stats(ref_p, 4)[2]
    for budget, count in ((element // rows.FOLD, 2), (element // rows.FOLD - 4, 2 * 4 * 2)):
        assert len(list(rows.tiles(r, budget))) == count, budget  # (folded; 49 + 1 rows)
        with sdpa.settings.override(chunk_bytes=budget):
            torch.testing.assert_close(rows.dense(r).double(), ref_p, atol=2e-6, rtol=0)
            torch.testing.assert_close(rows.entropy(r).double(), ref_entropy, atol=1e-5, rtol=0)


def test_full_refuses_over_budget_before_allocating(gen):
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=300, S=400)
    w = sdpa.attention(q, k, v).weights
    with pytest.raises(
        sdpa.WeightsTooLargeError,
        match=r"need 960,000 bytes .* over "
        r"max_bytes=100,000. Lazy reads work .* w.entropy\(\), torch.diagonal.* w.pairs",
    ):
        w.full(max_bytes=100_000)
    assert isinstance(sdpa.WeightsTooLargeError("x"), MemoryError)
    assert w.full(max_bytes=None).shape == (1, 2, 300, 400)


def test_statistics_work_where_the_dense_weights_exceed_the_budget(gen):
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=2048, S=2048, E=8)
    w = sdpa.attention(q, k, v).weights
    with pytest.raises(sdpa.WeightsTooLargeError):
        w.full(max_bytes=2**24)  # 32 MiB of weights
    sums, h, (top, _) = w.sum(-2), w.entropy(), w.topk(4)
    assert sums.shape == (1, 2, 2048) and h.shape == (1, 2, 2048) and top.shape == (1, 2, 2048, 4)
    torch.testing.assert_close(sums.sum(-1), torch.full((1, 2), 2048.0), rtol=1e-5, atol=0)
    assert ((h > 0) & (h <= torch.log(torch.tensor(2048.0)))).all()


@pytest.mark.parametrize("dim", [-1, 0, 3, (0, 1), None, (1, -2)])
@pytest.mark.parametrize("op", ["sum", "mean", "amax"])
def test_reductions_over_any_dims_equal_the_dense_tensors(gen, op, dim):
    """torch's reductions over any dims, keepdim or not: lazy where the dims include
    the queries (sum, mean) or the keys (amax), else on the dense weights; gradients
    as the dense tensor's. The two sum in other orders: a sum over every dim is about
    B*H*L (42 here), where float32's spacing is 3.8e-6, so the bound is relative
    (torch's float32 rtol) on top of 1e-6, and the gradient's bound scales with the
    loss's (a sum over the keys is 1 in every row: its gradient is 0 plus the
    rounding of 2 x 42 x d(42)/dq); a wrong dim is off by far more."""
    q, k, v, _ = make_inputs(gen)
    q.requires_grad_()
    w = sdpa.attention(q, k, v).weights
    for keepdim in (False, True):
        got = getattr(w, op)(dim, keepdim=keepdim) if dim is not None else getattr(w, op)()
        dense = w.full()
        want = getattr(dense, op)(dim, keepdim=keepdim) if dim is not None else getattr(dense, op)()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1.3e-6)
        (g_got,) = torch.autograd.grad(got.square().sum(), q)
        (g_want,) = torch.autograd.grad(want.square().sum(), q)
        scale = 1.0 + want.detach().abs().max().item()
        torch.testing.assert_close(g_got, g_want, atol=1e-6 * scale, rtol=1.3e-6)


def test_an_op_past_the_budget_refuses_naming_it_and_the_lazy_reads(gen):
    """An op no lazy read answers takes the dense weights within the default budget;
    past it WeightsTooLargeError names the op and the lazy reads (no allocation)."""
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=12000, S=12000, E=8)
    w = sdpa.attention(q, k, v).weights  # 1.07 GiB dense in float32
    with pytest.raises(sdpa.WeightsTooLargeError, match=r"`cumsum` on AttentionWeights .* "
                       r"Lazy reads .* torch.diagonal\(w, offset, -2, -1\), w.pairs"):  # fmt: skip
        w.cumsum(-1)
    assert w.mean(dim=-2).shape == (1, 2, 12000)  # lazy: O(L + S)
    assert w.mean(1)[0, 7].shape == (12000,)  # the head mean: a lazy expression


@pytest.mark.parametrize("k", [-1, 10, 2.0, True])
def test_bad_topk(gen, k):
    q, k_, v, _ = make_inputs(gen)
    with pytest.raises(ValueError, match=r"k must be an int in \[0, S=9\]"):
        sdpa.attention(q, k_, v).weights.topk(k)


def test_topk_of_zero_is_empty_as_in_torch(gen):
    q, k, v, _ = make_inputs(gen)
    values, indices = sdpa.attention(q, k, v).weights.topk(0)
    assert values.shape == indices.shape == (2, 3, 7, 0)
    assert values.dtype == torch.float32 and indices.dtype == torch.long


def _keep(kind, B, L, S):
    """Structured mask `kind` as sdpa.masks builds it, and its keep-mask (B|1, 1, L, S)
    written out here independently of sdpa.masks, for the oracle."""
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]  # (L, 1), (1, S)
    lengths = torch.tensor([S // 2, 0][:B])  # batch element 1 sees no key at all
    ids_q, ids_k = torch.arange(L) * 3 // L, torch.arange(S) * 3 // S
    cases = {
        "causal": (masks.causal(), j <= i + S - L),
        "causal_top_left": (masks.causal("top-left"), j <= i),
        "sliding_window": (masks.sliding_window(4), (j <= i + S - L) & (j > i + S - L - 4)),
        "padding": (masks.padding(lengths), j[None] < lengths[:, None, None]),
        "documents": (masks.documents(ids_q, ids_k), ids_q[:, None] == ids_k[None, :]),
        "window_and_padding": (
            masks.sliding_window(6, "top-left") & masks.padding(lengths),
            (j <= i) & (j > i - 6) & (j[None] < lengths[:, None, None]),
        ),
        "causal_or_documents": (
            masks.causal() | masks.documents(ids_q, ids_k),
            (j <= i + S - L) | (ids_q[:, None] == ids_k[None, :]),
        ),
    }
    mask, keep = cases[kind]
    keep = keep if keep.ndim == 3 else keep[None]  # (B|1, L, S)
    return mask, keep[:, None]


# worst seen over 100 seeds of every case below: 1.3e-6 (structured), 1.8e-6 (scores
# in the tens, over 1000 seeds), 2e-7 (huge biases)
AMAX_TOL = 5e-6
AMAX_MASKS = [
    "causal",
    "causal_top_left",
    "sliding_window",
    "padding",
    "documents",
    "window_and_padding",
    "causal_or_documents",
]


@pytest.mark.parametrize("L,S", [(13, 21), (21, 13)])  # L > S: bottom-right leaves dead rows
@pytest.mark.parametrize("kind", AMAX_MASKS)
def test_amax_under_structured_masks(gen, kind, L, S):
    q, k, v, _ = make_inputs(gen, Hq=4, Hkv=2, L=L, S=S)
    mask, keep = _keep(kind, 2, L, S)
    top = sdpa.attention(q, k, v, mask).weights.amax(-1)
    ref = oracle(q, k, v, keep)[1].amax(-1)
    torch.testing.assert_close(top.double(), ref, atol=AMAX_TOL, rtol=0)


def _float_mask(gen, kind, L, S):
    """(2, 1, L, S) additive masks: -inf entries, whole rows of -inf, huge finite biases."""
    bias = torch.randn(2, 1, L, S, generator=gen)
    drop = torch.rand(2, 1, L, S, generator=gen) < 0.5
    if kind == "float_inf":
        return bias.masked_fill(drop, -torch.inf)
    if kind == "float_inf_dead_rows":
        bias = bias.masked_fill(drop, -torch.inf)
        bias[:, :, ::3] = -torch.inf  # every third row sees no key
        return bias
    if kind == "float_huge":  # -1e9 for "excluded", and rows shifted by -2**20
        # (every row keeps its diagonal key: a row of nothing but -1e9 + s is uniform in
        # float32, where -1e9 swamps s, and not in float64)
        drop &= ~torch.eye(L, S, dtype=torch.bool)
        bias = torch.zeros(2, 1, L, S).masked_fill(drop, -1e9)
        bias[:, :, ::4] = -(2.0**20)  # |lse| ~ 1e6: recomputed, not rebuilt from the LSE
        return bias
    if kind == "float_large_scores":  # |lse| in the tens: the mirror path
        return bias * 30
    raise ValueError(kind)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["float_inf", "float_inf_dead_rows", "float_huge",
                                  "float_large_scores"])  # fmt: skip
def test_amax_under_float_masks(gen, kind, causal):
    q, k, v, _ = make_inputs(gen, Hq=4, Hkv=2, L=17, S=17)
    mask, scale = _float_mask(gen, kind, 17, 17), None
    if kind == "float_huge":  # scores on a grid of 1/8 that float32 holds exactly at 2**20
        q, k = (torch.randint(-2, 3, t.shape, generator=gen).float() for t in (q, k))
        scale = 0.125
    top = sdpa.attention(q, k, v, mask, causal=causal, scale=scale).weights.amax(-1)
    ref = oracle(q, k, v, mask, causal=causal, scale=scale)[1].amax(-1)
    torch.testing.assert_close(top.double(), ref, atol=AMAX_TOL, rtol=0)


@pytest.mark.parametrize("mask_kind", ["none", "float_inf", "dead_rows"])
def test_amax_is_each_rows_largest_weight(gen, mask_kind):
    q, k, v, mask = make_inputs(gen, Hq=4, Hkv=2, L=13, S=21, mask_kind=mask_kind)
    w = sdpa.attention(q, k, v, mask).weights
    top = w.amax(-1)
    assert top.shape == (2, 4, 13) and w.amax(dim=3).shape == top.shape
    torch.testing.assert_close(top.double(), oracle(q, k, v, mask)[1].amax(-1), atol=2e-6, rtol=0)
    dead = oracle(q, k, v, mask)[1].sum(-1) == 0
    assert torch.equal(top[dead], torch.zeros_like(top[dead]))  # rows that see no key: 0


def test_max_and_argmax_over_the_keys_are_lazy_and_torchs(gen):
    """w.max(-1) (torch.return_types.max), w.argmax(-1), w.max(): as the dense tensor's
    (an index where the values tie may differ: the weight there is the maximum)."""
    q, k, v, _ = make_inputs(gen)
    w = sdpa.attention(q, k, v).weights
    dense = w.full()
    got = w.max(-1)
    assert isinstance(got, torch.return_types.max)
    torch.testing.assert_close(got.values, dense.max(-1).values, atol=1e-6, rtol=0)
    picked = dense.gather(-1, w.argmax(-1, keepdim=True))[..., 0]
    torch.testing.assert_close(picked, dense.amax(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(w.max(), dense.max(), atol=1e-6, rtol=0)
    torch.testing.assert_close(w.max(dim=-1, keepdim=True).indices, w.argmax(-1, True))
    assert isinstance(w.topk(2), torch.return_types.topk)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "top-left", "padding", "decode"])
def test_received_attention_equals_the_oracle_keys_no_query_sees_included(gen, mask_kind):
    """w.sum(dim=-2) on CPU, from the rows engine on cache-sized tiles, against the
    oracle: keys no query sees receive exactly 0."""
    L = 1 if mask_kind == "decode" else 70
    S = 70 if mask_kind != "decode" else 130
    q = torch.randn(2, 4, L, 16, generator=gen)
    k = torch.randn(2, 2, S, 16, generator=gen)
    keep = torch.rand(2, 1, 1, S, generator=gen) > 0.3
    keep[1, ..., : S // 2] = False  # half the keys of batch 1: seen by no query
    mask, causal = {
        "none": (None, False),
        "causal": (None, True),
        "top-left": (masks.causal("top-left"), False),
        "padding": (keep, False),
        "decode": (keep, False),
    }[mask_kind]
    w = sdpa.attention(q, k, k, mask, causal=causal).weights
    sums = w.sum(dim=-2)
    dense = masks.causal("top-left").materialize(L, S) if mask_kind == "top-left" else mask
    want = oracle(q, k, k, dense, causal=causal)[1].sum(-2)
    torch.testing.assert_close(sums.double(), want, atol=1e-6, rtol=2e-6)
    if mask_kind == "padding":
        assert torch.all(sums[1, :, : S // 2] == 0)


def test_statistics_over_long_rows_take_256_rows_within_4x_the_budget(gen):
    """rows.stat_budget: a single-pass statistic's tile holds 256 rows of one head where
    the rows are long, at most 4x chunk_bytes, never less than chunk_bytes; its answers
    are those of tiles of one row (L = 300: 64-row tiles end on a short one)."""
    q, k, v, mask = make_inputs(gen, Hq=4, Hkv=2, L=300, S=70, mask_kind="float")
    w = sdpa.attention(q, k, v, mask).weights
    r = w._every_row()
    row = 70 * 4  # one head's row of float32 weights, bytes
    for rows_in_budget, rows_per_tile in [(16, 64), (100, 256), (300, 300), (1, 4)]:
        with sdpa.settings.override(chunk_bytes=rows_in_budget * row):
            assert rows.stat_budget(r) == rows_per_tile * row
    reads = {
        "sum": lambda: w.sum(dim=-2), "entropy": lambda: w.entropy(),
        "topk": lambda: w.topk(3).values, "amax": lambda: w.amax(-1),
        "u @ w": lambda: torch.ones(300) @ w, "max_logits": lambda: w.max_logits().row,
    }  # fmt: skip
    for name, read in reads.items():
        with sdpa.settings.override(chunk_bytes=16 * row):  # 64-row tiles
            stretched = read()
        with sdpa.settings.override(chunk_bytes=row // 4):  # one row a tile
            single = read()
        torch.testing.assert_close(stretched, single, atol=1e-6, rtol=1e-6, msg=name)
