"""Nested (jagged) tensors in the drop-in: torch's result for every call that torch's own
scaled_dot_product_attention accepts with `torch.nested` jagged-layout tensors (NJTs),
and a refusal naming the argument for every call it refuses.

Shapes (j: ragged, per sequence b: L_b queries, S_b keys):
    query (B, H, j_L, E), key (B, H, j_S, E), value (B, H, j_S, Ev) -> output (B, H, j_L, Ev)
    each an NJT made (B, j, H, E) with layout=torch.jagged and then .transpose(1, 2).
    Sequence b is attention of its L_b queries over its own S_b keys, L_b and S_b ragged
    independently (cross-attention); the output has query's offsets and layout.

What torch 2.13 accepts (CPU), and so do we:
    the shapes above; any scale; dropout_p; float32/float64/bf16/fp16; autograd; empty
    sequences (a query with no key gives 0); autocast (inputs cast before the checks).
    NJTs ragged in dim 1 with 4+ dims, (B, j, ..., H, E): torch attends within each token
    over the last two dims (its dense path on the values): is_causal works there, and
    enable_gqa is ignored, as in torch.
What torch refuses, and so do we, in words that say what works instead:
    attn_mask; is_causal (torch's CPU path has no kernel for it; on CUDA its fused
    kernels run it, so we do too where every L_b == S_b > 0, the only case where their
    causal alignments agree); key/value heads other than query's (enable_gqa or not);
    a mix of nested and dense inputs; different dtypes, devices or ragged dims; NJTs not
    the transpose of a contiguous (B, j, H, E) NJT (e.g. with holes); 3-D NJTs; 5-D+
    NJTs ragged in dim 2 (torch returns a malformed NJT for them).

torch's older strided-layout nested tensors (torch.nested.nested_tensor(list), a
prototype) are also accepted by torch, and so by us: each component is ordinary
attention over its last two dims, with the same leading dims in query, key and value;
refused alike: attn_mask, is_causal, broadcasting, non-contiguous inputs, an irregular
query E without an explicit scale, a mix of layouts.

Two ways to run the sequences, chosen from sizes alone: one `dense` call per sequence
(fastest once sequences are a few dozen tokens long), or all sequences packed into one
call with a `sdpa.masks.documents` mask (fastest for many short sequences: one call,
and the engine skips the blocks between documents). benchmarks/bench_nested.py times
both against torch's own NJT path.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from sdpa import masks
from sdpa.errors import NotSupportedError, SdpaTypeError, SdpaValueError
from sdpa.inputs import autocast, autocast_enabled

# dense(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) on dense tensors
Dense = Callable[..., torch.Tensor]

# Pack into one call when there are many sequences, all short (mean tokens per sequence,
# queries and keys). Measured on CPU (bench_nested.py): packing wins 2-5x below a mean
# of ~16 tokens with B >= 8 and loses up to 2x above ~32, where per-call cost is small
# next to the work.
PACK_MIN_BATCH, PACK_MAX_MEAN_LENGTH = 8, 16

_LAYOUT = (
    "nested query/key/value must be (B, H, j, E) jagged NJTs ragged in dim 2 (made "
    "(B, j, H, E) with layout=torch.jagged, then .transpose(1, 2)), or NJTs of 4+ dims "
    "ragged in dim 1"
)


def nested_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    dense: Dense,
) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention on nested inputs, with
    torch's result and torch's refusals (see the module docstring); `dense` runs the
    drop-in on ordinary tensors. Called when any of query, key, value is nested."""
    _check_all_nested(query, key, value)
    query, key, value = _autocast(query, key, value)
    _check_alike(query, key, value)
    if attn_mask is not None:
        raise NotSupportedError(
            f"attn_mask is not supported with nested query/key/value, as in torch "
            f"('Masks are not yet supported!'); got attn_mask "
            f"{_describe_mask(attn_mask)}. Each sequence already sees only its own keys; for "
            f"more, pad with .to_padded_tensor(0.0) and pass a dense mask, or "
            f"sdpa.masks.padding(lengths) & another sdpa.masks mask"
        )
    if query.layout == torch.strided:
        return _strided(query, key, value, dropout_p, is_causal, scale, enable_gqa, dense)
    _check_ragged_dims(query, key, value)
    ragged = query._ragged_idx
    if ragged == 1 and min(query.dim(), key.dim(), value.dim()) > 3:
        # torch's path for a ragged batch dim: attention within each token, on the values
        q, k, v = query.values(), key.values(), value.values()  # (nnz, ..., H, E)
        out = dense(q, k, v, None, dropout_p, is_causal, scale, False)
        return torch.nested.nested_tensor_from_jagged(out, query.offsets(), query.lengths())
    if ragged != 2 or {query.dim(), key.dim(), value.dim()} != {4}:
        raise SdpaValueError(
            f"{_LAYOUT}; got query {_shape(query)}, key {_shape(key)}, value "
            f"{_shape(value)} ragged in dim {ragged}"
        )
    lq, lk = _check_sequences(query, key, value, is_causal)
    if _pack(lq, lk, is_causal):
        out = _packed(query, key, value, lq, lk, dropout_p, scale, dense)
    else:
        out = _per_sequence(query, key, value, lq, lk, dropout_p, is_causal, scale, dense)
    return torch.nested.nested_tensor_from_jagged(
        out, query.offsets(), min_seqlen=min(lq), max_seqlen=max(lq)
    ).transpose(1, 2)  # (B, H, j_L, Ev)


