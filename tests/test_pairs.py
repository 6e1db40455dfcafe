"""w.pairs(i, j) and w.diagonal(offset): weights at chosen (query, key) pairs, against
the float64 oracle, on every mask kind, structured masks, score mods, GQA and per-batch
pairs; and the refusals."""

from __future__ import annotations

import pytest
import torch

import sdpa
from sdpa import masks

from conftest import MASK_KINDS, make_inputs, randn
from oracle import oracle
from tolerances import selection_atol

STRUCTURED = {
    "causal": lambda B, L, S: masks.causal(),
    "top-left": lambda B, L, S: masks.causal("top-left"),
    "padding": lambda B, L, S: masks.padding([S // 2, S][:B]),
    "window&padding": lambda B, L, S: masks.sliding_window(3) & masks.padding([S - 1, 2][:B]),
    "documents": lambda B, L, S: masks.documents(torch.arange(L) // 3, torch.arange(S) // 3),
}


def _check(gen, w, p, per_batch):
    L, S = p.shape[-2:]
    atol = selection_atol(w.lse)  # a pair is a selection of one key: p = exp(s - lse)
    qi = torch.randint(0, L, (13,), generator=gen)
    kj = torch.randint(0, S, (13,), generator=gen)
    torch.testing.assert_close(w.pairs(qi, kj).double(), p[..., qi, kj], atol=atol, rtol=0)
    for off in (-1, 0, 1, -(L - 1), S - 1, S, -L):
        want = torch.diagonal(p, off, dim1=-2, dim2=-1)
        torch.testing.assert_close(w.diagonal(off, -2, -1).double(), want, atol=atol, rtol=0)
    if per_batch:
        B = p.shape[0]
        qi = torch.randint(0, L, (B, 6), generator=gen)
        kj = torch.randint(0, S, (B, 6), generator=gen)
        want = torch.stack([p[b][..., qi[b], kj[b]] for b in range(B)])
        torch.testing.assert_close(w.pairs(qi, kj).double(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("L, S", [(7, 9), (65, 64), (1, 5)])
def test_pairs_equal_the_oracle(gen, mask_kind, L, S):
    q, k, v, mask = make_inputs(gen, B=2, Hq=4, Hkv=2, L=L, S=S, E=16, mask_kind=mask_kind)
    _, w = sdpa.attention(q, k, v, mask, scale=0.7)
    _, p = oracle(q, k, v, mask, scale=0.7)
    _check(gen, w, p, per_batch=True)


@pytest.mark.parametrize("kind", list(STRUCTURED))
@pytest.mark.parametrize("L, S", [(9, 9), (300, 300), (5, 12)])
def test_pairs_under_structured_masks(gen, kind, L, S):
    q, k, v, _ = make_inputs(gen, B=2, Hq=2, L=L, S=S, E=8)
    mask = STRUCTURED[kind](2, L, S)
    _, w = sdpa.attention(q, k, v, mask)
    keep = masks.as_4d(mask.materialize(L, S))
    _, p = oracle(q, k, v, keep)
    _check(gen, w, p, per_batch=True)


def test_pairs_with_softcap_sinks_and_no_heads(gen):
    q, k, v, _ = make_inputs(gen, B=2, Hq=3, L=10, S=12, E=8)
    sinks = randn(gen, 3, 1, 1)
    _, w = sdpa.attention(q, k, v, masks.softcap(2.0, masks.sinks(sinks, masks.causal())))
    keep = masks.causal().materialize(10, 12)
    _, p = oracle(q, k, v, keep, softcap=2.0, sinks=sinks[..., 0].expand(2, 3, 10))
    _check(gen, w, p, per_batch=True)
    q3, k3, v3 = randn(gen, 3, 6, 8), randn(gen, 3, 7, 8), randn(gen, 3, 7, 8)
    _, w = sdpa.attention(q3, k3, v3)
    _check(gen, w, oracle(q3, k3, v3)[1], per_batch=True)  # (N, L, S): N is the batch


@pytest.mark.small_shapes
def test_pairs_of_kept_weights(gen):
    q, k, v, mask = make_inputs(gen, B=2, Hq=2, L=6, S=6, E=8, mask_kind="bool")
    _, w = sdpa.attention(q, k, v, mask)  # the small backend keeps the weights
    _check(gen, w, oracle(q, k, v, mask)[1], per_batch=True)


@pytest.mark.parametrize(
    "q_index, k_index, exc, pattern",
    [
        ([0, 9], [0, 1], IndexError, "q_index entry 9 is out of bounds"),
        ([0], [12], IndexError, "k_index entry 12 is out of bounds"),
        ([0, 1], [0], ValueError, "must have one shape"),
        (torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long), ValueError,
         "first dim"),
        (torch.zeros(2, dtype=torch.float32), torch.zeros(2, dtype=torch.long), TypeError,
         "integer tensor"),
        ("0", [0], TypeError, "q_index must be an integer tensor"),
    ],
)  # fmt: skip
def test_bad_pairs(gen, q_index, k_index, exc, pattern):
    q, k, v, _ = make_inputs(gen, B=2, Hq=2, L=9, S=12, E=8)
    w = sdpa.attention(q, k, v).weights
    with pytest.raises(exc, match=pattern):
        w.pairs(q_index, k_index)
    with pytest.raises(TypeError, match="offset"):  # torch's own error, as the dense tensor's
        w.diagonal(1.0, -2, -1)
