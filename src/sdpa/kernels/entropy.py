"""Entropy and largest weight of every query row, in one pass over the keys that reads
neither V nor writes an output: Q K^T, one exp2 per score, three row sums.

In base 2, with the row's LSE as a fixed shift (s_j = scale q . k_j + bias_j):
    u_j = (s_j - lse) log2 e    l = sum_j 2^u_j    a = sum_j 2^u_j u_j    x = max_j u_j
    entropy = ln2 (log2 l - a / l)           max_j p_j = 2^x / l
With the attention's own LSE, l = 1 up to rounding and every term of -a is >= 0 (no
cancellation). Dividing by l makes the result independent of the shift (within ~60
nats of the LSE), so an LSE that lost digits under a huge finite bias still serves:
the bias is added before the shift, rounded as the listing's scores + mask, and such a
row comes out as the float32 listing's (uniform where the bias swallows the scores).
No running max, no rescaling: the shift is known before the first key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sdpa.kernels import configs
from sdpa.kernels.launch import (
    LN2,
    LOG2E,
    block,
    checked,
    dot_nt,
    head_blocks,
    ieee,
    interpreting,
    key_range,
    launch_options,
    load_rows,
    mask_args,
    query_block,
    shifted_scores,
)

# excluded scores become -BIG: 2^-BIG = 0 and 0 * -BIG = 0 (0 * -inf would be NaN)
BIG = tl.constexpr(1e30)


@triton.jit
def _scores(q, Kbh, start_n, offs_d, sks, skd, S, E: tl.constexpr, MASKED: tl.constexpr,
            EVEN_D: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """q . k of one key block: (BLOCK_M, BLOCK_N); keys past S read 0 when MASKED."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_rows(Kbh, offs_n, sks, offs_d, skd, S, E, MASKED, EVEN_D)  # (BLOCK_N, BLOCK_D)
    return dot_nt(q, k, IEEE)


