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


def spatial_block(block, x):
    """A SpatialSelfAttention block computed with Listing 9.1 for its attention.

    x (B, C, H, W) -> (B, C, H, W): the same GroupNorm, projections and residual as
    `block`, with the listing's materialised scores in between (the peer in comparisons).
    """
    B, C, H, W = x.shape
    h = block.norm(x).flatten(2).transpose(1, 2)  # (B, H*W, C)
    q, k, v = (
        block.qkv(h).view(B, H * W, 3, block.num_heads, C // block.num_heads).permute(2, 0, 3, 1, 4)
    )  # (B, heads, H*W, D) each
    out, _ = attention(q, k, v)
    out = block.proj_out(out.transpose(1, 2).reshape(B, H * W, C))  # (B, H*W, C)
    return x + out.transpose(1, 2).reshape(B, C, H, W)
