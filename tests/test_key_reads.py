"""Reads over the key dim: w[..., j] and w[..., J] compute only the selected columns,
O(L x |J|), equal to the oracle's columns under every mask kind."""

from __future__ import annotations

import pytest
import torch

import sdpa
from sdpa import masks
from test_weights import Allocations

from conftest import MASK_KINDS, make_inputs
from oracle import oracle

# key indices of each kind, for S = 65 keys (past a 64-key block edge)
KEY_INDICES = {
    "int": 64,
    "negative int": -65,
    "slice": slice(3, 40),
    "step slice": slice(1, None, 7),
    "list": [64, 0, 31, 31, -1],
    "range": range(60, 65),
    "tensor": torch.tensor([5, 63, 64]),
    "int32 tensor": torch.tensor([2, -2], dtype=torch.int32),
    "empty list": [],
}


def _expected(p: torch.Tensor, lead: tuple, key: object) -> torch.Tensor:
    """The oracle's answer: rows as selected, then the key columns."""
    if isinstance(key, list | range):
        key = torch.tensor(list(key), dtype=torch.long)
    return p[lead][..., key]


@pytest.mark.parametrize("key", list(KEY_INDICES))
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_columns_equal_the_oracle(gen, mask_kind, key):
    q, k, v, mask = make_inputs(gen, B=2, Hq=4, Hkv=2, L=33, S=65, mask_kind=mask_kind)
    w = sdpa.attention(q, k, v, mask, scale=0.3).weights
    _, p = oracle(q, k, v, mask, scale=0.3)
    index = KEY_INDICES[key]
    for lead in [(Ellipsis,), (1, slice(1, 4), slice(5, 30)), (0, 3, 17)]:
        got = w[(*lead, index)]
        want = _expected(p, lead, index)
        assert got.shape == want.shape, (lead, key)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)


STRUCTURED = {
    "causal": (masks.causal(), False),
    "causal top-left": (masks.causal("top-left"), False),
    "window": (masks.sliding_window(9), False),
    "window and padding": (masks.sliding_window(20) & masks.padding([50, 61]), False),
    "documents": (masks.documents(torch.arange(65) // 20), False),
    "is_causal": (None, True),
}


@pytest.mark.parametrize("L", [1, 64, 65])  # a decode row, a block, one past it
@pytest.mark.parametrize("kind", list(STRUCTURED))
def test_columns_under_structured_masks(gen, kind, L):
    """The columns see the keys' real positions (causal offsets, windows, documents)."""
    mask, causal = STRUCTURED[kind]
    if kind == "documents" or (causal and L != 65):
        L = 65  # documents / is_causal want one sequence of 65
    q, k, v, _ = make_inputs(gen, B=2, Hq=2, L=L, S=65)
    w = sdpa.attention(q, k, v, mask, causal=causal).weights
    keep = w.full() != 0  # (B, H, L, S): where the keys take part
    dense = mask.materialize(L, 65, q.device) if mask is not None else None
    if causal:
        dense = torch.ones(L, 65, dtype=torch.bool).tril()
    _, p = oracle(q, k, v, dense)
    assert keep.any()
    for index in [0, 64, [64, 3, 40], slice(10, 65, 2)]:
        want = _expected(p, (Ellipsis,), index)
        torch.testing.assert_close(w[..., index].double(), want, atol=2e-6, rtol=0)


def test_columns_with_softcap_and_sinks(gen):
    q, k, v, _ = make_inputs(gen, B=1, Hq=3, L=20, S=65)
    sinks = torch.randn(3, generator=gen)
    w = sdpa.attention(
        q, k, v, masks.sinks(sinks[:, None, None], masks.softcap(5.0, masks.causal()))
    ).weights
    _, p = oracle(q, k, v, torch.ones(20, 65, dtype=torch.bool).tril(45), softcap=5.0,
                  sinks=sinks[:, None])  # fmt: skip
    torch.testing.assert_close(w[0, :, :, [0, 50, 64]].double(), p[0][..., [0, 50, 64]],
                               atol=2e-6, rtol=0)  # fmt: skip


def test_rows_that_need_every_key_are_read_whole(gen):
    """A row under a huge finite bias has |lse| past the exact limit: its weights come
    from a log-softmax over all its keys, so the column read takes whole rows and
    agrees with them (row 4: float32 scores - 1e9 all round alike, as in torch)."""
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=9, S=65)
    bias = torch.zeros(9, 65)
    bias[4] = -1e9  # every key of row 4
    bias[6, :60] = -1e9  # row 6 sees the last 5 keys only
    w = sdpa.attention(q, k, v, bias).weights
    _, p = oracle(q, k, v, bias)
    dense = w.full()
    for index in [3, [64, 0, 62]]:
        key = torch.tensor(index) if isinstance(index, list) else index
        torch.testing.assert_close(w[..., index], dense[..., key], atol=0, rtol=0)
        rows = [0, 1, 2, 3, 5, 6, 7, 8]  # every row but 4 against the float64 oracle
        torch.testing.assert_close(w[..., index][:, :, rows].double(), p[..., key][:, :, rows],
                                   atol=2e-6, rtol=0)  # fmt: skip


@pytest.mark.small_shapes
def test_columns_of_kept_weights(gen):
    """The small backend keeps its weights: columns are indexed out of them."""
    q, k, v, mask = make_inputs(gen, B=2, Hq=4, Hkv=1, L=5, S=7, mask_kind="dead_rows")
    w = sdpa.attention(q, k, v, mask).weights
    _, p = oracle(q, k, v, mask)
    for index in [6, [6, 0, 0], torch.tensor([-1]), slice(2, 5)]:
        for lead in [(Ellipsis,), (0, slice(None), 2), (1, 3, slice(None))]:
            got, want = w[(*lead, index)], _expected(p, lead, index)
            torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)


def test_a_column_costs_a_column(gen):
    """w[0, :, :, j] on a long sequence allocates O(H x L x E), not the L x S weights."""
    B, H, L, E = 1, 4, 2048, 32
    q, k = (torch.randn(B, H, L, E, generator=gen) for _ in range(2))
    w = sdpa.attention(q, k, k, masks.causal()).weights
    with Allocations() as allocated:
        column = w[0, :, :, 1000]
        few = w[0, :, :, [1, 2000, 7]]
    assert column.shape == (H, L) and few.shape == (H, L, 3)
    # measured: 4.7 MB for both, the largest q with a column for the LSE, H x L x (E+1)
    # floats; one head's L x S alone would be 16 MB, the weights 64 MB
    assert allocated.largest[0] <= H * L * (E + 1) * 4, allocated.largest
    assert allocated.total < B * H * L * L * 4 / 10, allocated.sizes
    s = q[0].double() @ k[0, :, [1000]].double().mT / E**0.5  # (H, L, 1)
    p = (s - w.lse[0, :, :, None].double()).exp()[..., 0]
    p[:, :1000] = 0.0  # causal: queries before key 1000 do not see it
    torch.testing.assert_close(column.double(), p, atol=2e-6, rtol=0)


@pytest.mark.parametrize(
    ("index", "exc", "pattern"),
    [
        ((..., [0, 65]), IndexError, "key index 65 is out of bounds"),
        ((..., [-66]), IndexError, "key index -66"),
    ],
)
def test_bad_key_indices(gen, index, exc, pattern):
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=4, S=65)
    w = sdpa.attention(q, k, v).weights
    with pytest.raises(exc, match=pattern):
        w[index]


@pytest.mark.parametrize(
    "index",
    [
        (..., [1.5]),
        (..., [True]),
        (..., torch.tensor([True, False])),
        (..., torch.arange(65) % 3 == 0),  # a boolean selection of keys
        (..., torch.tensor([[1, 2]])),
        (..., torch.tensor([1.0])),
        (0, [1, 2], slice(None)),  # a list over a lead dim
    ],
    ids=["float-list", "bool-list", "bool-short", "bool-keys", "2-d", "float", "lead-list"],
)
def test_other_indices_answer_or_refuse_as_the_dense_tensor(gen, index):
    """An index the rows engine does not take as written is the dense tensor's: its
    value, or the error torch gives for it (a boolean mask of the key dim's size is read
    as its positions)."""
    q, k, v, _ = make_inputs(gen, B=1, Hq=2, L=4, S=65)
    w = sdpa.attention(q, k, v).weights
    dense = w.full()
    try:
        want = dense[index]
    except (IndexError, TypeError, ValueError) as e:
        with pytest.raises(type(e)):
            w[index]
    else:  # (a boolean selection of keys is a read of those keys: float32 rounding)
        torch.testing.assert_close(w[index], want, atol=1e-6, rtol=1e-6)
