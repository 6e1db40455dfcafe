"""Block skipping for the fused backend: feed the kernel only the keys a block can see.

Queries are cut into blocks of BLOCK_Q rows and keys into blocks of BLOCK_K. From the
mask's block occupancy (EMPTY, PARTIAL, FULL) each query block gets the contiguous span
of key blocks it can see: keys outside the span are skipped; a span of FULL blocks runs
without a mask; otherwise the mask's slice for that span goes with it. Adjacent query
blocks with the same span and kind are merged into one kernel call, so a mask without
structure costs one call, as without this layer. Every query row is computed by exactly
one call, so outputs, LSEs and gradients are exact with no merging step.

On CPU the plan is read from the occupancy on the host (cheap there, and it pays). On a
GPU nothing is read from device memory: a tensor mask goes to the kernel whole, and a
structured mask is planned from its host-side spans (`masks.Mask.spans`) or, without
them, materialised on the device and taken whole.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sdpa import masks, tile
from sdpa.inputs import Inputs

BLOCK_Q, BLOCK_K = 256, 64


class Piece(NamedTuple):
    """One kernel call: batch rows `batch`, queries [q0, q1), keys [k0, k1)."""

    batch: slice
    q0: int
    q1: int
    k0: int
    k1: int
    masked: bool  # False: every key in the span is visible to every query


def whole(mask: torch.Tensor | None, L: int, on_cpu: bool = True) -> bool:
    """Whether the kernel takes a tensor mask (or none) as it is, decided without reading
    it: no mask; a mask tensor over at most one query block (decoding, short texts),
    whose scan would cost more than the keys it could skip; a mask tensor on a GPU (its
    plan would be read from device memory: a host sync); or a mask tensor while
    torch.compile traces (a plan read from data cannot live in a graph, and L is not
    guarded on: a traced L is tested only as a plain int, which needs no guard)."""
    if mask is None or not on_cpu or (L.__class__ is int and L <= BLOCK_Q):
        return True
    return torch.compiler.is_compiling() or L <= BLOCK_Q


def pieces(inputs: Inputs) -> list[Piece] | None:
    """The kernel calls of a block plan for these inputs, or None where there is no
    structure to use. On CPU from the block occupancy (`structure`, read on the host);
    elsewhere from the masks' host-side spans (`masks.Mask.spans`: no tensor on the
    device is read, no host sync), None where a mask has none (the kernel then takes the
    mask whole)."""
    L, S = inputs.query.shape[2], inputs.key.shape[2]
    if inputs.query.is_cpu:
        occ = structure(inputs)
        return None if occ is None else exact(plan(occ, L, S), inputs)
    mask = inputs.mask
    if torch.compiler.is_compiling() or not isinstance(mask, masks.Mask):
        return None  # (a tensor part goes to the kernel whole: no plan read from it)
    spans = mask.spans(L, S, BLOCK_Q, BLOCK_K)
    return None if spans is None else exact(plan_spans(spans, L, S), inputs)


def exact(pieces: list[Piece], inputs: Inputs) -> list[Piece]:
    """The pieces cut to their batch element's key span where every row that sees a key
    sees every key of it (masks.key_spans full): its rows within masks.query_spans run
    on the real keys alone, with no mask, and its rows outside see none (output 0).
    Block edges would leave up to BLOCK_K - 1 padded keys in a masked call, and a mask
    to build per call. Read from the host (the spans' own rule); the pieces as they are
    where there is none."""
    B, L, S = inputs.query.shape[0], inputs.query.shape[2], inputs.key.shape[2]
    spans = masks.key_spans(inputs.mask, B, S)
    if spans is None or not any(full for _, _, full in spans):
        return pieces
    rows = masks.query_spans(inputs.mask, B, L) or ((0, L),) * B
    out = []
    for p in pieces:
        at = range(B)[p.batch]  # the piece's batch elements
        (lo, hi, full), (r0, r1) = spans[at[0]], rows[at[0]]
        if p.k1 == p.k0 or not full or any(spans[b] != spans[at[0]] or rows[b] != rows[at[0]]
                                           for b in at):  # fmt: skip
            out.append(p)
            continue
        a, z = min(max(p.q0, r0), p.q1), max(min(p.q1, r1), p.q0)  # the live rows [a, z)
        out += [Piece(p.batch, q0, q1, k0, k1, False)
                for q0, q1, k0, k1 in ((p.q0, a, 0, 0), (a, z, lo, hi), (z, p.q1, 0, 0))
                if q1 > q0]  # fmt: skip
    return _merged(out)


def plan_spans(spans: masks.Spans, L: int, S: int) -> list[Piece]:
    """Kernel calls covering every query row once, from a mask's spans (Bm, nQ): what
    `plan` makes of the same occupancy (held equal by tests/test_no_sync.py)."""
    calls = []
    for b, row in enumerate(spans):
        batch = slice(None) if len(spans) == 1 else slice(b, b + 1)
        for qi, (lo, hi, partial) in enumerate(row):
            q0, q1 = qi * BLOCK_Q, min(L, (qi + 1) * BLOCK_Q)
            if hi <= lo:
                calls.append((batch, q0, q1, 0, 0, False))  # sees no key: output 0
            else:
                calls.append((batch, q0, q1, lo * BLOCK_K, min(S, hi * BLOCK_K), partial))
    return _merged(calls)


def _merged(calls: list[tuple[slice, int, int, int, int, bool]]) -> list[Piece]:
    """Pieces from calls in batch and row order: adjacent query blocks of one batch
    element with the same span and kind become one call."""
    out: list[Piece] = []
    for batch, q0, q1, k0, k1, masked in calls:
        last = out[-1] if out else None
        if (
            last is not None and last.batch == batch and last.q1 == q0
            and (last.k0, last.k1, last.masked) == (k0, k1, masked)
        ):  # fmt: skip
            out[-1] = last._replace(q1=q1)
        else:
            out.append(Piece(batch, q0, q1, k0, k1, masked))
    return out


def structure(inputs: Inputs) -> torch.Tensor | None:
    """(Bm, nQ, nK) block occupancy of everything that masks these inputs (mask and
    causal flag), or None where there is no structure to use (no mask, a float mask, a
    bool tensor over at most one query block, or while torch.compile traces)."""
    L, S = inputs.query.shape[2], inputs.key.shape[2]
    if torch.compiler.is_compiling():  # a plan read from data cannot live in a graph
        return None
    tensor, structured = masks.split(inputs.mask)
    parts = []
    if tensor is not None:
        if tensor.dtype != torch.bool or whole(tensor, L):
            return None  # an additive float mask, or one block: nothing read cheaply pays
        parts.append(_tensor_blocks(tensor))
    if structured is not None:
        parts.append(structured.blocks(L, S, BLOCK_Q, BLOCK_K))
    if not parts:
        return None
    occ = parts[0]
    for p in parts[1:]:
        occ = torch.minimum(occ, p)  # AND
    return occ


def plan(occ: torch.Tensor, L: int, S: int) -> list[Piece]:
    """Kernel calls covering every query row once, from the block occupancy (Bm, nQ, nK)
    (read on the host: a CPU plan)."""
    calls = []
    occ = occ.cpu()
    for b in range(occ.shape[0]):
        batch = slice(None) if occ.shape[0] == 1 else slice(b, b + 1)
        for qi, row in enumerate(occ[b]):
            seen = (row != masks.EMPTY).nonzero()
            q0, q1 = qi * BLOCK_Q, min(L, (qi + 1) * BLOCK_Q)
            if len(seen) == 0:
                calls.append((batch, q0, q1, 0, 0, False))  # sees no key: output 0
            else:
                lo, hi = int(seen[0]), int(seen[-1])
                masked = bool((row[lo : hi + 1] != masks.FULL).any())
                calls.append((batch, q0, q1, lo * BLOCK_K, min(S, (hi + 1) * BLOCK_K), masked))
    return _merged(calls)


def keep(inputs: Inputs, piece: Piece) -> torch.Tensor:
    """Bool keep-mask of one piece, (B|1, H|1, q1 - q0, k1 - k0): the tile rule's window."""
    tensor, structured = masks.split(inputs.mask)
    if tensor is not None and tensor.shape[0] > 1:
        tensor = tensor[piece.batch]
    L, S = inputs.query.shape[2], inputs.key.shape[2]
    rows, keys = slice(piece.q0, piece.q1), slice(piece.k0, piece.k1)
    out = tile.window(masks.join(tensor, structured), L, S, rows, keys, inputs.query.device)
    if structured is not None and out.shape[0] > 1:  # a structured mask's batch
        out = out[piece.batch]
    return out


def _tensor_blocks(mask: torch.Tensor) -> torch.Tensor:
    """(Bm, nQ, nK) occupancy of a bool mask (Bm|1, H|1, L, S), read on its distinct
    entries (a broadcast (B, 1, 1, S) padding mask costs O(B*S)), merged over heads."""
    L, S = mask.shape[2:]
    base = tile.distinct(mask)
    occ = masks.occupancy(
        base, BLOCK_Q if base.shape[2] == L else 1, BLOCK_K if base.shape[3] == S else 1
    )  # (Bm', Hm', nQ', nK')
    occ = occ.expand(-1, -1, -(-L // BLOCK_Q), -(-S // BLOCK_K))
    full = (occ == masks.FULL).all(dim=1)
    empty = (occ == masks.EMPTY).all(dim=1)
    out = torch.full(full.shape, masks.PARTIAL, dtype=torch.int8, device=mask.device)
    out[full] = masks.FULL
    out[empty] = masks.EMPTY
    return out
