"""Block kernels of the ring: attention of some query rows against one key/value
shard, forward (output and log-sum-exp) and backward (gradients given the *global*
output and log-sum-exp, so each block's share is exact without any rescaling).

Shapes: q (B, Hq, r, E), k (B, Hkv, c, E), v (B, Hkv, c, Ev) (Hkv divides Hq), bias
None or float (Bm, 1, r, c) added to the scores (-inf excludes), out (B, Hq, r, Ev),
lse (B, Hq, r) float32 for 16-bit inputs. causal: top-left within the block.

On CPU, torch's fused kernel (`_scaled_dot_product_flash_attention_for_cpu` and its
registered backward). Elsewhere (CUDA with NCCL, ...), or where this torch lacks those
private ops, the same math by the tile rule (tile.attend, tile.softmax_grad) in row
chunks of the settings' chunk_bytes (tile.chunk_rows).
"""

from __future__ import annotations

import torch

from sdpa import masks, tile
from sdpa.backends import aten
from sdpa.inputs import compute_dtype


def forward(q, k, v, bias, causal: bool, scale: float):
    """out (B, Hq, r, Ev) and lse (B, Hq, r) of rows q against one block of keys."""
    if q.device.type != "cpu" or aten.CPU_FLASH is None:
        return _math_forward(q, k, v, bias, causal, scale)
    E, Ev = q.shape[-1], v.shape[-1]
    D = max(E, Ev)  # the fused kernel takes one head size
    q, k, v = (aten.pad_to(t, D) for t in (q, k, v))
    out, lse = aten.CPU_FLASH(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    return out[..., :Ev], lse


def backward(dout, q, k, v, out, lse, bias, causal: bool, scale: float, dbias=None):
    """(dq, dk, dv) of this block, from the global out and lse of rows q. dbias: a
    (B, Hq, r, c) tensor to receive the gradient of the scores as the bias meets them
    (a float mask's gradient; the math kernel then runs, torch's fused one gives none)."""
    if dbias is not None or q.device.type != "cpu" or aten.CPU_FLASH_BACKWARD is None:
        return _math_backward(dout, q, k, v, out, lse, bias, causal, scale, dbias)
    E, Ev = q.shape[-1], v.shape[-1]
    D = max(E, Ev)
    dout, q, k, v, out = (aten.pad_to(t, D) for t in (dout, q, k, v, out))
    dq, dk, dv = aten.CPU_FLASH_BACKWARD(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )
    return dq[..., :E], dk[..., :E], dv[..., :Ev]


def _chunks(q: torch.Tensor, c: int) -> list[slice]:
    """Row slices of q (B, Hq, r, D) whose scores against c keys fit the settings'
    chunk_bytes (tile.chunk_rows)."""
    B, H, r, _ = q.shape
    return tile.row_chunks(r, tile.chunk_rows(B * H, c, compute_dtype(q.dtype)))


def _window(q, k, bias, causal, rows: slice):
    """The mask of query rows `rows` over this block's keys: bias (Bm, 1, r, c) and
    top-left causality."""
    r, c = q.shape[2], k.shape[2]
    mask = masks.and_top_left(bias) if causal else bias
    return tile.window(mask, r, c, rows, slice(None), q.device)


def _math_forward(q, k, v, bias, causal, scale):
    cd = compute_dtype(q.dtype)
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=cd, device=q.device)  # (B, Hq, r)
    scoring = tile.Scoring(scale)
    for rows in _chunks(q, k.shape[2]):
        window = _window(q, k, bias, causal, rows)
        out[:, :, rows], lse[:, :, rows], _ = tile.attend(q[:, :, rows], k, v, window, scoring)
    return out, lse


def _math_backward(dout, q, k, v, out, lse, bias, causal, scale, dbias=None):
    group = q.shape[1] // k.shape[1]
    cd = lse.dtype
    kr = k.repeat_interleave(group, dim=1).to(cd)  # (B, Hq, c, D)
    vr = v.repeat_interleave(group, dim=1).to(cd)
    dq = torch.empty(q.shape, dtype=cd, device=q.device)
    dk = torch.zeros(kr.shape, dtype=cd, device=q.device)
    dv = torch.zeros(vr.shape, dtype=cd, device=q.device)
    scoring = tile.Scoring(scale)
    for rows in _chunks(q, k.shape[2]):
        s = tile.scores(q[:, :, rows], k, scoring)  # this block's share of the rows' keys
        s = tile.exclude(s, _window(q, k, bias, causal, rows))
        p = tile.rebuild(s, lse[:, :, rows])  # exp(s - global lse)
        do = dout[:, :, rows].to(cd)  # (B, Hq, n, D)
        dv += torch.matmul(p.mT, do)
        dp = torch.matmul(do, vr.mT)  # (B, Hq, n, c)
        delta = (do * out[:, :, rows].to(cd)).sum(dim=-1, keepdim=True)  # D = dO . O
        ds = tile.softmax_grad(p, p * dp, delta)[0]  # dS = P (dP - D)
        if dbias is not None:  # the bias is added after the scale: its gradient is dS
            dbias[:, :, rows] = ds
        ds = tile.raw_grad(ds, s, scoring)  # (scale only: no softcap reads s, now p)
        dq[:, :, rows] = torch.matmul(ds, kr)
        dk += torch.matmul(ds.mT, q[:, :, rows].to(cd))

    def fold(t):  # (B, Hq, c, D) -> (B, Hkv, c, D): a key head's share summed over its group
        return t.unflatten(1, (k.shape[1], group)).sum(dim=2).to(q.dtype)

    return dq.to(q.dtype), fold(dk), fold(dv)
