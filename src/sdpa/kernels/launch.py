"""What the kernels share: tile sizes, argument checks, mask arguments, the score tile
and how they run on CPU.

Triton compiles the kernels for CUDA tensors. With TRITON_INTERPRET=1 in the
environment *before triton is first imported*, Triton's interpreter runs them instead,
on CPU tensors (slow, same semantics): how the test suite checks them without a GPU.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl
from triton import knobs

from sdpa import kernels
from sdpa.errors import SdpaTypeError, SdpaValueError

# constants the kernels read (Triton takes globals only as constexpr; `.value` in Python)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1 at import)."""
    return bool(knobs.runtime.interpret)


def ieee(dtype: torch.dtype) -> bool:
    """Whether the kernels' dots run in float32 IEEE: for float32 inputs (no TF32), and
    for bfloat16 under the interpreter (its dot multiplies bfloat16 bit patterns as
    integers; float32 products of bfloat16 values are exact, as on the GPU)."""
    return dtype == torch.float32 or (interpreting() and dtype == torch.bfloat16)


def block(n: int, at_least: int = 16) -> int:
    """The power-of-two block that covers n (tl.arange needs one; tl.dot needs >= 16)."""
    return max(at_least, triton.next_power_of_2(n))


def launch_options(device: torch.device, warps: int, stages: int) -> dict[str, int]:
    """num_warps / num_stages for compiled launches; the interpreter takes neither."""
    return {} if interpreting() else {"num_warps": warps, "num_stages": stages}


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (the kernels' batch x heads)


def head_blocks(BH: int) -> list[tuple[int, int]]:
    """(first, count) slices of the B x H programs' axis, each within MAX_GRID_Y: one
    launch per slice (the kernels add `first` to their program id)."""
    return [(b0, min(MAX_GRID_Y, BH - b0)) for b0 in range(0, BH, MAX_GRID_Y)]


def mask_args(mask: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, tuple, int]:
    """(pointer tensor, its 4 strides, kind) for a mask (B, H, L, S): kind 0 none,
    1 bool keep-mask (read as bytes, nonzero = takes part), 2 float added to the scores.
    Broadcast dims keep stride 0: nothing is materialised."""
    if mask is None:
        return like, (0, 0, 0, 0), 0
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), mask.stride(), 1
    return mask, mask.stride(), 2


