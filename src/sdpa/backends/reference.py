"""The listing's math in plain torch, with the documented edge semantics.

Materialises the (B, Hq, L, S) scores. Excluded positions get -inf; rows that see no
key give output 0 (and LSE 0, the fused kernel's convention; with sinks,
logaddexp(0, sink)); 16-bit inputs take their softmax in float32. Softcap and sinks
(`sdpa.masks.ScoreMod`) are applied as written there. Differentiable, and the only
backend with dropout on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sdpa import masks
from sdpa.backends.base import Backend
from sdpa.inputs import Inputs


class Reference(Backend):
    name = "reference"

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        return []

    def forward(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, mask = inputs.query, inputs.key, inputs.value, inputs.mask
        cd = inputs.compute_dtype
        if isinstance(mask, masks.Mask):
            L, S = q.shape[2], k.shape[2]
            mask = masks.as_4d(mask.materialize(L, S, q.device, max_bytes=None))  # (B|1,1,L,S)
        group = inputs.group
        if group > 1:  # grouped-query attention: query head h uses key/value head h // group
            k = k.repeat_interleave(group, dim=1)  # (B, Hq, S, E)
            v = v.repeat_interleave(group, dim=1)  # (B, Hq, S, Ev)
        scores = torch.matmul(q.to(cd), k.to(cd).transpose(-2, -1)) * inputs.scale  # (B,Hq,L,S)
        if inputs.softcap is not None:
            scores = torch.tanh(scores / inputs.softcap) * inputs.softcap
        if inputs.causal:
            keep = masks.top_left(*scores.shape[-2:], scores.device)  # (L, S)
            scores = scores.masked_fill(~keep, -torch.inf)
        if mask is not None:
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, -torch.inf)
            else:
                scores = scores + mask.to(cd)
        with torch.no_grad():
            dead = (scores == -torch.inf).all(dim=-1, keepdim=True)  # (B, Hq, L, 1)
        scores = scores.masked_fill(dead, 0.0)  # keeps softmax and its gradient finite
        sinks = inputs.sinks
        if sinks is None:
            p = torch.softmax(scores, dim=-1)  # (B, Hq, L, S)
        else:  # a virtual key per head: score sinks[b, h], value 0
            column = sinks[..., None].expand(*scores.shape[:-1], 1)  # (B, Hq, L, 1)
            p = torch.softmax(torch.cat([scores.masked_fill(dead, -torch.inf), column], -1), -1)
            p = p[..., :-1]  # (B, Hq, L, S)
        p = p.masked_fill(dead, 0.0)
        with torch.no_grad():
            lse = torch.logsumexp(scores, dim=-1).masked_fill(dead.squeeze(-1), 0.0)  # (B,Hq,L)
            if sinks is not None:  # a row that sees no key keeps lse 0 before the sink
                lse = torch.logaddexp(lse, sinks.detach())
        if inputs.dropout_p > 0:
            p = F.dropout(p, inputs.dropout_p, training=True)
        out = torch.matmul(p, v.to(cd)).to(q.dtype)  # (B, Hq, L, Ev)
        return out, lse
