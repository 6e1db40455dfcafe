"""Key padding skipped, not masked (sdpa.masks.key_spans, the rows engine's key spans):
every read and gradient over tiles cut to each batch element's span equals the same read
over every key with the mask applied (the slow path, spans off) and the float64 oracle,
under right, left and holed padding, fully padded elements, padding & causal, padding
with a float bias, GQA, sinks, tiles cut on row-chunk edges, and joint reads (KL, score
errors) between calls padded differently. A property test (hypothesis), not examples."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa
from sdpa import losses, masks, rows
from sdpa import settings as sdpa_settings

from oracle import oracle

# chunk_bytes small enough that the tiles are row chunks of one head (block edges)
CHUNKS = [None, 7 * 13 * 4]


def _padding(kind: str, lengths: list[int], starts: list[int], B: int, S: int, L: int):
    """A key-padding mask of one of the forms users hand over."""
    keep = torch.zeros(B, S, dtype=torch.bool)
    for b, (n, s0) in enumerate(zip(lengths, starts, strict=True)):
        keep[b, s0 : s0 + n] = True
    if kind == "bool (B,1,1,S)":
        return keep[:, None, None, :]
    if kind == "expanded (B,1,L,S)":  # as transformers' sdpa_mask hands it over
        return keep[:, None, None, :].expand(B, 1, L, S)
    if kind == "holes":
        keep[:, 1::3] = False
        return keep[:, None, None, :]
    if kind == "padding()":
        return masks.padding(lengths)
    if kind == "padding() & causal":
        return masks.padding(lengths) & masks.causal()
    if kind == "padding(queries=True)":
        return masks.padding(lengths, queries=True)
    if kind == "padding(queries=True) & causal":
        return masks.causal() & masks.padding(lengths, queries=True)
    if kind == "bool & causal=True":
        return keep[:, None, None, :]  # (with causal=True: a TensorAnd)
    raise ValueError(kind)


KINDS = [
    "bool (B,1,1,S)",
    "expanded (B,1,L,S)",
    "holes",
    "padding()",
    "padding() & causal",
    "padding(queries=True)",
    "padding(queries=True) & causal",
    "bool & causal=True",
]


@st.composite
def cases(draw):
    B = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.integers(1, 2))
    S = draw(st.integers(2, 20))
    L = draw(st.integers(1, 20))
    kind = draw(st.sampled_from(KINDS))
    causal = kind == "bool & causal=True"
    if causal or kind.endswith("& causal"):
        L = S
    right = kind.startswith("padding")
    lengths = [draw(st.integers(0, S)) for _ in range(B)]
    starts = [0 if right else draw(st.integers(0, S - n)) for n in lengths]
    sinks = draw(st.booleans()) and not causal
    chunk = draw(st.sampled_from(CHUNKS))
    seed = draw(st.integers(0, 2**31 - 1))
    return B, Hq, Hkv, L, S, kind, lengths, starts, causal, sinks, chunk, seed


def _reads(w, t, other, u: torch.Tensor):
    """Every read that tiles complete rows, each as a differentiable tensor: t a teacher
    with w's mask, other one padded otherwise (the joint span is the wider one)."""
    k = min(3, w.shape[-1])
    return {
        "full": w.full(),
        "sum over queries": w.sum(dim=-2),
        "entropy": w.entropy(),
        "amax": w.amax(dim=-1),
        f"top-{k}": w.topk(k).values,
        "top-k past a span": w.topk(w.shape[-1]).values,
        "u @ w": u @ w,
        "kl": w.kl(t),
        "kl reverse": w.kl(t, reverse=True),
        "score errors": w.score_errors(t),
        "kl, other padding": w.kl(other),
        "kl reverse, other padding": w.kl(other, reverse=True),
        "score errors, other padding": w.score_errors(other),
        "row": w[..., 0, :],
    }


def _run(case, spans: bool):
    """(values, gradients of q, k, teacher q) of every read, with the spans on or off."""
    B, Hq, Hkv, L, S, kind, lengths, starts, causal, sinks, chunk, seed = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, 8, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, S, 8, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, S, 8, generator=g)
    qt = torch.randn(B, Hq, L, 8, generator=g, requires_grad=True)
    u = torch.randn(B, Hq, 2, L, generator=g)
    mask = _padding(kind, lengths, starts, B, S, L)
    other_mask = masks.padding([max(1, S - n) for n in lengths])
    if sinks:
        mask = masks.sinks(torch.randn(Hq, 1, 1, generator=g), mask)
    overrides = {} if chunk is None else {"chunk_bytes": chunk}
    before = rows.SPAN_MIN_SCORES
    rows.SPAN_MIN_SCORES = 0 if spans else 2**62
    try:
        with sdpa_settings.override(**overrides):
            w = sdpa.attention(q, k, v, mask, causal=causal).weights
            t = sdpa.attention(qt, k.detach(), v, mask, causal=causal).weights
            other = sdpa.attention(qt, k.detach(), v, other_mask).weights
            if spans:  # the fast path is taken where this test means it to be
                assert rows.Rows.every(w._inputs, w._log_sum_exp()).spans is not None
            out = {}
            for name, value in _reads(w, t, other, u).items():
                grads = torch.autograd.grad(
                    value.sum(), [q, k, qt], allow_unused=True, materialize_grads=True
                )
                out[name] = (value.detach(), *grads)
    finally:
        rows.SPAN_MIN_SCORES = before
    return out, (q, k, v, mask, causal)


