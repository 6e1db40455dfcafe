"""The seed's Listing 9.1, verbatim in behaviour: the peer every comparison names.

It materialises the (..., L, S) scores three times over (scores, scaled, softmax) and
masks with -1e9, so a fully masked row gets uniform weights rather than 0.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def attention(query, key, value, mask=None, dropout=None):
    """Listing 9.1: returns (output (..., L, Ev), p_attn (..., L, S))."""
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = nn.functional.softmax(scores, dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn
