"""Modules built on sdpa's public calls."""

from sdpa.nn.positional import PositionalEncoding

__all__ = ["PositionalEncoding"]
