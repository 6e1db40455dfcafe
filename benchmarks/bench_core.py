"""Core benchmark: sdpa.attention against torch's SDPA and the seed's listing.

Shapes from the seed: text (1, 8, 4, 32) and U-Net (1, 4, 4096, 32), (B, H, L, E);
float32 and bfloat16; no autograd. GFLOP/s counts the forward, 4*B*H*L*S*E.

    python benchmarks/bench_core.py [--quick] [--no-memory] [--json FILE]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import sdpa
from sdpa import listing
from sdpa.benchmark import Comparison, main

SHAPES = {"text": (1, 8, 4, 32), "unet": (1, 4, 4096, 32)}  # (B, H, L, E), from the seed
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def inputs(shape, dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g).to(dtype) for _ in range(3)]


def side(name, fn, shape, dtype):
    def setup():
        q, k, v = inputs(shape, dtype)
        return lambda: fn(q, k, v)

    return name, setup


def ours_with_weights(q, k, v):
    out, w = sdpa.attention(q, k, v)
    return out, w.full()


def comparisons() -> list[Comparison]:
    out = []
    for case, shape in SHAPES.items():
        B, H, L, E = shape
        for dname, dtype in DTYPES.items():
            common = dict(shape=f"{case} {shape}", dtype=dname, flop=4 * B * H * L * L * E,
                          calls_per_rep=200 if L < 100 else 1)  # fmt: skip
            out.append(Comparison(
                case=f"{case} {dname} forward",
                ours=side("sdpa.attention", lambda q, k, v: sdpa.attention(q, k, v).output,
                          shape, dtype),
                peer=side("F.scaled_dot_product_attention", F.scaled_dot_product_attention,
                          shape, dtype),
                target=3.0 if case == "text" else 1.05, **common,
            ))  # fmt: skip
            if case == "unet":
                out.append(Comparison(
                    case=f"{case} {dname} weights",
                    ours=side("sdpa.attention + weights.full()", ours_with_weights, shape, dtype),
                    peer=side("listing (output + p_attn)", listing.attention, shape, dtype),
                    target=0.6, **common,
                ))  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main(comparisons(), __file__, __doc__))
