"""Weights on demand: statistics and rows against the fused forward, without L x S.

At (1, 4, 16384, 32) float32 the dense weights are 4 GiB. Each statistic, row or key
column is timed against the fused forward that produced the LSE (torch's SDPA on the
same inputs), and its peak memory is measured in a fresh process after the inputs and
the attention call exist. The statistics' targets (issue 36): attention received
(`w.sum(dim=-2)`) and max logits at most 1.0x the forward, entropy and top-k at most
1.5x; the JSON records each case's target and whether it was met.

    python benchmarks/bench_weights.py [--quick] [--no-memory] [--json FILE]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import sdpa
from sdpa.benchmark import Comparison, main

SHAPE = (1, 4, 16384, 32)  # (B, H, L, E)
SHORT = (1, 4, 4096, 32)  # the diffusion U-Net's 64 x 64 pixels: dense weights 256 MiB
KEYS = [5, 700, 1999, 2000, 3000, 3500, 4000, 4095]  # e.g. 8 pixels' columns


def _inputs(shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=g) for _ in range(3))


def stat_side(name: str, stat, shape: tuple[int, ...]):
    def setup():
        w = sdpa.attention(*_inputs(shape)).weights
        return lambda: stat(w)

    return name, setup


def forward_side(shape: tuple[int, ...]):
    def setup():
        q, k, v = _inputs(shape)
        return lambda: F.scaled_dot_product_attention(q, k, v)

    return "F.scaled_dot_product_attention", setup


STATS = [  # (case id, what is timed, the call, target ratio to the forward, shape)
    ("sum", "w.sum(dim=-2)", lambda w: w.sum(dim=-2), 1.0, SHAPE),
    ("entropy", "w.entropy()", lambda w: w.entropy(), 1.5, SHAPE),
    ("topk", "w.topk(8)", lambda w: w.topk(8), 1.5, SHAPE),
    ("max_logits", "w.max_logits()", lambda w: w.max_logits(), 1.0, SHAPE),
    ("row", "w[0, :, 5] (one query, all heads)", lambda w: w[0, :, 5], 0.02, SHAPE),
    ("column", "w[0, :, :, 2000] (one key, all heads)", lambda w: w[0, :, :, 2000], 0.15,
     SHORT),
    ("columns", "w[0, :, :, J] (8 keys, all heads)", lambda w: w[0, :, :, KEYS], 0.15, SHORT),
    ("column-long", "w[0, :, :, 2000] (one key, all heads)", lambda w: w[0, :, :, 2000], 0.15,
     SHAPE),
]  # fmt: skip


def comparisons() -> list[Comparison]:
    return [
        Comparison(
            case=case,
            shape=f"{shape}, dense weights {4 * shape[1] * shape[2] ** 2 // 2**20} MiB",
            dtype="float32",
            ours=stat_side(name, stat, shape),
            peer=forward_side(shape),
            target=target,
            max_peak_mib=256,
        )
        for case, name, stat, target, shape in STATS
    ]


if __name__ == "__main__":
    sys.exit(main(comparisons(), __file__, __doc__))
