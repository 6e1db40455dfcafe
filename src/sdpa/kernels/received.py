"""Attention each key receives, sum_i p_ij, from q, k and the LSE in one pass.

p_ij = 2^(s2_ij - lse_i * log2(e)) with s2 the base-2 scores; the key block is the
outer loop (one program per key block and query head), the queries the inner one, so
each column sum stays in registers and nothing L x S is written. Query heads stay
apart: with grouped-query attention the result is per query head, (B, Hq, S).
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
def _received(
    Q, K, Lse, M, Out,
    sqb, sqh, sql, sqd,
    skb, skh, sks, skd,
    smb, smh, sml, sms,
    H, GROUP, L, S, E, scale_log2,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP  # grouped-query attention: the key head of query head h
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < S
    k = tl.load(
        K + b * skb + hk * skh + offs_n[None, :] * sks + offs_d[:, None] * skd,
        mask=col_ok[None, :] & (offs_d[:, None] < E),
        other=0.0,
    )  # (BLOCK_D, BLOCK_N)
    if IEEE:
        k = k.to(tl.float32)
    acc = tl.zeros([BLOCK_N], tl.float32)
    lo = 0
    if CAUSAL:  # top-left: key j is seen by queries i >= j
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for start_m in range(lo, L, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < L
        q = tl.load(
            Q + b * sqb + h * sqh + offs_m[:, None] * sql + offs_d[None, :] * sqd,
            mask=row_ok[:, None] & (offs_d[None, :] < E),
            other=0.0,
        )  # (BLOCK_M, BLOCK_D)
        lse2 = tl.load(Lse + pid_bh * L + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
        # (BLOCK_M, BLOCK_N) base-2 scores, -inf where excluded
        s = block_scores(
            q, k, offs_m, offs_n, row_ok, col_ok, M + b * smb + h * smh, sml, sms,
            scale_log2, MASK_KIND, CAUSAL, IEEE,
        )  # fmt: skip
        p = tl.exp2(s - lse2[:, None])  # (BLOCK_M, BLOCK_N): 0 where excluded
        acc += tl.sum(p, 0)
    tl.store(Out + pid_bh * S + offs_n, acc, mask=col_ok)


def _config(block_d: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); small tiles when interpreted."""
    if interpreting():
        return 32, 32, 4, 1
    if dtype == torch.float32 or block_d > 128:
        return 32, 64, 4, 2
    return 64, 128, (8 if block_d > 64 else 4), 3


def received(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    scale: float,
) -> torch.Tensor:
    """sum_i p_ij for every key: the attention it receives, per query head.

    Shapes: q (B, Hq, L, E), k (B, Hkv, S, E) (Hkv divides Hq; query head h uses key
    head h // (Hq // Hkv)), lse (B, Hq, L) of the same attention (0 for rows that see
    no key), mask as in `forward_stats` (bool keep or float added, broadcasting to
    (B, Hq, L, S)), causal top-left. Returns (B, Hq, S) float32.
    The LSE must be accurate to float32 rounding of moderate numbers: a row whose
    |lse| is huge (a large finite bias such as -1e9) has lost its digits; callers
    recompute those rows exactly instead.
    """
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise SdpaValueError(f"key heads must divide query heads, got q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}")  # fmt: skip
    if tuple(lse.shape) != (B, Hq, L):
        raise SdpaValueError(f"lse must be (B, Hq, L) = {(B, Hq, L)}, got {tuple(lse.shape)}")
    if mask is not None:
        mask = mask.expand(B, Hq, L, S)  # a view: stride 0 where broadcast
    lse = lse.to(torch.float32).contiguous()
    out = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    m_ptr, m_strides, kind = mask_args(mask, q)
    block_d = block(E)
    bm, bn, warps, stages = _config(block_d, q.dtype)
    grid = (triton.cdiv(S, bn), B * Hq)
    _received[grid](
        q, k, lse, m_ptr, out,
        *q.stride(), *k.stride(), *m_strides,
        Hq, Hq // Hkv, L, S, E, scale * LOG2E,
        MASK_KIND=kind, CAUSAL=bool(causal), IEEE=ieee(q.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d,
        **launch_options(q.device, warps, stages),
    )  # fmt: skip
    return out
