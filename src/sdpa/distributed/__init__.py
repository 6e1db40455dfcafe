"""Sequence parallelism: attention over a sequence sharded across processes.

    torchrun --nproc-per-node 4 examples/ring.py

`ring_attention`, `ulysses_attention` and `hybrid_attention` are `sdpa.attention` for a
sequence cut into one shard per rank along dim -2 (the ring, DeepSpeed-Ulysses, and
Ulysses inside a group with the ring across groups); `shard`, `unshard` and `positions`
cut and join sequences in any layout; `traffic` counts the bytes sent.
"""

from sdpa.distributed.comm import RingError, RingTimeoutError, Traffic, traffic
from sdpa.distributed.layout import (
    LAYOUTS,
    per_document,
    positions,
    rearranged,
    shard,
    unshard,
)
from sdpa.distributed.local_masks import key_padding
from sdpa.distributed.schemes import hybrid_attention, ring_attention, ulysses_attention
from sdpa.distributed.weights import RingWeights

__all__ = [
    "LAYOUTS",
    "RingError",
    "RingTimeoutError",
    "RingWeights",
    "Traffic",
    "hybrid_attention",
    "key_padding",
    "per_document",
    "positions",
    "rearranged",
    "ring_attention",
    "shard",
    "traffic",
    "ulysses_attention",
    "unshard",
]
