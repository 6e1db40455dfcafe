"""Padding costs nothing: the attention part of a distillation step on a padded batch
against the same step on the batch without padding (issue 36, item 1).

The attention part of one layer pair of the distillation benchmark (bench_distill.py),
at its batch sizes, 12 heads of 32: the student's call with its weights (q, k and v
require grad), the teacher's under no_grad, `sdpa.losses.attention_kl(ws, wt,
attention_mask)` plus a loss on the output, and the backward. Ours runs it on a batch
padded as the distillation benchmark's batches are (its `row_lengths`: 42-44% of the
tokens are padding), the mask as transformers hands it over (the tokenizer's
attention_mask expanded to a (B, 1, L, S) bool); the peer is the same step on a batch of
the same shape without padding (no mask). Target: at most 0.65x the unpadded step at
8 x 512. A second line times the padded step with the padding masked, not skipped
(sdpa.rows' key spans and real rows turned off): what skipping saves. A third declares
the padded queries in the mask (`masks.padding(lengths, queries=True)`): the calls' fused
forward and backward skip those rows too, whose output is then 0 (the loss on the output
reads only real rows there; the KL gives padded rows no weight either way).

    python benchmarks/bench_padding.py [--quick] [--no-memory] [--json FILE]

--quick runs 2 x 64 tokens.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

import sdpa
from sdpa import losses, masks, rows
from sdpa.benchmark import Comparison, main

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_distill import row_lengths  # (the distillation benchmark's batches)

QUICK = "--quick" in sys.argv
SIZES = [(2, 64)] if QUICK else [(8, 512), (8, 128)]
if "--peak" in sys.argv:  # (sdpa.benchmark's fresh process for a peak: any case's id)
    SIZES = [(2, 64), (8, 512), (8, 128)]
H, E = 12, 32
TARGET = {512: 0.65}


def inputs(B: int, L: int, padded: bool, queries: bool = False) -> dict:
    """q, k, v (student, requiring grad), the teacher's, and the masks of one batch;
    queries: the mask declares the padded queries (masks.padding)."""
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(B, H, L, E, generator=g) for _ in range(6)]
    for t in x[:3]:
        t.requires_grad_()
    if not padded:
        return {"x": x, "mask": None, "keep": None}
    keep = torch.arange(L)[None, :] < torch.tensor(row_lengths(B, L))[:, None]  # (B, L)
    if queries:
        return {"x": x, "mask": masks.padding(row_lengths(B, L), queries=True), "keep": keep}
    return {"x": x, "mask": keep[:, None, None, :].expand(B, 1, L, L), "keep": keep}


@contextlib.contextmanager
def masked():
    """The padding masked, not skipped: no key spans, every query row read."""
    before = rows.SPAN_MIN_SCORES, rows.real_rows
    rows.SPAN_MIN_SCORES, rows.real_rows = 2**62, lambda r, keep: r
    try:
        yield
    finally:
        rows.SPAN_MIN_SCORES, rows.real_rows = before


def step(batch: dict, skip: bool = True) -> None:
    """One layer pair's attention part: both calls, the KL, the backward."""
    q, k, v, qt, kt, vt = batch["x"]
    with contextlib.nullcontext() if skip else masked():
        out, ws = sdpa.attention(q, k, v, batch["mask"])
        with torch.no_grad():
            wt = sdpa.attention(qt, kt, vt, batch["mask"]).weights
        real = out if batch["keep"] is None else out * batch["keep"][:, None, :, None]
        loss = losses.attention_kl(ws, wt, batch["keep"]) + real.square().mean()
        loss.backward()
    for t in (q, k, v):
        t.grad = None


def side(B: int, L: int, padded: bool, skip: bool = True, queries: bool = False):
    def setup():
        batch = inputs(B, L, padded, queries)
        return lambda: step(batch, skip)

    return setup


def comparisons() -> list[Comparison]:
    out = []
    for B, L in SIZES:
        pad = 1 - sum(row_lengths(B, L)) / (B * L)
        shape = f"({B}, {H}, {L}, {E}), {pad:.0%} padding: call, KL, backward"
        unpadded = ("the batch without padding", side(B, L, False))
        sides = [  # (case, what ours is, its side, target)
            (f"padded step {B}x{L}", "padding skipped", side(B, L, True), TARGET.get(L)),
            (f"padded step masked {B}x{L}", "padding masked", side(B, L, True, skip=False), None),
            (
                f"padded step queries {B}x{L}",
                "padded queries declared",
                side(B, L, True, queries=True),
                None,
            ),
        ]
        out += [
            Comparison(
                case=case,
                shape=shape,
                dtype="float32",
                ours=(impl, ours),
                peer=unpadded,
                target=target,
                grad=True,  # (the step runs its own backward)
                length=L,
            )
            for case, impl, ours, target in sides
        ]
    return out


if __name__ == "__main__":
    raise SystemExit(main(comparisons(), __file__, __doc__))
