"""How a sequence is cut into one shard per rank, and back.

"contiguous": rank r holds the r-th stretch of the sequence. Shards may differ in size
(`sizes`, zero included): packed documents split where the documents end. With causal
attention the last rank does the most work.
"zigzag": the sequence is cut into 2R equal chunks and rank r holds chunks r and
2R-1-r, so every rank gets an early and a late chunk and the same causal work (the
head-tail load balancing of ring-flash-attention and torch's context_parallel).
`per_document(lengths)`: the zigzag inside each packed document (the order of the
example in the docstring of torch's per-document head-tail balancer): rank r holds
chunks r and 2R-1-r of every document.
`rearranged(indices)`: the buffers of torch's context_parallel with a load balancer:
the sequence is rearranged by `indices` (the balancer's `_generate_indices()[0]`) and
rank r holds the r-th of R equal slices, so its positions are indices[r*n:(r+1)*n].

    R = 2, 8 positions   contiguous: rank 0 [0 1 2 3]  rank 1 [4 5 6 7]
                         zigzag:     rank 0 [0 1 6 7]  rank 1 [2 3 4 5]
    documents of 4 and 4 per_document: rank 0 [0 3 4 7]  rank 1 [1 2 5 6]
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from sdpa.errors import SdpaTypeError, SdpaValueError

LAYOUTS = ("contiguous", "zigzag")


class Run(NamedTuple):
    """A stretch of a shard whose global positions are consecutive."""

    local: int  # first index in the shard
    start: int  # its global position
    length: int

    @property
    def rows(self) -> slice:
        return slice(self.local, self.local + self.length)


class PerDocument:
    """The layout of packed documents of `lengths` (each a multiple of 2R), every one
    cut head-tail across the R ranks (see the module's docstring)."""

    def __init__(self, lengths: Sequence[int]):
        if any(not isinstance(n, int) or isinstance(n, bool) for n in lengths):
            raise SdpaTypeError(
                f"per_document takes one list of document lengths (the same packing for "
                f"every batch row: each rank's shard holds the same positions for all of "
                f"them), got {lengths!r}"
            )
        lengths = list(lengths)
        if not lengths or any(n <= 0 for n in lengths):
            raise SdpaValueError(
                f"per_document takes the positive lengths of the packed documents, got {lengths}"
            )
        self.lengths = lengths

    def runs(self, rank: int, world: int) -> list[Run]:
        out, local, start = [], 0, 0
        for n in self.lengths:
            c = n // (2 * world)
            for chunk in (rank, 2 * world - 1 - rank):
                out.append(Run(local, start + chunk * c, c))
                local += c
            start += n
        return out

    def check(self, world: int) -> None:
        bad = [n for n in self.lengths if n % (2 * world)]
        if bad:
            raise SdpaValueError(
                f"per_document: documents of length {bad} do not cut into {2 * world} equal "
                f"chunks ({world} ranks); pad each document to a multiple of {2 * world}"
            )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PerDocument) and other.lengths == self.lengths

    def __hash__(self) -> int:
        return hash(tuple(self.lengths))

    def __repr__(self) -> str:
        return f"per_document({self.lengths})"


def per_document(lengths: Sequence[int] | torch.Tensor) -> PerDocument:
    """The layout for packed documents of these lengths: the zigzag inside each one."""
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    return PerDocument(lengths)


class Rearranged:
    """The layout of a sequence rearranged by a permutation `indices` of range(L) and
    cut into R equal slices (torch's context_parallel buffers)."""

    def __init__(self, indices: torch.Tensor):
        self.indices = indices
        digest = hashlib.sha1(indices.numpy().tobytes()).hexdigest()[:16]
        self._name = f"rearranged(L={len(indices)}, sha1:{digest})"

    def runs(self, rank: int, world: int) -> list[Run]:
        n = len(self.indices) // world
        mine = self.indices[rank * n : (rank + 1) * n].tolist()
        out: list[Run] = []
        for local, p in enumerate(mine):
            if out and out[-1].start + out[-1].length == p:
                out[-1] = Run(out[-1].local, out[-1].start, out[-1].length + 1)
            else:
                out.append(Run(local, p, 1))
        return out

    def check(self, world: int) -> None:
        if len(self.indices) % world:
            raise SdpaValueError(
                f"{self!r} does not cut into {world} equal slices; torch's balancers give "
                f"lengths that divide by the ranks (twice the ranks for head-tail)"
            )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rearranged) and repr(other) == repr(self)

    def __hash__(self) -> int:
        return hash(self._name)

    def __repr__(self) -> str:
        return self._name


def rearranged(indices: Sequence[int] | torch.Tensor) -> Rearranged:
    """The layout of torch's context_parallel buffers rearranged by a load balancer's
    indices, (L,) or (1, L): rank r holds positions indices[r * L/R : (r + 1) * L/R]."""
    t = torch.as_tensor(indices).detach().cpu()
    if t.ndim == 2 and t.shape[0] == 1:
        t = t[0]
    t = t.long()
    if t.ndim != 1 or not torch.equal(torch.sort(t).values, torch.arange(len(t))):
        raise SdpaValueError(
            f"rearranged takes a permutation of range(L), (L,) or (1, L) (one for every "
            f"batch row), got a tensor of shape {tuple(t.shape)} that is not one"
        )
    return Rearranged(t)


Layout = str | PerDocument | Rearranged


