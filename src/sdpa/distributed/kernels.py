"""Block kernels of the ring: attention of some query rows against one key/value
shard, forward (output and log-sum-exp) and backward (gradients given the *global*
output and log-sum-exp, so each block's share is exact without any rescaling).

Shapes: q (B, Hq, r, E), k (B, Hkv, c, E), v (B, Hkv, c, Ev) (Hkv divides Hq), bias
None or float (Bm, 1, r, c) added to the scores (-inf excludes), out (B, Hq, r, Ev),
lse (B, Hq, r) float32 for 16-bit inputs. causal: top-left within the block.

On CPU, torch's fused kernel (`_scaled_dot_product_flash_attention_for_cpu` and its
registered backward). Elsewhere (CUDA with NCCL, ...), or where this torch lacks those
private ops, the same math in plain torch ops (chunks of `math_chunk_bytes` of scores,
see sdpa.settings).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sdpa import settings, tile
from sdpa.backends import aten
from sdpa.inputs import compute_dtype


def _pad(t: torch.Tensor, D: int) -> torch.Tensor:
    """Zero features up to head size D: they change no score and no kept column."""
    return t if t.shape[-1] == D else F.pad(t, (0, D - t.shape[-1]))


def forward(q, k, v, bias, causal: bool, scale: float):
    """out (B, Hq, r, Ev) and lse (B, Hq, r) of rows q against one block of keys."""
    if q.device.type != "cpu" or aten.CPU_FLASH is None:
        return _math_forward(q, k, v, bias, causal, scale)
    E, Ev = q.shape[-1], v.shape[-1]
    D = max(E, Ev)  # the fused kernel takes one head size
    out, lse = aten.CPU_FLASH(
        _pad(q, D), _pad(k, D), _pad(v, D), 0.0, causal, attn_mask=bias, scale=scale
    )
    return out[..., :Ev], lse


def backward(dout, q, k, v, out, lse, bias, causal: bool, scale: float):
    """(dq, dk, dv) of this block, from the global out and lse of rows q."""
    if q.device.type != "cpu" or aten.CPU_FLASH_BACKWARD is None:
        return _math_backward(dout, q, k, v, out, lse, bias, causal, scale)
    E, Ev = q.shape[-1], v.shape[-1]
    D = max(E, Ev)
    dq, dk, dv = aten.CPU_FLASH_BACKWARD(
        _pad(dout, D), _pad(q, D), _pad(k, D), _pad(v, D), _pad(out, D), lse,
        0.0, causal, attn_mask=bias, scale=scale,
    )  # fmt: skip
    return dq[..., :E], dk[..., :E], dv[..., :Ev]


def _chunks(q: torch.Tensor, c: int):
    """Row slices of q (B, Hq, r, D) whose float32 scores against c keys fit the
    settings' math_chunk_bytes."""
    B, H, r, _ = q.shape
    step = max(1, settings.get().math_chunk_bytes // max(1, B * H * c * 4))
    return [slice(r0, min(r, r0 + step)) for r0 in range(0, r, step)]


def _scores(q, k, bias, causal, scale, rows: slice):
    """Scores (B, Hq, n, c) of query rows `rows` by the tile rule, float32 (float64 for
    float64 inputs), -inf where excluded; bias (Bm, 1, r, c) and top-left causality."""
    r, c = q.shape[2], k.shape[2]
    window = tile.window(bias, causal, r, c, rows, slice(None), q.device)
    return tile.exclude(tile.scores(q[:, :, rows], k, tile.Scoring(scale)), window)


def _math_forward(q, k, v, bias, causal, scale):
    cd = compute_dtype(q.dtype)
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=cd, device=q.device)  # (B, Hq, r)
    for rows in _chunks(q, k.shape[2]):
        p, lse[:, :, rows] = tile.finish(_scores(q, k, bias, causal, scale, rows))
        out[:, :, rows] = tile.values(p, v).to(q.dtype)
    return out, lse


def _math_backward(dout, q, k, v, out, lse, bias, causal, scale):
    group = q.shape[1] // k.shape[1]
    cd = lse.dtype
    kr = k.repeat_interleave(group, dim=1).to(cd)  # (B, Hq, c, D)
    vr = v.repeat_interleave(group, dim=1).to(cd)
    dq = torch.empty(q.shape, dtype=cd, device=q.device)
    dk = torch.zeros(kr.shape, dtype=cd, device=q.device)
    dv = torch.zeros(vr.shape, dtype=cd, device=q.device)
    for rows in _chunks(q, k.shape[2]):
        s = _scores(q, k, bias, causal, scale, rows)  # this block's share of the rows' keys
        p = tile.rebuild(s, lse[:, :, rows])  # exp(s - global lse)
        do = dout[:, :, rows].to(cd)  # (B, Hq, n, D)
        dv += torch.matmul(p.mT, do)
        dp = torch.matmul(do, vr.mT)  # (B, Hq, n, c)
        delta = (do * out[:, :, rows].to(cd)).sum(dim=-1, keepdim=True)  # (B, Hq, n, 1)
        ds = p * (dp - delta) * scale
        dq[:, :, rows] = torch.matmul(ds, kr)
        dk += torch.matmul(ds.mT, q[:, :, rows].to(cd))

    def fold(t):  # (B, Hq, c, D) -> (B, Hkv, c, D): a key head's share summed over its group
        return t.unflatten(1, (k.shape[1], group)).sum(dim=2).to(q.dtype)

    return dq.to(q.dtype), fold(dk), fold(dv)
