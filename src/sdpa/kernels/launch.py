"""What both kernels share: tile sizes, mask arguments, and how they run on CPU.

Triton compiles the kernels for CUDA tensors. With TRITON_INTERPRET=1 in the
environment *before triton is first imported*, Triton's interpreter runs them instead,
on CPU tensors (slow, same semantics): how the test suite checks them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs


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


def mask_args(mask: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, tuple, int]:
    """(pointer tensor, its 4 strides, kind) for a mask (B, H, L, S): kind 0 none,
    1 bool keep-mask (read as bytes, nonzero = takes part), 2 float added to the scores.
    Broadcast dims keep stride 0: nothing is materialised."""
    if mask is None:
        return like, (0, 0, 0, 0), 0
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), mask.stride(), 1
    return mask, mask.stride(), 2


@triton.jit
def block_scores(
    q, k, offs_m, offs_n, row_ok, col_ok, Mbh, sml, sms, scale_log2,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Base-2 scores of one tile, q (BLOCK_M, BLOCK_D) . k (BLOCK_D, BLOCK_N) * scale_log2,
    -inf where an edge, causality (top-left) or a bool mask excludes the key; a float
    mask is added. Mbh: the mask of this (batch, head), rows and keys at strides sml, sms."""
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
