"""Triton kernels for the weights' statistics (layer 3: compute; optional `triton`).

Single passes over Q K^T that read no V (half a forward; docs/guide/gpu-kernels.md):
- `entropy.entropy_and_max(q, k, lse, mask, causal=, scale=)`: entropy and largest
  weight of every query row, (B, Hq, L) each;
- `received.received(q, k, lse, mask, causal=, scale=)`: attention each key receives,
  sum_i p_ij, per query head, (B, Hq, S);
- `logits.max_logits(q, k, mask, causal=, scale=)`: the largest raw score of every row
  (B, Hq, L) and of every head (B, Hq), as QK-clip needs.
And `stats.forward_stats`: a flash-style forward that also writes, per query, the
entropy of its weights and its largest weight, accumulated online in the same pass.
Launch configs are pinned per kernel in `configs` (sm90), not autotuned.

All run compiled on CUDA tensors and under Triton's interpreter on CPU tensors (how
the test suite checks them without a GPU). Import those modules only after
`unavailable()` says None: they import triton.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@functools.cache
def unavailable() -> str | None:
    """Why the Triton kernels cannot run here, or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'sdpa[gpu]')"
    try:
        import triton.language  # noqa: F401
        from triton import knobs  # noqa: F401  (triton >= 3.4)
    except Exception as e:  # a broken install or an old triton: say what failed
        return f"triton does not import what the kernels need ({type(e).__name__}: {e})"
    return None


def unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> str | None:
    """Why the kernels cannot take these (B, H, L, D) tensors, or None when they can."""
    why = unavailable()
    if why is not None:
        return why
    if q.device.type not in ("cuda", "cpu"):
        return f"tensors on {q.device.type} (the kernels run on cuda, or cpu interpreted)"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (the kernels take float32, float16 and bfloat16)"
    heads = [q.shape[-1]] + ([] if v is None else [v.shape[-1]])
    if max(heads) > MAX_HEAD_DIM:
        return f"head size {max(heads)} (the kernels take up to {MAX_HEAD_DIM})"
    if 0 in q.shape or 0 in k.shape:
        return "an empty dimension"
    return None