@settings(max_examples=40, deadline=None)
@given(cases())
def test_reads_over_key_spans_equal_the_masked_reads(case):
    fast, _ = _run(case, spans=True)
    slow, _ = _run(case, spans=False)
    for name in slow:
        for a, b, what in zip(
            fast[name], slow[name], ("value", "dq", "dk", "dq teacher"), strict=True
        ):
            if what != "value" and not slow[name][0].isfinite().all():
                break  # (an infinite KL, where one side sees a key the other does not,
                # has no gradient to compare: 0 x inf, NaN or 0 by the order of the sum)
            torch.testing.assert_close(
                a, b, atol=2e-5, rtol=1e-5, equal_nan=True, msg=f"{name}: {what}"
            )


@pytest.mark.parametrize("kind", KINDS)
def test_the_weights_over_key_spans_equal_the_oracle(kind):
    """Padding on the left where the form allows it, one element fully padded, one not
    at all, at sizes off every block edge."""
    S = 13
    causal = "causal" in kind
    L = S if causal else 9
    starts = [0, 0, 0] if kind.startswith("padding") else [6, 0, 0]
    case = (3, 2, 1, L, S, kind, [5, 0, S], starts, kind == "bool & causal=True", False, None, 7)
    fast, (q, k, v, mask, causal_flag) = _run(case, spans=True)
    if isinstance(mask, masks.Mask):
        mask = mask.materialize(L, S)  # (B, 1, L, S)
    want = oracle(q.detach(), k.detach(), v, mask, causal=causal_flag)[1]
    torch.testing.assert_close(fast["full"][0].double(), want, atol=2e-6, rtol=0)


def test_key_spans_read_only_what_they_may():
    """The forms recognised, each from O(B x S) entries or the host; None for the rest."""
    keep = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    spans = masks.key_spans(keep[:, None, None, :].expand(4, 2, 3, 4), 4, 4)
    assert spans == ((0, 2, True), (1, 3, True), (0, 4, False), (0, 3, False))
    assert masks.key_spans(masks.padding([3, 0, 9]), 3, 4) == (
        (0, 3, True), (0, 4, False), (0, 4, True),
    )  # fmt: skip
    both = masks.key_spans(masks.padding([3, 4]) & masks.causal(), 2, 4)
    assert both == ((0, 3, False), (0, 4, False))  # (causality still applies inside)
    varies = torch.rand(2, 1, 3, 4) < 0.5  # a mask that varies over queries: not scanned
    assert masks.key_spans(varies, 2, 4) is None
    assert masks.key_spans(torch.zeros(2, 1, 1, 4), 2, 4) is None  # a float mask
    assert masks.key_spans(masks.causal(), 2, 4) is None
    assert masks.key_spans(None, 2, 4) is None


def test_query_spans_come_from_a_declaration_alone():
    """Padded queries are skipped where the mask declares them (padding(..., queries=True),
    also inside an &), never found by scanning; a saved mask keeps the declaration."""
    padded = masks.padding([3, 0, 9], queries=True)
    assert masks.query_spans(padded, 3, 5) == ((0, 3), (0, 0), (0, 5))
    assert masks.query_spans(masks.causal() & padded, 3, 5) == ((0, 3), (0, 0), (0, 5))
    both = masks.padding([4, 2], queries=True) & masks.padding([3, 5], queries=True)
    assert masks.query_spans(both, 2, 5) == ((0, 3), (0, 2))
    assert masks.query_spans(masks.padding([3, 0, 9]), 3, 5) is None  # (keys alone)
    assert masks.query_spans(padded | masks.causal(), 3, 5) is None
    dead = torch.zeros(3, 1, 5, 5, dtype=torch.bool)  # (a tensor is not scanned for rows)
    assert masks.query_spans(dead, 3, 5) is None
    assert masks.query_spans(None, 3, 5) is None
    assert repr(padded) == "masks.padding([3, 0, 9], queries=True)"
    loaded = masks.from_state(masks.state_of(padded))
    assert loaded.queries and masks.query_spans(loaded, 3, 5) == ((0, 3), (0, 0), (0, 5))
    assert not masks.from_state(("padding", torch.tensor([2]))).queries  # (an older save)
    with pytest.raises(sdpa.SdpaTypeError, match="queries must be True or False"):
        masks.padding([3], queries="yes")


