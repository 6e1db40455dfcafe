"""The reference math over chunks of query rows: every score transform, in O(chunk x S).

Serves what torch's fused kernels cannot compute, without the reference backend's
(B, Hq, L, S) scores: a softcap on the scores (`sdpa.masks.softcap`), a float mask
that needs its gradient, sinks with gradients off CPU. A driver of the tile rule
(sdpa.tile): each chunk of rows gets its window of the mask (causality and structured
masks for those rows only), its scores and its finish step, in place and without
autograd where nothing needs a gradient; under top-left causality a chunk reads only
the keys its rows can see, and masks only its diagonal keys. A chunk's scores, weights
and mask take at most `chunk_bytes` (sdpa.settings). With autograd on, each chunk's
weights are kept for the backward, as the reference backend keeps them all.
"""

from __future__ import annotations

import torch

from sdpa import tile
from sdpa.backends.base import Backend
from sdpa.backends.reference import Reference
from sdpa.inputs import Inputs, sink_rows

_REFERENCE = Reference()


def _keys_seen(inputs: Inputs, r1: int) -> int:
    """How many leading keys rows < r1 can see: r1 where top-left causality is part of
    the mask (query p sees keys j <= p), else all S. Decided from the mask's kind, no
    scan."""
    L, S = inputs.query.shape[2], inputs.key.shape[2]
    structured = inputs.structured
    return min(S, r1) if structured is not None and structured.within_top_left(L, S) else S


def _step(inputs: Inputs) -> int:
    """Query rows per chunk: scores, weights and a mask row within chunk_bytes."""
    B, Hq, _, _ = inputs.query.shape
    return tile.chunk_rows(B * Hq, inputs.key.shape[2], inputs.compute_dtype, copies=3)


class Chunked(Backend):
    name = "chunked"

    def path(self, inputs: Inputs) -> str:
        n = -(-inputs.query.shape[2] // _step(inputs))
        return f"the reference math in {n} chunk{'s' if n != 1 else ''} of query rows"

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        if inputs.dropout_p > 0:
            return [f"dropout_p={inputs.dropout_p} > 0 (the reference backend applies dropout)"]
        return []

    def forward(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs.no_work:  # 0 heads, queries or keys: zeros, differentiable
            return _REFERENCE.forward(inputs)
        q_all, k, v = inputs.query, inputs.key, inputs.value
        L, S = q_all.shape[2], k.shape[2]
        step = _step(inputs)
        tensor = inputs.tensor_mask
        grad = tile._grad(q_all, k, v, inputs.sinks) or (tensor is not None and tile._grad(tensor))
        cd = inputs.compute_dtype
        if not grad:
            k, v = k.to(cd), v.to(cd)
        mask = inputs.mask
        diagonal = not grad and inputs.causal_only  # rows r0:r1 see every key before r0
        scoring = tile.Scoring.of(inputs)
        outs, lses = [], []
        for rows in tile.row_chunks(L, step):
            s1 = _keys_seen(inputs, rows.stop)
            k0 = min(rows.start, s1) if diagonal else 0  # keys before k0: all visible
            window = tile.window(mask, L, S, rows, slice(k0, s1), q_all.device)
            out, lse, _ = tile.attend(
                q_all[:, :, rows], k[:, :, :s1], v[:, :, :s1], window, scoring,
                sink_rows(inputs.sinks, rows), from_key=k0,
            )  # fmt: skip
            outs.append(out)  # (B, Hq, r, Ev)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)  # (B, Hq, L, Ev), (B, Hq, L)
