"""PositionalEncoding: the interleaved sinusoid table of Vaswani et al."""

from __future__ import annotations

import math

import pytest
import torch

from sdpa import PositionalEncoding


@pytest.mark.parametrize("d_model", [256, 7])
def test_table_matches_the_formula(d_model):
    pe = PositionalEncoding(d_model, max_len=50)
    x = torch.zeros(2, 50, d_model)
    table = pe(x)[0]
    for pos in (0, 1, 17, 49):
        for i in range(d_model):
            w = math.exp(-(i - i % 2) * math.log(10000.0) / d_model)
            want = math.sin(pos * w) if i % 2 == 0 else math.cos(pos * w)
            assert abs(table[pos, i].item() - want) < 1e-6


def test_adds_to_input_and_keeps_dtype():
    pe = PositionalEncoding(16)
    x = torch.randn(3, 4, 16, dtype=torch.bfloat16)
    y = pe(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    torch.testing.assert_close(y.float() - x.float(), pe.pe[:4].expand(3, 4, 16), atol=2e-2, rtol=0)


def test_refusals():
    pe = PositionalEncoding(16, max_len=8)
    with pytest.raises(ValueError, match=r"x must be \(..., L, d_model=16\), got shape \(2, 8\)"):
        pe(torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"sequence length 9 exceeds max_len=8"):
        pe(torch.zeros(9, 16))
    with pytest.raises(ValueError, match=r"d_model and max_len must be >= 1"):
        PositionalEncoding(0)