def check_layout(layout: object) -> Layout:
    if isinstance(layout, PerDocument | Rearranged) or layout in LAYOUTS:
        return layout  # type: ignore[return-value]
    raise SdpaValueError(
        f"layout must be 'contiguous', 'zigzag', sdpa.distributed.per_document(lengths) or "
        f"sdpa.distributed.rearranged(indices), got {layout!r}"
    )


def describe(layout: Layout) -> str:
    """The layout as the ranks compare it."""
    return layout if isinstance(layout, str) else repr(layout)


def _check_sizes(sizes: Sequence[int], what: str) -> list[int]:
    if isinstance(sizes, torch.Tensor) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes
    ):
        raise SdpaTypeError(f"{what} must be a list of non-negative ints, got {sizes!r}")
    return list(sizes)


def cut(layout: Layout, sizes: Sequence[int], what: str = "shards") -> list[list[Run]]:
    """Every rank's runs, for shards of `sizes` (one per rank, in rank order) cut by
    `layout`; refuses sizes the layout cannot have."""
    sizes = _check_sizes(sizes, what)
    world = len(sizes)
    if layout == "contiguous":
        starts = [sum(sizes[:r]) for r in range(world)]
        return [[Run(0, starts[r], sizes[r])] if sizes[r] else [] for r in range(world)]
    if isinstance(layout, PerDocument | Rearranged):
        layout.check(world)
        runs = [layout.runs(r, world) for r in range(world)]
        want = [sum(run.length for run in rs) for rs in runs]
        if sizes != want:
            raise SdpaValueError(
                f"{what} of {sizes} positions, but {layout!r} over {world} ranks gives {want}"
            )
        return runs
    if len(set(sizes)) > 1 or sizes[0] % 2:
        raise SdpaValueError(
            f"layout='zigzag' needs equal, even shards (two chunks per rank), got {what} of "
            f"{sizes}; pad the sequence to a multiple of {2 * world}, or use "
            f"layout='contiguous' for shards of any size"
        )
    h = sizes[0] // 2
    if not h:
        return [[] for _ in range(world)]
    return [[Run(0, r * h, h), Run(h, (2 * world - 1 - r) * h, h)] for r in range(world)]


def index(runs: list[Run]) -> torch.Tensor:
    """The global positions of a shard's entries, (n,) int64."""
    if not runs:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(r.start, r.start + r.length) for r in runs])


def _sizes_of(n_total: int, world: int, layout: Layout, sizes, what: str) -> list[int]:
    """The shard sizes of a whole sequence of n_total positions."""
    if sizes is not None:
        sizes = _check_sizes(sizes, "sizes")
        if len(sizes) != world or sum(sizes) != n_total:
            raise SdpaValueError(
                f"sizes must give one shard size per rank ({world}) summing to {what}'s "
                f"length {n_total}, got {sizes}"
            )
        return sizes
    if isinstance(layout, PerDocument | Rearranged):
        layout.check(world)
        return [sum(r.length for r in layout.runs(rank, world)) for rank in range(world)]
    parts = world * (2 if layout == "zigzag" else 1)
    if n_total % parts:
        raise SdpaValueError(
            f"{what} of length {n_total} does not cut into {parts} equal chunks ({world} "
            f"ranks, layout={layout!r}); pad the sequence to a multiple of {parts} (and mask "
            f"the padding), or pass sizes=[...] with layout='contiguous'"
        )
    return [n_total // world] * world


def _check_rank(rank: int, world: int) -> None:
    if not 0 <= rank < world:
        raise SdpaValueError(f"rank must be in [0, world={world}), got {rank}")


def positions(
    n: int, rank: int, world: int, layout: Layout = "contiguous", *, sizes=None
) -> torch.Tensor:
    """Global positions of the n entries of rank `rank`'s shard, (n,) int64: what a
    positional encoding or a per-position mask needs on each rank. sizes: every rank's
    shard size (contiguous shards of unequal sizes); n must be sizes[rank]."""
    layout = check_layout(layout)
    _check_rank(rank, world)
    if sizes is None:
        sizes = _sizes_of(n * world, world, layout, None, "a shard")
    runs = cut(layout, sizes, "sizes")[rank]
    if sum(r.length for r in runs) != n:
        raise SdpaValueError(
            f"rank {rank}'s shard has {sum(r.length for r in runs)} entries, not {n}"
        )
    return index(runs)


def shard(
    x: torch.Tensor,
    rank: int,
    world: int,
    *,
    layout: Layout = "contiguous",
    dim: int = -2,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Rank `rank`'s shard of the whole sequence x along `dim` (a view for contiguous,
    a copy otherwise). sizes: every rank's shard size, for unequal contiguous shards."""
    layout = check_layout(layout)
    _check_rank(rank, world)
    every = _sizes_of(x.shape[dim], world, layout, sizes, f"x (dim {dim})")
    pieces = [x.narrow(dim, r.start, r.length) for r in cut(layout, every)[rank]]
    if not pieces:
        return x.narrow(dim, 0, 0)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def unshard(pieces: list[torch.Tensor], *, layout: Layout = "contiguous", dim: int = -2):
    """The whole sequence from every rank's shard, given in rank order."""
    layout = check_layout(layout)
    if layout == "contiguous":
        return torch.cat(pieces, dim=dim)
    runs = cut(layout, [p.shape[dim] for p in pieces])
    order = sorted((r.start, rank, r) for rank, rs in enumerate(runs) for r in rs)
    return torch.cat([pieces[rank].narrow(dim, r.local, r.length) for _, rank, r in order], dim=dim)
