"""torch's private attention ops, looked up without failing: None where this torch has
none by that name (private ops get renamed between releases). A backend that needs a
missing op says so in `not_supported_reasons`; `import sdpa` never fails on it.

Grouped-query heads: torch's CPU flash op takes fewer key/value heads than query heads
only in newer releases (torch 2.5's reads past the end of k and v: garbage forward, and
its backward writes past the end of dk and dv, which aborts the process). One probe at
import asks the op itself (`CPU_GQA`); where it cannot, `CPU_FLASH` and
`CPU_FLASH_BACKWARD` are wrappers that give it one key/value head per query head (query
heads folded into rows where that is a view, else k and v expanded), so every caller
passes grouped heads as on a newer torch. Where the op takes them, both are torch's own
(every release from the declared floor, 2.12, on: the wrappers keep an older torch exact
instead of wrong or aborted).
"""

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
_CPU_FLASH = binding(CPU_FLASH_NAME)
_CPU_FLASH_BACKWARD = op(CPU_FLASH_BACKWARD_NAME)


def takes_gqa(forward) -> bool:
    """Whether the CPU flash op `forward` maps query head h to key/value head h // g for
    key/value heads that divide the query heads. Asked of the op itself, without a read
    out of bounds: k and v are the first head of two-head buffers, so an op that ignores
    the grouping reads the second head (1.0) where one that honours it reads the first
    (0.5); one key, so the output is that value row exactly. Any error: False (the
    wrappers are exact on every torch, only slower)."""
    try:
        with torch.no_grad():
            q = torch.ones(1, 2, 1, 8, dtype=torch.float32, device="cpu")  # (B, Hq, L, D)
            kv = torch.full((1, 2, 1, 8), 1.0, dtype=torch.float32, device="cpu")
            kv[:, 0] = 0.5
            out = forward(q, kv[:, :1], kv[:, :1], 0.0, False, scale=1.0)[0]  # (1, 2, 1, 8)
            return bool((out == 0.5).all())
    except Exception:
        return False


def _fold(t: torch.Tensor, Hkv: int) -> torch.Tensor | None:
    """t (B, Hq, L, D) as (B, Hkv, g * L, D), the g query heads of a key head one after
    another as rows: a view, or None where t's strides do not allow one."""
    B, Hq, L, D = t.shape
    if L != 1 and t.stride(1) != L * t.stride(2):
        return None
    return t.view(B, Hkv, Hq // Hkv * L, D)  # (B, Hkv, g*L, D)


def _fold_mask(mask: torch.Tensor | None, Hq: int, Hkv: int, L: int):
    """A mask (B|1, Hq|1, L|1, S) for folded rows (B|1, Hkv|1, g*L|1, S), as a view:
    (True, mask) where there is one (no mask, one row for all, or a mask per query head
    with foldable strides), else (False, None)."""
    if mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1):
        return True, mask
    if mask.dim() == 4 and mask.shape[1] == Hq and mask.shape[2] == L:
        folded = _fold(mask, Hkv)
        return folded is not None, folded
    return False, None


def _expand(t: torch.Tensor, g: int) -> torch.Tensor:
    """Key/value heads (B, Hkv, S, D) repeated for their query heads: (B, Hkv*g, S, D),
    head h // g at h (one copy; its gradient sums over the group)."""
    B, Hkv, S, D = t.shape
    return t[:, :, None].expand(B, Hkv, g, S, D).reshape(B, Hkv * g, S, D)


def _cpu_flash_grouped(q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    """The CPU flash op on a torch whose op takes one key/value head per query head:
    grouped heads folded into rows (no copy of k, v; not with the op's causal, whose
    diagonal would move) or k and v expanded. Same results and outputs (out, lse, ...)."""
    B, Hq, L, _ = q.shape
    Hkv = k.shape[1]
    if Hkv == Hq:
        return _CPU_FLASH(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    folded = None if is_causal else _fold(q, Hkv)
    ok, mask = _fold_mask(attn_mask, Hq, Hkv, L) if folded is not None else (False, None)
    if not ok:
        g = Hq // Hkv
        k, v = _expand(k, g), _expand(v, g)  # (B, Hq, S, D)
        return _CPU_FLASH(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    out, lse, *rest = _CPU_FLASH(folded, k, v, dropout_p, False, attn_mask=mask, scale=scale)
    out = out.reshape(B, Hq, L, out.shape[-1])  # (B, Hq, L, Dv)
    return (out, lse.reshape(B, Hq, L), *rest)  # lse (B, Hq, L)


def _cpu_flash_backward_grouped(
    grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask=None, scale=None
):
    """The CPU flash backward for grouped heads on such a torch: k and v expanded, their
    gradients summed over each group (in float32 for 16-bit inputs)."""
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hkv == Hq:
        return _CPU_FLASH_BACKWARD(
            grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )
    g = Hq // Hkv
    dq, dk, dv = _CPU_FLASH_BACKWARD(
        grad_out, q, _expand(k, g), _expand(v, g), out, lse, dropout_p, is_causal,
        attn_mask=attn_mask, scale=scale,
    )  # fmt: skip
    B, _, S, _ = k.shape

    def group_sum(t: torch.Tensor) -> torch.Tensor:  # (B, Hq, S, D) -> (B, Hkv, S, D)
        wide = torch.promote_types(t.dtype, torch.float32)
        return t.reshape(B, Hkv, g, S, t.shape[-1]).sum(2, dtype=wide).to(t.dtype)

    return dq, group_sum(dk), group_sum(dv)


CPU_GQA = _CPU_FLASH is not None and takes_gqa(_CPU_FLASH)
if CPU_GQA or _CPU_FLASH is None:
    CPU_FLASH, CPU_FLASH_BACKWARD = _CPU_FLASH, _CPU_FLASH_BACKWARD
else:
    CPU_FLASH = _cpu_flash_grouped
    CPU_FLASH_BACKWARD = None if _CPU_FLASH_BACKWARD is None else _cpu_flash_backward_grouped


def pad_to(t: torch.Tensor, D: int) -> torch.Tensor:
    """t (..., E) with zero features up to head size D, the one head size the fused ops
    take: zero features change no score q . k, and zero value columns are sliced off the
    output (a view where E == D)."""
    E = t.shape[-1]
    return t if E == D else torch.nn.functional.pad(t, (0, D - E))


def missing_cpu_ops() -> list[str]:
    """The names of the CPU flash ops this torch lacks (read at each call: a test can
    take one away)."""
    found = {CPU_FLASH_NAME: CPU_FLASH, CPU_FLASH_BACKWARD_NAME: CPU_FLASH_BACKWARD}
    return [name for name, fn in found.items() if fn is None]