@triton.jit
def _fold(
    a_i, l_i, x_i, s, start_n, offs_m, lse, lse2, Mbh, sml, sms, L, S, scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One key block's scores s folded into the row sums (a, l, x); MASKED for blocks
    that cross S, the causal diagonal or a mask."""
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        u = shifted_scores(s, scale, lse[:, None], offs_m[:, None], offs_n[None, :], L, S, Mbh,
                           sml, sms, LOG2E, CAUSAL, MASK_KIND)  # fmt: skip
        u = tl.maximum(u, -BIG, propagate_nan=tl.PropagateNan.ALL)  # -inf -> -BIG, NaN stays
    else:
        u = s * (scale * LOG2E) - lse2[:, None]
    p = tl.exp2(u)
    return a_i + tl.sum(p * u, 1), l_i + tl.sum(p, 1), tl.maximum(x_i, tl.max(u, 1))


@triton.jit
def _entropy_and_max(
    Q, K, Lse, M, Ent, Mx,
    sqb, sqh, sql, sqd,
    skb, skh, sks, skd,
    smb, smh, sml, sms,
    H, GROUP, BH0, L, S, scale,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, IEEE: tl.constexpr, E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PIPELINED: tl.constexpr,
):  # fmt: skip
    pid_bh, m0, offs_m, offs_d, q, Kbh, Mbh = query_block(
        Q, K, M, sqb, sqh, sql, sqd, skb, skh, smb, smh, H, GROUP, BH0, L,
        CAUSAL, IEEE, E, BLOCK_M, BLOCK_D,
    )  # fmt: skip
    EVEN_D: tl.constexpr = E == BLOCK_D
    row_ok = offs_m < L
    lse = tl.load(Lse + pid_bh * L + offs_m, mask=row_ok, other=0.0)
    lse2 = lse * LOG2E
    a_i = tl.zeros([BLOCK_M], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    x_i = tl.full([BLOCK_M], -BIG, tl.float32)
    full, hi = key_range(m0, S, CAUSAL, MASK_KIND, BLOCK_M, BLOCK_N)
    if PIPELINED:  # the next block's Q K^T runs on the tensor cores during this one's exp2
        if full > 0:
            s = _scores(q, Kbh, 0, offs_d, sks, skd, S, E, False, EVEN_D, IEEE, BLOCK_N)
            for start_n in range(BLOCK_N, full, BLOCK_N):
                s_next = _scores(q, Kbh, start_n, offs_d, sks, skd, S, E, False, EVEN_D, IEEE,
                                 BLOCK_N)  # fmt: skip
                a_i, l_i, x_i = _fold(
                    a_i, l_i, x_i, s, start_n - BLOCK_N, offs_m, lse, lse2, Mbh, sml, sms, L, S,
                    scale, False, CAUSAL, MASK_KIND, BLOCK_N,
                )  # fmt: skip
                s = s_next
            a_i, l_i, x_i = _fold(
                a_i, l_i, x_i, s, full - BLOCK_N, offs_m, lse, lse2, Mbh, sml, sms, L, S, scale,
                False, CAUSAL, MASK_KIND, BLOCK_N,
            )  # fmt: skip
    else:
        for start_n in range(0, full, BLOCK_N):
            s = _scores(q, Kbh, start_n, offs_d, sks, skd, S, E, False, EVEN_D, IEEE, BLOCK_N)
            a_i, l_i, x_i = _fold(
                a_i, l_i, x_i, s, start_n, offs_m, lse, lse2, Mbh, sml, sms, L, S, scale,
                False, CAUSAL, MASK_KIND, BLOCK_N,
            )  # fmt: skip
    for start_n in range(full, hi, BLOCK_N):
        s = _scores(q, Kbh, start_n, offs_d, sks, skd, S, E, True, EVEN_D, IEEE, BLOCK_N)
        a_i, l_i, x_i = _fold(
            a_i, l_i, x_i, s, start_n, offs_m, lse, lse2, Mbh, sml, sms, L, S, scale,
            True, CAUSAL, MASK_KIND, BLOCK_N,
        )  # fmt: skip
    bad = (l_i != l_i) | (l_i == float("inf"))  # a NaN or +inf score: the row is NaN
    # a row that saw no key has l = a = 0 and x = -BIG: entropy 0 and max 0 with l := 1
    l_safe = tl.where(bad | (l_i == 0.0), 1.0, l_i)
    ent = tl.maximum((tl.log2(l_safe) - a_i / l_safe) * LN2, 0.0)  # rounding: never < 0
    top = tl.exp2(x_i) / l_safe
    ent = tl.where(bad, float("nan"), ent)
    top = tl.where(bad, float("nan"), top)
    row = pid_bh * L + offs_m  # statistics are contiguous (B, H, L)
    tl.store(Ent + row, ent, mask=row_ok)
    tl.store(Mx + row, top, mask=row_ok)


def entropy_and_max(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy (nats) and largest weight of each query row's weights, in one pass
    over the keys that never reads V.

    Shapes: q (B, Hq, L, E), k (B, Hkv, S, E) (Hkv divides Hq; query head h uses key
    head h // (Hq // Hkv)), lse (B, Hq, L) of the same attention (any per-row shift
    within ~60 nats of it serves: the kernel normalises, so an LSE rounded under a
    huge finite bias still gives the listing's statistics). mask: None, bool (True = takes
    part) or float (added to the scores), broadcasting to (B, Hq, L, S) with any
    strides. causal: top-left (query i sees keys j <= i), ANDed with the mask.
    scale multiplies q . k (0 gives uniform weights).
    Returns (entropy, max weight), each (B, Hq, L) float32.
    Edges: a row that sees no key gives entropy 0 and max 0; a NaN or +inf score (or
    NaN / +inf in a float mask) where the row sees the key makes that row's entropy
    and max NaN, as the listing's softmax row is.
    """
    mask = checked("entropy_and_max", q, k, lse, mask, scale)
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    f32 = dict(dtype=torch.float32, device=q.device)
    ent, top = torch.empty(B, Hq, L, **f32), torch.empty(B, Hq, L, **f32)
    if ent.numel() == 0 or S == 0:  # nothing to launch; no key: the dead-row answer
        return ent.zero_(), top.zero_()
    lse = lse.to(torch.float32).contiguous()
    m_ptr, m_strides, kind = mask_args(mask, q)
    block_d = block(E)
    cfg = configs.pick("entropy", q.dtype, block_d, interpreting())
    for bh0, count in head_blocks(B * Hq):
        _entropy_and_max[(triton.cdiv(L, cfg.block_m), count)](
            q, k, lse, m_ptr, ent, top,
            *q.stride(), *k.stride(), *m_strides,
            Hq, Hq // Hkv, bh0, L, S, float(scale),
            CAUSAL=bool(causal), MASK_KIND=kind, IEEE=ieee(q.dtype), E=E,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, PIPELINED=cfg.pipelined,
            **launch_options(q.device, cfg.warps, cfg.stages),
        )  # fmt: skip
    return ent, top