def _pack(lq: list[int], lk: list[int], is_causal: bool) -> bool:
    """Whether to pack all sequences into one call (many, all short), from sizes alone."""
    B = len(lq)
    short = max(sum(lq), sum(lk)) <= PACK_MAX_MEAN_LENGTH * B
    return not is_causal and B >= PACK_MIN_BATCH and short


def _per_sequence(query, key, value, lq, lk, dropout_p, is_causal, scale, dense):
    """One dense call per sequence b on its (H, L_b, E) slice; values (nnz_L, H, Ev)."""
    qv, kv, vv = (t.transpose(1, 2).values() for t in (query, key, value))  # (nnz, H, E)
    outs, i, j = [], 0, 0
    for n, m in zip(lq, lk, strict=True):
        q, k, v = (t.transpose(0, 1) for t in (qv[i : i + n], kv[j : j + m], vv[j : j + m]))
        out = dense(q, k, v, None, dropout_p, is_causal, scale, False)  # (H, L_b, Ev)
        outs.append(out.transpose(0, 1))  # (L_b, H, Ev)
        i, j = i + n, j + m
    return torch.cat(outs)  # (nnz_L, H, Ev)


def _packed(query, key, value, lq, lk, dropout_p, scale, dense):
    """All sequences in one call: (1, H, nnz, E) with a documents mask (query i of
    sequence b sees the keys of sequence b); values (nnz_L, H, Ev)."""
    device = query.device
    batch = torch.arange(len(lq), device=device)
    q_ids = torch.repeat_interleave(batch, torch.tensor(lq, device=device))  # (nnz_L,)
    k_ids = torch.repeat_interleave(batch, torch.tensor(lk, device=device))  # (nnz_S,)
    q, k, v = (t.transpose(1, 2).values() for t in (query, key, value))  # (nnz, H, E)
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, H, nnz, E)
    out = dense(q, k, v, masks.documents(q_ids, k_ids), dropout_p, False, scale, False)
    return out[0].transpose(0, 1).contiguous()  # (nnz_L, H, Ev)


