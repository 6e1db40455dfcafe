"""The largest raw score of every query row (after scale and any float mask, before
softcap and softmax) in one pass of Q K^T with no exponential, and its maximum over
the rows of each head: the statistic QK-clip (MuonClip) rescales W_q and W_k by.

A program keeps an elementwise running maximum of its (BLOCK_M, BLOCK_N) score tiles
and reduces it over the keys once at the end: one max per score, no shuffles per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sdpa.kernels import configs
from sdpa.kernels.launch import (
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


@triton.jit
def _keys(
    top, q, Kbh, Mbh, start_n, offs_m, offs_d, sks, skd, sml, sms, L, S, scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, IEEE: tl.constexpr,
    E: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One key block folded into the running maximum tile; MASKED for blocks that
    cross S, the causal diagonal or a mask."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_rows(Kbh, offs_n, sks, offs_d, skd, S, E, MASKED, EVEN_D)  # (BLOCK_N, BLOCK_D)
    s = dot_nt(q, k, IEEE)  # (BLOCK_M, BLOCK_N)
    if MASKED:
        u = shifted_scores(s, scale, 0.0, offs_m[:, None], offs_n[None, :], L, S, Mbh,
                           sml, sms, 1.0, CAUSAL, MASK_KIND)  # fmt: skip
    else:
        u = s * scale
    return tl.maximum(top, u, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_logits(
    Q, K, M, Out,
    sqb, sqh, sql, sqd,
    skb, skh, sks, skd,
    smb, smh, sml, sms,
    H, GROUP, BH0, L, S, scale,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, IEEE: tl.constexpr, E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_bh, m0, offs_m, offs_d, q, Kbh, Mbh = query_block(
        Q, K, M, sqb, sqh, sql, sqd, skb, skh, smb, smh, H, GROUP, BH0, L,
        CAUSAL, IEEE, E, BLOCK_M, BLOCK_D,
    )  # fmt: skip
    EVEN_D: tl.constexpr = E == BLOCK_D
    top = tl.full([BLOCK_M, BLOCK_N], -float("inf"), tl.float32)
    full, hi = key_range(m0, S, CAUSAL, MASK_KIND, BLOCK_M, BLOCK_N)
    for start_n in range(0, full, BLOCK_N):
        top = _keys(
            top, q, Kbh, Mbh, start_n, offs_m, offs_d, sks, skd, sml, sms, L, S, scale,
            False, CAUSAL, MASK_KIND, IEEE, E, EVEN_D, BLOCK_N,
        )  # fmt: skip
    for start_n in range(full, hi, BLOCK_N):
        top = _keys(
            top, q, Kbh, Mbh, start_n, offs_m, offs_d, sks, skd, sml, sms, L, S, scale,
            True, CAUSAL, MASK_KIND, IEEE, E, EVEN_D, BLOCK_N,
        )  # fmt: skip
    # tl.max drops NaN (maxnum): find the rows holding one with a sum
    nan = tl.sum((top != top).to(tl.int32), 1) > 0
    row_max = tl.where(nan, float("nan"), tl.max(top, 1))
    tl.store(Out + pid_bh * L + offs_m, row_max, mask=offs_m < L)


def max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest score of each query row, and of each head: max_j (scale q_i . k_j +
    bias_ij) over the keys the row sees, in one pass that never reads V.

    Shapes: q (B, Hq, L, E), k (B, Hkv, S, E) (Hkv divides Hq; query head h uses key
    head h // (Hq // Hkv)). mask: None, bool (True = takes part) or float (added to
    the scores), broadcasting to (B, Hq, L, S) with any strides. causal: top-left
    (query i sees keys j <= i), ANDed with the mask. The scores are taken after scale
    and the float mask, before any softcap and the softmax.
    Returns (row max (B, Hq, L), head max (B, Hq): the row max over L), float32;
    `.amax(0)` of the head max is QK-clip's per-head maximum over the batch.
    Edges: a row that sees no key gives -inf (the maximum of no score; it leaves the
    head's maximum alone); a NaN score (or NaN in a float mask) where the row sees the
    key gives NaN for the row and its head; a +inf score gives +inf, the true maximum.
    """
    mask = checked("max_logits", q, k, None, mask, scale)
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rows = torch.empty(B, Hq, L, dtype=torch.float32, device=q.device)
    if rows.numel() == 0 or S == 0:  # nothing to launch; no key: the dead-row answer
        rows.fill_(-float("inf"))
    else:
        m_ptr, m_strides, kind = mask_args(mask, q)
        block_d = block(E)
        cfg = configs.pick("max_logits", q.dtype, block_d, interpreting())
        for bh0, count in head_blocks(B * Hq):
            _max_logits[(triton.cdiv(L, cfg.block_m), count)](
                q, k, m_ptr, rows,
                *q.stride(), *k.stride(), *m_strides,
                Hq, Hq // Hkv, bh0, L, S, float(scale),
                CAUSAL=bool(causal), MASK_KIND=kind, IEEE=ieee(q.dtype), E=E,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
                **launch_options(q.device, cfg.warps, cfg.stages),
            )  # fmt: skip
    heads = rows.amax(dim=-1) if L else rows.new_full((B, Hq), -float("inf"))  # NaN stays
    return rows, heads
