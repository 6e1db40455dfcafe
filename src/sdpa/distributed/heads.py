"""Ulysses' all-to-alls: from sequence shards with every head to every row of the
group's shards with a share of the heads, and back (DeepSpeed-Ulysses).

A group of U ranks holds shards of n_0 ... n_{U-1} rows. `to_heads` gives member j the
heads [j * h, (j + 1) * h) (h = H / U) of every member's rows, concatenated in member
order: (B, H, n_j, D) -> (B, h, n_0 + ... + n_{U-1}, D). `to_sequence` is its inverse.
Each is the other's backward, so gradients go back over the same all-to-alls.
"""

from __future__ import annotations

import math

import torch

from sdpa.distributed.comm import Ring
from sdpa.errors import SdpaValueError


def kv_repeats(Hq: int, Hkv: int, U: int) -> int:
    """How many times each key/value head is repeated for a group of U (each member
    takes Hq / U query heads): query heads must divide by U; key/value heads that do
    not are repeated to lcm(Hkv, U) (each member then holds whole GQA groups, its
    queries' own key heads), which adds (lcm / Hkv - 1) copies of K and V to the
    all-to-all."""
    if Hq % U:
        raise SdpaValueError(
            f"Ulysses splits the query heads across the {U} ranks of its group: {Hq} query "
            f"heads do not divide by {U}; use a group whose size divides the heads, or "
            f"ring_attention"
        )
    return math.lcm(Hkv, U) // Hkv


def to_heads(ring: Ring, x: torch.Tensor, sizes: list[int], what: str) -> torch.Tensor:
    """(B, H, sizes[me], D) -> (B, H / U, sum(sizes), D), members' rows in order."""
    if ring.world == 1:
        return x
    return _AllToAll.apply(x, ring, sizes, what, _heads)


def to_sequence(ring: Ring, x: torch.Tensor, sizes: list[int], what: str) -> torch.Tensor:
    """(B, h, sum(sizes), D) -> (B, h * U, sizes[me], D): the inverse of to_heads."""
    if ring.world == 1:
        return x
    return _AllToAll.apply(x, ring, sizes, what, _sequence)


def _heads(ring: Ring, x: torch.Tensor, sizes: list[int], what: str) -> torch.Tensor:
    me, U = ring.rank, ring.world
    h = x.shape[1] // U
    share = [x[:, j * h : (j + 1) * h] for j in range(U)]
    pieces = {j: x.new_empty(x.shape[0], h, sizes[j], x.shape[3]) for j in range(U) if j != me}
    ring.exchange(
        {j: [share[j]] for j in pieces}, {j: [t] for j, t in pieces.items()}, what,
        f"Ulysses' all-to-all of {what}",
    )  # fmt: skip
    pieces[me] = share[me]
    return torch.cat([pieces[j] for j in range(U)], dim=2)


def _sequence(ring: Ring, x: torch.Tensor, sizes: list[int], what: str) -> torch.Tensor:
    me, U = ring.rank, ring.world
    rows = torch.split(x, sizes, dim=2)
    pieces = {
        j: x.new_empty(x.shape[0], x.shape[1], sizes[me], x.shape[3]) for j in range(U) if j != me
    }
    ring.exchange(
        {j: [rows[j]] for j in pieces}, {j: [t] for j, t in pieces.items()}, what,
        f"Ulysses' all-to-all of {what}",
    )  # fmt: skip
    pieces[me] = rows[me]
    return torch.cat([pieces[j] for j in range(U)], dim=1)


class _AllToAll(torch.autograd.Function):
    """to_heads (forward=_heads) or to_sequence (forward=_sequence); the backward is
    the other one, of the gradient."""

    @staticmethod
    def forward(ctx, x, ring, sizes, what, there):
        ctx.ring, ctx.sizes, ctx.back = ring, sizes, _sequence if there is _heads else _heads
        return there(ring, x, sizes, what)

    @staticmethod
    def backward(ctx, g):
        return ctx.back(ctx.ring, g.contiguous(), ctx.sizes, "grad"), None, None, None, None
