"""Modules built on sdpa's public calls."""

from sdpa.nn.multihead import MultiHeadAttention
from sdpa.nn.positional import PositionalEncoding
from sdpa.nn.spatial import SpatialSelfAttention, pixel_attention

__all__ = ["MultiHeadAttention", "PositionalEncoding", "SpatialSelfAttention", "pixel_attention"]
