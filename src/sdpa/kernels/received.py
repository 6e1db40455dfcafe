"""Attention each key receives, sum_i p_ij, from q, k and the LSE in one pass that
reads neither V nor writes anything L x S: Q K^T, one exp2 per score, one sum.

p_ij = 2^(s2_ij - lse_i * log2 e) with s2 the base-2 scores. A program holds a block
of keys as the rows of its score tile (K Q^T) and streams the queries, so each key's
sum is a row sum kept in registers. Query heads stay apart: with grouped-query
attention the result is per query head, (B, Hq, S). Queries past L read lse = +inf,
so their weights are 0 without a mask: only causal-diagonal blocks and masks pay for
masking.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sdpa.kernels import configs
from sdpa.kernels.launch import (
    LOG2E,
    block,
    checked,
    dot_nt,
    head_blocks,
    ieee,
    interpreting,
    launch_options,
    load_rows,
    mask_args,
    shifted_scores,
)


@triton.jit
def _scores(k, Qbh, Lbh, start_m, offs_d, sql, sqd, L, E: tl.constexpr, EVEN_D: tl.constexpr,
            IEEE: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """k . q of one query block, (BLOCK_N keys, BLOCK_M queries), and the queries' LSE
    (+inf past L: weight 0 there without a mask)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = load_rows(Qbh, offs_m, sql, offs_d, sqd, L, E, True, EVEN_D)  # (BLOCK_M, BLOCK_D)
    lse = tl.load(Lbh + offs_m, mask=offs_m < L, other=float("inf"))
    return dot_nt(k, q, IEEE), lse


