"""diffusers attention processors on sdpa: each computes q, k and v exactly as the
diffusers processor it replaces, then calls `calls.attend` once.

    SdpaAttnProcessor       for AttnProcessor2_0 / AttnProcessor (UNet, VAE: Attention)
    SdpaJointAttnProcessor  for JointAttnProcessor2_0 (SD3's MMDiT: image + text tokens)
    SdpaFluxAttnProcessor   for FluxAttnProcessor (Flux: text + image tokens, rotary)

Shapes: hidden_states (B, N, C) or (B, C, h, w), encoder_hidden_states (B, T, Ct);
q (B, H, L, D), k/v (B, H, S, D). N: image tokens, T: text tokens.
"""

from __future__ import annotations

import torch

from sdpa.errors import NotSupportedError
from sdpa.integrations.diffusers.calls import ACTIVE, CallInfo, Kind, ModelState, attend, default


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, H * D) -> (B, H, N, D), as diffusers' processors lay out q, k and v."""
    return x.view(x.shape[0], -1, heads, x.shape[-1] // heads).transpose(1, 2)


def _merge_heads(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, N, D) -> (B, N, H * D) in `dtype`: the attention output for to_out."""
    return x.transpose(1, 2).flatten(2, 3).to(dtype)


class _Processor:
    """What every sdpa processor keeps: its name (the attn_processors key) and the model
    state the forward pre-hook fills while a session is open."""

    def __init__(self, name: str, state: ModelState) -> None:
        self.name = name
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def _attend(
        self, attn, q, k, v, mask, kind: Kind, *, grid=None, scale: float | None = None,
        image_tokens: int | None = None, text_tokens: int | None = None,
        text_start: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """attend(info, q, k, v, mask), the info built only while a session is open:
        otherwise one context-variable read on top of the kernel."""
        if not ACTIVE.get():
            return default(q, k, v, mask, scale)
        if grid is None:
            grid = self.state.grid(q.shape[-2] if image_tokens is None else image_tokens)
        info = CallInfo(
            name=self.name, kind=kind, step=0, tokens=q.shape[-2], grid=grid, scale=scale,
            text_tokens=text_tokens, text_start=text_start, layer=attn,
        )  # fmt: skip
        return attend(info, q, k, v, mask)

    def _refuse(self, what: str, why: str) -> NotSupportedError:
        return NotSupportedError(
            f"{self.name}: {type(self).__name__} was given {what}, which {why}; put "
            f"diffusers' processors back (sdpa.integrations.diffusers.restore(model)) for it"
        )


class SdpaAttnProcessor(_Processor):
    """diffusers' AttnProcessor2_0 (scale from the head width) or, with
    module_scale=True, AttnProcessor (scale = attn.scale), on sdpa: spatial norm, 4-D
    input, group norm, cross-attention norm, q/k norm, encoder_attention_mask (float,
    added; prepared as diffusers prepares it), residual and rescale_output_factor."""

    def __init__(self, name: str, state: ModelState, module_scale: bool = False) -> None:
        super().__init__(name, state)
        self.module_scale = module_scale

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        ip_adapter_masks=None,
        ip_hidden_states=None,
    ) -> torch.Tensor:
        if ip_hidden_states is not None or ip_adapter_masks is not None:
            raise self._refuse("IP-Adapter inputs", "needs IP-Adapter's own processor")
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        grid = None
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            grid = (height, width)
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        kind: Kind = "self" if encoder_hidden_states is None else "cross"
        mask = attention_mask
        if mask is not None:  # (B*heads, L|1, S) -> (B, heads, L|1, S)
            mask = attn.prepare_attention_mask(mask, sequence_length, batch_size)
            mask = mask.view(batch_size, attn.heads, -1, mask.shape[-1])
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)
        query = _split_heads(query, attn.heads)  # (B, H, L, D)
        key = _split_heads(key, attn.heads)  # (B, H, S, D)
        value = _split_heads(value, attn.heads)  # (B, H, S, D)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        text = key.shape[-2] if kind == "cross" else None
        hidden_states = self._attend(
            attn, query, key, value, mask, kind, grid=grid,
            scale=attn.scale if self.module_scale else None,
            text_tokens=text, text_start=0 if kind == "cross" else None,
        )  # fmt: skip
        hidden_states = _merge_heads(hidden_states, query.dtype)  # (B, L, H * D)
        hidden_states = attn.to_out[0](hidden_states)  # linear proj
        hidden_states = attn.to_out[1](hidden_states)  # dropout
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2)  # (B, C, h * w)
            hidden_states = hidden_states.reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


class SdpaJointAttnProcessor(_Processor):
    """diffusers' JointAttnProcessor2_0 (SD3, SD3.5) on sdpa: image tokens then text
    tokens in one call; without encoder_hidden_states (SD3.5's attn2) self-attention."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        ip_adapter_masks=None,
        ip_hidden_states=None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is not None:
            raise self._refuse(
                "attention_mask", "JointAttnProcessor2_0 ignores (so sdpa cannot match it)"
            )
        if ip_hidden_states is not None or ip_adapter_masks is not None:
            raise self._refuse("IP-Adapter inputs", "needs IP-Adapter's own processor")
        residual = hidden_states
        query = _split_heads(attn.to_q(hidden_states), attn.heads)  # (B, H, N, D)
        key = _split_heads(attn.to_k(hidden_states), attn.heads)
        value = _split_heads(attn.to_v(hidden_states), attn.heads)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        image = query.shape[-2]
        text = None
        if encoder_hidden_states is not None:
            eq = _split_heads(attn.add_q_proj(encoder_hidden_states), attn.heads)  # (B, H, T, D)
            ek = _split_heads(attn.add_k_proj(encoder_hidden_states), attn.heads)
            ev = _split_heads(attn.add_v_proj(encoder_hidden_states), attn.heads)
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            text = eq.shape[-2]
            query = torch.cat([query, eq], dim=2)  # (B, H, N + T, D)
            key = torch.cat([key, ek], dim=2)
            value = torch.cat([value, ev], dim=2)
        hidden_states = self._attend(
            attn, query, key, value, None, "self" if text is None else "joint",
            image_tokens=image, text_tokens=text, text_start=None if text is None else image,
        )  # fmt: skip
        hidden_states = _merge_heads(hidden_states, query.dtype)  # (B, N + T, H * D)
        if encoder_hidden_states is not None:  # split the image and text outputs
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : residual.shape[1]],
                hidden_states[:, residual.shape[1] :],
            )
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[0](hidden_states)  # linear proj
        hidden_states = attn.to_out[1](hidden_states)  # dropout
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


