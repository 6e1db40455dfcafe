"""Sinusoidal positional encoding (Vaswani et al., 2017)."""

from __future__ import annotations

import math

import torch
from torch import nn

from sdpa.errors import SdpaValueError


class PositionalEncoding(nn.Module):
    """Adds the sinusoidal position table to (B, L, d_model) input, then dropout.

    PE[pos, 2i] = sin(pos * w_i), PE[pos, 2i+1] = cos(pos * w_i),
    w_i = exp(-2i * ln(10000) / d_model). Interleaved sin/cos, as in the paper.
    """

    pe: torch.Tensor

    def __init__(self, d_model: int, max_len: int = 5000, dropout: float = 0.0):
        super().__init__()
        if d_model < 1 or max_len < 1:
            raise SdpaValueError(f"d_model and max_len must be >= 1, got {d_model} and {max_len}")
        position = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
        freq = torch.exp(
            torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model)
        )
        pe = torch.zeros(max_len, d_model, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(position * freq)
        pe[:, 1::2] = torch.cos(position * freq[: d_model // 2])
        self.register_buffer("pe", pe.float(), persistent=False)  # (max_len, d_model)
        self.dropout = nn.Dropout(dropout)
        self.d_model, self.max_len = d_model, max_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., L, d_model) -> x + PE[:L], same shape and dtype."""
        if x.ndim < 2 or x.shape[-1] != self.d_model:
            raise SdpaValueError(
                f"x must be (..., L, d_model={self.d_model}), got shape {tuple(x.shape)}"
            )
        L = x.shape[-2]
        if L > self.max_len:
            raise SdpaValueError(
                f"sequence length {L} exceeds max_len={self.max_len}; raise max_len"
            )
        return self.dropout(x + self.pe[:L].to(x.dtype))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}"
