"""sdpa.masks: each mask against its hand-built dense twin, through every path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sdpa
from engines import BACKEND_ENGINES, run, run_or_skip, skip_refused
from sdpa import masks
from sdpa.backends import blocks

from conftest import make_inputs
from oracle import oracle


def twin_causal(L, S, align="bottom-right", size=None):
    """Hand-built: query i at key position i + (S - L) (bottom-right) or i (top-left)."""
    p = torch.arange(L)[:, None] + (S - L if align == "bottom-right" else 0)  # (L, 1)
    j = torch.arange(S)[None, :]  # (1, S)
    return (j <= p) & (j > p - size) if size is not None else j <= p


def twin_padding(lengths, L, S, queries=False):
    keep = torch.zeros(len(lengths), 1, L, S, dtype=torch.bool)
    for b, n in enumerate(lengths):
        keep[b, :, : n if queries else L, :n] = True
    return keep


def twin_documents(q_ids, k_ids):
    return torch.tensor(q_ids)[:, None] == torch.tensor(k_ids)[None, :]


def test_bottom_right_causal_as_flash_attention_draws_it():
    # flash-attention's docstring: L=2, S=5 bottom-right; L=5, S=2 (first 3 rows empty)
    assert masks.causal().materialize(2, 5).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert masks.causal().materialize(5, 2).int().tolist() == [
        [0, 0], [0, 0], [0, 0], [1, 0], [1, 1]
    ]  # fmt: skip
    assert masks.causal("top-left").materialize(2, 5).int().tolist() == [
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]
    ]  # fmt: skip


@pytest.mark.parametrize("L,S", [(1, 1), (97, 130), (130, 97), (300, 300), (1, 700)])
def test_materialize_equals_the_twins(L, S):
    for align in masks.ALIGNS:
        assert torch.equal(masks.causal(align).materialize(L, S), twin_causal(L, S, align))
        for size in (1, 7, 64):
            assert torch.equal(masks.sliding_window(size, align).materialize(L, S),
                               twin_causal(L, S, align, size))  # fmt: skip
    lengths = [S, max(0, S - 50), 1]
    assert torch.equal(masks.padding(lengths).materialize(L, S), twin_padding(lengths, L, S))
    padded = masks.padding(lengths, queries=True).materialize(L, S)
    assert torch.equal(padded, twin_padding(lengths, L, S, queries=True))


def mask_cases(L, S, B):
    """(structured mask, its dense twin broadcasting to (B, 1, L, S))."""
    g = torch.Generator().manual_seed(L * 1000 + S)
    lengths = torch.randint(0, S + 1, (B,), generator=g).tolist()
    lengths[0] = S
    cases = [
        (masks.causal(), twin_causal(L, S)),
        (masks.causal("top-left"), twin_causal(L, S, "top-left")),
        (masks.sliding_window(33), twin_causal(L, S, size=33)),
        (masks.sliding_window(300, "top-left"), twin_causal(L, S, "top-left", 300)),
        (masks.padding(lengths), twin_padding(lengths, L, S)),
        (masks.padding(lengths, queries=True), twin_padding(lengths, L, S, queries=True)),
        (masks.causal() & masks.padding(lengths), twin_causal(L, S) & twin_padding(lengths, L, S)),
        (
            masks.sliding_window(40) | masks.padding([3] * B),
            twin_causal(L, S, size=40) | twin_padding([3] * B, L, S),
        ),
    ]
    if L == S:
        ids = torch.sort(torch.randint(0, 4, (L,), generator=g)).values
        cases.append((masks.documents(ids), twin_documents(ids.tolist(), ids.tolist())))
        batch_ids = torch.sort(torch.randint(0, 3, (B, L), generator=g)).values
        twin = torch.stack([twin_documents(r.tolist(), r.tolist()) for r in batch_ids])[:, None]
        cases.append((masks.documents(batch_ids) & masks.causal(), twin & twin_causal(L, S)))
    return cases


SIZES = [(1, 1), (97, 130), (130, 97), (300, 300), (600, 600), (5, 700)]


@pytest.mark.parametrize("L,S", SIZES)
@pytest.mark.parametrize("engine", BACKEND_ENGINES)
def test_attention_and_weights_equal_the_dense_twin(gen, L, S, engine):
    B = 2
    q, k, v, _ = make_inputs(gen, B=B, Hq=4, Hkv=2, L=L, S=S, E=40, Ev=24)
    cases = mask_cases(L, S, B)
    for mask, twin in cases:  # the engine runs every case, or the test skips
        skip_refused(engine, q, k, v, mask)
        skip_refused(engine, q, k, v, twin)
    for mask, twin in cases:
        out, w, reads = run(engine, q, k, v, mask)
        ref_out, ref_p = oracle(q, k, v, twin)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0, msg=repr(mask))
        with reads:
            torch.testing.assert_close(w[:, :, ::7].double(), ref_p[:, :, ::7], atol=2e-5,
                                       rtol=0, msg=repr(mask))  # fmt: skip
            torch.testing.assert_close(w.sum(-2).double(), ref_p.sum(-2), atol=1e-4, rtol=0)
            plogp = torch.where(ref_p > 0, ref_p * ref_p.log(), torch.zeros_like(ref_p))
            torch.testing.assert_close(w.entropy().double(), -plogp.sum(-1), atol=1e-4, rtol=0)
        # the same mask as a dense bool tensor gives the same answer
        torch.testing.assert_close(run(engine, q, k, v, twin)[0], out,
                                   atol=1e-5, rtol=0)  # fmt: skip


@pytest.mark.parametrize("L,S", [(97, 130), (300, 300), (600, 600)])
def test_gradients_through_block_skipping(gen, L, S):
    q, k, v, _ = make_inputs(gen, B=2, Hq=2, L=L, S=S, E=16)
    grad = torch.randn(2, 2, L, 16, generator=gen)
    for mask, twin in mask_cases(L, S, 2):
        ours = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = [t.double().requires_grad_(True) for t in (q, k, v)]
        sdpa.attention(*ours, mask).output.backward(grad)
        oracle(*ref, twin)[0].backward(grad.double())
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=0, msg=repr(mask))


@pytest.mark.parametrize("L,S", [(300, 300), (97, 130)])
def test_drop_in_takes_masks(gen, L, S):
    q, k, v, _ = make_inputs(gen, L=L, S=S)
    for mask, twin in mask_cases(L, S, 2):
        ours = sdpa.scaled_dot_product_attention(q, k, v, mask)
        theirs = F.scaled_dot_product_attention(q, k, v, twin)
        ref = oracle(q, k, v, twin)[0].float()
        dead = ~twin.any(-1, keepdim=True).expand_as(ref)  # torch gives NaN there on some paths
        torch.testing.assert_close(ours[~dead], theirs[~dead], atol=1e-5, rtol=0)
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match=r"attn_mask and is_causal=True were both given"):
        sdpa.scaled_dot_product_attention(q, k, v, masks.causal(), is_causal=True)


def test_modules_take_masks(gen):
    m = sdpa.MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 50, 32, generator=gen)
    a = m(x, mask=masks.padding([50, 20])).output
    b = m(x, mask=twin_padding([50, 20], 50, 50)).output
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("L,S", [(600, 600), (300, 700)])
def test_dense_bool_tensors_get_block_skipping_too(gen, L, S):
    """A plain bool tensor with structure is cut into pieces, exactly."""
    q, k, v, _ = make_inputs(gen, B=2, Hq=2, L=L, S=S)
    for mask, twin in mask_cases(L, S, 2):
        inputs = sdpa.inputs.normalize(q, k, v, twin)
        occ = blocks.structure(inputs)
        assert occ is not None
        ref = occ.clone()
        structured = mask.blocks(L, S, blocks.BLOCK_Q, blocks.BLOCK_K).expand_as(ref)
        # the analytic answer is never wrong, only sometimes more cautious
        assert ((structured == ref) | (structured == masks.PARTIAL)).all(), repr(mask)


def test_plan_skips_what_the_mask_excludes():
    L = S = 4096
    occ = masks.sliding_window(512).blocks(L, S, blocks.BLOCK_Q, blocks.BLOCK_K)
    pieces = blocks.plan(occ, L, S)
    assert len(pieces) == L // blocks.BLOCK_Q
    assert max(p.k1 - p.k0 for p in pieces) <= 512 + blocks.BLOCK_Q
    pad = blocks.plan(masks.padding([4096, 2048]).blocks(L, S, 256, 64), L, S)
    assert [(p.q0, p.q1, p.k0, p.k1, p.masked) for p in pad] == [
        (0, 4096, 0, 4096, False), (0, 4096, 0, 2048, False)
    ]  # fmt: skip
    docs = masks.documents(torch.arange(4096) // 1024)
    assert [(p.k0, p.k1, p.masked) for p in blocks.plan(docs.blocks(L, S, 256, 64), L, S)] == [
        (0, 1024, False), (1024, 2048, False), (2048, 3072, False), (3072, 4096, False)
    ]  # fmt: skip
    noise = torch.rand(L, S, generator=torch.Generator().manual_seed(0)) < 0.5
    assert len(blocks.plan(masks.occupancy(noise[None], 256, 64), L, S)) == 1  # one plain call


def test_refusals():
    with pytest.raises(ValueError, match=r"align must be 'bottom-right' or 'top-left'"):
        masks.causal("left")
    with pytest.raises(ValueError, match=r"size must be a positive int"):
        masks.sliding_window(0)
    with pytest.raises(TypeError, match=r"lengths must be a 1-D integer"):
        masks.padding(torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"lengths must be non-negative"):
        masks.padding([3, -1])
    with pytest.raises(TypeError, match=r"q_ids must be integer document ids"):
        masks.documents(torch.rand(5))
    with pytest.raises(TypeError, match=r"masks combine with other sdpa.masks objects"):
        masks.causal() & torch.ones(3, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"cannot combine masks with batch 2 and 3"):
        masks.padding([1, 2]) & masks.padding([1, 2, 3])
    q = torch.randn(3, 2, 5, 8)
    with pytest.raises(
        ValueError,
        match=r"batch dim of 2, so the inputs need exactly one batch "
        r"dim of that size .* got batch dims \(3,\)",
    ):
        sdpa.attention(q, q, q, masks.padding([1, 2]))
    with pytest.raises(
        ValueError,
        match=r"ids for 4 queries and 4 keys, but the attention has "
        r"L=5, S=5",
    ):
        sdpa.attention(q, q, q, masks.documents(torch.arange(4)))


ANY_MASK = [
    masks.causal(),
    masks.sliding_window(3, "top-left"),
    masks.padding([2, 0]),
    masks.documents([0, 0, 1]),
    masks.causal() & masks.padding([1]),
]
SIZE_HINT = r"; e\.g\. mask\.materialize\(L=4, S=6\) for 4 queries, 6 keys"


@pytest.mark.parametrize("mask", ANY_MASK, ids=repr)
@pytest.mark.parametrize(
    "L,S,error,match",
    [
        (-1, 3, ValueError, r"L must be a non-negative int \(the number of queries\), got -1"),
        (3, -5, ValueError, r"S must be a non-negative int \(the number of keys\), got -5"),
        (3.0, 3, TypeError, r"L must be an int \(the number of queries\), got 3\.0 \(float\)"),
        (3, True, TypeError, r"S must be an int \(the number of keys\), got True \(bool\)"),
        ("3", 3, TypeError, r"L must be an int \(the number of queries\), got '3' \(str\)"),
        (3, None, TypeError, r"S must be an int \(the number of keys\), got None \(NoneType\)"),
        (torch.tensor(3.0), 3, TypeError, r"L must be an int .* got tensor\(3\.\) \(Tensor\)"),
    ],
)
def test_materialize_refuses_bad_sizes(mask, L, S, error, match):
    with pytest.raises(error, match=r"materialize: " + match + SIZE_HINT) as info:
        mask.materialize(L, S)
    assert isinstance(info.value, RuntimeError)  # torch-style `except RuntimeError` works


def test_materialize_takes_integer_sizes_of_any_kind():
    want = masks.causal().materialize(3, 4)
    assert torch.equal(masks.causal().materialize(torch.tensor(3), 4), want)  # 0-d int
    assert masks.padding([1, 0]).materialize(0, 2).shape == (2, 1, 0, 2)


def test_materialize_refuses_over_budget_before_allocating(monkeypatch):
    def boom(*args):
        raise AssertionError("keep ran: the budget was checked too late")

    for cls in (masks._Band, masks._Padding):
        monkeypatch.setattr(cls, "keep", boom)
    with pytest.raises(
        MemoryError,
        match=r"masks\.causal\(align='bottom-right'\)\.materialize: the bool mask "
        r"\(1, 100000, 100000\) need 10,000,000,000 bytes \(9\.31 GiB\), over "
        r"max_bytes=1,073,741,824\. Ask for rows with mask\.keep",
    ) as info:
        masks.causal().materialize(10**5, 10**5)
    assert isinstance(info.value, sdpa.errors.WeightsTooLargeError)
    with pytest.raises(MemoryError, match=r"\(2, 100, 100\) need 20,000 bytes"):
        masks.padding([3, 4]).materialize(100, 100, max_bytes=19_999)  # counts the batch
    with pytest.raises(TypeError, match=r"max_bytes must be a non-negative int .* got -1"):
        masks.causal().materialize(4, 4, max_bytes=-1)


def test_materialize_budget_is_inclusive():
    assert masks.padding([3, 4]).materialize(100, 100, max_bytes=20_000).shape == (2, 1, 100, 100)
    assert masks.causal().materialize(300, 400, max_bytes=None).shape == (300, 400)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: masks.causal(1), TypeError, r"align must be a str, 'bottom-right' or "
         r"'top-left', got 1 \(int\)"),
        (lambda: masks.causal(None), TypeError, r"align must be a str, .* got None"),
        (lambda: masks.sliding_window(4, align="right"), ValueError,
         r"align must be 'bottom-right' or 'top-left', got 'right'"),
        (lambda: masks.sliding_window(2.0), TypeError, r"size must be a positive int \(keys "
         r"per window\), got 2\.0 \(float\); e\.g\. sliding_window\(512\)"),
        (lambda: masks.sliding_window(True), TypeError, r"size must be .* got True \(bool\)"),
        (lambda: masks.sliding_window("8"), TypeError, r"size must be .* got '8' \(str\)"),
        (lambda: masks.sliding_window(-3), ValueError, r"size must be a positive int \(keys "
         r"per window\), got -3; e\.g\. sliding_window\(512\)"),
        (lambda: masks.padding([1.5, 2]), TypeError, r"lengths must be a 1-D integer tensor "
         r"or list of ints, e\.g\. \[5, 3\]; got torch\.float32 values of shape \(2,\) "
         r"\(list\)"),
        (lambda: masks.padding(torch.tensor([3.0])), TypeError,
         r"lengths must be .* got torch\.float32 values of shape \(1,\) \(Tensor\)"),
        (lambda: masks.padding([True, False]), TypeError,
         r"lengths must be .* got torch\.bool values"),
        (lambda: masks.padding("12"), TypeError, r"lengths must be .* got '12' \(str\)"),
        (lambda: masks.padding(["1", "2"]), TypeError,
         r"lengths must be .* got \['1', '2'\] \(list\)"),
        (lambda: masks.padding(None), TypeError, r"lengths must be .* got None \(NoneType\)"),
        (lambda: masks.padding([1 + 2j]), TypeError,
         r"lengths must be .* got torch\.complex64 values"),
        (lambda: masks.padding([]), ValueError, r"lengths must be a 1-D integer tensor or list "
         r"\(one length per batch element\), got shape \(0,\); e\.g\. padding\(\[5, 3\]\)"),
        (lambda: masks.padding(4), ValueError, r"lengths must be a 1-D .* got shape \(\)"),
        (lambda: masks.documents([0.0, 1.0]), TypeError, r"q_ids must be integer document ids "
         r"of shape \(L,\) or \(B, L\), e\.g\. \[0, 0, 1, 1, 1\]; got torch\.float32"),
        (lambda: masks.documents(torch.ones(3, 3, dtype=torch.bool)), TypeError,
         r"q_ids must be integer document ids .* got torch\.bool values of shape \(3, 3\)"),
        (lambda: masks.documents([0, 1], "ab"), TypeError,
         r"k_ids must be integer document ids .* got 'ab' \(str\)"),
        (lambda: masks.documents(torch.zeros(2, 2, 2, dtype=torch.long)), ValueError,
         r"q_ids must be integer document ids of shape \(L,\) or \(B, L\), got torch\.int64 "
         r"of shape \(2, 2, 2\)"),
        (lambda: masks.documents([[0, 1]], [0, 1]), ValueError,
         r"q_ids \(1, 2\) and k_ids \(2,\) must both be \(L,\) or both \(B, L\)"),
    ],
)  # fmt: skip
def test_constructors_refuse_bad_arguments(make, error, match):
    with pytest.raises(error, match=match) as info:
        make()
    assert isinstance(info.value, RuntimeError)


def test_constructors_take_what_works():
    assert masks.documents([]).materialize(0, 0).shape == (0, 0)
    assert masks.padding(torch.tensor([2, 0], dtype=torch.int32)).lengths.dtype == torch.long
    assert masks.documents(torch.tensor([0, 0, 1], dtype=torch.uint8)).materialize(3, 3).sum() == 5


@pytest.mark.parametrize("L,S,bq,bk", [(16, 16, 4, 4), (17, 23, 4, 8), (64, 64, 16, 8)])
def test_occupancy_is_exact(L, S, bq, bk):
    g = torch.Generator().manual_seed(L + S)
    cases = [
        torch.rand(2, L, S, generator=g) < 0.5,  # no structure
        masks.causal().materialize(L, S)[None],
        masks.sliding_window(5).materialize(L, S)[None],
        torch.zeros(1, L, S, dtype=torch.bool),
        torch.ones(1, L, S, dtype=torch.bool),
    ]
    for keep in cases:
        occ = masks.occupancy(keep, bq, bk)
        for b in range(keep.shape[0]):
            for i in range(-(-L // bq)):
                for j in range(-(-S // bk)):
                    block = keep[b, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
                    want = masks.FULL if block.all() else masks.EMPTY if not block.any() else 1
                    assert occ[b, i, j] == want


def test_occupancy_of_awkward_block_sizes():
    for bq in (17, 19, 26, 28):
        assert masks.occupancy(torch.ones(1, bq, 4, dtype=torch.bool), bq, 4).tolist() == [
            [[masks.FULL]]
        ]


def test_masks_copy_their_ids_so_weights_cannot_go_stale(gen):
    q, k, v, _ = make_inputs(gen, L=6, S=6)
    lengths, ids = torch.tensor([6, 6]), torch.tensor([0, 0, 0, 1, 1, 1])
    for mask, data in ((masks.padding(lengths), lengths), (masks.documents(ids), ids)):
        w = sdpa.attention(q, k, v, mask).weights
        before = w.full()
        data[0] = 2  # an in-place edit of the caller's tensor changes nothing
        torch.testing.assert_close(w.full(), before)


@pytest.mark.parametrize("engine", BACKEND_ENGINES)
def test_a_batch_that_sees_nothing_keeps_its_graph(gen, engine):
    q, k, v, _ = make_inputs(gen, B=1, Hq=1, L=8, S=8, E=4)
    ts = [t.requires_grad_(True) for t in (q, k, v)]
    for mask in (masks.padding([0]), torch.zeros(8, 8, dtype=torch.bool)):
        out, _, _ = run_or_skip(engine, *ts, mask)
        assert out.requires_grad and torch.equal(out, torch.zeros_like(out))
        out.sum().backward()
        assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in ts)


def test_masks_same_is_one_mask_by_state_without_tensors_and_by_object_with_them():
    """masks.same: causal or window masks made apart are one mask (the layers of a capture
    then stack as one lazy handle); masks holding tensors are one only as one object."""
    assert masks.same(None, None) and masks.same(masks.causal(), masks.causal())
    assert masks.same(masks.sliding_window(4), masks.sliding_window(4))
    assert not masks.same(masks.causal(), masks.sliding_window(4))
    assert not masks.same(masks.sliding_window(4), masks.sliding_window(5))
    assert not masks.same(masks.causal(), None)
    assert not masks.same(masks.causal(align="top-left"), masks.causal())
    pad = masks.padding(torch.tensor([3, 5]))
    assert masks.same(pad, pad) and not masks.same(pad, masks.padding(torch.tensor([3, 5])))
