"""The textbook passage's U-Net case: 4-head self-attention over 4,096 pixels (1, 128, 64, 64).

The feature map is made from a picture drawn by code. SpatialSelfAttention against the
same block written with the passage's Listing 9.1: output shape, median time and peak memory
(each measured in a fresh process); with --out, what a few query pixels attend to.

    python examples/unet_attention.py [--size 64] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import sdpa
from sdpa import listing
from sdpa.measure import median_ms, peak_mib_of, peaks_mib_in_subprocesses


def picture(size: int) -> torch.Tensor:
    """A small scene drawn by code, (size, size, 3) in [0, 1]: sky, grass, a sun, a red
    house, a blue pond."""
    y, x = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    img = torch.stack([0.45 + 0.2 * y, 0.65 + 0.15 * y, 0.95 - 0.1 * y], dim=-1)  # sky
    ground = y > 0.62
    img[ground] = torch.tensor([0.25, 0.6, 0.2]) + 0.08 * torch.sin(40 * x[ground])[:, None]
    sun = (x - 0.8) ** 2 + (y - 0.18) ** 2 < 0.01
    img[sun] = torch.tensor([1.0, 0.85, 0.2])
    house = (x > 0.15) & (x < 0.42) & (y > 0.4) & (y < 0.7)
    img[house] = torch.tensor([0.8, 0.15, 0.12])
    pond = ((x - 0.68) / 0.2) ** 2 + ((y - 0.82) / 0.08) ** 2 < 1
    img[pond] = torch.tensor([0.1, 0.3, 0.85])
    return img.clamp(0, 1)


def features(img: torch.Tensor, channels: int = 128) -> torch.Tensor:
    """(1, channels, H, W): fixed features of each pixel's colour and 3x3 neighbourhood
    (a seeded random projection), so that similar-looking pixels get similar features."""
    g = torch.Generator().manual_seed(0)
    x = img.permute(2, 0, 1)[None]  # (1, 3, H, W)
    patches = torch.nn.functional.unfold(x, 3, padding=1)  # (1, 27, H*W)
    proj = torch.randn(channels, 27, generator=g) / 27**0.5
    f = torch.tanh(3 * proj @ (patches - 0.5))  # (1, C, H*W)
    return f.view(1, channels, *img.shape[:2])


def setup(size: int, seed: int = 0):
    """The passage's block on a feature map of the drawn picture. Its q/k/v projections are
    set to the identity (scaled for q and k), so a pixel attends to look-alike pixels."""
    torch.manual_seed(seed)
    block = sdpa.SpatialSelfAttention(128, num_heads=4).eval()
    with torch.no_grad():
        eye = torch.eye(128)
        block.qkv.weight.copy_(torch.cat([2.0 * eye, 2.0 * eye, eye]))
        block.qkv.bias.zero_()
    return block, features(picture(size))


def pixel_picture(block, x: torch.Tensor, size: int, out_dir: Path) -> tuple[Path, list]:
    """The attention maps of a few query pixels over the picture, as a PNG."""
    from sdpa import plot
    from sdpa.nn import pixel_attention

    with torch.no_grad():
        w = block(x).weights
    pixels = [
        (int(size * fy), int(size * fx))
        for fy, fx in ((0.55, 0.28), (0.82, 0.68), (0.18, 0.8), (0.2, 0.3))
    ]
    maps = torch.stack([pixel_attention(w, py, px, (size, size))[0].mean(0) for py, px in pixels])
    return plot.pixel_maps(picture(size), maps, pixels, out_dir / "unet_pixels.png"), pixels


def calls(block: sdpa.SpatialSelfAttention, x: torch.Tensor) -> dict:
    return {
        "sdpa": lambda: block(x).output,
        "listing": lambda: listing.spatial_block(block, x),
    }


def main(size: int = 64, out_dir: Path | None = None) -> list[str]:
    block, x = setup(size)
    with torch.no_grad():
        out, w = block(x)
        ms = {name: median_ms(fn, reps=3) for name, fn in calls(block, x).items()}
        agree = (out - listing.spatial_block(block, x)).abs().max().item()
    argv = ["-m", "sdpa.examples.unet_attention", "--size", str(size), "--peak"]
    mib = dict(zip(ms, peaks_mib_in_subprocesses([[*argv, name] for name in ms]), strict=True))
    pixels = size * size
    lines = [
        f"U-Net map {tuple(x.shape)}: 4 heads over {pixels} pixels -> output "
        f"{tuple(out.shape)}, weights {tuple(w.shape)} (lazy; listing agrees to {agree:.1e})",
        f"SpatialSelfAttention {ms['sdpa']:.0f} ms, {mib['sdpa']:.0f} MiB peak vs the listing's "
        f"block {ms['listing']:.0f} ms, {mib['listing']:.0f} MiB: "
        f"{ms['sdpa'] / ms['listing']:.2f}x the time, "
        f"{mib['sdpa'] / mib['listing']:.2f}x the memory",
    ]
    if out_dir is not None:
        png, pixels = pixel_picture(block, x, size, Path(out_dir))
        lines.append(f"wrote {png} (query pixels {pixels}: house, pond, sun, sky)")
    return lines


def _peak(size: int, name: str) -> None:
    block, x = setup(size)
    with torch.no_grad():
        print(peak_mib_of(calls(block, x)[name]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=64, help="feature map height and width")
    parser.add_argument("--out", type=Path, help="also draw the pixel maps into this folder")
    parser.add_argument("--peak", choices=["sdpa", "listing"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        _peak(args.size, args.peak)
    else:
        print("\n".join(main(args.size, args.out)))