class SdpaFluxAttnProcessor(_Processor):
    """diffusers' FluxAttnProcessor on sdpa: text then image tokens in one call (the
    double-stream blocks), or the joint sequence the single-stream blocks concatenate;
    rotary embeddings applied as diffusers applies them. This processor is the attention
    backend: a backend chosen through diffusers' dispatch (set_attention_backend, the
    attention_backend context, context parallelism) is refused, not ignored."""

    _attention_backend = None  # set by model.set_attention_backend: refused when set
    _parallel_config = None

    def __init__(self, name: str, state: ModelState) -> None:
        from diffusers.models import attention_dispatch
        from diffusers.models.embeddings import apply_rotary_emb
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections

        super().__init__(name, state)
        self._registry = attention_dispatch._AttentionBackendRegistry
        self._native = attention_dispatch.AttentionBackendName.NATIVE
        self._rotary = apply_rotary_emb
        self._projections = _get_qkv_projections

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        ip_adapter_masks=None,
        ip_hidden_states=None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if ip_hidden_states is not None or ip_adapter_masks is not None:
            raise self._refuse("IP-Adapter inputs", "needs FluxIPAdapterAttnProcessor")
        if self._attention_backend is not None or self._parallel_config is not None:
            raise self._refuse(
                "a diffusers attention backend or parallel config",
                "sdpa replaces (call set_attention_backend only without use_sdpa)",
            )
        active = self._registry._active_backend
        if active != self._native:
            raise self._refuse(
                f"the active diffusers attention backend {getattr(active, 'value', active)!r}",
                "sdpa replaces (leave the attention_backend(...) context)",
            )
        query, key, value, encoder_query, encoder_key, encoder_value = self._projections(
            attn, hidden_states, encoder_hidden_states
        )
        query = query.unflatten(-1, (-1, attn.head_dim))  # (B, N, H, D)
        key = key.unflatten(-1, (-1, attn.head_dim))
        value = value.unflatten(-1, (-1, attn.head_dim))
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        text = None
        if attn.added_kv_proj_dim is not None:
            encoder_query = encoder_query.unflatten(-1, (-1, attn.head_dim))  # (B, T, H, D)
            encoder_key = encoder_key.unflatten(-1, (-1, attn.head_dim))
            encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
            encoder_query = attn.norm_added_q(encoder_query)
            encoder_key = attn.norm_added_k(encoder_key)
            text = encoder_query.shape[1]
            query = torch.cat([encoder_query, query], dim=1)  # (B, T + N, H, D)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)
        if image_rotary_emb is not None:
            query = self._rotary(query, image_rotary_emb, sequence_dim=1)
            key = self._rotary(key, image_rotary_emb, sequence_dim=1)
        mask = attention_mask
        if mask is not None and mask.ndim == 2 and mask.shape == (query.shape[0], key.shape[1]):
            mask = mask[:, None, None]  # (B, S) -> (B, 1, 1, S), as dispatch "native" does
        L = query.shape[1]
        if text is None and self.state.text_tokens is not None:  # single-stream: [text, image]
            text = self.state.text_tokens if 0 < self.state.text_tokens < L else None
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))  # (B, H, L, D)
        out = self._attend(
            attn, q, k, v, mask, "self" if text is None else "joint",
            image_tokens=L - (text or 0), text_tokens=text, text_start=None if text is None else 0,
        )  # fmt: skip
        hidden_states = _merge_heads(out, query.dtype)  # (B, L, H * D)
        if encoder_hidden_states is not None:
            T = encoder_hidden_states.shape[1]
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [T, hidden_states.shape[1] - T], dim=1
            )
            hidden_states = attn.to_out[0](hidden_states.contiguous())
            hidden_states = attn.to_out[1](hidden_states)
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
            return hidden_states, encoder_hidden_states
        return hidden_states