def _strided(query, key, value, dropout_p, is_causal, scale, enable_gqa, dense):
    """torch's strided-layout nested tensors: each component b is ordinary attention,
    query_b (..., L_b, E) over key_b (..., S_b, E), value_b (..., S_b, Ev_b), with the
    same leading dims (no broadcasting); the output is strided-nested too."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not t.is_contiguous():
            raise SdpaValueError(
                f"nested {name} must be contiguous, as torch requires of strided-layout "
                f"nested tensors; call .contiguous() on it"
            )
    if is_causal:
        raise NotSupportedError(
            "is_causal=True is not supported with nested query/key/value, as in torch "
            "('Nested tensors for query / key are not supported when is_causal=True'); run "
            "each component (query.unbind()) on its own with is_causal=True"
        )
    qs, ks, vs = query.unbind(), key.unbind(), value.unbind()
    if not len(qs) == len(ks) == len(vs):
        raise SdpaValueError(
            f"nested query, key and value must hold the same number of components, got "
            f"{len(qs)}, {len(ks)} and {len(vs)}"
        )
    if scale is None and len({q.shape[-1] for q in qs}) > 1:
        raise SdpaValueError(
            f"query's last dim E differs between components ({[q.shape[-1] for q in qs]}), so "
            f"there is no one default scale 1/sqrt(E), as in torch; pass scale"
        )
    heads = [q.shape[-3] if q.ndim > 2 else None for q in qs]
    if enable_gqa and len(set(heads)) > 1:
        raise SdpaValueError(
            f"enable_gqa=True needs query's heads (dim -3) the same in every component, as "
            f"in torch; got {heads}. Pass enable_gqa=False (each component's key/value "
            f"have its query's heads anyway)"
        )
    for b, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True)):
        if q.ndim < 2 or not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
            raise SdpaValueError(
                f"nested component {b} of query {tuple(q.shape)}, key {tuple(k.shape)} and "
                f"value {tuple(v.shape)}: torch's nested path needs 2+ dims and the same "
                f"leading dims in all three (no broadcasting or grouped-query attention)"
            )
        if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
            raise SdpaValueError(
                f"nested component {b}: query {tuple(q.shape)} and key {tuple(k.shape)} need "
                f"the same E, key and value {tuple(v.shape)} the same S"
            )
    outs = [
        dense(q, k, v, None, dropout_p, False, scale, False)  # (..., L_b, Ev_b)
        for q, k, v in zip(qs, ks, vs, strict=True)
    ]
    return torch.nested.as_nested_tensor(outs, layout=torch.strided)


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(n) for n in t.shape) + ")"


def _check_all_nested(query, key, value) -> None:
    tensors = {"query": query, "key": key, "value": value}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise SdpaTypeError(f"{name} must be a tensor, got {type(t).__name__}")
    nested = [name for name, t in tensors.items() if t.is_nested]
    if len(nested) != 3:
        dense = [name for name in tensors if name not in nested]
        raise SdpaValueError(
            f"query, key and value must be all nested or all dense, as in torch; got "
            f"{' and '.join(nested)} nested, {' and '.join(dense)} dense. Nest the dense ones "
            f"(torch.nested.nested_tensor_from_jagged(values, offsets)), or pad the nested "
            f"ones with .to_padded_tensor(0.0) and pass sdpa.masks.padding(lengths)"
        )
    layouts = {t.layout for t in tensors.values()}
    if len(layouts) != 1:
        raise SdpaTypeError(
            f"nested query, key and value must share one layout, as in torch; got "
            f"{query.layout}, {key.layout} and {value.layout}: make them all "
            f"layout=torch.jagged (torch.nested.nested_tensor(..., layout=torch.jagged))"
        )


def _autocast(query, key, value):
    """torch casts nested inputs under autocast before its checks (its SDPA rule)."""
    device_type = query.device.type
    if not autocast_enabled(device_type):
        return query, key, value
    return tuple(autocast([query, key, value], device_type))


def _check_alike(query, key, value) -> None:
    if not query.dtype == key.dtype == value.dtype or not query.is_floating_point():
        raise SdpaTypeError(
            f"nested query, key and value must have one floating dtype, got {query.dtype}, "
            f"{key.dtype} and {value.dtype}"
        )
    if not query.device == key.device == value.device:
        raise SdpaValueError(
            f"nested query, key and value must be on one device, got {query.device}, "
            f"{key.device} and {value.device}"
        )


def _check_ragged_dims(query, key, value) -> None:
    ragged = (query._ragged_idx, key._ragged_idx, value._ragged_idx)
    if len(set(ragged)) != 1:
        raise SdpaValueError(
            f"nested query, key and value must be ragged in the same dim, got dims "
            f"{ragged[0]}, {ragged[1]} and {ragged[2]} (shapes {_shape(query)}, "
            f"{_shape(key)}, {_shape(value)}); {_LAYOUT}"
        )


def _lengths(name: str, t: torch.Tensor) -> list[int]:
    """Sequence lengths of a (B, H, j, E) NJT whose offsets cover its values exactly."""
    offsets = t.offsets().tolist()
    if offsets[0] != 0 or offsets[-1] != t.transpose(1, 2).values().shape[0]:
        raise SdpaValueError(
            f"nested {name}'s offsets must run from 0 to its number of tokens "
            f"{t.transpose(1, 2).values().shape[0]}, as torch requires; got offsets from "
            f"{offsets[0]} to {offsets[-1]}"
        )
    return [b - a for a, b in itertools.pairwise(offsets)]


def _check_sequences(query, key, value, is_causal) -> tuple[list[int], list[int]]:
    """torch's conditions on (B, H, j, E) NJTs; returns the lengths L_b and S_b."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not t.transpose(1, 2).is_contiguous():
            raise SdpaValueError(
                f"nested {name} {_shape(t)} must be the transpose of a contiguous "
                f"(B, j, H, E) NJT, as torch requires (no holes from narrow(), no "
                f".contiguous() after the transpose); call .contiguous() on the (B, j, H, E) "
                f"NJT, then .transpose(1, 2)"
            )
    (B, H, _, E), (Bk, Hk, _, Ek), (Bv, Hv, _, _) = query.shape, key.shape, value.shape
    if not B == Bk == Bv:
        raise SdpaValueError(
            f"nested query, key and value must hold the same number of sequences, got "
            f"B={B}, {Bk} and {Bv}"
        )
    if not H == Hk == Hv:
        raise NotSupportedError(
            f"nested key/value heads must equal query heads, as in torch's nested path "
            f"(no grouped-query attention or broadcasting, enable_gqa or not); got query "
            f"H={H}, key {Hk}, value {Hv}. Repeat them on the values: "
            f"torch.nested.nested_tensor_from_jagged(key.transpose(1, 2).values()"
            f".repeat_interleave({H} // {Hk}, dim=1), key.offsets()).transpose(1, 2)"
        )
    if E != Ek:
        raise SdpaValueError(
            f"nested query and key must have the same last dim E, got query {_shape(query)} "
            f"and key {_shape(key)}"
        )
    lq, lk, lv = _lengths("query", query), _lengths("key", key), _lengths("value", value)
    if lv != lk:
        raise SdpaValueError(
            f"nested key and value must have the same sequence lengths S_b, got key {lk} "
            f"and value {lv}"
        )
    if is_causal:
        fix = (
            "run each sequence on its own (query.unbind()) with is_causal=True, or pad "
            "with .to_padded_tensor(0.0) and pass sdpa.masks.causal(align=...) & "
            "sdpa.masks.padding(lengths)"
        )
        if query.device.type != "cuda":
            raise NotSupportedError(
                f"is_causal=True is not supported with nested (jagged) query/key/value on "
                f"{query.device.type}, as in torch ('No viable backend'); {fix}"
            )
        if lq != lk or min(lq) == 0:
            raise NotSupportedError(
                f"is_causal=True with nested inputs needs every sequence's query and key "
                f"lengths equal and nonzero (torch's CUDA kernels align the causal mask "
                f"differently otherwise), got L_b {lq} and S_b {lk}; {fix}"
            )
    return lq, lk


def _describe_mask(mask: object) -> str:
    shape = getattr(mask, "shape", None)
    return f"of shape {tuple(shape)}" if shape is not None else repr(mask)
