"""Module benchmark: sdpa's modules against torch's and the seed's listing.

- MultiHeadAttention vs torch.nn.MultiheadAttention(need_weights=False), d_model 128,
  4 heads, L = 4096, float32: inference (no autograd, eval; and again with torch's
  module in train mode, which skips its native fast path for F.sdpa) and training
  (forward + backward, train mode, dropout 0).
- SpatialSelfAttention vs the same block with the listing's attention, on the seed's
  (1, 128, 64, 64) U-Net map with 4 heads, no autograd.

    python benchmarks/bench_modules.py [--quick] [--no-memory] [--json FILE]
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import sdpa
from sdpa import listing
from sdpa.benchmark import Comparison, main

D_MODEL, HEADS, L = 128, 4, 4096
UNET = (1, 128, 64, 64)


def mha_pair(train: bool):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True).train(train)
    ours = sdpa.MultiHeadAttention.from_torch(ref)
    x = torch.randn(1, L, D_MODEL, requires_grad=train)
    return ref, ours, x


def mha_side(name: str, train: bool, torch_mode: bool | None = None):
    """torch_mode: run torch's module in this mode (default: `train`); its eval mode
    without autograd takes torch's native fast path, its train mode calls F.sdpa."""

    def setup():
        ref, ours, x = mha_pair(train)
        ref.train(train if torch_mode is None else torch_mode)
        if name.startswith("sdpa"):
            call = lambda: ours(x).output  # noqa: E731
        else:
            call = lambda: ref(x, x, x, need_weights=False)[0]  # noqa: E731
        return (lambda: call().sum().backward()) if train else call

    return name, setup


def spatial_side(name: str):
    def setup():
        torch.manual_seed(0)
        m = sdpa.SpatialSelfAttention(UNET[1], num_heads=4).eval()
        x = torch.randn(*UNET)
        return (
            (lambda: m(x).output)
            if name.startswith("sdpa")
            else (lambda: listing.spatial_block(m, x))
        )

    return name, setup


def comparisons() -> list[Comparison]:
    mha = f"MHA d_model {D_MODEL}, {HEADS} heads, (1, {L})"
    return [
        Comparison(
            case="mha inference",
            shape=mha + ", no grad",
            dtype="float32",
            ours=mha_side("sdpa.MultiHeadAttention", train=False),
            peer=mha_side("nn.MultiheadAttention(need_weights=False)", train=False),
            target=0.5,
        ),
        Comparison(
            case="mha inference sdpa-path",
            shape=mha + ", no grad, torch in train mode (its F.sdpa path)",
            dtype="float32",
            ours=mha_side("sdpa.MultiHeadAttention", train=False),
            peer=mha_side("nn.MultiheadAttention(need_weights=False)", False, torch_mode=True),
        ),
        Comparison(
            case="mha training",
            shape=mha + ", forward + backward",
            dtype="float32",
            ours=mha_side("sdpa.MultiHeadAttention", train=True),
            peer=mha_side("nn.MultiheadAttention(need_weights=False)", train=True),
            target=1.0,
            grad=True,
        ),
        Comparison(
            case="spatial",
            shape=f"SpatialSelfAttention {UNET}, 4 heads, no grad",
            dtype="float32",
            ours=spatial_side("sdpa.SpatialSelfAttention"),
            peer=spatial_side("the same block with the listing"),
            target=0.35,
        ),
    ]


if __name__ == "__main__":
    sys.exit(main(comparisons(), __file__, __doc__))
