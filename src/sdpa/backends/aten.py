"""torch's private attention ops, looked up without failing: None where this torch has
none by that name (private ops get renamed between releases). A backend that needs a
missing op says so in `not_supported_reasons`; `import sdpa` never fails on it."""

from __future__ import annotations

import torch

CPU_FLASH_NAME = "_scaled_dot_product_flash_attention_for_cpu"
CPU_FLASH_BACKWARD_NAME = "_scaled_dot_product_flash_attention_for_cpu_backward"


def op(name: str):
    """torch.ops.aten's op `name` (an OpOverloadPacket), or None."""
    return getattr(torch.ops.aten, name, None)


def binding(name: str):
    """torch's own Python binding of op `name` (~1.5 us faster per call than torch.ops
    dispatch), else torch.ops.aten's, else None."""
    return getattr(torch, name, None) or op(name)


# (q, k, v, dropout_p, causal, attn_mask=, scale=) -> (out, lse, ...), and its backward
CPU_FLASH = binding(CPU_FLASH_NAME)
CPU_FLASH_BACKWARD = op(CPU_FLASH_BACKWARD_NAME)


def missing_cpu_ops() -> list[str]:
    """The names of the CPU flash ops this torch lacks (read at each call: a test can
    take one away)."""
    found = {CPU_FLASH_NAME: CPU_FLASH, CPU_FLASH_BACKWARD_NAME: CPU_FLASH_BACKWARD}
    return [name for name, fn in found.items() if fn is None]
