"""The seed's U-Net case: 4-head self-attention over the 4,096 pixels of (1, 128, 64, 64).

SpatialSelfAttention against the same block written with the seed's listing: output
shape, median time and peak memory (each measured in a fresh process).

    python examples/unet_attention.py [--size 64]
"""

from __future__ import annotations

import argparse

import torch

import sdpa
from sdpa import listing
from sdpa.measure import median_ms, peak_mib_in_subprocess, peak_mib_of


def setup(size: int, seed: int = 0):
    torch.manual_seed(seed)
    block = sdpa.SpatialSelfAttention(128, num_heads=4).eval()
    return block, torch.randn(1, 128, size, size)


def calls(block: sdpa.SpatialSelfAttention, x: torch.Tensor) -> dict:
    return {
        "sdpa": lambda: block(x).output,
        "listing": lambda: listing.spatial_block(block, x),
    }


def main(size: int = 64) -> list[str]:
    block, x = setup(size)
    with torch.no_grad():
        out, w = block(x)
        ms = {name: median_ms(fn, reps=3) for name, fn in calls(block, x).items()}
        agree = (out - listing.spatial_block(block, x)).abs().max().item()
    mib = {
        name: peak_mib_in_subprocess(["-m", "sdpa.examples.unet_attention", "--size",
                                      str(size), "--peak", name])
        for name in ms
    }  # fmt: skip
    pixels = size * size
    lines = [
        f"U-Net map {tuple(x.shape)}: 4 heads over {pixels} pixels -> output "
        f"{tuple(out.shape)}, weights {tuple(w.shape)} (lazy; listing agrees to {agree:.1e})",
        f"SpatialSelfAttention {ms['sdpa']:.0f} ms, {mib['sdpa']:.0f} MiB peak vs the listing's "
        f"block {ms['listing']:.0f} ms, {mib['listing']:.0f} MiB: "
        f"{ms['sdpa'] / ms['listing']:.2f}x the time, "
        f"{mib['sdpa'] / mib['listing']:.2f}x the memory",
    ]
    for line in lines:
        print(line)
    return lines


def _peak(size: int, name: str) -> None:
    block, x = setup(size)
    with torch.no_grad():
        print(peak_mib_of(calls(block, x)[name]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=64, help="feature map height and width")
    parser.add_argument("--peak", choices=["sdpa", "listing"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        _peak(args.size, args.peak)
    else:
        main(args.size)