@triton.jit
def _fold(
    acc, s, lse, start_m, offs_n, Mbh, sml, sms, L, S, scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """One query block's weights added to the keys' sums; MASKED for blocks that cross
    the causal diagonal or carry a mask."""
    if MASKED:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        u = shifted_scores(s, scale, lse[None, :], offs_m[None, :], offs_n[:, None], L, S, Mbh,
                           sml, sms, LOG2E, CAUSAL, MASK_KIND)  # fmt: skip
    else:
        u = s * (scale * LOG2E) - (lse * LOG2E)[None, :]
    return acc + tl.sum(tl.exp2(u), 1)


@triton.jit
def _received(
    Q, K, Lse, M, Out,
    sqb, sqh, sql, sqd,
    skb, skh, sks, skd,
    smb, smh, sml, sms,
    H, GROUP, BH0, L, S, scale,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, IEEE: tl.constexpr, E: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    PIPELINED: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)  # causal: key block 0, the longest, runs first
    pid_bh = tl.program_id(1).to(tl.int64) + BH0  # this launch's first (batch, head)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP  # grouped-query attention: the key head of query head h
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    EVEN_D: tl.constexpr = E == BLOCK_D
    k = load_rows(K + b * skb + hk * skh, offs_n, sks, offs_d, skd, S, E, True, EVEN_D)
    if IEEE:
        k = k.to(tl.float32)
    Qbh = Q + b * sqb + h * sqh
    Lbh = Lse + pid_bh * L
    Mbh = M + b * smb + h * smh
    acc = tl.zeros([BLOCK_N], tl.float32)
    lo = 0
    full = 0  # query blocks [full, L) need no masking
    if CAUSAL:  # top-left: key j is seen by queries i >= j
        lo = (n0 // BLOCK_M) * BLOCK_M
        full = tl.minimum(tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, L)
    if MASK_KIND != 0:
        full = L
    for start_m in range(lo, full, BLOCK_M):
        s, lse = _scores(k, Qbh, Lbh, start_m, offs_d, sql, sqd, L, E, EVEN_D, IEEE, BLOCK_M)
        acc = _fold(acc, s, lse, start_m, offs_n, Mbh, sml, sms, L, S, scale, True, CAUSAL,
                    MASK_KIND, BLOCK_M)  # fmt: skip
    first = tl.maximum(full, lo)
    if PIPELINED:  # the next block's K Q^T runs on the tensor cores during this one's exp2
        if first < L:
            s, lse = _scores(k, Qbh, Lbh, first, offs_d, sql, sqd, L, E, EVEN_D, IEEE, BLOCK_M)
            for start_m in range(first + BLOCK_M, L, BLOCK_M):
                s_next, lse_next = _scores(k, Qbh, Lbh, start_m, offs_d, sql, sqd, L, E, EVEN_D,
                                           IEEE, BLOCK_M)  # fmt: skip
                acc = _fold(acc, s, lse, start_m - BLOCK_M, offs_n, Mbh, sml, sms, L, S, scale,
                            False, CAUSAL, MASK_KIND, BLOCK_M)  # fmt: skip
                s, lse = s_next, lse_next
            last = first + (tl.cdiv(L - first, BLOCK_M) - 1) * BLOCK_M
            acc = _fold(acc, s, lse, last, offs_n, Mbh, sml, sms, L, S, scale, False, CAUSAL,
                        MASK_KIND, BLOCK_M)  # fmt: skip
    else:
        for start_m in range(first, L, BLOCK_M):
            s, lse = _scores(k, Qbh, Lbh, start_m, offs_d, sql, sqd, L, E, EVEN_D, IEEE, BLOCK_M)
            acc = _fold(acc, s, lse, start_m, offs_n, Mbh, sml, sms, L, S, scale, False, CAUSAL,
                        MASK_KIND, BLOCK_M)  # fmt: skip
    tl.store(Out + pid_bh * S + offs_n, acc, mask=offs_n < S)


def received(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    scale: float,
) -> torch.Tensor:
    """sum_i p_ij for every key: the attention it receives, per query head, in one
    pass that never reads V.

    Shapes: q (B, Hq, L, E), k (B, Hkv, S, E) (Hkv divides Hq; query head h uses key
    head h // (Hq // Hkv)), lse (B, Hq, L) of the same attention (0 for rows that see
    no key). mask: None, bool (True = takes part) or float (added to the scores),
    broadcasting to (B, Hq, L, S) with any strides. causal: top-left (key j is seen by
    queries i >= j), ANDed with the mask. scale multiplies q . k (0: uniform weights).
    Returns (B, Hq, S) float32.
    Edges: a row that sees no key adds nothing; a NaN or +inf score (or NaN / +inf in
    a float mask) where a row sees a key makes that row's weights NaN, as the
    listing's softmax row is, so every key of that (batch, head) receives NaN, as the
    listing's sum does.
    The LSE must be accurate to float32 rounding of moderate numbers: a row whose
    |lse| is huge (a large finite bias such as -1e9) has lost its digits; callers
    recompute those rows exactly instead (settings.kernel_lse_limit).
    """
    mask = checked("received", q, k, lse, mask, scale)
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    out = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or L == 0:  # nothing to launch; no query: nothing received
        return out.zero_()
    lse = lse.to(torch.float32).contiguous()
    m_ptr, m_strides, kind = mask_args(mask, q)
    block_d = block(E)
    cfg = configs.pick("received", q.dtype, block_d, interpreting())
    for bh0, count in head_blocks(B * Hq):  # the tile's rows are keys
        _received[(triton.cdiv(S, cfg.block_m), count)](
            q, k, lse, m_ptr, out,
            *q.stride(), *k.stride(), *m_strides,
            Hq, Hq // Hkv, bh0, L, S, float(scale),
            CAUSAL=bool(causal), MASK_KIND=kind, IEEE=ieee(q.dtype), E=E,
            BLOCK_N=cfg.block_m, BLOCK_M=cfg.block_n, BLOCK_D=block_d, PIPELINED=cfg.pipelined,
            **launch_options(q.device, cfg.warps, cfg.stages),
        )  # fmt: skip
    # a row with a NaN or +inf weight is NaN for every key it sees (the listing's
    # softmax row): one non-finite sum marks the whole (batch, head), on the device
    bad = ~torch.isfinite(out).all(dim=-1, keepdim=True)  # (B, Hq, 1)
    return out.masked_fill(bad, float("nan"))
