"""Weights on demand: statistics and rows against the fused forward, without L x S.

At (1, 4, 16384, 32) float32 the dense weights are 4 GiB. Each statistic is timed
against the fused forward that produced the LSE (torch's SDPA on the same inputs), and
its peak memory is measured in a fresh process after the inputs and the attention call
exist.

    python benchmarks/bench_weights.py [--quick] [--no-memory] [--json FILE]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import sdpa
from sdpa.benchmark import Comparison, main

SHAPE = (1, 4, 16384, 32)  # (B, H, L, E)


def stat_side(name: str, stat):
    def setup():
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(*SHAPE, generator=g) for _ in range(3))
        w = sdpa.attention(q, k, v).weights
        return lambda: stat(w)

    return name, setup


def forward_side():
    def setup():
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(*SHAPE, generator=g) for _ in range(3))
        return lambda: F.scaled_dot_product_attention(q, k, v)

    return "F.scaled_dot_product_attention", setup


STATS = [  # (case id, what is timed, the call, target ratio to the forward)
    ("sum", "w.sum(dim=-2)", lambda w: w.sum(dim=-2), 2.5),
    ("entropy", "w.entropy()", lambda w: w.entropy(), 1.5),
    ("topk", "w.topk(8)", lambda w: w.topk(8), 2.5),
    ("row", "w[0, :, 5] (one query, all heads)", lambda w: w[0, :, 5], 0.02),
]


def comparisons() -> list[Comparison]:
    return [
        Comparison(
            case=case,
            shape=f"{SHAPE}, dense weights 4 GiB",
            dtype="float32",
            ours=stat_side(name, stat),
            peer=forward_side(),
            target=target,
            max_peak_mib=256,
        )
        for case, name, stat, target in STATS
    ]


if __name__ == "__main__":
    sys.exit(main(comparisons(), __file__, __doc__))
