"""How a sequence is cut into one shard per rank, and back.

"contiguous": rank r holds positions [r*n, (r+1)*n). With causal attention the last
rank does R times the work of the first.
"zigzag": the sequence is cut into 2R chunks of n/2 and rank r holds chunks r and
2R-1-r, so every rank gets an early and a late chunk and the same causal work
(the load balancing of ring-flash-attention and torch's context_parallel).

    R = 2, 8 positions   contiguous: rank 0 [0 1 2 3]  rank 1 [4 5 6 7]
                         zigzag:     rank 0 [0 1 6 7]  rank 1 [2 3 4 5]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sdpa.errors import SdpaValueError

LAYOUTS = ("contiguous", "zigzag")


class Run(NamedTuple):
    """A stretch of a shard whose global positions are consecutive."""

    local: int  # first index in the shard
    start: int  # its global position
    length: int

    @property
    def rows(self) -> slice:
        return slice(self.local, self.local + self.length)


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise SdpaValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")
    return layout  # type: ignore[return-value]


def _check_shardable(n_total: int, world: int, layout: str, what: str) -> None:
    parts = world * (2 if layout == "zigzag" else 1)
    if n_total % parts:
        raise SdpaValueError(
            f"{what} of length {n_total} does not cut into {parts} equal chunks ({world} "
            f"ranks, layout={layout!r}); pad the sequence to a multiple of {parts} (and mask "
            f"the padding)"
        )


def runs(n: int, rank: int, world: int, layout: str) -> list[Run]:
    """The stretches of consecutive positions in rank `rank`'s shard of n positions."""
    if layout == "contiguous":
        return [Run(0, rank * n, n)]
    h = n // 2
    return [Run(0, rank * h, h), Run(h, (2 * world - 1 - rank) * h, h)]


def positions(n: int, rank: int, world: int, layout: str = "contiguous") -> torch.Tensor:
    """Global positions of the n entries of rank `rank`'s shard, (n,) int64: what a
    positional encoding or a per-position mask needs on each rank."""
    check_layout(layout)
    _check_shardable(n * world, world, layout, "a shard")
    return torch.cat(
        [torch.arange(r.start, r.start + r.length) for r in runs(n, rank, world, layout)]
    )


def shard(x: torch.Tensor, rank: int, world: int, *, layout: str = "contiguous", dim: int = -2):
    """Rank `rank`'s shard of the whole sequence x along `dim` (a view for contiguous,
    a copy for zigzag)."""
    check_layout(layout)
    n_total = x.shape[dim]
    _check_shardable(n_total, world, layout, f"x (dim {dim})")
    if not 0 <= rank < world:
        raise SdpaValueError(f"rank must be in [0, world={world}), got {rank}")
    n = n_total // world
    pieces = [x.narrow(dim, r.start, r.length) for r in runs(n, rank, world, layout)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def unshard(pieces: list[torch.Tensor], *, layout: str = "contiguous", dim: int = -2):
    """The whole sequence from every rank's shard, given in rank order."""
    check_layout(layout)
    world = len(pieces)
    if layout == "contiguous":
        return torch.cat(pieces, dim=dim)
    n = pieces[0].shape[dim]
    h = n // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * world)
    for rank, p in enumerate(pieces):
        chunks[rank] = p.narrow(dim, 0, h)
        chunks[2 * world - 1 - rank] = p.narrow(dim, h, h)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]
