"""Sequence parallelism: attention over a sequence sharded across processes.

    torchrun --nproc-per-node 4 examples/ring.py

`ring_attention` is `sdpa.attention` for a sequence cut into one shard per rank along
dim -2; `shard`, `unshard` and `positions` cut and join sequences in either layout.
"""

from sdpa.distributed.comm import RingError, RingTimeoutError
from sdpa.distributed.layout import LAYOUTS, positions, shard, unshard
from sdpa.distributed.ring import ring_attention
from sdpa.distributed.weights import RingWeights

__all__ = [
    "LAYOUTS",
    "RingError",
    "RingTimeoutError",
    "RingWeights",
    "positions",
    "ring_attention",
    "shard",
    "unshard",
]
