"""The reference math over chunks of query rows: every score transform, in O(chunk x S).

Serves what torch's fused kernels cannot compute, without the reference backend's
(B, Hq, L, S) scores: a softcap on the scores (`sdpa.masks.softcap`), a float mask
that needs its gradient, sinks with gradients off CPU. Each chunk of rows gets its own
slice of the mask (causality and structured masks materialised for those rows only) and
runs the reference math; the output and LSE are concatenated. With autograd on, each
chunk's weights are kept for the backward, as the reference backend keeps them all.
"""

from __future__ import annotations

import torch

from sdpa import masks
from sdpa.backends.base import Backend
from sdpa.backends.reference import Reference
from sdpa.inputs import Inputs, sink_rows

CHUNK_BYTES = 64 * 2**20  # scores of one chunk of rows, all batch elements and heads
_REFERENCE = Reference()
_TOP_LEFT = masks.causal("top-left")


def _rows_mask(inputs: Inputs, r0: int, r1: int) -> torch.Tensor | None:
    """The mask of query rows r0:r1, causality included: (B|1, Hq|1, r, S), bool or
    float."""
    L, S = inputs.query.shape[2], inputs.key.shape[2]
    device = inputs.query.device
    mask = inputs.mask
    if isinstance(mask, masks.Mask) or inputs.causal:
        q_pos = torch.arange(r0, r1, device=device)
        k_pos = torch.arange(S, device=device)
    if isinstance(mask, masks.Mask):
        mask = mask.keep(q_pos, k_pos, L, S)[:, None]  # (Bm, 1, r, S)
    elif mask is not None:
        mask = mask[:, :, r0:r1]  # (B|1, Hq|1, r, S)
    if not inputs.causal:
        return mask
    keep = _TOP_LEFT.keep(q_pos, k_pos, L, S)[:, None]  # (1, 1, r, S)
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, -torch.inf)


class Chunked(Backend):
    name = "chunked"

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        if inputs.dropout_p > 0:
            return [f"dropout_p={inputs.dropout_p} > 0 (the reference backend applies dropout)"]
        return []

    def forward(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        B, Hq, L, _ = inputs.query.shape
        S = inputs.key.shape[2]
        row_bytes = max(1, B * Hq * S) * 4 * 3  # scores, weights and a mask row, float32
        step = max(1, CHUNK_BYTES // row_bytes)
        outs, lses = [], []
        for r0 in range(0, max(L, 1), step):
            r1 = min(L, r0 + step)
            chunk = inputs._replace(
                query=inputs.query[:, :, r0:r1],  # (B, Hq, r, E)
                mask=_rows_mask(inputs, r0, r1) if L else None,
                causal=False,
                sinks=sink_rows(inputs.sinks, slice(r0, r1)),
            )
            out, lse = _REFERENCE.forward(chunk)
            outs.append(out)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)  # (B, Hq, L, Ev), (B, Hq, L)