def checked(
    what: str,
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor | None:
    """Refuse what `what` (a kernel's public name) cannot honour, naming the argument;
    returns the mask as a (B, Hq, L, S) view (stride 0 where broadcast) or None."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise SdpaValueError(f"{what}: {name} must be a 4-D tensor (B, H, len, E), got {got}")
    B, Hq, L, E = q.shape
    if k.shape[0] != B or k.shape[3] != E or k.shape[1] == 0 or Hq % k.shape[1]:
        raise SdpaValueError(
            f"{what}: k must be (B, Hkv, S, E) with q's B and E and key heads dividing query "
            f"heads, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if k.dtype != q.dtype or k.device != q.device:
        raise SdpaTypeError(
            f"{what}: q and k must share dtype and device, got q {q.dtype} on {q.device}, "
            f"k {k.dtype} on {k.device}"
        )
    why = kernels.unsupported(q, k)
    if why is not None and "empty" not in why:
        raise SdpaValueError(f"{what} cannot run these inputs: {why}")
    if q.device.type == "cpu" and not interpreting():
        raise SdpaValueError(
            f"{what}: CPU tensors run only under Triton's interpreter (TRITON_INTERPRET=1 "
            f"set before triton is first imported); pass CUDA tensors to run it compiled"
        )
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, lse, mask)
    ):
        raise SdpaValueError(
            f"{what} has no backward, and an input requires grad: its result would be "
            f"silently detached; call it under torch.no_grad(), or read the statistic from "
            f"sdpa.attention(...).weights, whose reads carry the gradient"
        )
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise SdpaTypeError(
            f"{what}: scale must be a Python float (the kernels take it as a launch "
            f"argument, never from device memory), got {type(scale).__name__}"
        )
    if lse is not None and (
        not isinstance(lse, torch.Tensor)
        or tuple(lse.shape) != (B, Hq, L)
        or not lse.is_floating_point()
        or lse.device != q.device
    ):
        got = (f"{tuple(lse.shape)} {lse.dtype} on {lse.device}" if isinstance(lse, torch.Tensor)
               else type(lse).__name__)  # fmt: skip
        raise SdpaValueError(
            f"{what}: lse must be a floating (B, Hq, L) = {(B, Hq, L)} tensor on {q.device}, "
            f"got {got}"
        )
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.device != q.device:
        got = mask.device if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise SdpaValueError(f"{what}: mask must be a tensor on {q.device}, got {got}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise SdpaTypeError(
            f"{what}: mask must be bool (True = takes part) or floating (added to the "
            f"scores), got {mask.dtype}; pass mask != 0 for a keep-mask"
        )
    S = k.shape[2]
    try:
        return mask.expand(B, Hq, L, S)  # a view: stride 0 where broadcast
    except RuntimeError:
        raise SdpaValueError(
            f"{what}: mask {tuple(mask.shape)} does not broadcast to (B, Hq, L, S) = "
            f"{(B, Hq, L, S)}"
        ) from None


# --- pieces of the kernels -----------------------------------------------------------


@triton.jit
def dot_nt(a, b, IEEE: tl.constexpr):
    """a (R, D) . b (C, D)^T -> (R, C) float32; IEEE float32 products where asked."""
    if IEEE:
        s = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(a, tl.trans(b))
    return s


@triton.jit
def query_block(Q, K, M, sqb, sqh, sql, sqd, skb, skh, smb, smh, H, GROUP, BH0, L,
                CAUSAL: tl.constexpr, IEEE: tl.constexpr, E: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """This program's block of query rows: (pid_bh, m0, offs_m, offs_d, q (BLOCK_M,
    BLOCK_D) in float32 when IEEE, the key head's K base, the mask's base). Grid: (query
    blocks, batch x heads of this launch, from BH0); causal programs take the longest
    rows first (the last ones would otherwise run alone); query head h reads key head
    h // GROUP."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1).to(tl.int64) + BH0
    b = pid_bh // H
    h = pid_bh % H
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_rows(Q + b * sqb + h * sqh, offs_m, sql, offs_d, sqd, L, E, True, E == BLOCK_D)
    if IEEE:
        q = q.to(tl.float32)
    return pid_bh, m0, offs_m, offs_d, q, K + b * skb + (h // GROUP) * skh, M + b * smb + h * smh


@triton.jit
def key_range(m0, S, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """(full, hi) for a query block from m0: key blocks [0, full) need no masking (inside
    S and below the diagonal, no mask), [full, hi) are masked, keys from hi on are never
    seen (top-left causal: query i sees keys j <= i)."""
    hi = S
    if CAUSAL:
        hi = tl.minimum(S, m0 + BLOCK_M)
    full = 0
    if MASK_KIND == 0:
        full = (S // BLOCK_N) * BLOCK_N
        if CAUSAL:
            full = tl.minimum(full, ((m0 + 1) // BLOCK_N) * BLOCK_N)
    return full, hi


@triton.jit
def load_rows(base, offs, stride, offs_d, stride_d, n, E: tl.constexpr,
              EDGE: tl.constexpr, EVEN_D: tl.constexpr):  # fmt: skip
    """The (R, BLOCK_D) tile of rows `offs` (of n when EDGE: rows past it read 0) and
    head columns < E (those past it read 0)."""
    ptrs = base + offs[:, None] * stride + offs_d[None, :] * stride_d
    if EDGE:
        ok = offs[:, None] < n
        if not EVEN_D:
            ok = ok & (offs_d[None, :] < E)
        tile = tl.load(ptrs, mask=ok, other=0.0)
    elif EVEN_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=offs_d[None, :] < E, other=0.0)
    return tile


@triton.jit
def shifted_scores(s, scale, shift, i, j, L, S, Mbh, sml, sms, f: tl.constexpr,
                   CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr):  # fmt: skip
    """u = (scale * s + bias - shift) * f where query i sees key j, -inf elsewhere.

    s: the tile's q . k; i, j: query and key positions, broadcasting to s's shape
    (i[:, None], j[None, :] when rows are queries). Excluded: past L or S, after the
    query under top-left causality, False in a bool mask (MASK_KIND 1); a float mask
    (MASK_KIND 2) is the bias, added in natural units before the shift as the listing's
    scores + mask rounds it (a huge finite bias swallows s alike), so bias - shift
    stays exact when the shift is an LSE under that bias."""
    ok = (i < L) & (j < S)
    if CAUSAL:
        ok = ok & (j <= i)
    if MASK_KIND == 0:
        u = s * (scale * f) - shift * f
    else:  # int64 rows: L * S of one mask can pass 2^31
        mv = tl.load(Mbh + i.to(tl.int64) * sml + j * sms, mask=ok, other=0)
        if MASK_KIND == 1:
            ok = ok & (mv != 0)
            u = s * (scale * f) - shift * f
        else:
            u = (s * scale + mv.to(tl.float32) - shift) * f
    return tl.where(ok, u, -float("inf"))


@triton.jit
def block_scores(
    q, k, offs_m, offs_n, row_ok, col_ok, Mbh, sml, sms, scale_log2,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Base-2 scores of one tile, q (BLOCK_M, BLOCK_D) . k (BLOCK_D, BLOCK_N) * scale_log2,
    -inf where an edge, causality (top-left) or a bool mask excludes the key; a float
    mask is added. Mbh: the mask of this (batch, head), rows and keys at strides sml, sms.
    (The flash-style forward of stats.py.)"""
    if IEEE:  # noqa: SIM108 (a compile-time branch)
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * scale_log2  # (BLOCK_M, BLOCK_N)
    valid = row_ok[:, None] & col_ok[None, :]
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None])
    if MASK_KIND != 0:
        m_ptrs = Mbh + offs_m[:, None] * sml + offs_n[None, :] * sms
        mv = tl.load(m_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0)
        if MASK_KIND == 1:
            valid = valid & (mv != 0)
        else:
            s = s + mv.to(tl.float32) * 1.4426950408889634
    return tl.where(valid, s, -float("inf"))
