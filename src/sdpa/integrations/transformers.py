"""Hugging Face transformers on sdpa: fused speed, and the attentions when asked.

    import sdpa.integrations.transformers as sdpa_hf
    name = sdpa_hf.register()                                  # "sdpa_lse"
    model = AutoModel.from_pretrained(path, attn_implementation=name)
    out = model(**batch, output_attentions=True)              # dense, from the LSE
    with sdpa_hf.capture(model) as cap:                       # lazy, no n^2 memory
        model(**batch)
    cap.weights[3].entropy()                                  # layer 3, per query

`output_attentions=True` as a call argument returns dense attentions computed from the
fused kernel's LSE (not by an eager fallback). transformers 5 refuses the config route
(`config.output_attentions = True`, or `from_pretrained(..., output_attentions=True)`)
for every implementation but "eager": its setter raises before any attention runs, so
that route cannot reach us; use the call argument or `capture`.

Rows that see no key at all (a fully padded query under causal masking) get weights 0
here; eager gives them uniform weights over the masked keys.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from sdpa import masks
from sdpa.errors import SdpaValueError
from sdpa.functional import attention
from sdpa.weights import AttentionWeights

NAME = "sdpa_lse"

_capturing: contextvars.ContextVar[Capture | None] = contextvars.ContextVar(
    "sdpa_capture", default=None
)


@dataclass
class Capture:
    """What `capture` collects: one lazy AttentionWeights per attention call, in order."""

    weights: list[AttentionWeights] = field(default_factory=list)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention-function contract on sdpa.attention.

    query (B, H, L, D), key/value (B, Hkv, S, D) (grouped-query attention as is),
    attention_mask (B, 1, L, S) bool (True = takes part, from the registered mask
    function), float (added), or None -> output (B, L, H, D) and the dense weights
    (B, H, L, S) when output_attentions=True, else None.
    """
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise SdpaValueError(
            f"the {NAME!r} attention has no softcap or position_bias; use 'eager' for this model"
        )
    is_causal = getattr(module, "is_causal", False) if is_causal is None else is_causal
    mask: torch.Tensor | masks.Mask | None = attention_mask
    if (
        mask is None and is_causal and query.shape[2] > 1
    ):  # no padding: the mask function left it to us
        mask = masks.causal("top-left")  # transformers' (and torch's) alignment
    out, weights = attention(query, key, value, mask, scale=scaling, dropout_p=dropout)
    active = _capturing.get()
    if active is not None:
        active.weights.append(weights)
    dense = weights.full(max_bytes=None) if kwargs.get("output_attentions") else None
    return out.transpose(1, 2).contiguous(), dense  # (B, L, H, D)


def register(name: str = NAME) -> str:
    """Register sdpa with transformers under `name` (attention and mask functions) and
    return it, for `from_pretrained(..., attn_implementation=name)`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    # without a mask function of the same name, padding would be silently ignored
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


@contextlib.contextmanager
def capture(model: torch.nn.Module) -> Iterator[Capture]:
    """Collect the lazy weights of every attention call made inside the block.

    The model must run on sdpa (`attn_implementation=register()`). After a forward,
    `.weights[i]` is layer i's AttentionWeights (B, H, L, S): rows, sums, entropy,
    top-k of any layer without the dense L x S tensors.
    """
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != NAME and not _is_registered_as_ours(impl):
        raise SdpaValueError(
            f"capture needs a model on sdpa's attention, got attn_implementation={impl!r}; "
            f"load it with attn_implementation=sdpa.integrations.transformers.register()"
        )
    found = Capture()
    token = _capturing.set(found)
    try:
        yield found
    finally:
        _capturing.reset(token)


def _is_registered_as_ours(name: str | None) -> bool:
    if name is None:
        return False
    from transformers import AttentionInterface

    return AttentionInterface._global_mapping.get(name) is attention_forward
