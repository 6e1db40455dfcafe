"""Which kernel calls one ring step needs: this rank's queries against one shard of
keys, cut by what the mask lets them see.

Both shards are made of runs of consecutive global positions (one for the contiguous
layout, two for zigzag). For each (query run, key run) pair, causality alone is decided
from the positions: keys all before the queries (full), all after (skipped), or the same
positions (the kernel's own causal path). A structured mask is evaluated by position,
query rows a chunk at a time, and each chunk keeps only the key columns it can see: an
empty chunk is skipped, a fully visible one runs unmasked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

from sdpa import masks, settings, tile
from sdpa.distributed.layout import Run

FULL, EMPTY, DIAGONAL, OVERLAP = "full", "empty", "diagonal", "overlap"


class Call(NamedTuple):
    """One kernel call: query rows `rows` of this shard against key columns `cols` of the
    other (global key positions `kpos`); keep (Bm, r, c) bool where the mask applies
    (None: every key counts); causal: top-left within the call; alive (Bm, r) bool where
    some key is kept (None: all)."""

    rows: slice
    cols: slice
    keep: torch.Tensor | None
    causal: bool
    alive: torch.Tensor | None
    kpos: slice


def relation(q: Run, k: Run, causal: bool) -> str:
    if not causal or k.start + k.length <= q.start:
        return FULL
    if k.start >= q.start + q.length:
        return EMPTY
    if k.start == q.start and k.length == q.length:
        return DIAGONAL
    return OVERLAP


def calls(
    q_runs: list[Run],
    k_runs: list[Run],
    mask: masks.Mask | None,
    causal: bool,
    L: int,
    S: int,
    device: torch.device,
) -> Iterator[Call]:
    """The kernel calls for one (query shard, key shard) pair; each (row, column) the
    mask keeps is covered exactly once."""
    top_left = masks.TOP_LEFT
    for qr in q_runs:
        for kr in k_runs:
            rel = relation(qr, kr, causal)
            if rel == EMPTY:
                continue
            if mask is None and rel in (FULL, DIAGONAL):
                kpos = slice(kr.start, kr.start + kr.length)
                yield Call(qr.rows, kr.rows, None, rel == DIAGONAL, None, kpos)
                continue
            rule = mask if rel == FULL else top_left if mask is None else mask & top_left
            yield from _masked(qr, kr, rule, L, S, device)


def needs(
    q_runs: list[Run],
    k_runs: list[Run],
    mask: masks.Mask | None,
    causal: bool,
    L: int,
    S: int,
    device: torch.device,
) -> bool:
    """Whether some query of q_runs sees some key of k_runs: from the positions alone
    without a mask (O(runs)), else by evaluating the mask until a kept entry shows."""
    return next(iter(calls(q_runs, k_runs, mask, causal, L, S, device)), None) is not None


def _masked(qr: Run, kr: Run, rule: masks.Mask, L: int, S: int, device) -> Iterator[Call]:
    k_pos = torch.arange(kr.start, kr.start + kr.length, device=device)
    # the settings' mask_chunk_bytes: 1 byte of keep + 4 of bias per entry
    budget = settings.get().mask_chunk_bytes
    step = tile.chunk_rows(1, kr.length, torch.bool, copies=5, budget=budget)
    for chunk in tile.row_chunks(qr.length, step):
        r0, r1 = chunk.start, chunk.stop
        q_pos = torch.arange(qr.start + r0, qr.start + r1, device=device)
        keep = rule.keep(q_pos, k_pos, L, S)  # (Bm, r, c)
        seen = keep.any(dim=0).any(dim=0).nonzero()  # key columns some row keeps
        if len(seen) == 0:
            continue
        c0, c1 = int(seen[0]), int(seen[-1]) + 1
        keep = keep[:, :, c0:c1]
        rows = slice(qr.local + r0, qr.local + r1)
        cols = slice(kr.local + c0, kr.local + c1)
        kpos = slice(kr.start + c0, kr.start + c1)
        if bool(keep.all()):
            yield Call(rows, cols, None, False, None, kpos)
        else:
            yield Call(rows, cols, keep, False, keep.any(dim=-1), kpos)


def bias(keep: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Keep (Bm, r, c) -> additive (Bm, 1, r, c): 0 where kept, -inf elsewhere."""
    return None if keep is None else tile.additive(keep[:, None], dtype)
