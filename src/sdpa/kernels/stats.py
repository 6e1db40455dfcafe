"""Flash-style forward that also writes each query's entropy and largest weight.

Per query row i, over its visible keys j, in base 2 (s2 = s * log2(e)):
    m  = max_j s2_ij                   l = sum_j 2^(s2_ij - m)
    t  = sum_j 2^(s2_ij - m) (s2_ij - m)
    lse = ln2 (m + log2 l)      entropy = ln2 (log2 l - t / l)      max_j p_ij = 1 / l
m, l, t and the output are accumulated online over key blocks; when m grows by d < 0
(d = m_old - m_new), everything is rescaled by 2^d and t also shifts: t <- 2^d (t + l d).
Working relative to m keeps the entropy free of the cancellation lse - sum p s has when
scores are large. Rows that see no key give output 0, lse 0, entropy 0 and max 0.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sdpa.errors import SdpaValueError
from sdpa.kernels.launch import (
    block,
    block_scores,
    ieee,
    interpreting,
    launch_options,
    mask_args,
)

LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _forward_stats(
    Q, K, V, M, Out, Lse, Ent, Mx,
    sqb, sqh, sql, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    smb, smh, sml, sms,
    sob, soh, sol, sod,
    H, GROUP, L, S, E, EV, scale_log2,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, WRITE_OUT: tl.constexpr,
    STATS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP  # grouped-query attention: the key/value head of query head h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < L
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sql + offs_d[None, :] * sqd,
        mask=row_ok[:, None] & (offs_d[None, :] < E),
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    t_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    hi = S
    if CAUSAL:  # top-left: query i sees keys j <= i
        hi = tl.minimum(S, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < S
        k = tl.load(
            K + b * skb + hk * skh + offs_n[None, :] * sks + offs_d[:, None] * skd,
            mask=col_ok[None, :] & (offs_d[:, None] < E),
            other=0.0,
        )  # (BLOCK_D, BLOCK_N)
        # (BLOCK_M, BLOCK_N) base-2 scores, -inf where excluded
        s = block_scores(
            q, k, offs_m, offs_n, row_ok, col_ok, M + b * smb + h * smh, sml, sms,
            scale_log2, MASK_KIND, CAUSAL, IEEE,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows with no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        if STATS:
            shift = tl.where(l_i > 0, m_i - m_safe, 0.0)
            sm = tl.where(s == -float("inf"), 0.0, s - m_safe[:, None])
            t_i = alpha * (t_i + l_i * shift) + tl.sum(p * sm, 1)
        l_i = l_i * alpha + tl.sum(p, 1)
        if WRITE_OUT:
            v = tl.load(
                V + b * svb + hk * svh + offs_n[:, None] * svs + offs_dv[None, :] * svd,
                mask=col_ok[:, None] & (offs_dv[None, :] < EV),
                other=0.0,
            )  # (BLOCK_N, BLOCK_DV)
            if IEEE:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
        m_i = m_new
    dead = l_i == 0.0
    l_safe = tl.where(dead, 1.0, l_i)
    m_fin = tl.where(dead, 0.0, m_i)
    log2_l = tl.log2(l_safe)
    row = pid_bh * L + offs_m  # statistics are contiguous (B, H, L)
    tl.store(Lse + row, tl.where(dead, 0.0, (m_fin + log2_l) * 0.6931471805599453), mask=row_ok)
    if STATS:
        ent = tl.where(dead, 0.0, (log2_l - t_i / l_safe) * 0.6931471805599453)
        tl.store(Ent + row, ent, mask=row_ok)
        tl.store(Mx + row, tl.where(dead, 0.0, 1.0 / l_safe), mask=row_ok)
    if WRITE_OUT:
        out = acc / l_safe[:, None]  # dead rows: acc is 0
        o_ptrs = Out + b * sob + h * soh + offs_m[:, None] * sol + offs_dv[None, :] * sod
        tl.store(
            o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < EV)
        )


def _config(q: torch.Tensor, block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): Hopper-friendly tiles on CUDA (not
    autotuned: tuning every shape would dominate short runs), small ones interpreted."""
    if interpreting():
        return 32, 32, 4, 1
    if q.dtype == torch.float32 or block_d > 128:  # fp32 tiles and wide heads: registers
        return 64, 32, 4, 2
    return 128, 64, (8 if block_d > 64 else 4), 3


def forward_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    scale: float,
    stats: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Attention forward with per-query statistics, in one pass over the keys.

    Shapes: q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) or None (statistics
    only: no output, half the work); Hkv divides Hq, query head h uses key/value head
    h // (Hq // Hkv). mask: None, bool (True = takes part) or float (added to the
    scores), broadcasting to (B, Hq, L, S) with any strides (0 where broadcast).
    causal: top-left (query i sees keys j <= i), ANDed with the mask.
    Returns (out (B, Hq, L, Ev) in q's dtype or None, lse, entropy in nats, largest
    weight), the last three (B, Hq, L) float32, the last two None unless stats.
    """
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise SdpaValueError(f"key heads must divide query heads, got q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}")  # fmt: skip
    if mask is not None:
        mask = mask.expand(B, Hq, L, S)  # a view: stride 0 where broadcast
    Ev = E if v is None else v.shape[-1]
    f32 = dict(dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, L, **f32)
    ent = torch.empty(B, Hq, L, **f32) if stats else lse
    mx = torch.empty(B, Hq, L, **f32) if stats else lse
    out = None if v is None else torch.empty(B, Hq, L, Ev, dtype=q.dtype, device=q.device)
    m_ptr, m_strides, kind = mask_args(mask, q)
    block_d, block_dv = block(E), block(Ev)
    bm, bn, warps, stages = _config(q, max(block_d, block_dv))
    grid = (triton.cdiv(L, bm), B * Hq)
    o, vv = (q, q) if v is None else (out, v)  # unused pointers when there is no value
    _forward_stats[grid](
        q, k, vv, m_ptr, o, lse, ent, mx,
        *q.stride(), *k.stride(), *vv.stride(), *m_strides, *o.stride(),
        Hq, Hq // Hkv, L, S, E, Ev, scale * LOG2E,
        MASK_KIND=kind, CAUSAL=bool(causal), WRITE_OUT=v is not None, STATS=bool(stats),
        IEEE=ieee(q.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, BLOCK_DV=block_dv,
        **launch_options(q.device, warps, stages),
    )  # fmt: skip
    return out, lse, (ent if stats else None), (mx if stats else None)
