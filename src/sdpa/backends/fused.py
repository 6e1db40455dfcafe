"""PyTorch's own fused kernel, through the op that also returns the log-sum-exp.

On CPU that is `aten._scaled_dot_product_flash_attention_for_cpu`: it wants 4-D
(B, H, L, D) tensors with one head size D for q, k and v, each with a unit stride in its
last dim (it silently misreads others), a float mask (bool masks
become 0/-inf), and has no dropout. Different head sizes are padded with zeros (which
changes no score and no output column) and the output sliced back. Its backward is
registered, so autograd works through it. CUDA ops slot in as further entries of
`_KERNELS` keyed by device type.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from sdpa.backends.base import Backend
from sdpa.inputs import Inputs

Kernel = Callable[[Inputs, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Keep-mask (bool) -> additive 0/-inf in `dtype`; float masks pass through.

    Converts only the distinct entries: broadcast (stride-0) dims stay broadcast, so a
    (B, 1, 1, S) key-padding mask costs O(B*S), not O(B*L*S).
    """
    if mask is None or mask.dtype != torch.bool:
        return mask
    distinct = [1 if st == 0 else n for n, st in zip(mask.shape, mask.stride(), strict=True)]
    base = mask.as_strided(distinct, mask.stride())  # the entries the view repeats
    bias = torch.zeros(distinct, dtype=dtype, device=mask.device).masked_fill_(~base, -torch.inf)
    return bias.expand(mask.shape)


# torch's own Python binding is ~1.5 us faster per call than torch.ops dispatch
_cpu_op = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu", None) or (
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """The CPU kernel silently misreads a last dim whose stride is not 1."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _cpu_kernel(inputs: Inputs, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _unit_stride(inputs.query), _unit_stride(inputs.key), _unit_stride(inputs.value)
    E, Ev = q.shape[-1], v.shape[-1]
    if E < Ev:  # zero features add nothing to q.k
        q = F.pad(q, (0, Ev - E))  # (B, Hq, L, Ev)
        k = F.pad(k, (0, Ev - E))  # (B, Hkv, S, Ev)
    elif Ev < E:
        v = F.pad(v, (0, E - Ev))  # (B, Hkv, S, E)
    out, lse = _cpu_op(q, k, v, 0.0, inputs.causal, attn_mask=mask, scale=inputs.scale)
    if Ev < E:
        out = out[..., :Ev]  # (B, Hq, L, Ev)
    return out, lse


_KERNELS: dict[str, Kernel] = {"cpu": _cpu_kernel}


class Fused(Backend):
    name = "fused"

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        reasons = []
        device = inputs.query.device.type
        if device not in _KERNELS:
            reasons.append(f"inputs on {device} (the fused backend runs on: {', '.join(_KERNELS)})")
        if inputs.dropout_p > 0 and device == "cpu":
            reasons.append(
                f"dropout_p={inputs.dropout_p} > 0 on CPU (torch's fused CPU kernel has no dropout)"
            )
        mask = inputs.mask
        if mask is not None and mask.requires_grad and torch.is_grad_enabled():
            reasons.append(
                "a float mask that requires grad (torch's fused kernel has no gradient for "
                "attn_mask)"
            )
        if 0 in inputs.query.shape or 0 in inputs.key.shape or 0 in inputs.value.shape:
            reasons.append("an empty dimension (B, H, L, S or a head size is 0)")
        return reasons

    def forward(self, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        mask = _float_mask(inputs.mask, inputs.query.dtype)
        return _KERNELS[inputs.query.device.type](inputs, mask)