@st.composite
def loss_cases(draw):
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    L = draw(st.integers(1, 20))
    form = draw(st.sampled_from(["right", "left", "holes"]))
    keep = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        n = draw(st.integers(0, L))
        start = 0 if form == "right" else draw(st.integers(0, L - n))
        keep[b, start : start + n] = True
    if form == "holes":
        keep[:, 1::4] = False
    chunk = draw(st.sampled_from(CHUNKS))
    return B, H, L, keep, chunk, draw(st.integers(0, 2**31 - 1))


def _losses(case, skip: bool):
    """(values, grads) of attention_kl and relation_kl ("none" and "mean") with the padded
    query rows skipped (as sdpa.losses reads them) or computed."""
    B, H, L, keep, chunk, seed = case
    g = torch.Generator().manual_seed(seed)
    q, k, qt, kt = (torch.randn(B, H, L, 8, generator=g, requires_grad=True) for _ in range(4))
    mask = keep[:, None, None, :]
    overrides = {} if chunk is None else {"chunk_bytes": chunk}
    before = rows.real_rows
    if not skip:
        rows.real_rows = lambda r, keep: r
    try:
        with sdpa_settings.override(**overrides):
            ws = sdpa.attention(q, k, k, mask).weights
            wt = sdpa.attention(qt, kt, kt, mask).weights
            out = {}
            for reduction in ("none", "mean"):
                for name, value in (
                    ("attention_kl", losses.attention_kl(ws, wt, keep, reduction=reduction)),
                    ("relation_kl", losses.relation_kl(q, qt, None, keep, reduction=reduction)),
                ):
                    grads = torch.autograd.grad(
                        value.sum(), [q, k, qt, kt], allow_unused=True, materialize_grads=True
                    )
                    out[name, reduction] = (value.detach(), *grads)
    finally:
        rows.real_rows = before
    return out


@settings(max_examples=30, deadline=None)
@given(loss_cases())
def test_losses_skip_padded_queries_and_equal_the_full_reads(case):
    """sdpa.losses read only the real query rows (attention_mask), left and right
    padding and holes alike: the values and gradients of the rows computed in full."""
    fast, slow = _losses(case, skip=True), _losses(case, skip=False)
    for name in slow:
        for a, b, what in zip(
            fast[name], slow[name], ("value", "dq", "dk", "dqt", "dkt"), strict=True
        ):
            torch.testing.assert_close(
                a, b, atol=2e-5, rtol=1e-5, equal_nan=True, msg=f"{name}: {what}"
            )


def _count_tile_scores(monkeypatch) -> list[int]:
    """Spans looked for at any size, and a list that gets each tile's heads x rows x keys
    as the rows engine computes it (rows.operands)."""
    monkeypatch.setattr(rows, "SPAN_MIN_SCORES", 0)
    seen = []
    operands = rows.operands

    def counted(r, t):
        got = operands(r, t)
        seen.append(got[0].shape[1] * got[0].shape[2] * got[1].shape[2])
        return got

    monkeypatch.setattr(rows, "operands", counted)
    return seen


def test_skipped_rows_and_keys_are_never_computed(monkeypatch):
    """What is skipped costs nothing: the tiles of a KL read over padded queries (declared
    real rows) and padded keys hold only the real rows x real keys, and the rows left out
    read as 0."""
    B, H, L = 3, 2, 40
    keep = torch.zeros(B, L, dtype=torch.bool)
    keep[0, :25], keep[1, 10:40], keep[2, :40] = True, True, True  # right, left, none
    q, k, qt, kt = (torch.randn(B, H, L, 8) for _ in range(4))
    mask = keep[:, None, None, :]
    seen = _count_tile_scores(monkeypatch)
    ws = sdpa.attention(q, k, k, mask).weights
    wt = sdpa.attention(qt, kt, kt, mask).weights
    per_row = ws._kl(wt, real=keep)
    real = keep.sum(-1)
    assert sum(seen) == 2 * H * int((real * real).sum())  # (each side's tiles)
    monkeypatch.undo()
    torch.testing.assert_close(per_row, ws.kl(wt).masked_fill(~keep[:, None], 0.0))
    assert (per_row[~keep[:, None].expand(B, H, L)] == 0).all()


