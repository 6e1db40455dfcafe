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
from typing import NamedTuple

import torch

from sdpa import masks, settings
from sdpa.inputs import Inputs

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


class Args(NamedTuple):
    """What the kernels take for one call: q (B, Hq, L, E), k (B, Hkv, S, E), a mask
    tensor broadcasting to (B, Hq, L, S) (bool keep or float bias) or None, and the
    kernels' own top-left causal flag."""

    q: torch.Tensor
    k: torch.Tensor
    mask: torch.Tensor | None
    causal: bool


def admit(inputs: Inputs, *, raw_scores: bool = False) -> Args | None:
    """The kernels' arguments for a call's inputs, or None where they cannot serve it:
    not on the settings' kernel_devices, `unsupported`, a softcap or sinks (the kernels
    score plain q . k; with raw_scores, the largest raw score, before the softcap and
    where a sink is no key's score, they can), or a structured mask over
    kernel_mask_bytes (it is materialised for them). The one eligibility rule of every
    kernel read."""
    tuning = settings.get()
    q, k = inputs.query, inputs.key
    if q.device.type not in tuning.kernel_devices or unsupported(q, k) is not None:
        return None
    if not raw_scores and (inputs.softcap is not None or inputs.sinks is not None):
        return None
    L, S = q.shape[2], k.shape[2]
    rest, causal = masks.causal_flag(inputs.mask, L, S)
    tensor, structured = masks.split(rest)
    if structured is not None:
        if (structured.batch or 1) * L * S > tuning.kernel_mask_bytes:
            return None
        keep = masks.as_4d(structured.materialize(L, S, q.device, max_bytes=None))  # (Bm|1,1,L,S)
        tensor = masks.combine(tensor, keep)
    return Args(q, k, tensor, causal)
