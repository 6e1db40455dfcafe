"""Multi-head attention: learned projections around sdpa.attention."""

from __future__ import annotations

import torch
from torch import nn

from sdpa.errors import SdpaTypeError, SdpaValueError
from sdpa.functional import AttentionResult, attention, with_output

# Self-attention over at most this many tokens (B x L) under autograd projects q, k and v
# with three GEMMs rather than concatenating the weights for one: measured on CPU, 1
# thread, d_model 256, forward under grad: 4 tokens 28 vs 57 us, 64: 151 vs 198,
# 512: 1037 vs 1164; 1024: 2222 vs 1982.
THREE_GEMMS_TOKENS = 512


class MultiHeadAttention(nn.Module):
    """Multi-head attention whose forward returns the output and lazy weights.

    Shapes: query (B, L, d_model), key/value (B, S, d_model) (default: the query, i.e.
    self-attention) -> output (B, L, d_model), weights (B, num_heads, L, S). Batch-first.

    d_model is split into num_heads heads of d_model // num_heads (the seed: 8 heads of
    32 over 256). kv_heads < num_heads gives grouped-query attention: key/value are
    projected to kv_heads heads, query head h uses key/value head h // (num_heads //
    kv_heads). Dropout on the weights applies in training mode only.

    mask broadcasts to (B, num_heads, L, S): True/nonzero = takes part, float = added;
    key padding is (B, 1, 1, S), a 2-D mask is (L, S). causal=True needs L == S.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
    ):
        super().__init__()
        kv_heads = num_heads if kv_heads is None else kv_heads
        if num_heads < 1 or d_model % num_heads:
            raise SdpaValueError(
                f"d_model must split into num_heads equal heads, got d_model={d_model} and "
                f"num_heads={num_heads}; pick num_heads dividing d_model"
            )
        if kv_heads < 1 or num_heads % kv_heads:
            raise SdpaValueError(
                f"kv_heads must divide num_heads (grouped-query attention), got "
                f"kv_heads={kv_heads} and num_heads={num_heads}"
            )
        if not 0.0 <= dropout <= 1.0:
            raise SdpaValueError(f"dropout must be a probability in [0, 1], got {dropout}")
        self.d_model, self.num_heads, self.kv_heads = d_model, num_heads, kv_heads
        self.head_dim = d_model // num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, kv_heads * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        # the q, k, v weights packed for one GEMM, with the (address, version) of each
        # parameter they were packed from: reused while none changed (see _packed_weights)
        self._packed: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        *,
        causal: bool = False,
    ) -> AttentionResult:
        key = query if key is None else key
        value = key if value is None else value
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.ndim != 3 or t.shape[-1] != self.d_model:
                seen = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise SdpaValueError(
                    f"{name} must be (B, length, d_model={self.d_model}), got {seen}; add a "
                    f"batch dim to a single sequence with x[None]"
                )
        B, L, _ = query.shape
        S = key.shape[1]
        if value.shape[1] != S:
            raise SdpaValueError(
                f"key and value must have the same length, got key {tuple(key.shape)} and "
                f"value {tuple(value.shape)}"
            )
        if key.shape[0] not in (1, B) or value.shape[0] not in (1, B):
            raise SdpaValueError(
                f"key and value batch must be the query's ({B}) or 1, got key "
                f"{tuple(key.shape)} and value {tuple(value.shape)}"
            )
        if key is query and value is query:  # self-attention: one GEMM for q, k and v
            q, k, v = self._packed_projection(query)
        else:
            q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        q = q.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, D)
        k = k.view(k.shape[0], S, self.kv_heads, self.head_dim).transpose(1, 2)  # (B,Hkv,S,D)
        v = v.view(v.shape[0], S, self.kv_heads, self.head_dim).transpose(1, 2)  # (B,Hkv,S,D)
        r = attention(
            q, k, v, mask, causal=causal, dropout_p=self.dropout if self.training else 0.0
        )
        out = self.out_proj(r.output.transpose(1, 2).reshape(B, L, self.d_model))  # (B,L,d_model)
        return with_output(r, out)

    def _packed_projection(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v projections of x as one GEMM (as torch's packed in_proj does), or as
        three where autograd would need a fresh concatenation of the weights for at most
        THREE_GEMMS_TOKENS tokens (there the concatenation costs more than it saves)."""
        mods = self._modules  # (nn.Module's attribute lookup costs a microsecond each)
        projs = (mods["q_proj"], mods["k_proj"], mods["v_proj"])
        params = [m._parameters["weight"] for m in projs]
        if projs[0]._parameters.get("bias") is not None:
            params += [m._parameters["bias"] for m in projs]
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            if x.numel() <= THREE_GEMMS_TOKENS * self.d_model:
                return tuple(
                    nn.functional.linear(x, m._parameters["weight"], m._parameters.get("bias"))
                    for m in projs
                )
            weight, bias = self._pack(projs)  # (fresh and differentiable)
        else:
            weight, bias = self._packed_weights(projs, params)
        kv_dim = self.kv_heads * self.head_dim
        return nn.functional.linear(x, weight, bias).split([self.d_model, kv_dim, kv_dim], -1)

    def _packed_weights(
        self, projs: tuple[nn.Linear, ...], params: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight (d_model + 2 * kv_dim, d_model), bias) of the q, k, v projections
        outside autograd: the one packed earlier while no parameter has moved or changed
        in place."""
        key = tuple([(p.data_ptr(), p._version) for p in params])
        if self._packed is None or self._packed[0] != key:
            with torch.no_grad():
                self._packed = (key, *self._pack(projs))
        return self._packed[1], self._packed[2]

    @staticmethod
    def _pack(projs: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight = torch.cat([p.weight for p in projs])  # (d_model + 2 * kv_dim, d_model)
        bias = None if projs[0].bias is None else torch.cat([p.bias for p in projs])
        return weight, bias

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """A MultiHeadAttention with the weights of a torch.nn.MultiheadAttention.

        Ours is always batch-first: call it with (B, L, d_model) whatever the source's
        batch_first. torch's masks say True = *ignore*; ours say True = *takes part*:
        convert them once, at this edge, with `mask_from_torch`.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise SdpaTypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module)}")
        if not module._qkv_same_embed_dim:
            raise SdpaValueError(
                f"kdim/vdim different from embed_dim ({module.kdim}, {module.vdim} vs "
                f"{module.embed_dim}) are not supported: key and value must be d_model wide"
            )
        if module.bias_k is not None or module.add_zero_attn:
            raise SdpaValueError("add_bias_kv and add_zero_attn are not supported")
        ours = cls(
            module.embed_dim,
            module.num_heads,
            dropout=module.dropout,
            bias=module.in_proj_bias is not None,
        )
        ref = module.in_proj_weight
        ours = ours.to(device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            for proj, w in zip(
                (ours.q_proj, ours.k_proj, ours.v_proj), module.in_proj_weight.chunk(3), strict=True
            ):
                proj.weight.copy_(w)
            if module.in_proj_bias is not None:
                for proj, b in zip(
                    (ours.q_proj, ours.k_proj, ours.v_proj),
                    module.in_proj_bias.chunk(3),
                    strict=True,
                ):
                    proj.bias.copy_(b)
            ours.out_proj.weight.copy_(module.out_proj.weight)
            if module.out_proj.bias is not None:
                ours.out_proj.bias.copy_(module.out_proj.bias)
        return ours.train(module.training)

    @staticmethod
    def mask_from_torch(
        attn_mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        *,
        num_heads: int | None = None,
    ) -> torch.Tensor | None:
        """torch.nn.MultiheadAttention's masks as one sdpa mask, (B|1, H|1, L|1, S).

        torch's bool masks mean True = ignore; ours mean True = takes part, so bools are
        inverted here and nowhere else. Float masks are added in both conventions.
        attn_mask: (L, S), or (B * num_heads, L, S) (then num_heads is needed);
        key_padding_mask: (B, S).
        """
        for name, m in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
            if m is not None and m.dtype != torch.bool and not m.is_floating_point():
                raise SdpaTypeError(
                    f"{name} must be bool (True = ignore, torch's convention) or float "
                    f"(added), got {m.dtype}, as torch.nn.MultiheadAttention requires"
                )
        parts = []
        if attn_mask is not None:
            if attn_mask.ndim == 3:
                if num_heads is None or attn_mask.shape[0] % num_heads:
                    raise SdpaValueError(
                        f"a 3-D attn_mask {tuple(attn_mask.shape)} is (B * num_heads, L, S): "
                        f"pass the num_heads that divides its first dim, got {num_heads}"
                    )
                attn_mask = attn_mask.view(-1, num_heads, *attn_mask.shape[-2:])  # (B,H,L,S)
            elif attn_mask.ndim != 2:
                raise SdpaValueError(
                    f"attn_mask must be (L, S) or (B * num_heads, L, S), got "
                    f"{tuple(attn_mask.shape)}"
                )
            parts.append(attn_mask)
        if key_padding_mask is not None:
            if key_padding_mask.ndim != 2:
                raise SdpaValueError(
                    f"key_padding_mask must be (B, S), got {tuple(key_padding_mask.shape)}"
                )
            parts.append(key_padding_mask[:, None, None, :])  # (B, 1, 1, S)
        if not parts:
            return None
        if all(p.dtype == torch.bool for p in parts):
            keep = ~parts[0]
            for p in parts[1:]:
                keep = keep & ~p
            return keep
        bias = None
        for p in parts:
            p = (
                torch.zeros(p.shape, dtype=torch.float32, device=p.device).masked_fill_(
                    p, -torch.inf
                )
                if p.dtype == torch.bool
                else p
            )
            bias = p if bias is None else bias + p
        return bias
