"""Self-attention over the pixels of a feature map, as in a denoising U-Net."""

from __future__ import annotations

import torch
from torch import nn

from sdpa.errors import SdpaValueError
from sdpa.functional import AttentionResult, attention, with_output
from sdpa.weights import AttentionWeights


class SpatialSelfAttention(nn.Module):
    """U-Net attention block: GroupNorm, 1x1 Q/K/V projections, attention over the H*W
    pixels, output projection, residual.

    Shapes: x (B, C, H, W) -> output (B, C, H, W) = x + proj_out(attention(norm(x)));
    weights (B, num_heads, H*W, H*W), lazy: row y*W + x is what pixel (y, x) attends
    to; `pixel_attention(weights, y, x, (H, W))` gives it as (B, num_heads, H, W) maps,
    computing one row per head. The seed's case: channels=128, num_heads=4 on a
    (1, 128, 64, 64) map, 4,096 pixels.
    """

    def __init__(
        self, channels: int, num_heads: int = 4, *, groups: int = 32, dropout: float = 0.0
    ):
        super().__init__()
        if groups < 1 or channels % groups:
            raise SdpaValueError(
                f"channels must split into GroupNorm groups, got channels={channels} and "
                f"groups={groups}; pick groups dividing channels"
            )
        if num_heads < 1 or channels % num_heads:
            raise SdpaValueError(
                f"channels must split into num_heads equal heads, got channels={channels} and "
                f"num_heads={num_heads}"
            )
        if not 0.0 <= dropout <= 1.0:
            raise SdpaValueError(f"dropout must be a probability in [0, 1], got {dropout}")
        self.channels, self.num_heads, self.dropout = channels, num_heads, dropout
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Linear(channels, 3 * channels)  # a 1x1 convolution over pixels
        self.proj_out = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> AttentionResult:
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[1] != self.channels:
            seen = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise SdpaValueError(
                f"x must be a feature map (B, C={self.channels}, H, W), got {seen}"
            )
        B, C, H, W = x.shape
        heads, D = self.num_heads, C // self.num_heads
        h = self.norm(x).flatten(2).transpose(1, 2)  # (B, H*W, C)
        q, k, v = self.qkv(h).view(B, H * W, 3, heads, D).permute(2, 0, 3, 1, 4)  # (B,h,HW,D)
        r = attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        out = self.proj_out(r.output.transpose(1, 2).reshape(B, H * W, C))  # (B, H*W, C)
        return with_output(r, x + out.transpose(1, 2).reshape(B, C, H, W))

    def extra_repr(self) -> str:
        return f"channels={self.channels}, num_heads={self.num_heads}, dropout={self.dropout}"


def pixel_attention(
    weights: AttentionWeights, y: int, x: int, size: tuple[int, int]
) -> torch.Tensor:
    """What pixel (y, x) attends to, as maps (B, num_heads, H, W) over the (H, W) image.

    weights: a SpatialSelfAttention's (B, num_heads, H*W, H*W); size: the map's
    (H, W), height first, as in x.shape[-2:] (weights do not know the image, so a
    transposed size with the same H*W cannot be caught). Only the B*num_heads rows of
    that pixel are computed, never the H*W x H*W matrix.
    """
    H, W = size
    if tuple(weights.shape[-2:]) != (H * W, H * W):
        raise SdpaValueError(
            f"weights {tuple(weights.shape)} are not over a {H}x{W} image: expected "
            f"(..., {H * W}, {H * W})"
        )
    if not (0 <= y < H and 0 <= x < W):
        raise IndexError(f"pixel (y={y}, x={x}) is outside the {H}x{W} image")
    rows = weights[..., y * W + x, :]  # (B, num_heads, H*W)
    return rows.reshape(*rows.shape[:-1], H, W)