def test_declared_padded_queries_are_never_computed(monkeypatch):
    """masks.padding(lengths, queries=True): the entropy, the dense weights and the KL
    read (and the KL's backward) compute only real rows x real keys; the padded rows
    read as 0, their output is 0, and nothing else changes (the key padding alone)."""
    B, H, L = 3, 2, 40
    lengths = [25, 0, 40]
    q, k, qt = (torch.randn(B, H, L, 8, requires_grad=True) for _ in range(3))
    padded = masks.padding(lengths, queries=True)
    seen = _count_tile_scores(monkeypatch)
    out, ws = sdpa.attention(q, k, k, padded)
    wt = sdpa.attention(qt, k, k, padded).weights
    real = torch.tensor(lengths)
    real_scores = H * int((real * real).sum())
    reads = ((lambda: ws.entropy(), 1), (lambda: ws.full(), 1), (lambda: ws.kl(wt), 2))
    for read, sides in reads:
        seen.clear()
        value = read()
        assert sum(seen) == sides * real_scores
    seen.clear()
    value.sum().backward()  # (the KL's backward into each side reads both sides' tiles)
    assert sum(seen) == 4 * real_scores and q.grad is not None and qt.grad is not None
    full, top = ws.full(), ws.topk(3).indices
    monkeypatch.undo()
    padded_rows = (torch.arange(L) >= real[:, None])[:, None].expand(B, H, L)
    assert (out[padded_rows] == 0).all() and (full[padded_rows] == 0).all()
    # a row left out: the indices torch.topk picks among its ties on the dense row
    assert torch.equal(top[padded_rows], full.topk(3).indices[padded_rows])
    keys_only = sdpa.attention(q, k, k, masks.padding(lengths))
    torch.testing.assert_close(out[~padded_rows], keys_only.output[~padded_rows])
    torch.testing.assert_close(full[~padded_rows], keys_only.weights.full()[~padded_rows])


@pytest.mark.parametrize("mask_of", ["padding", "padding & causal"])
def test_the_small_backend_zeroes_declared_queries_with_their_gradients(mask_of):
    """The one-product path scores declared padded rows as open and zeroes them (where
    rows of -inf would take the dead-row repair): output, kept weights and the gradients
    of both equal the float64 oracle on the materialised mask, rows past a length and
    an element with no row included; and it is the path the call took."""
    B, H, L = 3, 2, 40
    lengths = [25, 0, 40]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, L, 8, generator=g, requires_grad=True) for _ in range(3))
    mask = masks.padding(lengths, queries=True)
    if mask_of == "padding & causal":
        mask = masks.causal() & mask
    with sdpa_settings.override(small_weights=2**21, small_head=2**16, small_causal=2**14):
        assert masks.query_spans(mask, B, L) is not None
        out, w = sdpa.attention(q, k, v, mask)
        assert w.served_by.startswith("small")
        p = w.full()
    c_out, c_p = torch.randn(out.shape, generator=g), torch.randn(p.shape, generator=g)
    got = torch.autograd.grad((c_out * out).sum() + (c_p * p).sum(), (q, k, v))
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    r_out, r_p = oracle(*ref, mask.materialize(L, L))
    want = torch.autograd.grad((c_out * r_out).sum() + (c_p * r_p).sum(), ref)
    torch.testing.assert_close(out.double(), r_out, atol=2e-6, rtol=0)
    torch.testing.assert_close(p.double(), r_p, atol=2e-6, rtol=0)
    for a, b, name in zip(got, want, "qkv", strict=True):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=0, msg=name)


def test_a_masks_spans_are_read_once_for_the_plan_and_every_read(monkeypatch):
    """A bool (B, 1, 1, S) mask's spans take one host read per mask and version: the
    fused plan (backends.blocks.exact) and each read of the weights ask again and get
    the same; a write into the mask, or another mask of the same values, reads again;
    an inference tensor (no version counter) is read each time, never kept."""
    reads = []
    real = masks._read_key_spans
    monkeypatch.setattr(masks, "_read_key_spans", lambda *a: reads.append(1) or real(*a))
    B, S = 2, 300
    keep = torch.arange(S) < torch.tensor([S, 200])[:, None]
    mask = keep[:, None, None, :]
    q, k, v = torch.randn(B, 2, S, 8), torch.randn(B, 2, S, 8), torch.randn(B, 2, S, 8)
    w = sdpa.attention(q, k, v, mask).weights
    w.entropy(), w.sum(dim=-2), w.kl(w)
    assert len(reads) == 1
    held = w._inputs.mask  # (the call's view of the mask)
    assert masks.key_spans(held, B, S) == ((0, S, True), (0, 200, True)) and len(reads) == 1
    keep[1, 200:250] = True  # (in place: the version moves)
    assert masks.key_spans(held, B, S) == ((0, S, True), (0, 250, True)) and len(reads) == 2
    other = mask.clone()  # (B, 1, 1, S), as the call had it
    assert masks.key_spans(other, B, S) == masks.key_spans(held, B, S) and len(reads) == 3
    with torch.inference_mode():
        frozen = mask.clone()  # (no version counter)
    assert masks.key_spans(frozen, B, S) == masks.key_spans(frozen, B, S) and len(reads) == 5
