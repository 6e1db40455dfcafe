"""The reference math over chunks of query rows: every score transform, in O(chunk x S).

Serves what torch's fused kernels cannot compute, without the reference backend's
(B, Hq, L, S) scores: a softcap on the scores (`sdpa.masks.softcap`), a float mask
that needs its gradient, sinks with gradients off CPU. Each chunk of rows gets its own
slice of the mask (causality and structured masks materialised for those rows only) and
runs the reference math (without autograd, in place and with grouped-query heads folded
into rows); under top-left causality a chunk reads only the keys its rows can see. A
chunk's scores, weights and mask take at most `chunk_bytes` (sdpa.settings). The
output and LSE are concatenated. With autograd on, each chunk's weights are kept for
the backward, as the reference backend keeps them all.
"""

from __future__ import annotations

import torch

from sdpa import masks, settings
from sdpa.backends.base import Backend
from sdpa.backends.reference import Reference
from sdpa.inputs import Inputs, sink_rows

_REFERENCE = Reference()
_TOP_LEFT = masks.causal("top-left")


def _rows_mask(inputs: Inputs, r0: int, r1: int, k0: int, k1: int) -> torch.Tensor | None:
    """The mask of query rows r0:r1 over keys k0:k1, causality included:
    (B|1, Hq|1, r, k1 - k0), bool or float."""
    L, S = inputs.query.shape[2], inputs.key.shape[2]
    device = inputs.query.device
    mask = inputs.mask
    if isinstance(mask, masks.Mask) or inputs.causal:
        q_pos = torch.arange(r0, r1, device=device)
        k_pos = torch.arange(k0, k1, device=device)
    if isinstance(mask, masks.Mask):
        mask = mask.keep(q_pos, k_pos, L, S)[:, None]  # (Bm, 1, r, k)
    elif mask is not None:
        mask = mask[:, :, r0:r1, k0:k1]  # (B|1, Hq|1, r, k)
    if not inputs.causal:
        return mask
    keep = _TOP_LEFT.keep(q_pos, k_pos, L, S)[:, None]  # (1, 1, r, k)
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, -torch.inf)


def _keys_seen(inputs: Inputs, r1: int) -> int:
    """How many leading keys rows < r1 can see: r1 under top-left causality (query p
    sees keys j <= p), else all S. Decided from the mask's kind, no scan."""
    S = inputs.key.shape[2]
    return min(S, r1) if inputs.causal or inputs.causal_only else S


def _math(q, k, v, mask, k0, inputs: Inputs, sinks) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk without autograd, in place where it can be: q (B, Hq, r, E) in the
    input dtype; k (B, Hkv, s, E), v (B, Hkv, s, Ev) already in the compute dtype; the
    mask applies to keys k0:s (those before k0 are all visible)."""
    B, Hq, r, E = q.shape
    Hkv, s, g = k.shape[1], k.shape[2], inputs.group
    cd, cap = k.dtype, inputs.softcap
    scale = inputs.scale if cap is None else inputs.scale / cap  # the cap's 1/c folded in
    folded = (q.to(cd) * scale).reshape(B, Hkv, g * r, E)  # heads into rows
    scores = torch.matmul(folded, k.transpose(-2, -1)).view(B, Hq, r, s)
    if cap is not None:
        scores.tanh_().mul_(cap)
    if mask is not None:
        masked = scores[..., k0:]  # (B, Hq, r, s - k0), a view
        if mask.dtype == torch.bool:
            masked.masked_fill_(mask.logical_not(), -torch.inf)
        else:
            masked.add_(mask)
    # softmax by hand, for the LSE too (torch.logsumexp is ~4x a softmax on CPU); the
    # row max first, so scores under a huge finite bias stay exact
    top = scores.amax(dim=-1)  # (B, Hq, r)
    dead = torch.isneginf(top)  # rows that see no key
    top.masked_fill_(dead, 0.0)
    p = scores.sub_(top[..., None]).exp_()  # (B, Hq, r, s), unnormalised; 0 where excluded
    total = p.sum(dim=-1)  # (B, Hq, r)
    if sinks is not None:  # the sink's share of the denominator
        total = total + torch.exp(sinks - top)
    lse = top + torch.log(total)
    lse.masked_fill_(dead, 0.0)  # (before the sink, the fused kernel's convention)
    if sinks is not None:
        lse = torch.where(dead, torch.logaddexp(torch.zeros_like(lse), sinks), lse)
    p.div_(total.masked_fill_(total == 0, 1.0)[..., None])
    out = torch.matmul(p.view(B, Hkv, g * r, s), v)  # (B, Hkv, g*r, Ev)
    return out.view(B, Hq, r, v.shape[-1]).to(q.dtype), lse


class Chunked(Backend):
    name = "chunked"

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        if inputs.dropout_p > 0:
            return [f"dropout_p={inputs.dropout_p} > 0 (the reference backend applies dropout)"]
        return []

    def forward(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs.no_work:  # 0 heads, queries or keys: zeros, differentiable
            return _REFERENCE.forward(inputs)
        B, Hq, L, _ = inputs.query.shape
        S = inputs.key.shape[2]
        row_bytes = max(1, B * Hq * S) * 4 * 3  # scores, weights and a mask row, float32
        step = max(1, settings.get().chunk_bytes // row_bytes)
        tensors = (inputs.query, inputs.key, inputs.value, inputs.mask, inputs.sinks)
        grad = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
        )
        cd = inputs.compute_dtype
        k, v = (inputs.key, inputs.value) if grad else (inputs.key.to(cd), inputs.value.to(cd))
        diagonal = not grad and inputs.causal_only  # rows r0:r1 see every key before r0
        outs, lses = [], []
        for r0 in range(0, L, step):
            r1 = min(L, r0 + step)
            s1 = _keys_seen(inputs, r1)
            k0 = min(r0, s1) if diagonal else 0  # keys before k0: all visible
            mask = _rows_mask(inputs, r0, r1, k0, s1)
            sinks = sink_rows(inputs.sinks, slice(r0, r1))
            q = inputs.query[:, :, r0:r1]  # (B, Hq, r, E)
            if grad:  # the reference math, differentiable, on this chunk
                chunk = inputs._replace(
                    query=q, key=k[:, :, :s1], value=v[:, :, :s1], mask=mask, causal=False,
                    sinks=sinks,
                )  # fmt: skip
                out, lse = _REFERENCE.forward(chunk)
            else:
                out, lse = _math(q, k[:, :, :s1], v[:, :, :s1], mask, k0, inputs, sinks)
            outs.append(out)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)  # (B, Hq, L, Ev), (B, Hq, L)
