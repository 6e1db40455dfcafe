"""The one oracle: the seed's listing in float64, with the documented edge semantics.

Written independently of sdpa's backends: GQA by repeating key/value heads, masks by
-inf, fully masked rows by turning softmax's NaN into 0.
"""

from __future__ import annotations

import math

import torch


def oracle(
    q, k, v, mask=None, *, causal=False, scale=None, softcap=None, sinks=None,
    dtype=torch.float64,
):  # fmt: skip
    """(out, p) of the listing in `dtype`: q (..., L, E), k (..., S, E), v (..., S, Ev).

    mask: bool/int keep-mask or float bias, broadcasting to (..., L, S); causal is
    top-left (query i sees keys j <= i). Rows with no key give out 0 and p 0.
    softcap: scores -> softcap * tanh(scores / softcap) before the mask. sinks: logits
    broadcasting to (..., L), one more softmax column whose value is 0.
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if q.ndim >= 4 and k.shape[-3] not in (1, q.shape[-3]):
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        L, S = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -math.inf)
    if mask is not None:
        if mask.is_floating_point():
            scores = scores + mask.to(dtype)
        else:
            scores = scores.masked_fill(mask == 0, -math.inf)
    if sinks is not None:
        column = sinks.to(dtype)[..., None].expand(*scores.shape[:-1], 1)
        p = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(scores, dim=-1).nan_to_num(nan=0.0)
    return torch.matmul(p, v), p
