"""Block kernels of the ring: attention of some query rows against one key/value
shard, forward (output and log-sum-exp) and backward (gradients given the *global*
output and log-sum-exp, so each block's share is exact without any rescaling).

Shapes: q (B, Hq, r, D), k and v (B, Hkv, c, D) (one head size D; Hkv divides Hq),
bias None or float (Bm, 1, r, c) added to the scores (-inf excludes), out (B, Hq, r, D),
lse (B, Hq, r) float32 for 16-bit inputs. causal: top-left within the block.

On CPU, torch's fused kernel (`_scaled_dot_product_flash_attention_for_cpu` and its
registered backward). Elsewhere (CUDA with NCCL, ...), the same math in plain torch ops.
"""

from __future__ import annotations

import torch

from sdpa.inputs import HALF_DTYPES

_cpu_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def forward(q, k, v, bias, causal: bool, scale: float):
    if q.device.type == "cpu":
        return _cpu_forward(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    return _math_forward(q, k, v, bias, causal, scale)


def backward(dout, q, k, v, out, lse, bias, causal: bool, scale: float):
    """(dq, dk, dv) of this block, from the global out and lse of rows q."""
    if q.device.type == "cpu":
        return _cpu_backward(dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    return _math_backward(dout, q, k, v, out, lse, bias, causal, scale)


def _scores(q, k, bias, causal, scale):
    """float32 (or float64) scores (B, Hq, r, c), key heads repeated for GQA."""
    cd = torch.float32 if q.dtype in HALF_DTYPES else q.dtype
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, Hq, c, D)
    s = torch.matmul(q.to(cd), k.to(cd).mT) * scale  # (B, Hq, r, c)
    if bias is not None:
        s = s + bias
    if causal:
        r, c = s.shape[-2:]
        s = s.masked_fill(torch.ones(r, c, dtype=torch.bool, device=s.device).triu(1), -torch.inf)
    return s


def _math_forward(q, k, v, bias, causal, scale):
    s = _scores(q, k, bias, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hq, r)
    dead = torch.isneginf(lse)
    lse = lse.masked_fill(dead, 0.0)
    p = torch.exp(s - lse[..., None])  # 0 where excluded, 0 on dead rows
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)  # (B, Hq, c, D)
    return torch.matmul(p, v.to(p.dtype)).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, bias, causal, scale):
    group = q.shape[1] // k.shape[1]
    cd = lse.dtype
    p = torch.exp(_scores(q, k, bias, causal, scale) - lse[..., None])  # (B, Hq, r, c)
    dout, vr = dout.to(cd), v.repeat_interleave(group, dim=1).to(cd)
    dv = torch.matmul(p.mT, dout)  # (B, Hq, c, D)
    dp = torch.matmul(dout, vr.mT)  # (B, Hq, r, c)
    delta = (dout * out.to(cd)).sum(dim=-1, keepdim=True)  # (B, Hq, r, 1)
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, k.repeat_interleave(group, dim=1).to(cd))
    dk = torch.matmul(ds.mT, q.to(cd))  # (B, Hq, c, D)

    def fold(t):  # (B, Hq, c, D) -> (B, Hkv, c, D): a key head's share summed over its group
        return t.unflatten(1, (k.shape[1], group)).sum(dim=2).to(q.dtype)

    return dq.to(q.dtype), fold(dk), fold(dv)
