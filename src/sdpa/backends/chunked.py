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

from sdpa import settings, tile
from sdpa.backends.base import Backend
from sdpa.backends.reference import Reference
from sdpa.inputs import Inputs, sink_rows

_REFERENCE = Reference()


def _keys_seen(inputs: Inputs, r1: int) -> int:
    """How many leading keys rows < r1 can see: r1 under top-left causality (query p
    sees keys j <= p), else all S. Decided from the mask's kind, no scan."""
    S = inputs.key.shape[2]
    return min(S, r1) if inputs.causal or inputs.causal_only else S


def _step(inputs: Inputs) -> int:
    """Query rows per chunk: scores, weights and a mask row in float32 within chunk_bytes."""
    B, Hq, _, _ = inputs.query.shape
    row_bytes = max(1, B * Hq * inputs.key.shape[2]) * 4 * 3
    return max(1, settings.get().chunk_bytes // row_bytes)


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
        grad = tile._grad(q_all, k, v, inputs.sinks) or (
            isinstance(inputs.mask, torch.Tensor) and tile._grad(inputs.mask)
        )
        cd = inputs.compute_dtype
        if not grad:
            k, v = k.to(cd), v.to(cd)
        mask, causal = (None, True) if inputs.causal_only else (inputs.mask, inputs.causal)
        diagonal = not grad and causal and mask is None  # rows r0:r1 see every key before r0
        scoring = tile.Scoring.of(inputs)
        outs, lses = [], []
        for r0 in range(0, L, step):
            r1 = min(L, r0 + step)
            s1 = _keys_seen(inputs, r1)
            k0 = min(r0, s1) if diagonal else 0  # keys before k0: all visible
            window = tile.window(mask, causal, L, S, slice(r0, r1), slice(k0, s1), q_all.device)
            s = tile.scores(q_all[:, :, r0:r1], k[:, :, :s1], scoring)  # (B, Hq, r, s1)
            if k0:
                tile.exclude(s[..., k0:], window)  # in place, on the diagonal keys' view
            else:
                s = tile.exclude(s, window)
            p, lse = tile.finish(s, sink_rows(inputs.sinks, slice(r0, r1)))
            outs.append(tile.values(p, v[:, :, :s1]).to(q_all.dtype))  # (B, Hq, r, Ev)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)  # (B, Hq, L, Ev), (B, Hq, L)
